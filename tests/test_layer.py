"""The host's decoder layer in one native call (npud/kernels/host/layer.py, layer.c) against the per-op
path it replaces (npud.kernels.base.compose_layer on the same backend: a call per kernel).

For every weight format the host serves (fp32, bf16, int8, int8-q8, int8-q16, bf16-bf16, GGUF blocks
on the exact path and as gguf-q8), on llama / qwen2 / qwen3 / mistral / gemma3 layers (head norms or
none, biases, widths that end inside a tile, sliding windows, gemma3's four norms and two RoPE
tables) and on a model with KV-shared layers, for M = 1, 3 and 8 rows in one, three and three
ragged sequences: the layer's output (x, delta), and every row of every plane it writes, are the
per-op path's bits; rows of a plane outside the pass's are untouched. Then the same at 1 and 2
threads and on every slower ISA path, with attention and per-row kernels large enough for threads
(split over the GEMM pool's threads inside the call), with stalled GEMM workers (the layer's weights are kept while they
may read them), and whole packed passes of three sequences (logits and planes). A whole model's
layers in one call (decoder_stack: KV-shared layers reading rows written in the same call) against
compose_layer a layer at a time; a decode step is one such call (cut at a tap layer); a call that
does not fit its planes or rows is refused before any native work.

Mutants run by hand against this file (each applied, the file run, reverted; failing tests of 80):
  layer.c's residual reassociated: x + (delta + attention output)             56 (the sandwich layers
                                                                                  add no delta there)
  layer.c: every sequence's attention reads the first sequence's plane         70
  layer.c: the KV rows not written into the planes                             75
  layer.py: the second sequence's rows start one row late (the bounds)         71
  layer.py: the call keeps none of the layer's weights for stalled workers      1 (the stall test)
  layer.py: every layer of a stack reads the stack's input, not the last
            layer's output                                                     11
(Not mutants: swapping the operands of the residual add, as IEEE addition commutes; a stack's layers
writing their outputs over their own inputs, as layer.c reads x and delta before it writes.)
tests/test_batch.py alone fails 11 of its tests on the first-plane and row-range mutants, 2 on the
reassociation (a batch and its rows alone take the same wrong path: only a reference catches it).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from npud.engine.config import AttentionKind, LayerSpec, ModelConfig, RopeSpec
from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.packed import Pass, Rows, run_packed
from npud.engine.testing.backends import ONE_CALL_LAYERS, PrimitivesOnly
from npud.engine.testing.checkpoints import build_tiny_checkpoint, write_tokenizer
from npud.engine.weights import AttentionWeights, LayerWeights, MlpWeights, ModelWeights
from npud.kernels.base import LayerCall, PlaneRows, RoundRows, StackCall, WeightFormat, compose_layer
from npud.kernels.host import HostBackend, backend as host_backend, layer as host_layer, native, pointwise
from npud.kernels.host.formats import KERNELS

sys.path.insert(0, str(Path(__file__).parent))
from gguf_checkpoints import write_tiny_gguf  # noqa: E402

F32 = np.float32
FORMATS = [f.value for f in WeightFormat]
# (held, rows) per sequence: one row; three rows of one sequence; three sequences of one row;
# three ragged sequences, the last past a window of 4
LAYOUTS = {
    "M1": ((7, 1),),
    "M3": ((0, 3),),
    "M3x3": ((4, 1), (9, 1), (0, 1)),
    "M8x3": ((5, 2), (0, 1), (12, 5)),
}
HF = {
    "qwen3": dict(model_type="qwen3"),
    # q 72, k/v 24, gate/up 100, hidden 72: outputs that end inside a tile (padding between fused parts)
    "qwen3_odd": dict(model_type="qwen3", head_dim=24, num_attention_heads=3, num_key_value_heads=1,
                      intermediate_size=100, hidden_size=72),
    "qwen2_bias": dict(model_type="qwen2"),
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),  # no head norm: RoPE alone
    "mistral_window": dict(model_type="mistral", sliding_window=4),
}


def _gemma3(out: Path) -> Path:
    """A tiny transformers Gemma 3: sliding layers (window 4) and a full one, two RoPE thetas,
    query_pre_attn_scalar != head_dim, 4 heads over 2 KV heads, the four norms, gelu_tanh."""
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        max_position_embeddings=256, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg.initializer_range = 0.15
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, vocab_size=320)
    return out


def shared_kv_config() -> ModelConfig:
    """Four layers: full, sliding (window 4), then a full layer reading layer 0's plane and a
    sliding one reading layer 1's."""
    kinds = [AttentionKind.FULL, AttentionKind.SLIDING] * 2
    layers = tuple(
        LayerSpec(index=i, kind=kind, num_heads=4, num_kv_heads=2, head_dim=16,
                  window=4 if kind is AttentionKind.SLIDING else 0, kv_owner=owner,
                  rope=RopeSpec(theta=10000.0, rotary_dim=16))
        for i, (kind, owner) in enumerate(zip(kinds, [0, 1, 0, 1]))
    )
    return ModelConfig(
        model_type="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, layers=layers, rms_norm_eps=1e-6,
        qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False, tie_word_embeddings=False,
        max_position_embeddings=256, eos_token_ids=(0,), bos_token_id=None, pad_token_id=None, hidden_act="silu",
        torch_dtype=None,
    )


def shared_kv_model(fmt: WeightFormat, seed: int = 0) -> Model:
    """shared_kv_config with random weights in `fmt` (the format's own sample: biases too); the
    KV-shared layers have no k and v of their own."""
    cfg = shared_kv_config()
    rng = np.random.default_rng(seed)

    def linear(n, k):
        return KERNELS[fmt].sample(rng, n, k)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(F32)

    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for spec in cfg.layers:
        own = spec.owns_kv
        attn = AttentionWeights(linear(spec.num_heads * spec.head_dim, d), linear(spec.kv_width, d) if own else None,
                                linear(spec.kv_width, d) if own else None, linear(d, spec.num_heads * spec.head_dim),
                                norm(spec.head_dim), norm(spec.head_dim))
        layers.append(LayerWeights(norm(d), attn, norm(d), MlpWeights(linear(f, d), linear(f, d), linear(d, f))))
    embed = KERNELS[WeightFormat.FP32].sample(rng, cfg.vocab_size, d)
    weights = ModelWeights(embed, layers, norm(d), linear(cfg.vocab_size, d), fingerprint=f"shared-kv-{fmt.value}")
    return Model(cfg, weights, HostBackend())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer")
    out = {name: build_tiny_checkpoint(root / name, **kw) for name, kw in HF.items()}
    out["gemma3"] = _gemma3(root / "gemma3")
    for arch in ("gemma3", "qwen2", "llama"):
        out[f"gguf_{arch}"] = write_tiny_gguf(root / f"{arch}.gguf", arch)
    return out


_models: dict = {}


def model_for(checkpoints, name: str, fmt: str) -> Model:
    key = (name, fmt)
    if key not in _models:
        if name == "shared":
            _models[key] = shared_kv_model(WeightFormat(fmt))
        else:
            _models[key] = Model.load(checkpoints[name], fmt)
    return _models[key]


def round_inputs(model: Model, layer, layout, seed: int, with_delta: bool):
    """A LayerCall's inputs for `layer` over the sequences of `layout` ((held, rows) each): random x
    (and delta), and per sequence a plane holding `held` random rows; a KV-shared layer's plane holds
    this pass's rows too (its owner's call wrote them). Rows past those are NaN sentinels."""
    rng = np.random.default_rng(seed)
    d = model.config.hidden_size
    m = sum(n for _, n in layout)
    x = rng.standard_normal((m, d)).astype(F32)
    delta = rng.standard_normal((m, d)).astype(F32) * F32(0.5) if with_delta else None
    bounds = np.cumsum([0] + [n for _, n in layout])
    positions = np.concatenate([np.arange(h, h + n, dtype=np.int64) for h, n in layout])
    planes = []
    for held, n in layout:
        shape = (held + n + 3, layer.num_kv_heads, layer.head_dim)
        keys, values = np.full(shape, np.nan, F32), np.full(shape, np.nan, F32)
        filled = held if layer.owns_kv else held + n
        keys[:filled] = rng.standard_normal((filled,) + shape[1:])
        values[:filled] = rng.standard_normal((filled,) + shape[1:])
        planes.append((keys, values, held))
    rows = RoundRows(positions, tuple((int(a), int(z)) for a, z in zip(bounds[:-1], bounds[1:])))
    return rows, x, delta, planes


def _call(layer, rows, x, delta, planes) -> LayerCall:
    mine = tuple(PlaneRows(k.copy(), v.copy(), held) for k, v, held in planes)
    return LayerCall(layer, rows, x.copy(), None if delta is None else delta.copy(), mine)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, F32).view(np.uint32)


def assert_same_layer(backend, layer, rows, x, delta, planes, where: str) -> None:
    """The native layer (which must run, not decline) against compose_layer on the same inputs."""
    fused_call, composed_call = _call(layer, rows, x, delta, planes), _call(layer, rows, x, delta, planes)
    fused = backend.decoder_layer(fused_call)
    assert fused is not None, f"{where}: the layer was left to the composed path"
    composed = compose_layer(backend, composed_call)
    if composed[1] is None:  # gemma3's sandwich: the composed layer adds the MLP's normed output itself
        assert np.array_equal(bits(fused[0] + fused[1]), bits(composed[0])), where
    else:
        assert np.array_equal(bits(fused[0]), bits(composed[0])), f"{where}: x"
        assert np.array_equal(bits(fused[1]), bits(composed[1])), f"{where}: delta"
    for s, (a, b) in enumerate(zip(fused_call.planes, composed_call.planes)):
        assert np.array_equal(bits(a.keys), bits(b.keys)), f"{where}: sequence {s}'s keys"
        assert np.array_equal(bits(a.values), bits(b.values)), f"{where}: sequence {s}'s values"


def check_model_layers(model: Model, layouts=LAYOUTS, seed: int = 0) -> None:
    for layer in model.decoder_layers:
        for i, (name, layout) in enumerate(layouts.items()):
            rows, x, delta, planes = round_inputs(model, layer, layout, seed + 10 * layer.index + i, i % 2 == 0)
            assert_same_layer(model.backend, layer, rows, x, delta, planes, f"layer {layer.index} {name}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(HF) + ["gemma3", "shared"])
def test_the_native_layer_has_the_per_op_bits(checkpoints, name, fmt):
    model = model_for(checkpoints, name, fmt)
    if name == "shared":
        assert [layer.owns_kv for layer in model.decoder_layers] == [True, True, False, False]
    if name == "gemma3":
        assert model.config.sandwich_norms and len({id(layer.inv_freq) for layer in model.decoder_layers}) == 2
    check_model_layers(model)


@pytest.mark.parametrize("fmt", ["bf16", "gguf-q8"])  # the exact path's block kernels, and q8 rows
@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "llama"])
def test_the_native_layer_has_the_per_op_bits_on_gguf_blocks(checkpoints, arch, fmt):
    model = model_for(checkpoints, f"gguf_{arch}", fmt)
    kinds = {type(w.fmt).__name__ for lw in model.weights.layers for w in (lw.attn.q, lw.attn.v, lw.mlp.down)}
    assert "BlockFormat" in kinds
    check_model_layers(model)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    native.set_threads(request.param)
    yield request.param
    native.set_threads(0)


@pytest.mark.parametrize("name,fmt", [("qwen3_odd", "fp32"), ("gemma3", "int8-q8"), ("llama_bias", "bf16-bf16"),
                                      ("gguf_gemma3", "bf16"), ("gguf_qwen2", "gguf-q8"), ("shared", "int8-q16")])
def test_every_isa_path_and_thread_count_gives_the_per_op_bits(checkpoints, name, fmt, threads):
    """The native layer on each slower ISA path against the per-op path on the best one."""
    model = model_for(checkpoints, name, fmt)
    best = native.isa()
    layer = model.decoder_layers[-1]
    rows, x, delta, planes = round_inputs(model, layer, LAYOUTS["M8x3"], 5, True)
    want = compose_layer(model.backend, _call(layer, rows, x, delta, planes))
    try:
        for path in native.ISA_NAMES[: native.ISA_NAMES.index(best) + 1]:
            native.set_isa(path)
            got = model.backend.decoder_layer(_call(layer, rows, x, delta, planes))
            total = got[0] + got[1] if want[1] is None else got[0]
            assert np.array_equal(bits(total), bits(want[0])), path
    finally:
        native.set_isa(best)


@pytest.mark.parametrize("name,fmt", [("gemma3", "bf16"), ("qwen3_odd", "fp32")])  # kv heads 2 and 1
def test_attention_and_per_row_kernels_large_enough_for_threads_run_inside_the_call(checkpoints, monkeypatch, name,
                                                                                     fmt):
    """A prefill-sized round stays one native call: its per-row kernels and each sequence's attention
    go to the GEMM pool's threads inside it (pool.c's pool_for), with the per-op path's bits, in
    native._attention_units' units (a kv head each for gemma3's two, row blocks for qwen3_odd's one).
    Workers that sleep on every unit they take (and take the first of each split) make the pool's
    workers compute units for certain, and the call wait for them."""
    model = model_for(checkpoints, name, fmt)
    monkeypatch.setattr(native, "PARALLEL_MIN_WORK", 1)  # every sequence's attention takes threads: the layer's
    monkeypatch.setattr(host_backend, "PARALLEL_MIN_WORK", 1)  # and the per-op path's (its own rule)
    monkeypatch.setattr(host_layer, "ROWS_PARALLEL_MIN", 1)  # and every per-row kernel of more than a row
    calls = []
    real = native.attention
    monkeypatch.setattr(native, "attention", lambda *a: calls.append(a[-1]) or real(*a))
    native.set_threads(2)
    native.stall_workers(200)
    before = native.pool_for_stats()
    try:
        check_model_layers(model, {"M8x3": LAYOUTS["M8x3"]})
    finally:
        native.stall_workers(0)
        native.set_threads(0)
    splits, units, by_workers = (b - a for a, b in zip(before, native.pool_for_stats()))
    layers = model.decoder_layers
    spec = layers[0]
    per_sequence = [len(native._attention_units(n, spec.num_kv_heads, 2, n * spec.num_heads * (held + n) * spec.head_dim))
                    for held, n in LAYOUTS["M8x3"]]
    split = [u for u in per_sequence if u > 1]  # one unit (qwen3_odd's one-row sequence) runs on the caller
    # per layer: the sequences' attention, and the per-row kernels (2 norm_rope, 2 norms or gemma3's 4,
    # the activation) in min(M, 4 x threads) = 8 blocks each
    rows_kernels = 2 + (4 if spec.sandwich_norms else 2) + 1
    assert splits == len(layers) * (len(split) + rows_kernels), splits
    assert units == len(layers) * (sum(split) + rows_kernels * 8), units
    # the caller gives a worker some time to take each split's first unit (not always enough on a
    # loaded machine: the worker's core may be busy), so some of them, not all, are the workers'
    assert by_workers > 0, f"the workers ran none of the {units} units: the bits above checked only the caller's"
    # only the composed layers call native.attention (on threads, their own rule)
    assert calls.count(True) == 3 * len(layers) and len(calls) == 3 * len(layers)


def test_a_round_whose_per_row_kernels_take_threads_stays_one_call(checkpoints, monkeypatch):
    model = model_for(checkpoints, "qwen3", "fp32")
    layer = model.decoder_layers[0]
    rows, x, delta, planes = round_inputs(model, layer, LAYOUTS["M3"], 1, False)
    native.set_threads(2)
    try:
        for threshold, split in ((3 * 128, True), (3 * 128 + 1, False)):  # M x F: the widest per-row call
            monkeypatch.setattr(host_layer, "ROWS_PARALLEL_MIN", threshold)
            before = native.pool_for_stats()
            assert_same_layer(model.backend, layer, rows, x, delta, planes, f"threshold {threshold}")
            assert (native.pool_for_stats()[0] > before[0]) == split, threshold
    finally:
        native.set_threads(0)


def test_layers_with_gemma4_extras_are_left_to_the_composed_path(checkpoints):
    model = model_for(checkpoints, "qwen3", "fp32")
    layer = model.decoder_layers[0]
    lw = layer.weights
    extras = {
        "layer_scalar": dataclasses.replace(lw, layer_scalar=np.ones(1, F32)),
        "v_norm": dataclasses.replace(lw, attn=dataclasses.replace(lw.attn, v_norm=np.ones(32, F32))),
        "k_eq_v": dataclasses.replace(lw, attn=dataclasses.replace(lw.attn, v=None, qkv=None)),
    }
    for name, weights in extras.items():
        assert host_layer.native_layer(model.backend, dataclasses.replace(layer, weights=weights)) is None, name
    assert host_layer.native_layer(model.backend, layer) is not None
    rows, x, delta, planes = round_inputs(model, layer, LAYOUTS["M1"], 2, False)
    call = dataclasses.replace(_call(layer, rows, x, delta, planes), per_layer=np.ones((1, 8), F32))
    assert model.backend.decoder_layer(call) is None  # gemma4's per-layer inputs


def test_a_stalled_worker_keeps_the_layers_weights(checkpoints):
    """With workers that sleep on every chunk they take (a descheduled core), the caller takes their
    chunks back: the layer keeps its bits, and while a worker may still read a finished call's
    weights, the arrays of the layer are among those native keeps alive."""
    model = model_for(checkpoints, "gguf_gemma3", "bf16")
    layer = model.decoder_layers[0]
    rows, x, delta, planes = round_inputs(model, layer, LAYOUTS["M3x3"], 3, True)
    want = compose_layer(model.backend, _call(layer, rows, x, delta, planes))
    native.set_threads(2)
    native.stall_workers(20_000)
    try:
        got = model.backend.decoder_layer(_call(layer, rows, x, delta, planes))
        held = native.held_calls()
        kept = {id(a) for arrays in native._held for a in arrays if a is not None}
    finally:
        native.stall_workers(0)
        native.set_threads(0)
    assert np.array_equal(bits(got[0] + got[1]), bits(want[0]))
    assert held > 0, "no worker took a chunk: the check below checked nothing"
    nat = layer.state["host"].layers[layer.index]
    assert {id(a) for a in nat.keep} <= kept
    deadline = time.monotonic() + 10
    while native.held_calls() and time.monotonic() < deadline:  # the sleeping workers let go
        time.sleep(0.01)


def _packed_run(model: Model, prompts, steps) -> tuple[list, list]:
    """Three sequences prefilled to their own lengths, then rounds packing one step of each, an
    8-row verify of the second and a 3-row chunk of the third: every logit and the planes."""
    seqs = [Forward(model) for _ in prompts]
    logits = []
    for f, p in zip(seqs, prompts):
        logits.append(f.prefill(p))
    for t in steps:
        outs = run_packed(model, [(f, Pass((t + i,), f.positions_held)) for i, f in enumerate(seqs)])
        logits += outs
    outs = run_packed(model, [(seqs[0], Pass((5,), seqs[0].positions_held)),
                              (seqs[1], Pass(tuple(range(10, 18)), seqs[1].positions_held)),
                              (seqs[2], Pass((7, 8, 9), seqs[2].positions_held, Rows.LAST))])
    logits += outs
    planes = [[(p.keys(), p.values()) for p in f.state.planes if p.kind.value == "kv"] for f in seqs]
    return logits, planes


@pytest.mark.parametrize("name,fmt", [("gemma3", "bf16"), ("mistral_window", "int8"), ("shared", "fp32"),
                                      ("gguf_gemma3", "gguf-q8")])
def test_packed_passes_have_the_per_op_bits(checkpoints, name, fmt):
    model = model_for(checkpoints, name, fmt)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    got = _packed_run(model, prompts, [40, 41, 42])
    per_op = Model(model.config, model.weights, PrimitivesOnly(model.backend, hide=ONE_CALL_LAYERS), prepared=True)
    want = _packed_run(per_op, prompts, [40, 41, 42])
    assert "host" not in per_op.decoder_layers[0].state  # the reference made no layer call
    assert all(rows_equal(a, b) for a, b in zip(got[0], want[0]))
    for mine, theirs in zip(got[1], want[1]):
        assert all(rows_equal(k, k2) and rows_equal(v, v2) for (k, v), (k2, v2) in zip(mine, theirs))
    assert model.decoder_layers[0].state["host"].layers[0] is not None  # the native layer ran


def stack_inputs(model: Model, layout, seed: int):
    """A StackCall's inputs over every layer of `model`: random x and delta, and per owning layer
    and sequence a plane of `held` random rows (NaN past them) that its KV-shared layers share."""
    rng = np.random.default_rng(seed)
    m = sum(n for _, n in layout)
    x = rng.standard_normal((m, model.config.hidden_size)).astype(F32)
    delta = rng.standard_normal(x.shape).astype(F32)
    bounds = np.cumsum([0] + [n for _, n in layout])
    rows = RoundRows(np.concatenate([np.arange(h, h + n, dtype=np.int64) for h, n in layout]),
                     tuple((int(a), int(z)) for a, z in zip(bounds[:-1], bounds[1:])))
    owned = {}
    for layer in model.decoder_layers:
        if layer.owns_kv:
            per_seq = []
            for held, n in layout:
                shape = (held + n + 3, layer.num_kv_heads, layer.head_dim)
                keys, values = np.full(shape, np.nan, F32), np.full(shape, np.nan, F32)
                keys[:held], values[:held] = rng.standard_normal((2, held) + shape[1:])
                per_seq.append((keys, values, held))
            owned[layer.index] = per_seq
    return rows, x, delta, owned


def _stack_planes(model: Model, owned) -> tuple:
    """Private copies of the planes, each owner's arrays shared by the layers that read them."""
    copies = {i: tuple(PlaneRows(k.copy(), v.copy(), held) for k, v, held in per_seq) for i, per_seq in owned.items()}
    return tuple(copies[layer.kv_owner] for layer in model.decoder_layers), copies


@pytest.mark.parametrize("name,fmt", [("shared", "int8-q8"), ("gemma3", "bf16"), ("qwen3_odd", "bf16-bf16"),
                                      ("gguf_gemma3", "gguf-q8"), ("gguf_llama", "bf16")])
@pytest.mark.parametrize("layout", ["M1", "M8x3"])
def test_a_stack_of_layers_in_one_call_has_the_per_op_bits(checkpoints, name, fmt, layout):
    """Every layer of the model in one native call (decoder_stack), each layer's output passed on
    to the next inside it and a KV-shared layer reading the rows its owner wrote in the same call,
    against compose_layer a layer at a time."""
    model = model_for(checkpoints, name, fmt)
    rows, x, delta, owned = stack_inputs(model, LAYOUTS[layout], 9)
    planes, written = _stack_planes(model, owned)
    got = model.backend.decoder_stack(StackCall(model.decoder_layers, rows, x.copy(), delta.copy(), planes))
    assert got is not None
    want_planes, want_written = _stack_planes(model, owned)
    want = (x.copy(), delta.copy())
    for layer, mine in zip(model.decoder_layers, want_planes):
        want = compose_layer(model.backend, LayerCall(layer, rows, want[0], want[1], mine))
    if want[1] is None:
        assert np.array_equal(bits(got[0] + got[1]), bits(want[0]))
    else:
        assert np.array_equal(bits(got[0]), bits(want[0])) and np.array_equal(bits(got[1]), bits(want[1]))
    for i in written:
        for a, b in zip(written[i], want_written[i]):
            assert np.array_equal(bits(a.keys), bits(b.keys)) and np.array_equal(bits(a.values), bits(b.values)), i


def test_a_step_is_one_native_call_for_its_layers(checkpoints, monkeypatch):
    """A decode step of a model whose layers all run natively makes one layer call for all of them
    (and the embedding, the final norm and the LM head); with a tap on layer 1 the stack is cut
    there, and the tap's rows and the logits are the per-op path's."""
    model = model_for(checkpoints, "gguf_gemma3", "bf16")
    per_op = Model(model.config, model.weights, PrimitivesOnly(model.backend, hide=ONE_CALL_LAYERS), prepared=True)
    made = []
    real = native._call
    monkeypatch.setattr(native, "_call", lambda fn, arrays, *args: made.append(fn.__name__) or real(fn, arrays, *args))
    f, g = Forward(model), Forward(per_op)
    f.prefill([3, 4, 5, 6])
    g.prefill([3, 4, 5, 6])
    made.clear()
    got = f.step(7, 4)
    assert made.count("npud_decoder_layers") == 1 and "npud_decoder_layer" not in made
    assert rows_equal(got, g.step(7, 4))
    taps: list = []
    tapped: list = []
    f.set_layer_taps([1], taps)
    g.set_layer_taps([1], tapped)
    made.clear()
    got = f.step_batch_all([8, 9, 10], 5)
    assert made.count("npud_decoder_layers") == 2  # layers 0..1, then 2
    assert rows_equal(got, g.step_batch_all([8, 9, 10], 5)) and rows_equal(taps[0], tapped[0])


def test_a_call_that_does_not_fit_is_refused_before_any_native_work(checkpoints):
    """Rows the planes cannot hold, sequences that are not the rows in order, positions past the
    keys: ValueError, nothing written."""
    model = model_for(checkpoints, "qwen3", "fp32")
    layer = model.decoder_layers[0]
    rows, x, delta, planes = round_inputs(model, layer, LAYOUTS["M8x3"], 4, True)
    short = [(k[: held + 1], v[: held + 1], held) for k, v, held in planes]  # room for one row of each
    negative = [(k, v, -1) for k, v, _ in planes]
    gap = RoundRows(rows.positions, ((0, 2), (3, 3), (3, 8)))
    late = RoundRows(rows.positions + 4, rows.seqs)
    for name, (r, p) in {"short": (rows, short), "held < 0": (rows, negative), "gap": (gap, planes),
                         "past the keys": (late, planes)}.items():
        call = _call(layer, r, x, delta, p)
        before = [(a.keys.copy(), a.values.copy()) for a in call.planes]
        with pytest.raises(ValueError):
            model.backend.decoder_layer(call)
        for (k, v), a in zip(before, call.planes):
            assert np.array_equal(bits(k), bits(a.keys)) and np.array_equal(bits(v), bits(a.values)), name
