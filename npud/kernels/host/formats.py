"""Weight formats of the host backend: how each is laid out at load time and which kernel multiplies it.

A format is a `LinearKernel` registered for a `WeightFormat` in KERNELS. The backend's
linear/embed dispatch through it, and the start-up self-check (npud/kernels/host/check.py) runs
every registered format from a weight its `sample` builds, so a new format (the GGUF block
formats, say) is checked for batch invariance the moment it is registered:

    from npud.kernels.host.formats import register
    register(WeightFormat.Q4_K, MyQ4KKernel())

The module that registers must be imported by npud/kernels/host/__init__.py, so that every format
is registered before the start-up self-check runs (tests/test_kernels.py checks that the
registered formats are exactly WeightFormat's members).

Registered here:
- FP32 / BF16 / INT8 against fp32 activations: column tiles [ceil(N / 64), K, 64], each weight
  widened to fp32 in registers, one FMA per k (gemm.c's float path); BF16 tiles hold each group
  of 32 columns in pairs (c, c + 16), widened by a shift and a mask (pair_bf16_columns).
- INT8_Q8: INT8's weights against activations quantized per row in blocks of 32 (llama.cpp's
  q8_0 activation blocks): tiles [ceil(N / 64), Kp / 4, 64, 4] holding w + 128 as uint8, exact
  integer block sums (VNNI's vpdpbusd where present), one FMA per block (gemm.c's q8 path).
- INT8_Q16: the same tiles and kernels against activations quantized per row in blocks of 32 to
  16-bit integers, each held as two signed bytes (q8pairs.c): two passes of byte products a block.
- BF16_BF16: BF16's weights against activations rounded per row to bf16: words [ceil(N / 64),
  Kp / 2, 64] each holding one column's (w[k], w[k + 1]), Kp = K rounded up to even, two
  flushed FMAs per word (AVX512_BF16's vdpbf16ps where present, bf16dot.c).
Prepared tiles are copied into huge-page-backed memory (resident.py), which a one-row GEMM
streams faster.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.host import native
from npud.kernels.host.native import QB, TILE
from npud.kernels.host.resident import resident_copy

PARALLEL_MIN_BYTES = 32 << 10  # weights below this run on one thread: waking another costs more


class LinearKernel(Protocol):
    """One weight format's kernels. `layout` names the prepared layout (LinearWeight.layout)."""

    layout: str

    def prepare(self, w: LinearWeight) -> LinearWeight:
        """A [N, K] rows weight in this format -> the same weight in `layout`."""

    def linear(self, x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
        """x: [M, K] f32 contiguous, w in `layout` -> [M, N] f32 (scale and bias applied)."""

    def embed(self, w: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        """tokens: [M] int64 in range -> rows [M, K] f32 of the [N, K] table `w` in `layout`."""

    def sample(self, rng: np.random.Generator, n: int, k: int) -> LinearWeight:
        """A random [n, k] rows weight in this format, with a bias (for the self-check)."""


KERNELS: dict[WeightFormat, LinearKernel] = {}


def register(fmt: WeightFormat, kernel: LinearKernel) -> None:
    """Serve `fmt` with `kernel` (replacing any earlier one)."""
    KERNELS[fmt] = kernel


def kernel_for(fmt: WeightFormat) -> LinearKernel:
    """The kernel of `fmt`; raises ValueError when none is registered."""
    try:
        return KERNELS[fmt]
    except KeyError:
        raise ValueError(f"the host backend has no kernel for weight format {fmt.value!r}") from None


def pack_tiles(data: np.ndarray) -> np.ndarray:
    """[N, K] -> [ceil(N / TILE), K, TILE], zero-padded columns past N."""
    n, k = data.shape
    tiles = -(-n // TILE)
    padded = np.zeros((tiles * TILE, k), dtype=data.dtype)
    padded[:n] = data
    return np.ascontiguousarray(padded.reshape(tiles, TILE, k).transpose(0, 2, 1))


def pair_bf16_columns(tiles: np.ndarray) -> np.ndarray:
    """bf16 tiles [T, K, TILE] -> the same with each group of 32 columns stored as 16 pairs (c, c + 16),
    so that the kernel widens a 32-bit word's halves by a shift and a mask (gemm.c's bf16_pos)."""
    t, k, _ = tiles.shape
    return np.ascontiguousarray(tiles.reshape(t, k, TILE // 32, 2, 16).transpose(0, 1, 2, 4, 3).reshape(t, k, TILE))


def pack_q8(q: np.ndarray) -> np.ndarray:
    """int8 [N, K] -> uint8 [ceil(N / TILE), Kp / 4, TILE, 4] holding q + 128, Kp = K rounded up to QB;
    padding (columns past N, k past K) holds the value 0."""
    n, k = q.shape
    tiles, kp = -(-n // TILE), -(-k // QB) * QB
    padded = np.full((tiles * TILE, kp), 128, np.uint8)
    padded[:n, :k] = (q.astype(np.int16) + 128).astype(np.uint8)
    return np.ascontiguousarray(padded.reshape(tiles, TILE, kp // 4, 4).transpose(0, 2, 1, 3))


def _quantized(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((n, k)).astype(np.float32)
    scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


class FloatTiles:
    """FP32, BF16 or INT8 weights widened to fp32 against fp32 activations."""

    layout = "tiles"

    def __init__(self, fmt: WeightFormat, code: int):
        self.fmt, self.code = fmt, code

    def prepare(self, w: LinearWeight) -> LinearWeight:
        tiles = pack_tiles(w.data)
        if self.fmt is WeightFormat.BF16:
            tiles = pair_bf16_columns(tiles)
        return LinearWeight(w.fmt, resident_copy(tiles), w.scale, w.bias, self.layout, w.out_features, w.in_features)

    def linear(self, x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
        out = native.gemm(self.code, x, w.data, w.out_features, w.scale, w.bias, parallel)
        return out if out.shape[1] == w.out_features else out[:, : w.out_features]

    def embed(self, w: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        return native.embed(self.code, w.data, w.in_features, w.in_features, tokens, w.scale)

    def sample(self, rng: np.random.Generator, n: int, k: int) -> LinearWeight:
        bias = rng.standard_normal(n).astype(np.float32)
        if self.fmt is WeightFormat.INT8:
            q, scale = _quantized(rng, n, k)
            return LinearWeight(self.fmt, q, scale, bias)
        w32 = rng.standard_normal((n, k)).astype(np.float32)
        if self.fmt is WeightFormat.BF16:
            return LinearWeight(self.fmt, (w32.view(np.uint32) >> 16).astype(np.uint16), None, bias)
        return LinearWeight(self.fmt, w32, None, bias)


class Q8Blocks:
    """INT8 weights (one scale per output column) against q8 activation blocks (or, `pairs`, 16-bit
    blocks held as byte pairs), integer dot products."""

    layout = "q8-tiles"

    def __init__(self, fmt: WeightFormat = WeightFormat.INT8_Q8):
        self.fmt, self.pairs = fmt, fmt is WeightFormat.INT8_Q16

    def prepare(self, w: LinearWeight) -> LinearWeight:
        if w.scale is None:
            raise ValueError("an int8-q8 weight needs its per-row scale")
        return LinearWeight(w.fmt, resident_copy(pack_q8(w.data)), w.scale, w.bias, self.layout, w.out_features,
                            w.in_features)

    def linear(self, x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
        out = native.linear_q8(x, w.data, w.out_features, w.scale, w.bias, parallel, self.pairs)
        return out if out.shape[1] == w.out_features else out[:, : w.out_features]

    def embed(self, w: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        return native.embed(native.FMT_Q8, w.data, w.data.shape[1] * 4, w.in_features, tokens, w.scale)

    def sample(self, rng: np.random.Generator, n: int, k: int) -> LinearWeight:
        q, scale = _quantized(rng, n, k)
        return LinearWeight(self.fmt, q, scale, rng.standard_normal(n).astype(np.float32))


def pack_bf16_pairs(w: np.ndarray) -> np.ndarray:
    """bf16 bits [N, K] -> uint32 [ceil(N / TILE), Kp / 2, TILE], each word (w[k] low, w[k + 1] high)
    of one column, Kp = K rounded up to even; padding holds zeros, and so do subnormal weights
    (the kernel's inputs are never subnormal: bf16dot.c says why)."""
    n, k = w.shape
    tiles, kp = -(-n // TILE), k + k % 2
    padded = np.zeros((tiles * TILE, kp), np.uint16)
    padded[:n, :k] = np.where(w & 0x7F80 == 0, w & 0x8000, w)
    pairs = padded.reshape(tiles, TILE, kp // 2, 2).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(pairs).view(np.uint32).reshape(tiles, kp // 2, TILE)


class BF16Pairs:
    """BF16 weights in k-pairs against activations rounded to bf16, pairs of products into fp32."""

    layout = "bf16-pairs"

    def prepare(self, w: LinearWeight) -> LinearWeight:
        return LinearWeight(w.fmt, resident_copy(pack_bf16_pairs(w.data)), w.scale, w.bias, self.layout,
                            w.out_features, w.in_features)

    def linear(self, x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
        out = native.linear_bf16_dot(x, w.data, w.out_features, w.bias, parallel)
        return out if out.shape[1] == w.out_features else out[:, : w.out_features]

    def embed(self, w: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        words = w.data[tokens // TILE, :, tokens % TILE]  # [M, Kp / 2]
        halves = np.ascontiguousarray(words).view(np.uint16)[:, : w.in_features]  # little-endian: w[k] first
        return (halves.astype(np.uint32) << 16).view(np.float32)

    def sample(self, rng: np.random.Generator, n: int, k: int) -> LinearWeight:
        w32 = rng.standard_normal((n, k)).astype(np.float32)
        return LinearWeight(WeightFormat.BF16_BF16, (w32.view(np.uint32) >> 16).astype(np.uint16), None,
                            rng.standard_normal(n).astype(np.float32))


register(WeightFormat.FP32, FloatTiles(WeightFormat.FP32, native.FMT_F32))
register(WeightFormat.BF16, FloatTiles(WeightFormat.BF16, native.FMT_BF16))
register(WeightFormat.INT8, FloatTiles(WeightFormat.INT8, native.FMT_I8))
register(WeightFormat.INT8_Q8, Q8Blocks())
register(WeightFormat.INT8_Q16, Q8Blocks(WeightFormat.INT8_Q16))
register(WeightFormat.BF16_BF16, BF16Pairs())
