"""GGUF checkpoints without the real model: block formats, the reader, tiny files of every
supported architecture against transformers, the tokenizers, errors, serving checks.

Block formats: every type's unpacked weights are bit-identical to `gguf.quants.dequantize`
on random blocks (finite scales; NaN/inf scales propagate the same way), the block GEMM's
rows do not depend on M (the start-up self-check, and its negative control), and its sums
are the float32 sums over the dequantized weights in k order.
Tiny files (tests/gguf_checkpoints.py): llama (permuted q/k), qwen2 (biases), qwen3 (q/k
norms), gemma3 (sliding window 8 < the prompt, 1 + w norms), tensors cycling through all
nine types; max |npud - transformers| <= 1e-4 x max |logit| over 24 positions.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from npud.engine.config import ConfigError
from npud.engine.forward import Forward
from npud.engine.gguf import open_gguf
from npud.engine.gguf.describe import describe_gguf
from npud.engine.model import Model
from npud.engine.testing.backends import PrimitivesOnly
from npud.engine.tokenizer import Tokenizer
from npud.engine.weights import WeightsError, checkpoint_fingerprint
from gguf_checkpoints import TYPES, write_tiny_gguf
from kernel_fixtures import _fma32, isa_and_threads  # noqa: F401  (a fixture)
from npud.kernels.base import LinearWeight
from npud.kernels.ggml.backend import BlockHostBackend, check_block_invariance, random_block_rows
from npud.kernels.ggml.blocks import LAYOUTS, BlockFormat, unpack_blocks, unpack_matrix, widen
from npud.kernels.ggml.gemm import dense_weights, pack_block_matrix
from npud.kernels.host import TILE, native

gguf = pytest.importorskip("gguf") if os.environ.get("CI") != "true" else __import__("gguf")
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: write_tiny_gguf(root / f"{arch}.gguf", arch) for arch in ARCHS}


# ------------------------------------------------------------------ block formats


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_unpacked_blocks_widen_to_gguf_dequantize_bits(fmt):
    lay = LAYOUTS[fmt]
    raw = np.random.default_rng(3).integers(0, 256, size=(2048, lay.block_bytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(lay.ggml_type))
        got = widen(*unpack_blocks(raw, fmt))
    assert np.isfinite(expected).mean() > 0.5  # random f16 scales: mostly finite, some inf/NaN
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert np.array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_packed_tiles_gather_and_gemm(fmt, isa_and_threads):
    """The gather gives the dequantized rows; the GEMM, on every kernel path and thread count,
    one FMA per k in k order over them, then the bias."""
    raw = random_block_rows(fmt, 70, 512, seed=5)
    dense = widen(*unpack_matrix(raw, fmt, 512))  # the reference's weights (the test above)
    w = pack_block_matrix(raw, fmt, 512)
    assert np.array_equal(dense_weights(w).view(np.uint32), dense.view(np.uint32))
    b = BlockHostBackend(parallel=True)
    rows = np.array([69, 0, 64, 63, 7])
    assert np.array_equal(b.embed(w, rows), dense[rows])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 512)).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    acc = np.zeros((30, 70), np.float32)
    for k in range(512):
        acc = _fma32(np.repeat(x[:, k : k + 1], 70, axis=1), np.broadcast_to(dense[:, k], (30, 70)), acc)
    wb = b.prepare_linear(dataclasses.replace(w, bias=bias))
    for path in native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1]:
        native.set_isa(path)
        for threads in (1, 2):
            native.set_threads(threads)
            # one row block; k chunks of three row blocks; five blocks on weights widened once (M = 30)
            for m in (1, 3, 13, 30):
                assert np.array_equal(b.linear(x[:m], w).view(np.uint32), acc[:m].view(np.uint32)), (path, m)
            assert np.array_equal(b.linear(x, wb), acc + bias), path
    padded = native.linear_qtiles(x, w.data, w.scale, 70, None, False)  # the tile's columns 70..127
    assert padded.shape == (30, 128) and not padded[:, 70:].any()  # hold q = 0, S = D = 0: zeros


def test_weights_widen_as_a_rounded_product_then_a_rounded_offset(isa_and_threads):
    """Any float32 S and D (a real block's S * q is exact, so it cannot tell a fused multiply-
    subtract from the reference's two roundings): the kernels widen round(round(S * q) - D)."""
    rng = np.random.default_rng(4)
    q = rng.integers(-32, 32, (1, 64, TILE)).astype(np.int8)
    f = rng.standard_normal((1, 2, 2, TILE)).astype(np.float32)  # K = 64 in two groups of 32
    w = LinearWeight(BlockFormat.Q4_K, q, scale=f, layout="qtiles", out_features=TILE, in_features=64)
    dense = widen(q[0].T, f[0].transpose(2, 0, 1))
    x = rng.standard_normal((30, 64)).astype(np.float32)  # 30 rows: the kernel's two ways to widen
    acc = np.zeros((30, TILE), np.float32)
    for k in range(64):
        acc = _fma32(np.repeat(x[:, k : k + 1], TILE, axis=1), np.broadcast_to(dense[:, k], (30, TILE)), acc)
    for path in native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1]:
        native.set_isa(path)
        assert np.array_equal(dense_weights(w).view(np.uint32), dense.view(np.uint32)), path
        for m in (2, 30):
            assert np.array_equal(BlockHostBackend().linear(x[:m], w).view(np.uint32), acc[:m].view(np.uint32)), path


def test_row_order_moves_whole_rows():
    raw = np.random.default_rng(9).integers(0, 256, size=(8, 144), dtype=np.uint8)
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
    order = np.array([3, 1, 7, 0, 2, 6, 4, 5])
    a = dense_weights(pack_block_matrix(raw, BlockFormat.Q4_K, 256))
    b = dense_weights(pack_block_matrix(raw, BlockFormat.Q4_K, 256, rows=order))
    assert np.array_equal(b, a[order])


def test_block_self_check_passes_and_can_fail():
    assert check_block_invariance(BlockHostBackend()) == []

    class Blas(BlockHostBackend):
        def linear(self, x, w):  # BLAS on the dense weights: gemv for one row, gemm for several
            return x @ dense_weights(w).T

    assert check_block_invariance(Blas(), k=1024) != []


def test_wrong_layout_and_row_width_are_errors():
    with pytest.raises(ValueError, match="whole number"):
        pack_block_matrix(np.zeros((2, 34), np.uint8), BlockFormat.Q8_0, 48)
    with pytest.raises(ValueError, match="layout"):
        BlockHostBackend().prepare_linear(LinearWeight(BlockFormat.Q8_0, np.zeros((2, 34), np.uint8)))


# ------------------------------------------------------------------ the reader


def test_reader_agrees_with_ggml_orgs_reader(files):
    for path in files.values():
        ours = open_gguf(path)
        ref = gguf.GGUFReader(path)
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            assert ours.metadata[key] == (pytest.approx(value) if isinstance(value, float) else value), key
        assert list(ours.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            mine = ours.tensors[t.name]
            assert mine.shape == tuple(reversed(t.shape.tolist())) and mine.type_name == t.tensor_type.name
            assert np.array_equal(mine.data, t.data.view(np.uint8).reshape(-1))


def test_every_type_is_in_the_tiny_files(files):
    seen = {t.type_name for path in files.values() for t in open_gguf(path).tensors.values()}
    assert set(TYPES) <= seen


def test_truncated_and_foreign_files_are_weights_errors(files, tmp_path):
    data = files["qwen2"].read_bytes()
    for name, content in (("cut.gguf", data[: len(data) // 2]), ("head.gguf", data[:100]),
                          ("junk.gguf", b"not a gguf at all")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(WeightsError):
            Model.load(tmp_path / name) if name == "cut.gguf" else open_gguf(tmp_path / name)


# ------------------------------------------------------------------ models against transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_transformers_on_the_same_file(files, arch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = Model.load(files[arch])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        files[arch].parent, gguf_file=files[arch].name, dtype=torch.float32).eval()
    ids = [(i * 37 + 11) % model.config.vocab_size for i in range(24)]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    got = Forward(model).step_batch_all(ids, 0)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    # and the batched rows are the single steps' bits
    single = Forward(model)
    for i, token in enumerate(ids[:6]):
        assert np.array_equal(single.step(token, i).view(np.uint32), got[i].view(np.uint32))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qkv biases; head norms
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_fused_block_projections_give_the_bits_of_the_primitives(tmp_path, arch, type_name):
    # every matrix of one block type: q/k/v and gate/up fuse into one "qtiles" weight each
    path = write_tiny_gguf(tmp_path / "one-type.gguf", arch, matrix_types=(type_name,))
    fused = Model.load(path)
    plain = Model.load(path, backend=PrimitivesOnly(fused.backend))
    for lw in fused.weights.layers:
        assert lw.attn.qkv is not None and lw.mlp.gate_up is not None
        assert np.shares_memory(lw.attn.v.data, lw.attn.qkv.weight.data)
    ids = [(i * 37 + 11) % fused.config.vocab_size for i in range(20)]

    def logits(model):  # steps, a verify, a chunked prefill
        f = Forward(model)
        out = [f.step(t, i) for i, t in enumerate(ids[:4])]
        return out + [f.step_batch_all(ids[4:12], 4), Forward(model, prefill_chunk=5).prefill(ids)]

    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(logits(fused), logits(plain)))
    assert fused.weight_bytes_per_token() == plain.weight_bytes_per_token()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # gpt2 (byte-level BPE) and llama (SentencePiece) vocabularies
def test_tokenizers_match_transformers_gguf_conversion(files, arch):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(files[arch])
    ref = transformers.AutoTokenizer.from_pretrained(files[arch].parent, gguf_file=files[arch].name)
    for text in ("def total(values):\n    return sum(v for v in values)\n", "  the café naïve  \t東京🙂 x",
                 "speculative decoding is for print(self.value)", "<|endoftext|>class A: pass<|im_end|>"):
        assert ours.encode(text, add_special_tokens=True) == ref(text).input_ids
        ids = ours.encode(text)
        assert ids == ref(text, add_special_tokens=False).input_ids
        assert ours.decode(ids) == ref.decode(ids)


# ------------------------------------------------------------------ refusals and metadata


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen2")
    data = path.read_bytes().replace(b"qwen2", b"phi_3", 1)  # general.architecture's value
    (tmp_path / "phi.gguf").write_bytes(data)
    with pytest.raises(ConfigError, match="'phi_3'.*not supported"):
        describe_gguf(tmp_path / "phi.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen2")
    data = bytearray(path.read_bytes())
    # the type id follows the tensor's name, its dimension count and its dimensions
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (3).to_bytes(4, "little")  # Q4_1: a type npud does not run
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="blk.0.attn_q.weight.*Q4_1"):
        describe_gguf(tmp_path / "bad.gguf")


def test_describe_and_fingerprint(files, tmp_path):
    info = describe_gguf(files["gemma3"])
    assert info["architecture"] == "gemma3" and info["model_type"] == "gemma3_text"
    assert info["file_bytes"] == files["gemma3"].stat().st_size and info["context_length"] == 512
    assert set(info["quant_mix"]) >= set(TYPES) - {"F32"}
    model = Model.load(files["gemma3"])
    assert model.checkpoint_info == info and model.fingerprint == checkpoint_fingerprint(files["gemma3"])
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(files["gemma3"].read_bytes())
    assert checkpoint_fingerprint(copy) == model.fingerprint
    changed = bytearray(copy.read_bytes())
    changed[-10] ^= 1
    copy.write_bytes(bytes(changed))
    assert checkpoint_fingerprint(copy) != model.fingerprint


def test_check_config_reads_gguf_headers(files, tmp_path):
    bad = tmp_path / "phi.gguf"
    bad.write_bytes(files["qwen2"].read_bytes().replace(b"qwen2", b"phi_3", 1))
    for path, ok in ((files["gemma3"], True), (bad, False), (tmp_path / "missing.gguf", False)):
        conf = tmp_path / "npud.toml"
        conf.write_text(f'[[models]]\nname = "m"\ncheckpoint_dir = "{path}"\n')
        code = "import sys; from npud.main import main; sys.exit(main(sys.argv[1:]))"
        run = subprocess.run([sys.executable, "-c", code, "--config", str(conf), "--check-config"],
                             capture_output=True, text=True, timeout=120)
        assert (run.returncode == 0) == ok, run.stderr
        if not ok:
            assert "models[m].checkpoint_dir" in run.stderr


def test_chat_template_and_bos_come_from_the_file(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<model>{% endif %}")
    path = write_tiny_gguf(tmp_path / "chat.gguf", "gemma3", chat_template=template)
    tok = Tokenizer.from_dir(path)
    text = tok.apply_chat_template([{"role": "user", "content": "the value"}], add_generation_prompt=True)
    assert text == "<bos><user>the value<model>"
    assert tok.add_bos_token and tok.bos_token_id == 2 and tok.eos_token_ids == (1,)
    assert tok.encode("the value", add_special_tokens=True)[0] == 2 and tok.encode("the value")[0] != 2


def test_served_gguf_prompt_starts_with_bos_and_describes_itself(files):
    from npud.engine.api import GenerateRequest
    from npud.engine.session import LoadedModel

    served = LoadedModel.load("tiny", files["gemma3"], backend="host")
    ids = served.prompt_ids(GenerateRequest(prompt="the value"))
    assert ids[0] == 2 and ids[1:] == served.tokenizer.encode("the value")
    info = served.describe()["checkpoint"]
    assert info["architecture"] == "gemma3" and info["resident_bytes"] == served.model.nbytes
    # a vocabulary that does not ask for BOS (gpt2 here) gets none
    plain = LoadedModel.load("tiny2", files["qwen2"], backend="host")
    assert plain.prompt_ids(GenerateRequest(prompt="the value")) == plain.tokenizer.encode("the value")


def test_llama_files_named_mistral_read_as_mistral(tmp_path):
    from npud.engine.gguf.config import gguf_config

    named = gguf_config(open_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", name="Mistral 7B Instruct")))
    plain = gguf_config(open_gguf(write_tiny_gguf(tmp_path / "l.gguf", "llama", name="Llama 3.2 1B")))
    assert named.model_type == "mistral" and plain.model_type == "llama"


def test_rope_scaling_metadata(tmp_path):
    from npud.engine.gguf.config import gguf_config

    linear = write_tiny_gguf(tmp_path / "lin.gguf", "qwen2", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    rope = gguf_config(open_gguf(linear)).layers[0].rope
    assert rope.scaling == "linear" and rope.factor == 4.0
    yarn = write_tiny_gguf(tmp_path / "yarn.gguf", "qwen2", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        gguf_config(open_gguf(yarn))
