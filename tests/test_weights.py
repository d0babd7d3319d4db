"""npud.engine.weights on checkpoints saved by transformers, and on broken files of every kind."""

import json
import pickle
import struct

import numpy as np
import pytest
import torch
import transformers

from npud.engine.config import load_config
from npud.engine.weights import (
    ModelWeights,
    WeightsError,
    checkpoint_fingerprint,
    f32_to_bf16_bits,
    load_weights,
    open_checkpoint,
    quantize_int8_rows,
    read_safetensors_header,
)
from npud.kernels.base import WeightFormat

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}


def save_model(directory, model_type="qwen3", dtype=torch.float32, seed=0, **save_kwargs):
    """Saves a random tiny model (norms and biases randomised too); returns its fp32 state dict."""
    config_cls, extra = MODELS[model_type]
    config = config_cls(**TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model = model.to(dtype)
    model.save_pretrained(directory, **save_kwargs)
    return {k: v.detach().float() for k, v in model.state_dict().items()}, model


def linears(weights: ModelWeights):
    """(HF name prefix, LinearWeight) for every linear layer of `weights`."""
    yield "model.embed_tokens", weights.embed
    yield "lm_head", weights.lm_head
    for i, layer in enumerate(weights.layers):
        for proj in ("q", "k", "v", "o"):
            yield f"model.layers.{i}.self_attn.{proj}_proj", getattr(layer.attn, proj)
        for proj in ("gate", "up", "down"):
            yield f"model.layers.{i}.mlp.{proj}_proj", getattr(layer.mlp, proj)


def vectors(weights: ModelWeights):
    yield "model.norm.weight", weights.final_norm
    for i, layer in enumerate(weights.layers):
        yield f"model.layers.{i}.input_layernorm.weight", layer.input_norm
        yield f"model.layers.{i}.post_attention_layernorm.weight", layer.post_attention_norm
        if layer.attn.q_norm is not None:
            yield f"model.layers.{i}.self_attn.q_norm.weight", layer.attn.q_norm
            yield f"model.layers.{i}.self_attn.k_norm.weight", layer.attn.k_norm


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def check_vectors_and_biases(weights, state):
    for name, vec in vectors(weights):
        assert vec.dtype == np.float32 and vec.flags.c_contiguous
        assert np.array_equal(vec, state[name].numpy()), name
    for prefix, lw in linears(weights):
        if f"{prefix}.bias" in state:
            assert lw.bias.dtype == np.float32
            assert np.array_equal(lw.bias, state[f"{prefix}.bias"].numpy()), prefix
        else:
            assert lw.bias is None, prefix


def tied_name(prefix, state):
    return "model.embed_tokens" if prefix == "lm_head" and "lm_head.weight" not in state else prefix


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_fp32_checkpoint_in_all_formats(tmp_path, model_type):
    state, _ = save_model(tmp_path, model_type)
    cfg = load_config(tmp_path)
    fp32 = load_weights(cfg, tmp_path, WeightFormat.FP32)
    bf16 = load_weights(cfg, tmp_path, WeightFormat.BF16)
    int8 = load_weights(cfg, tmp_path, WeightFormat.INT8)
    assert len(fp32.layers) == cfg.num_layers
    for weights in (fp32, bf16, int8):
        check_vectors_and_biases(weights, state)
        assert (weights.lm_head is weights.embed) == cfg.tie_word_embeddings

    for (prefix, w32), (_, w16), (_, w8) in zip(linears(fp32), linears(bf16), linears(int8), strict=True):
        expected = state[f"{tied_name(prefix, state)}.weight"]
        assert w32.fmt is WeightFormat.FP32 and w32.data.dtype == np.float32 and w32.data.flags.c_contiguous
        assert np.array_equal(w32.data, expected.numpy()), prefix
        assert w32.scale is None

        assert w16.fmt is WeightFormat.BF16 and w16.data.dtype == np.uint16 and w16.data.flags.c_contiguous
        assert np.array_equal(w16.data, bf16_bits(expected)), prefix

        assert w8.fmt is WeightFormat.INT8 and w8.data.dtype == np.int8 and w8.scale.dtype == np.float32
        w = expected.numpy().astype(np.float64)
        scale = w8.scale.astype(np.float64)
        np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)
        error = np.abs(w8.data.astype(np.float64) * scale[:, None] - w)
        assert np.all(error <= scale[:, None] / 2 * (1 + 1e-5)), prefix
        assert np.abs(w8.data).max() == 127


def test_bf16_checkpoint(tmp_path):
    _, model = save_model(tmp_path, "llama", dtype=torch.bfloat16)
    cfg = load_config(tmp_path)
    bf16 = load_weights(cfg, tmp_path, WeightFormat.BF16)
    fp32 = load_weights(cfg, tmp_path, WeightFormat.FP32)
    q = model.model.layers[1].self_attn.q_proj.weight.detach()
    assert np.array_equal(bf16.layers[1].attn.q.data, q.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(fp32.layers[1].attn.q.data, q.float().numpy())
    bias = model.model.layers[0].self_attn.k_proj.bias.detach()
    assert np.array_equal(bf16.layers[0].attn.k.bias, bias.float().numpy())
    assert np.array_equal(bf16.final_norm, model.model.norm.weight.detach().float().numpy())


def test_f16_checkpoint_goes_through_f32(tmp_path):
    _, model = save_model(tmp_path, "qwen2", dtype=torch.float16)
    cfg = load_config(tmp_path)
    bf16 = load_weights(cfg, tmp_path, WeightFormat.BF16)
    fp32 = load_weights(cfg, tmp_path, WeightFormat.FP32)
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    assert np.array_equal(bf16.layers[0].mlp.down.data, bf16_bits(w.float()))
    assert np.array_equal(fp32.layers[0].mlp.down.data, w.float().numpy())


def test_bf16_rounding_matches_torch_on_every_kind_of_value():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                        0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x00018000,
                        0x3F808000, 0x3F818000, 0x3F807FFF, 0x00000001, 0x7F7F8000], dtype=np.uint32)
    x = np.concatenate([bits, special]).view(np.float32)
    mine = f32_to_bf16_bits(x)
    nan = np.isnan(x)
    assert 1000 > nan.sum() > 100
    # torch's NaN bits depend on its code path (0x7FC0 or 0xFFFF); any NaN is right
    assert np.array_equal(mine[~nan], bf16_bits(torch.from_numpy(x[~nan])))
    assert np.all(mine[nan] == 0x7FC0)
    widened = (mine.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(np.isnan(widened), nan) and np.array_equal(np.isinf(widened[~nan]), np.isinf(x[~nan]) | (np.abs(x[~nan]) >= 3.3961775e38))
    # ties go to even, both ways, and overflow rounds to infinity
    ties = np.array([0x00008000, 0x00018000], np.uint32).view(np.float32)
    assert f32_to_bf16_bits(ties).tolist() == [0x0000, 0x0002]
    assert f32_to_bf16_bits(np.array([1.00390625], np.float32))[0] == 0x3F80
    assert f32_to_bf16_bits(np.array([1.01171875], np.float32))[0] == 0x3F82
    assert f32_to_bf16_bits(np.array([3.4e38], np.float32))[0] == 0x7F80


def test_int8_zero_row_and_rounding():
    w = np.array([[0.0, 0.0, 0.0], [1.0, -2.54, 0.5], [-127.0, 63.5, 0.0]], np.float32)
    q, scale = quantize_int8_rows(w)
    assert scale.tolist() == [1.0, np.float32(2.54) / np.float32(127), 1.0]
    assert q[0].tolist() == [0, 0, 0]
    assert q[1].tolist() == [50, -127, 25]
    assert q[2].tolist() == [-127, 64, 0]  # 63.5 is a tie: rint goes to even


def test_int8_refuses_non_finite_weights(tmp_path):
    save_model(tmp_path, "qwen3")
    path = tmp_path / "model.safetensors"
    header, start = read_safetensors_header(path)
    begin, _ = header["model.layers.1.mlp.up_proj.weight"]["data_offsets"]
    data = bytearray(path.read_bytes())
    offset = start + begin + 4 * 64 * 3  # row 3, column 0 of the [96, 64] float32 matrix
    data[offset:offset + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))
    cfg = load_config(tmp_path)
    with pytest.raises(WeightsError, match=r"up_proj.weight' row 3 holds NaN"):
        load_weights(cfg, tmp_path, WeightFormat.INT8)
    fp32 = load_weights(cfg, tmp_path, WeightFormat.FP32)
    assert np.isnan(fp32.layers[1].mlp.up.data[3, 0])
    assert load_weights(cfg, tmp_path, WeightFormat.BF16).layers[1].mlp.up.data[3, 0] == 0x7FC0


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_model(single, "llama")
    save_model(sharded, "llama", max_shard_size="40KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = load_config(sharded)
    a = load_weights(cfg, single, WeightFormat.BF16)
    b = load_weights(cfg, sharded, WeightFormat.BF16)
    for (name, x), (_, y) in zip(linears(a), linears(b), strict=True):
        assert np.array_equal(x.data, y.data), name
    assert a.nbytes == b.nbytes
    assert a.fingerprint != b.fingerprint  # different files, though the same values


def test_open_checkpoint_maps_without_reading(tmp_path):
    state, _ = save_model(tmp_path, "qwen3")
    refs = open_checkpoint(tmp_path)
    assert set(refs) == set(state) - {"lm_head.weight"}
    ref = refs["model.layers.0.self_attn.q_proj.weight"]
    arr = ref.array()
    assert ref.dtype == "F32" and ref.shape == (128, 64)
    assert not arr.flags.writeable
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)
    assert np.array_equal(arr, state["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_nbytes_counts_tied_table_once(tmp_path):
    save_model(tmp_path, "qwen3")
    weights = load_weights(load_config(tmp_path), tmp_path, WeightFormat.INT8)
    assert weights.lm_head is weights.embed
    total = weights.embed.nbytes + weights.final_norm.nbytes
    for layer in weights.layers:
        total += layer.input_norm.nbytes + layer.post_attention_norm.nbytes
        total += layer.attn.q_norm.nbytes + layer.attn.k_norm.nbytes
        total += sum(getattr(layer.attn, p).nbytes for p in "qkvo")
        total += sum(getattr(layer.mlp, p).nbytes for p in ("gate", "up", "down"))
    assert weights.nbytes == total


def test_fingerprint(tmp_path):
    save_model(tmp_path, "qwen3")
    first = checkpoint_fingerprint(tmp_path)
    assert len(first) == 64 and first == checkpoint_fingerprint(tmp_path)
    assert load_weights(load_config(tmp_path), tmp_path, WeightFormat.FP32).fingerprint == first
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    second = checkpoint_fingerprint(tmp_path)
    assert second != first
    rewrite_tensor(tmp_path / "model.safetensors", "model.norm.weight", dtype="F16")
    third = checkpoint_fingerprint(tmp_path)
    assert third != second


def test_fingerprint_changes_with_retrained_weights_of_the_same_shapes(tmp_path):
    # same config, names, dtypes and shapes (so the same header): only the data differs
    save_model(tmp_path / "a", "qwen3", seed=0)
    save_model(tmp_path / "b", "qwen3", seed=1)
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    assert checkpoint_fingerprint(tmp_path / "a") != checkpoint_fingerprint(tmp_path / "b")


def test_fingerprint_needs_config(tmp_path):
    save_model(tmp_path, "qwen3")
    config = tmp_path / "config.json"
    config.unlink()
    with pytest.raises(WeightsError, match="config.json"):
        checkpoint_fingerprint(tmp_path)


# ---- broken checkpoints --------------------------------------------------------------


def write_safetensors(path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None):
    """Writes a safetensors file by hand (so any dtype label can be written)."""
    labels = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<f8"): "F64",
              np.dtype("i1"): "I8", np.dtype("<u2"): "BF16"}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr).tobytes()
        label = (dtypes or {}).get(name, labels[arr.dtype])
        header[name] = {"dtype": label, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def read_all(path):
    header, _ = read_safetensors_header(path)
    refs = open_checkpoint(path.parent)
    return {name: np.array(refs[name].array()) for name in header}


def rewrite_tensor(path, name, array=None, dtype=None, drop=False):
    tensors = read_all(path)
    if drop:
        del tensors[name]
    elif array is not None:
        tensors[name] = array
    elif dtype is not None:
        tensors[name] = tensors[name].astype({"F16": np.float16, "F64": np.float64, "I8": np.int8}[dtype])
    write_safetensors(path, tensors)


@pytest.fixture
def ckpt(tmp_path):
    save_model(tmp_path, "qwen3")
    return tmp_path, load_config(tmp_path), tmp_path / "model.safetensors"


def load_error(directory, cfg) -> str:
    with pytest.raises(WeightsError) as info:
        load_weights(cfg, directory, WeightFormat.BF16)
    return str(info.value)


def test_missing_tensor(ckpt):
    directory, cfg, path = ckpt
    rewrite_tensor(path, "model.layers.1.self_attn.k_norm.weight", drop=True)
    assert "'model.layers.1.self_attn.k_norm.weight' is missing" in load_error(directory, cfg)


def test_untied_model_needs_lm_head(tmp_path):
    save_model(tmp_path, "mistral")
    rewrite_tensor(tmp_path / "model.safetensors", "lm_head.weight", drop=True)
    assert "'lm_head.weight' is missing" in load_error(tmp_path, load_config(tmp_path))


def test_wrong_shape(ckpt):
    directory, cfg, path = ckpt
    rewrite_tensor(path, "model.layers.0.mlp.down_proj.weight", array=np.zeros((64, 95), np.float32))
    message = load_error(directory, cfg)
    assert "'model.layers.0.mlp.down_proj.weight' has shape [64, 95], expected [64, 96]" in message


@pytest.mark.parametrize("dtype", ["I8", "F64"])
def test_unsupported_dtype(ckpt, dtype):
    directory, cfg, path = ckpt
    rewrite_tensor(path, "model.layers.0.self_attn.v_proj.weight", dtype=dtype)
    message = load_error(directory, cfg)
    assert "'model.layers.0.self_attn.v_proj.weight'" in message and f"dtype {dtype}" in message
    with pytest.raises(WeightsError, match=f"dtype {dtype}"):
        open_checkpoint(directory)["model.layers.0.self_attn.v_proj.weight"].array()


def test_f8_label_is_unsupported(ckpt):
    directory, cfg, path = ckpt
    tensors = read_all(path)
    tensors["model.norm.weight"] = np.zeros(64, np.int8)
    write_safetensors(path, tensors, dtypes={"model.norm.weight": "F8_E4M3"})
    assert "dtype F8_E4M3" in load_error(directory, cfg)


def test_all_problems_reported_together(ckpt):
    directory, cfg, path = ckpt
    rewrite_tensor(path, "model.norm.weight", drop=True)
    rewrite_tensor(path, "model.layers.0.input_layernorm.weight", array=np.zeros(3, np.float32))
    message = load_error(directory, cfg)
    assert "model.norm.weight" in message and "input_layernorm" in message


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -4])
def test_truncated_file(ckpt, keep):
    directory, cfg, path = ckpt
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    message = load_error(directory, cfg)
    assert str(path) in message and "truncated" in message


def test_not_safetensors_files(ckpt):
    directory, cfg, path = ckpt
    path.write_text("this is a README, not a tensor file\n" * 4)
    assert "not a safetensors file" in load_error(directory, cfg)
    path.write_bytes(pickle.dumps({"weight": [1.0, 2.0, 3.0]}, protocol=2))
    assert str(path) in load_error(directory, cfg)
    path.write_bytes(struct.pack("<Q", 6) + b"[1, 2]")
    assert "not a JSON object" in load_error(directory, cfg)
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
    assert "not JSON" in load_error(directory, cfg)
    path.unlink()
    path.mkdir()
    assert "directory" in load_error(directory, cfg)


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, ["data_offsets", "F32 [2]"]),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}, ["data_offsets"]),
        ({"dtype": "F32", "shape": [1], "data_offsets": [1000, 1004]}, ["truncated", "data ends at byte"]),
        ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}, ["unknown dtype 'Q4'"]),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}, ["shape"]),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, ["data_offsets"]),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, ["data_offsets"]),
        ([1, 2], ["entry must be an object"]),
    ],
)
def test_inconsistent_header_entries(tmp_path, entry, words):
    raw = json.dumps({"t": entry, "__metadata__": {"format": "pt"}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(WeightsError) as info:
        read_safetensors_header(path)
    message = str(info.value)
    assert str(path) in message and "'t'" in message
    for word in words:
        assert word in message


def test_overlapping_tensors(tmp_path):
    raw = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(WeightsError, match="'a' and 'b' overlap"):
        read_safetensors_header(path)


def test_header_reader_accepts_what_transformers_writes(ckpt):
    _, _, path = ckpt
    header, start = read_safetensors_header(path)
    assert "__metadata__" not in header and start % 8 == 0
    assert header["model.norm.weight"]["dtype"] == "F32"


def test_missing_shard_and_bad_index(tmp_path):
    save_model(tmp_path, "llama", max_shard_size="40KB")
    cfg = load_config(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = tmp_path / index["weight_map"]["model.norm.weight"]
    moved = shard.with_suffix(".moved")
    shard.rename(moved)
    message = load_error(tmp_path, cfg)
    assert str(shard) in message and "does not exist" in message
    moved.rename(shard)

    other = tmp_path / index["weight_map"]["model.embed_tokens.weight"]
    bad = dict(index, weight_map=dict(index["weight_map"], **{"model.norm.weight": other.name}))
    index_path.write_text(json.dumps(bad))
    assert "does not hold tensor 'model.norm.weight'" in load_error(tmp_path, cfg)

    bad = dict(index, weight_map=dict(index["weight_map"], **{"model.norm.weight": "../elsewhere.safetensors"}))
    index_path.write_text(json.dumps(bad))
    assert "invalid shard '../elsewhere.safetensors'" in load_error(tmp_path, cfg)

    index_path.write_text("{broken")
    assert "shard index" in load_error(tmp_path, cfg)


def test_tensor_in_two_shards(tmp_path):
    save_model(tmp_path, "llama", max_shard_size="40KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = tmp_path / index["weight_map"]["model.embed_tokens.weight"]
    second = tmp_path / index["weight_map"]["model.norm.weight"]
    tensors = read_all(second)
    tensors["model.embed_tokens.weight"] = np.zeros((300, 64), np.float32)
    write_safetensors(second, tensors)
    with pytest.raises(WeightsError, match="'model.embed_tokens.weight' is also in"):
        open_checkpoint(tmp_path)
    assert first.is_file()


def test_missing_files(tmp_path):
    with pytest.raises(WeightsError, match="no such checkpoint directory"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(WeightsError, match="neither model.safetensors nor"):
        open_checkpoint(tmp_path)
    with pytest.raises(WeightsError, match="no such file"):
        read_safetensors_header(tmp_path / "absent.safetensors")


def test_bad_format_argument(ckpt):
    directory, cfg, _ = ckpt
    with pytest.raises(WeightsError, match="fmt"):
        load_weights(cfg, directory, "bf16")


@pytest.mark.parametrize("fmt", list(WeightFormat))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conversion_in_row_blocks_equals_whole_tensor(tmp_path, monkeypatch, fmt, dtype):
    save_model(tmp_path, "llama", dtype=dtype)
    cfg = load_config(tmp_path)
    whole = load_weights(cfg, tmp_path, fmt)
    monkeypatch.setattr("npud.engine.weights.convert._CHUNK_ELEMENTS", 200)  # 3 rows of 64 per block, a partial last block
    blocks = load_weights(cfg, tmp_path, fmt)
    for (name, a), (_, b) in zip(linears(whole), linears(blocks), strict=True):
        assert np.array_equal(a.data, b.data), name
        assert (a.scale is None and b.scale is None) or np.array_equal(a.scale, b.scale), name
