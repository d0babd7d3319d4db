"""Gemma 4 and Qwen3.5 (text) on the host engine, against transformers and against itself.

Both tiny checkpoints are built here by transformers (npud/engine/testing/checkpoints.py's pattern: a large
init std and spread norms, so that greedy choices are decided by clear margins and a wrong
norm form shows):
- gemma4_text: 6 layers, sliding/full alternating (window 8 < the 32-token prompt), two KV
  widths (sliding 1 x 16, full 2 x 32), the last 2 layers KV-shared (4 reads 2, 5 reads 3),
  PLE on, double-wide MLP on the shared layers, attention_k_eq_v on the full layers,
  proportional partial RoPE on the full layers, final logit softcapping, layer scalars != 1;
- qwen3_5_text: 5 layers [GDN, GDN, full, GDN, full], partial RoPE (0.25), output-gated
  attention, (1 + w) norms, 2 key / 4 value heads in the GDN layers.

Tolerance: max |ours - transformers| <= 1e-4 x max |logit| over a 32-token prompt, as
tests/test_forward.py, with fp32 weights (and with bf16 weights against transformers on the
same rounded matrices). The arithmetic is fp32 on both sides; what differs is the order of
sums (our GEMMs sum k in increasing order, transformers' BLAS does not; its prompt pass runs
the chunked delta-rule form where we run the recurrent one row by row) and transcendentals
(ours are taken in float64 and rounded once). Measured here: 2.5e-6 (gemma4) and 2.3e-5
(qwen3_5, the chunked form accounts for most of it). A real error sits far outside: measured
by hand, reading the proportional RoPE as a plain partial one moves the logits by 0.81 of
their range, dropping the layer scalars 0.39, dropping the softcap 1.1e-2. Greedy tokens
must be identical; everything else here compares our own passes with each other, bit for bit.

Mutants, applied one at a time, this file run, then restored (failing tests of 43):
| mutant                                                                  | failing tests            |
| single KV width: ModelState.keep_positions cuts each KV plane where one | 5: verify commit 0/2/4   |
|   width (layer 0's, 16) would count it, n * 16 // width                 |   (gemma4), prompt lookup|
|                                                                         |   and draft model (gemma4)|
| a shared layer that appends: for_config gives a KV-shared layer a       | 6: verify commit 0/2/4,  |
|   KVPlane and the forward appends its owner's rows to it (the logits    |   prefix cache memory and|
|   are unchanged: only the planes can tell)                              |   disk, restore (gemma4) |
| GDN state after the last row: the forward records the pass's last       | 3: verify commit 2 of 4, |
|   state for every row, so a cut to an accepted prefix keeps the state   |   prompt lookup and draft|
|   after all rows (a cut to the pass start or its end still works)       |   model (qwen3_5)        |
| prefill records a recurrent state per row (record_rows=True)            | 1: prefill keeps no state|
|                                                                         |   per row                |
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from assistant_fixtures import BASE as GEMMA4_BASE
from npud.engine.testing.checkpoints import load_reference, write_tokenizer
from decoding import greedy_run, plain_tokens
from npud.engine.config import AttentionKind, ConfigError, parse_config
from npud.engine.drafters import DraftModelHead, PromptLookupHead
from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.prefix_cache import PrefixCache
from npud.engine.state import PlaneKind, StateError
from npud.engine.testing.backends import PrimitivesOnly
from npud.engine.tokenizer import Tokenizer

VOCAB = 320
LONG = [int(t) for t in np.random.default_rng(11).integers(3, VOCAB, 64)]
PROMPT = LONG[:32]

GEMMA4 = GEMMA4_BASE  # the Gemma 4 of the assistant tests: one config of the kind, not two copies
QWEN3_5 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    pad_token_id=0, eos_token_id=0, bos_token_id=None,
)
ARCHS = ("gemma4", "qwen3_5")


def build_hybrid_checkpoint(out_dir, arch: str, seed: int = 0, init_std: float = 0.15, **overrides):
    """Save a random transformers gemma4_text / qwen3_5_text model with a tokenizer; returns the directory."""
    if arch == "gemma4":
        config = transformers.Gemma4TextConfig(**{**GEMMA4, **overrides})
        model_cls = transformers.Gemma4ForCausalLM
    else:
        config = transformers.Qwen3_5TextConfig(**{**QWEN3_5, **overrides})
        model_cls = transformers.Qwen3_5ForCausalLM
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                # gemma4 scales by w, qwen3_5 by (1 + w): spread both around 1
                p.copy_((1.0 if arch == "gemma4" else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(0.6 + 0.8 * torch.rand(buf.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: build_hybrid_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(ckpts):
    return {arch: Model.load(ckpts[arch], "fp32") for arch in ARCHS}


def reference_logits(ckpt, tokens):
    with torch.no_grad():
        return load_reference(ckpt)(torch.tensor([tokens])).logits[0].numpy()


def reference_greedy(ckpt, tokens, n):
    with torch.no_grad():
        out = load_reference(ckpt).generate(
            torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(tokens):].tolist()


# ------------------------------------------------------------------ configuration


def test_gemma4_config_matches_the_model_transformers_builds(ckpts, models):
    cfg = models["gemma4"].config
    ref = load_reference(ckpts["gemma4"]).model
    widths = set()
    for spec, layer in zip(cfg.layers, ref.layers, strict=True):
        attn = layer.self_attn
        assert spec.kind.value == attn.layer_type and spec.head_dim == attn.head_dim
        assert spec.num_heads * spec.head_dim == attn.q_proj.out_features
        assert spec.window == (attn.sliding_window or 0)
        assert spec.owns_kv == (not attn.is_kv_shared_layer)
        if spec.owns_kv:
            assert spec.kv_width == attn.k_proj.out_features
            assert spec.k_eq_v == (attn.v_proj is None)
        assert cfg.mlp_width(spec) == layer.mlp.intermediate_size
        assert spec.scale == attn.scaling == 1.0
        inv = getattr(ref.rotary_emb, f"{spec.kind.value}_inv_freq").numpy()
        assert np.abs(spec.rope.inv_freq() - inv).max() <= 2e-7 * np.abs(inv).max()
        widths.add(spec.kv_width)
    assert [s.kv_owner for s in cfg.layers] == [0, 1, 2, 3, 2, 3]
    assert len(widths) == 2  # two KV widths: the mutant that counts one of them has something to break
    assert cfg.per_layer_input_size == 8 and cfg.final_logit_softcapping == 30.0
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.pad_token_id) == ((0,), None, 0)  # null stays null
    json.dumps(cfg.describe())


def test_qwen3_5_config_matches_the_model_transformers_builds(ckpts, models):
    cfg = models["qwen3_5"].config
    ref = load_reference(ckpts["qwen3_5"]).model
    for spec, layer in zip(cfg.layers, ref.layers, strict=True):
        assert spec.kind.value == layer.block_type
        if spec.kind is AttentionKind.LINEAR:
            g, gdn = spec.linear, layer.linear_attn
            assert (g.conv_dim, g.conv_kernel) == (gdn.conv_dim, gdn.conv_kernel_size)
            assert (g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim) == (
                gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
            assert cfg.recurrent_state_shapes(spec) == {"conv": (g.conv_dim, 3), "ssm": (4, 8, 12)}
        else:
            assert spec.scale == layer.self_attn.scaling
            assert 2 * spec.num_heads * spec.head_dim == layer.self_attn.q_proj.out_features
    inv = ref.rotary_emb.inv_freq.numpy()
    assert np.abs(cfg.layers[0].rope.inv_freq() - inv).max() <= 2e-7 * np.abs(inv).max()
    assert cfg.norm_weight_offset == 1.0 and cfg.attn_output_gate
    json.dumps(cfg.describe())


def test_gemma4_global_head_dim_form_reads_as_per_layer_config(ckpts):
    """Hub configs name the full layers' geometry global_head_dim / num_global_key_value_heads;
    transformers turns that into the per_layer_config it writes back."""
    raw = json.loads((ckpts["gemma4"] / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k != "per_layer_config"}
    legacy.update(global_head_dim=32, num_global_key_value_heads=2)
    assert parse_config(legacy) == parse_config(raw)
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in legacy.items() if k not in ("model_type",)})
    assert {int(k): v for k, v in hf.to_dict()["per_layer_config"].items()} == {
        int(k): v for k, v in raw["per_layer_config"].items()}
    # without attention_k_eq_v the KV-head override is not applied (transformers' rule)
    no_keqv = parse_config({**legacy, "attention_k_eq_v": False})
    assert {s.num_kv_heads for s in no_keqv.layers} == {1}


def _raw(arch, **overrides):
    cls = transformers.Gemma4TextConfig if arch == "gemma4" else transformers.Qwen3_5TextConfig
    raw = cls(**{**(GEMMA4 if arch == "gemma4" else QWEN3_5)}).to_dict()
    raw.update(overrides)
    return raw


@pytest.mark.parametrize(
    "arch, overrides, names",
    [
        ("gemma4", {"enable_moe_block": True, "num_experts": 4}, ["enable_moe_block", "MoE"]),
        ("gemma4", {"use_bidirectional_attention": "all"}, ["use_bidirectional_attention", "all"]),
        ("gemma4", {"hidden_activation": "relu"}, ["hidden_activation", "relu"]),
        ("gemma4", {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         ["rope_type", "yarn"]),
        ("gemma4", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ["rope_parameters"]),
        ("gemma4", {"per_layer_config": {"1": {"intermediate_size": 7}}}, ["intermediate_size", "per-layer"]),
        ("gemma4", {"num_kv_shared_layers": 6}, ["num_kv_shared_layers", "6"]),
        ("gemma4", {"num_kv_shared_layers": 5}, ["num_kv_shared_layers", "full_attention"]),
        ("qwen3_5", {"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
        ("qwen3_5", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, ["rope_type", "linear"]),
        ("qwen3_5", {"linear_num_value_heads": 3}, ["num_value_heads", "3"]),
        ("qwen3_5", {"layer_types": ["linear_attention"] * 4 + ["sliding_attention"]},
         ["layer_types[4]", "sliding_attention"]),
    ],
)
def test_unsupported_fields_are_config_errors(arch, overrides, names):
    with pytest.raises(ConfigError) as err:
        parse_config(_raw(arch, **overrides))
    for name in names:
        assert name in str(err.value)


def test_multimodal_wrapper_reads_the_text_model_under_its_prefix(ckpts, models, tmp_path):
    """A qwen3_5 / gemma4 (multimodal) config.json: the text_config, tensors under model.language_model."""
    from safetensors.numpy import load_file, save_file

    for arch in ARCHS:
        src, dst = ckpts[arch], tmp_path / arch
        dst.mkdir()
        text = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({"model_type": arch, "text_config": text,
                                                      "tie_word_embeddings": text["tie_word_embeddings"]}))
        tensors = load_file(src / "model.safetensors")
        save_file({k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()},
                  dst / "model.safetensors")
        wrapped = Model.load(dst, "fp32")
        assert wrapped.config.weight_prefix == "model.language_model."
        assert rows_equal(Forward(wrapped).step_batch_all(PROMPT[:8], 0),
                          Forward(models[arch]).step_batch_all(PROMPT[:8], 0))


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_and_greedy_tokens_match_transformers(ckpts, models, arch):
    ours = Forward(models[arch]).step_batch_all(PROMPT, 0)
    ref = reference_logits(ckpts[arch], PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert plain_tokens(models[arch], PROMPT, 32) == reference_greedy(ckpts[arch], PROMPT, 32)


def _bf16_round(w):
    return torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_weights_match_the_reference_on_the_same_rounded_weights(ckpts, arch):
    ours = Forward(Model.load(ckpts[arch], "bf16")).step_batch_all(PROMPT, 0)
    ref_model = load_reference(ckpts[arch])
    with torch.no_grad():
        for _, p in ref_model.named_parameters():
            if p.ndim == 2:  # every matrix we hold in bf16; vectors and the conv taps stay fp32
                p.copy_(torch.from_numpy(_bf16_round(p.numpy().copy())))
        ref = ref_model(torch.tensor([PROMPT])).logits[0].numpy()
    # qwen3_5's recurrent state carries rounding differences from row to row: on this
    # checkpoint our sequential FMA sums land 1.4e-4 x max |logit| from a float64 run on the
    # same rounded weights (torch's fp32 1.9e-5; our fp32 format on these weights gives the
    # same bits as bf16), and other seeds stay below 2e-5; the bound leaves room for that
    bound = 2e-4 if arch == "qwen3_5" else 1e-4
    assert np.abs(ours - ref).max() <= bound * np.abs(ref).max()
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


# ------------------------------------------------------------------ batched rows, verify commits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix", [0, 13])
def test_batched_rows_bit_identical_to_sequential_steps(models, arch, prefix):
    model = models[arch]
    tokens = LONG[: prefix + 8]
    seq = Forward(model)
    stepped = [seq.step(t, i) for i, t in enumerate(tokens)]
    for m in (1, 2, 4, 8):
        f = Forward(model)
        if prefix:
            f.prefill(tokens[:prefix])
        rows = f.step_batch_all(tokens[prefix : prefix + m], prefix)
        for i in range(m):
            assert rows_equal(rows[i], stepped[prefix + i]), f"M={m} row {i} at position {prefix + i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_and_kernels_give_the_bits_of_the_primitives(ckpts, models, arch):
    # qwen3_5's attention fuses q, k, v and the output gate; gemma4 fuses its sliding layers' q/k/v
    # (not the k_eq_v or KV-shared ones) and every gate/up, and keeps its sandwich norms primitive
    fused = models[arch]
    plain = Model.load(ckpts[arch], "fp32", backend=PrimitivesOnly(fused.backend))
    attn = [lw.attn for lw in fused.weights.layers if lw.attn is not None]
    assert any(a.qkv is not None for a in attn) and all(lw.mlp.gate_up is not None for lw in fused.weights.layers)
    if arch == "qwen3_5":
        assert all(len(a.qkv.parts) == 4 for a in attn)

    def logits(model):  # steps, a verify, a chunked prefill
        f = Forward(model)
        out = [f.step(t, i) for i, t in enumerate(LONG[:6])]
        return out + [f.step_batch_all(LONG[6:14], 6), Forward(model, prefill_chunk=5).prefill(LONG[:20])]

    assert all(rows_equal(a, b) for a, b in zip(logits(fused), logits(plain)))
    assert fused.weight_bytes_per_token() == plain.weight_bytes_per_token()


def _plane_positions(f):
    return [(p.kind, p.positions_held) for p in f.state.planes]


def _expected_planes(model, n):
    return [
        (PlaneKind.RECURRENT, n) if spec.kind is AttentionKind.LINEAR
        else (PlaneKind.KV, n) if spec.owns_kv else (PlaneKind.SHARED, None)
        for spec in model.config.layers
    ]


def _same_state(a: Forward, b: Forward) -> bool:
    sa, sb = a.state.snapshot(), b.state.snapshot()
    return sa.positions == sb.positions and all(
        pa.kind is pb.kind and pa.positions == pb.positions and pa.arrays.keys() == pb.arrays.keys()
        and all(rows_equal(pa.arrays[k], pb.arrays[k]) for k in pa.arrays)
        for pa, pb in zip(sa.planes, sb.planes, strict=True)
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_verify_commit_keeps_exactly_the_accepted_rows(models, arch, accepted):
    """step_batch_all of 4 rows then truncate(held + accepted): every plane holds exactly
    that, and the next step equals a forward that only ever saw the accepted rows."""
    model, held = models[arch], 11
    f = Forward(model)
    f.prefill(LONG[:held])
    f.step_batch_all(LONG[held : held + 4], held)
    f.truncate(held + accepted)
    assert f.positions_held == held + accepted
    assert _plane_positions(f) == _expected_planes(model, held + accepted)
    assert all(p.nbytes == 0 for p in f.state.planes if p.kind is PlaneKind.SHARED)
    fresh = Forward(model)
    fresh.prefill(LONG[: held + accepted])
    assert _same_state(f, fresh)
    nxt = LONG[40]
    assert rows_equal(f.step(nxt, held + accepted), fresh.step(nxt, held + accepted))
    assert _same_state(f, fresh)


def test_recurrent_planes_reach_back_across_single_step_passes(models):
    """A draft model steps its drafts one pass each; it can be cut back max_batch_rows positions."""
    model = models["qwen3_5"]
    f = Forward(model, max_batch_rows=4)
    f.prefill(LONG[:10])
    for i in range(10, 14):
        f.step(LONG[i], i)
    f.truncate(10)
    fresh = Forward(model)
    fresh.prefill(LONG[:10])
    assert _same_state(f, fresh)
    for i in range(10, 16):
        f.step(LONG[i], i)
    with pytest.raises(ValueError, match="recurrent"):
        f.truncate(10)  # 6 single-step passes back: beyond the 4 kept
    assert f.positions_held == 16


def test_prefill_keeps_no_recurrent_state_per_row(models):
    """A 64-row prefill chunk of a large GDN model would otherwise hold 65 copies of every
    layer's state; only the chunk boundaries are kept."""
    model = models["qwen3_5"]
    f = Forward(model, prefill_chunk=8)
    f.prefill(LONG[:20])  # chunks start at 0, 8, 16
    with pytest.raises(StateError, match="recurrent"):
        f.truncate(17)
    assert f.positions_held == 20
    f.truncate(16)
    fresh = Forward(model)
    fresh.prefill(LONG[:16])
    assert _same_state(f, fresh)


def test_failed_pass_rolls_back_every_plane(models, monkeypatch):
    model = models["qwen3_5"]
    f = Forward(model)
    f.prefill(PROMPT[:6])
    calls = {"n": 0}
    real = f.backend.silu_mul

    def failing(gate, up):
        calls["n"] += 1
        if calls["n"] == 4:  # the MLP of layer 3: GDN 0, 1, 3 and full layer 2 have advanced
            raise MemoryError("injected")
        return real(gate, up)

    monkeypatch.setattr(f.backend, "silu_mul", failing)
    with pytest.raises(MemoryError):
        f.step_batch_all(PROMPT[6:10], 6)
    monkeypatch.undo()
    assert _plane_positions(f) == _expected_planes(model, 6)
    fresh = Forward(model)
    fresh.prefill(PROMPT[:6])
    assert _same_state(f, fresh)


# ------------------------------------------------------------------ snapshots and the prefix cache


@pytest.mark.parametrize("where", ["memory", "disk"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_restore_then_continue_equals_a_full_prefill(models, arch, where, tmp_path):
    """npud/engine/prefix_cache.py's documented use, on two widths, shared and recurrent planes;
    "disk": the entry is spilled to a file and read back before the restore."""
    model = models[arch]
    prompt = LONG[:27]
    cold = Forward(model, prefill_chunk=8)
    cold_logits = cold.prefill(prompt)
    spill = dict(state_dir=tmp_path, max_bytes=0) if where == "disk" else {}
    cache = PrefixCache(model.fingerprint, Forward(model).state, block_size=8, **spill)
    first = Forward(model, prefill_chunk=8)
    boundary = cache.insert_boundary(len(prompt))
    first.prefill(prompt[:boundary])
    cache.insert(prompt[:boundary], first.state.snapshot())

    warm = Forward(model, prefill_chunk=8)
    match = cache.lookup(prompt)
    assert match is not None and match.num_cached_tokens == boundary == 24
    warm.state.restore(match.snapshot)
    assert warm.positions_held == 24 and _plane_positions(warm) == _expected_planes(model, 24)
    assert rows_equal(warm.prefill(prompt[24:]), cold_logits)
    assert _same_state(warm, cold)
    for i in range(27, 31):
        assert rows_equal(warm.step(LONG[i], i), cold.step(LONG[i], i))


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_restore_into_a_used_forward(models, arch):
    model = models[arch]
    a = Forward(model)
    a.prefill(LONG[:17])
    snap = a.state.snapshot()
    b = Forward(model)
    b.prefill(LONG[30:50])  # a longer, different history to be replaced
    b.state.restore(snap)
    assert _plane_positions(b) == _expected_planes(model, 17)
    assert rows_equal(b.step_batch_all(LONG[17:21], 17), a.step_batch_all(LONG[17:21], 17))


# ------------------------------------------------------------------ speculative decoding

N_NEW = 32


def spec_prompt(model):
    """P, then the model's own greedy continuation of P, then P again: prompt lookup finds
    the tail of P earlier in the context and proposes what followed it, which the model may
    or may not say again here."""
    head = LONG[:10]
    return head + plain_tokens(model, head, 8) + head


def _decode(model, head, k=4):
    prompt = spec_prompt(model)
    f = Forward(model, max_batch_rows=8)
    out, stats = greedy_run(f, prompt, N_NEW, head, k)
    return out, f, stats


def _check_equal_to_plain(model, head):
    plain, plain_f, _ = _decode(model, None)
    out, f, stats = _decode(model, head)
    assert out == plain and len(out) == N_NEW
    assert f.positions_held == plain_f.positions_held
    assert _same_state(f, plain_f)
    return stats


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_prompt_lookup_equals_plain_greedy(models, arch):
    stats = _check_equal_to_plain(models[arch], PromptLookupHead())
    print(arch, stats.as_dict())
    assert stats.drafted > 0 and stats.rounds > 0


NOISE = {"gemma4": 0.35, "qwen3_5": 0.05}  # relative to each tensor's spread


@pytest.fixture(scope="module")
def drafts(ckpts, tmp_path_factory):
    """Each base with a draft of its own architecture: the base's weights plus noise, so that
    it agrees with the base often but not always (partial accepts happen)."""
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for arch in ARCHS:
        ref = load_reference(ckpts[arch])
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, p in ref.named_parameters():
                p.add_(NOISE[arch] * p.std() * torch.randn(p.shape, generator=gen) if p.numel() > 1 else 0 * p)
        ref.save_pretrained(root / arch, safe_serialization=True)
        write_tokenizer(root / arch, vocab_size=VOCAB)
        out[arch] = root / arch
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_draft_model_equals_plain_greedy(ckpts, models, drafts, arch):
    draft = Forward(Model.load(drafts[arch], "fp32"), max_batch_rows=8)
    tok = Tokenizer.from_dir(ckpts[arch])
    head = DraftModelHead(draft, tok, Tokenizer.from_dir(drafts[arch]))
    stats = _check_equal_to_plain(models[arch], head)
    print(arch, stats.as_dict())
    assert 0 < stats.accepted < stats.drafted  # partial accepts: the commit cuts inside verify passes

