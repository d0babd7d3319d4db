"""The forward pass: parity with transformers, batch invariance, truncation.

Tolerances: with fp32 weights, max |our logit - transformers' logit| <= 1e-4 x max |logit|
over a 32-token prompt. With bf16 (or int8) host weights we compare against transformers
running in fp32 on the same rounded (or dequantised) weights, with the same 1e-4 bound,
since the arithmetic is fp32 on both sides; the cost of bf16 storage itself is the
rounding of the weights, which both sides share.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding import plain_tokens
from npud.engine.testing.checkpoints import build_tiny_checkpoint, load_reference
from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.weights import open_checkpoint
from npud.kernels.base import WeightFormat

LONG = [int(t) for t in np.random.default_rng(7).integers(3, 320, 48)]
PROMPT = LONG[:32]

CASES = {
    "llama": dict(model_type="llama"),
    "llama_tied_gqa": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=1),
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "llama3_rope": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral_window": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2"),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3"),
    "qwen3_tied_mha": dict(model_type="qwen3", tie_word_embeddings=True, num_key_value_heads=4),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_tiny_checkpoint(root / name, **kw) for name, kw in CASES.items()}


def reference_logits(ckpt, tokens):
    ref = load_reference(ckpt)
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


def reference_greedy(ckpt, tokens, n):
    ref = load_reference(ckpt)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(tokens) :].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_transformers(checkpoints, name):
    ckpt = checkpoints[name]
    model = Model.load(ckpt, WeightFormat.FP32)
    ours = Forward(model).step_batch_all(PROMPT, 0)
    ref = reference_logits(ckpt, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert plain_tokens(model, PROMPT, 32) == reference_greedy(ckpt, PROMPT, 32)


def _rounded_reference(ckpt, tmp_path, transform):
    """transformers on the checkpoint with every 2-D weight replaced by transform(weight)."""
    ref = load_reference(ckpt)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(transform(p.numpy().copy())))
    return ref


def _bf16_round(w):
    return torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()


def _int8_round(w):
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    scale[scale == 0] = 1.0
    return (np.clip(np.rint(w / scale), -127, 127) * scale).astype(np.float32)


@pytest.mark.parametrize("fmt,transform", [("bf16", _bf16_round), ("int8", _int8_round)])
@pytest.mark.parametrize("name", ["qwen3", "llama_tied_gqa"])
def test_low_precision_weights_match_rounded_reference(checkpoints, tmp_path, name, fmt, transform):
    ckpt = checkpoints[name]
    ours = Forward(Model.load(ckpt, fmt)).step_batch_all(PROMPT, 0)
    ref_model = _rounded_reference(ckpt, tmp_path, transform)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


# The activation-rounding formats against transformers on the same (dequantized) weights. Their
# bounds are the worst of bench/accuracy.py's sweep (random checkpoints of the six
# architectures, widths 64-512, weight scales 0.02-0.4, outlier channels, 64-256 teacher-forced
# positions) rounded up, and llama.cpp's own error on the same weights is as large (README):
# int8-q8 quantizes every activation entering a linear layer per row in blocks of 32 as llama.cpp's
# q8_0 (each value off by up to max|block| / 254), which random networks with outlier channels
# amplify past the logits' range (worst 1.99, gemma4 with outliers, softcapped logits; 75.0% of
# greedy choices equal there): the agreement is the figure that says something
Q8_ACTIVATION_BOUND = 2.0
Q8_AGREEMENT = 0.7
# int8-q16 quantizes them to 16-bit blocks (off by up to max|block| / 64516): worst 5.6e-2
# (gemma4 with outliers), median 1.3e-3, every greedy choice equal on every case
Q16_ACTIVATION_BOUND = 6e-2
Q16_AGREEMENT = 1.0
# bf16-bf16 rounds every activation entering a linear layer to bf16 (each value off by up to
# 2^-9 of itself): worst 0.49 (qwen3_5 with outliers), lowest agreement 92.2%
BF16_ACTIVATION_BOUND = 0.5
BF16_AGREEMENT = 0.9


@pytest.mark.parametrize("name", ["qwen3", "llama_tied_gqa"])
@pytest.mark.parametrize("fmt, rounding, bound, agreement", [
    ("int8-q8", _int8_round, Q8_ACTIVATION_BOUND, Q8_AGREEMENT),
    ("int8-q16", _int8_round, Q16_ACTIVATION_BOUND, Q16_AGREEMENT),
    ("bf16-bf16", _bf16_round, BF16_ACTIVATION_BOUND, BF16_AGREEMENT)])
def test_rounded_activation_formats_match_their_weights_reference(checkpoints, tmp_path, name, fmt, rounding, bound,
                                                                  agreement):
    # int8-q8 and int8-q16 against transformers on the dequantized int8 weights, bf16-bf16 on the same bf16 ones
    ckpt = checkpoints[name]
    ours = Forward(Model.load(ckpt, fmt)).step_batch_all(PROMPT, 0)
    ref_model = _rounded_reference(ckpt, tmp_path, rounding)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].numpy()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= bound, err
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= agreement


def test_int8_q16_holds_its_bound_on_outlier_channels_where_q8_rows_do_not(tmp_path):
    # trained models carry a few hidden channels far larger than the rest; in a block of 32 such a
    # value sets the q8 step for its 31 neighbours. A tiny llama with two channels at 20x (norm
    # gains, embedding): int8-q8 measured 0.46 x max|logit| (89.6% of greedy choices equal; the
    # 6e-2 it was held to before int8-q16 existed fails), int8-q16 1.8e-3 (all equal)
    ckpt = build_tiny_checkpoint(tmp_path / "outliers", "llama", init_std=0.1)
    model = load_reference(ckpt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p[[5, 40]] *= 20.0
        model.get_input_embeddings().weight[:, [5, 40]] *= 5.0
    model.save_pretrained(ckpt, safe_serialization=True)
    ref_model = _rounded_reference(ckpt, tmp_path, _int8_round)
    with torch.no_grad():
        ref = ref_model(torch.tensor([LONG])).logits[0].numpy()
    err = {}
    for fmt in ("int8-q8", "int8-q16"):
        ours = Forward(Model.load(ckpt, fmt)).step_batch_all(LONG, 0)
        err[fmt] = np.abs(ours - ref).max() / np.abs(ref).max()
        if fmt == "int8-q16":
            assert np.array_equal(ours.argmax(-1), ref.argmax(-1))
    assert err["int8-q8"] > 0.1  # the case is a hard one: q8 rows (as llama.cpp's) lose a tenth of the range
    assert err["int8-q16"] <= 1e-2, err


def test_bf16_checkpoint_loads_and_matches(tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "bf16", "qwen3", dtype="bfloat16")
    assert open_checkpoint(ckpt)["model.embed_tokens.weight"].dtype == "BF16"
    ref = reference_logits(ckpt, PROMPT)  # fp32 arithmetic on the bf16 values
    for fmt in ("bf16", "fp32"):
        ours = Forward(Model.load(ckpt, fmt)).step_batch_all(PROMPT, 0)
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.fixture(scope="module", params=["fp32", "bf16", "int8", "int8-q8", "int8-q16", "bf16-bf16"])
def qwen3_model(request, checkpoints):
    return Model.load(checkpoints["qwen3"], request.param)


@pytest.mark.parametrize("prefix", [0, 5, 23])
def test_batched_rows_bit_identical_to_sequential_steps(qwen3_model, prefix):
    tokens = LONG[: prefix + 16]
    seq = Forward(qwen3_model)
    stepped = [seq.step(t, i) for i, t in enumerate(tokens)]
    for m in range(1, 17):
        f = Forward(qwen3_model)
        if prefix:
            f.prefill(tokens[:prefix])
        rows = f.step_batch_all(tokens[prefix : prefix + m], prefix)
        for i in range(m):
            assert rows_equal(rows[i], stepped[prefix + i]), f"M={m} row {i} at position {prefix + i}"
        g = Forward(qwen3_model)
        if prefix:
            g.prefill(tokens[:prefix])
        assert rows_equal(g.step_batch(tokens[prefix : prefix + m], prefix), rows[-1])


def test_repeat_run_identical(qwen3_model):
    a = Forward(qwen3_model).step_batch_all(PROMPT[:9], 0)
    b = Forward(qwen3_model).step_batch_all(PROMPT[:9], 0)
    assert rows_equal(a, b)


def test_prefill_last_row_equals_steps(qwen3_model):
    f = Forward(qwen3_model, prefill_chunk=5)  # chunks of 5, 5, 5, ... over 32 tokens
    last = f.prefill(PROMPT)
    g = Forward(qwen3_model)
    for i, t in enumerate(PROMPT):
        stepped = g.step(t, i)
    assert rows_equal(last, stepped)
    assert f.positions_held == g.positions_held == len(PROMPT)


@pytest.mark.parametrize("keep", [0, 1, 7, 20])
def test_truncate_then_continue_equals_fresh_forward(qwen3_model, keep):
    f = Forward(qwen3_model)
    f.prefill(PROMPT[:20])
    f.step_batch_all(PROMPT[20:26], 20)
    f.truncate(keep)
    assert f.positions_held == keep
    cont = f.step_batch_all(PROMPT[keep : keep + 4], keep)
    fresh = Forward(qwen3_model)
    if keep:
        fresh.prefill(PROMPT[:keep])
    assert rows_equal(cont, fresh.step_batch_all(PROMPT[keep : keep + 4], keep))


def test_sliding_window_batched_rows_match_steps(checkpoints):
    model = Model.load(checkpoints["mistral_window"], "fp32")
    seq = Forward(model)
    stepped = [seq.step(t, i) for i, t in enumerate(PROMPT[:20])]
    f = Forward(model)
    f.prefill(PROMPT[:10])
    rows = f.step_batch_all(PROMPT[10:20], 10)
    assert all(rows_equal(rows[i], stepped[10 + i]) for i in range(10))


def test_pass_at_wrong_position_is_refused_and_changes_nothing(qwen3_model):
    f = Forward(qwen3_model)
    f.prefill(PROMPT[:4])
    with pytest.raises(ValueError, match="starts at position 3, but 4"):
        f.step(PROMPT[4], 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        f.step_batch_all([PROMPT[4], 10_000], 4)
    assert f.positions_held == 4
    g = Forward(qwen3_model)
    g.prefill(PROMPT[:4])
    assert rows_equal(f.step(PROMPT[4], 4), g.step(PROMPT[4], 4))


@pytest.mark.parametrize("where", ["decoder_stack", "decoder_layer", "silu_mul"])
def test_failed_pass_rolls_back_appended_rows(qwen3_model, monkeypatch, where):
    """A pass failing after the host's one-call stack wrote every layer's KV rows, or in layer 1 (in
    the host's one-call layer, or inside the composed layer's calls), leaves none of them held."""
    f = Forward(qwen3_model)
    f.prefill(PROMPT[:4])
    calls = {"n": 0}
    real = getattr(f.backend, where)

    def failing(*args):
        calls["n"] += 1
        if where == "decoder_stack":  # the whole stack runs, then the pass fails
            real(*args)
            raise MemoryError("injected")
        if calls["n"] == 2:  # layer 1: layer 0 has already appended its K/V rows
            raise MemoryError("injected")
        return real(*args)

    if where != "decoder_stack":
        monkeypatch.setattr(f.backend, "decoder_stack", None)  # a layer at a time
    if where == "silu_mul":
        monkeypatch.setattr(f.backend, "decoder_layer", None)  # the composed layer calls silu_mul
    monkeypatch.setattr(f.backend, where, failing)
    with pytest.raises(MemoryError):
        f.step_batch_all(PROMPT[4:8], 4)
    monkeypatch.undo()
    assert [p.length for p in f.state.planes] == [4, 4]
    g = Forward(qwen3_model)
    g.prefill(PROMPT[:4])
    assert rows_equal(f.step_batch_all(PROMPT[4:8], 4), g.step_batch_all(PROMPT[4:8], 4))


def test_layer_taps_receive_every_row(qwen3_model):
    rows = []

    class Sink:
        def append(self, r):
            rows.append(r.copy())

    f = Forward(qwen3_model)
    f.set_layer_taps([0, 1], Sink())
    f.prefill(PROMPT[:6])
    f.step_batch_all(PROMPT[6:9], 6)
    f.step(PROMPT[9], 9)
    taps = np.concatenate(rows)
    assert taps.shape == (10, 2 * qwen3_model.config.hidden_size)
    g = Forward(qwen3_model)
    g.set_layer_taps([0, 1], Sink())
    rows.clear()
    for i, t in enumerate(PROMPT[:10]):
        g.step(t, i)
    assert rows_equal(taps, np.concatenate(rows))
    assert f.last_hidden_rows().shape == (1, qwen3_model.config.hidden_size)
