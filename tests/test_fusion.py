"""Fused projections and fused per-row kernels in the forward pass: the same bits as the primitives.

The host backend fuses each layer's q/k/v and gate/up into one prepared weight at load (each part
on a tile boundary, its own weight a view of the fused tiles; GGUF block weights of one type alike), and the forward uses the fused
add + RMS norm and head norm + RoPE kernels. Every logit must be bit-identical to a model run
through the primitive interface alone (npud.engine.testing.backends.PrimitivesOnly), for every weight
format, in a step, a verify and a chunked prefill, on widths that are and are not multiples of the
tile; and the fused model holds no more weight bytes than the unfused one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.testing.backends import PrimitivesOnly
from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.ggml.backend import BlockHostBackend, random_block_weight
from npud.kernels.ggml.blocks import BlockFormat
from npud.kernels.host import HostBackend
from npud.kernels.host.formats import KERNELS

TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 320, 40)]
FORMATS = [f.value for f in WeightFormat]
CASES = {
    "qwen3": dict(model_type="qwen3"),  # q 128, k 64, v 64, gate/up 128: whole tiles
    # q 72, k/v 24, gate/up 100: parts end inside tiles, so the fused weight has padding between them
    "qwen3_odd": dict(model_type="qwen3", head_dim=24, num_attention_heads=3, num_key_value_heads=1,
                      intermediate_size=100),
    "qwen2_bias": dict(model_type="qwen2"),  # qkv_bias; k/v 32 wide
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fusion")
    return {name: build_tiny_checkpoint(root / name, **kw) for name, kw in CASES.items()}


def _logits(model: Model) -> list[np.ndarray]:
    """Steps over 12 tokens, an 8-row verify after them, and a prefill in chunks of 5."""
    f = Forward(model)
    out = [f.step(t, i) for i, t in enumerate(TOKENS[:12])]
    out.append(f.step_batch_all(TOKENS[12:20], 12))
    out.append(Forward(model, prefill_chunk=5).prefill(TOKENS))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_forward_is_bit_identical_to_the_primitives(checkpoints, case, fmt):
    fused = Model.load(checkpoints[case], fmt, backend=HostBackend())
    plain = Model.load(checkpoints[case], fmt, backend=PrimitivesOnly(HostBackend()))
    for lw in fused.weights.layers:  # the fused path is the one under test
        assert lw.attn.qkv is not None and lw.mlp.gate_up is not None
        assert np.shares_memory(lw.attn.k.data, lw.attn.qkv.weight.data)
    assert all(lw.attn.qkv is None and lw.mlp.gate_up is None for lw in plain.weights.layers)
    for got, want in zip(_logits(fused), _logits(plain)):
        assert rows_equal(got, want), (case, fmt)
    # the parts are views: no second copy, and the roofline counts what a step reads
    assert fused.weight_bytes_per_token() == plain.weight_bytes_per_token()
    assert fused.nbytes == plain.nbytes


def _sample(fmt: WeightFormat, n: int, k: int, seed: int) -> LinearWeight:
    return KERNELS[fmt].sample(np.random.default_rng(seed), n, k)


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_parts_are_views_with_the_tiles_of_their_own_preparation(fmt):
    backend = HostBackend()
    parts = [_sample(fmt, n, 70, seed) for seed, n in enumerate((72, 24, 64, 1))]
    fused = backend.fuse_linears(parts)
    assert fused.starts == (0, 128, 192, 256) and fused.weight.out_features == 320
    x = np.random.default_rng(9).standard_normal((3, 70)).astype(np.float32)
    y = backend.linear(x, fused.weight)
    for part, view, cols in zip(parts, fused.parts, fused.split(y)):
        own = backend.prepare_linear(part)
        assert view.layout == own.layout and view.out_features == own.out_features
        assert view.in_features == own.in_features
        assert np.array_equal(view.data, own.data) and np.shares_memory(view.data, fused.weight.data)
        assert np.array_equal(view.bias, own.bias)
        assert (view.scale is None) == (own.scale is None)
        if own.scale is not None:
            assert np.array_equal(view.scale, own.scale)
        assert rows_equal(cols, backend.linear(x, own))


@pytest.mark.parametrize("fmt", [BlockFormat.Q8_0, BlockFormat.Q4_K, BlockFormat.Q6_K])
def test_block_parts_are_views_with_their_own_tiles(fmt):
    backend = BlockHostBackend()
    parts = [dataclasses.replace(random_block_weight(fmt, n, 256, seed), bias=np.full(n, seed, np.float32))
             for seed, n in enumerate((72, 24, 64))]
    fused = backend.fuse_linears(parts)
    assert fused.starts == (0, 128, 192) and fused.weight.out_features == 256
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    for part, view, cols in zip(parts, fused.parts, fused.split(backend.linear(x, fused.weight))):
        assert np.array_equal(view.data, part.data) and np.array_equal(view.scale, part.scale)
        assert np.array_equal(view.bias, part.bias) and np.shares_memory(view.data, fused.weight.data)
        assert rows_equal(cols, backend.linear(x, part)) and rows_equal(backend.linear(x, view), cols)


def test_only_like_weights_are_fused():
    backend = BlockHostBackend()
    f32 = _sample(WeightFormat.FP32, 64, 32, 0)
    cases = {
        "one part": [f32],
        "two formats": [f32, _sample(WeightFormat.BF16, 64, 32, 1)],
        "int8 beside int8-q8": [_sample(WeightFormat.INT8, 64, 32, 2), _sample(WeightFormat.INT8_Q8, 64, 32, 3)],
        "two K": [f32, _sample(WeightFormat.FP32, 64, 48, 4)],
        "a bias on one only": [f32, LinearWeight(WeightFormat.FP32, f32.data)],
        "prepared already": [f32, backend.prepare_linear(f32)],
        "two block types": [random_block_weight(BlockFormat.Q8_0, 64, 256),
                            random_block_weight(BlockFormat.Q4_K, 64, 256)],
        "blocks beside floats": [random_block_weight(BlockFormat.Q8_0, 64, 32), f32],
        "blocks, two K": [random_block_weight(BlockFormat.Q8_0, 64, 64), random_block_weight(BlockFormat.Q8_0, 64, 32)],
    }
    for name, parts in cases.items():
        assert backend.fuse_linears(parts) is None, name
    assert backend.fuse_linears([f32, f32]) is not None
    assert backend.fuse_linears([random_block_weight(BlockFormat.Q8_0, 64, 64)] * 2) is not None
