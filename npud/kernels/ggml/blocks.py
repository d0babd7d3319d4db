"""GGML quant blocks (the weight formats of GGUF files), unpacked into one exact form.

Every block type npud runs dequantizes, in ggml and in gguf-py's reference
(`gguf.quants.dequantize`), as float32 arithmetic of the same shape: a group of g
consecutive weights of one row shares a float32 scale S (and, for the K-quants with a
minimum, a float32 offset D), and weight i of the group is

    w = S * q_i          (Q8_0, Q4_0, Q5_0, Q6_K)
    w = S * q_i - D      (Q4_K, Q5_K)

with q_i a small integer, each operation rounded to float32 once. S and D themselves are
products the reference also rounds once: Q8_0/Q4_0/Q5_0 S = d (an f16, widened exactly);
Q4_K/Q5_K S = d * sc, D = dmin * m (f16 times a 6-bit integer); Q6_K S = d * sc (f16
times an int8). So a block is stored as its integers (int8, one per weight) and its
per-group S (and D), computed here once with exactly the reference's operations, and the
GEMM widens a weight with the same one or two float32 operations: the weights it
multiplies by are bit for bit `gguf.quants.dequantize`'s.

Groups: 32 weights (Q8_0, Q4_0, Q5_0 blocks; the 8 sub-blocks of a Q4_K/Q5_K super-block),
16 weights (the 16 sub-blocks of a Q6_K super-block).

Memory: one byte per weight plus 4 (8 with D) bytes per group — 1.125 bytes a weight for
Q8_0/Q4_0/Q5_0, 1.25 for the K-quants. The kernels' tiles (npud/kernels/ggml/gemm.py) hold the same
numbers in fewer bytes where that is exact: 4 / 5-bit integers packed (nibbles.py), factors in
float16 where each is a float16 value; a Q4_K_M file then grows by about a hundredth.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class BlockFormat(enum.Enum):
    """A GGML block type npud keeps in block form; values are ggml's type names."""

    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q5_0 = "q5_0"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"


@dataclass(slots=True, frozen=True)
class BlockLayout:
    """One GGML block type: weights and bytes per block, weights per scale group."""

    ggml_type: int  # ggml's enum value (GGMLQuantizationType)
    block_weights: int
    block_bytes: int
    group: int
    has_offset: bool  # w = S * q - D rather than S * q


LAYOUTS: dict[BlockFormat, BlockLayout] = {
    BlockFormat.Q8_0: BlockLayout(8, 32, 34, 32, False),
    BlockFormat.Q4_0: BlockLayout(2, 32, 18, 32, False),
    BlockFormat.Q5_0: BlockLayout(6, 32, 22, 32, False),
    BlockFormat.Q4_K: BlockLayout(12, 256, 144, 32, True),
    BlockFormat.Q5_K: BlockLayout(13, 256, 176, 32, True),
    BlockFormat.Q6_K: BlockLayout(14, 256, 210, 16, False),
}
BY_GGML_TYPE = {layout.ggml_type: fmt for fmt, layout in LAYOUTS.items()}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian f16 -> [...] float32 (exact)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 12 scale bytes of each super-block -> (sc, m), each [B, 8] uint8 of 6 bits.

    Bytes 0-3 hold sc 0-3 in their low six bits, bytes 4-7 m 0-3; sc 4-7 and m 4-7 are the
    low and high nibbles of bytes 8-11 with their top two bits taken from bytes 0-3 and 4-7.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def unpack_blocks(raw: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    """Unpack B blocks of `fmt`.

    raw: [B, block_bytes] uint8 -> (q [B, block_weights] int8, factors [B, groups, P]
    float32), P = 2 (S, D) for a type with an offset, else 1 (S). Raises ValueError for a
    raw array of the wrong width.
    """
    lay = LAYOUTS[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != lay.block_bytes:
        raise ValueError(f"{fmt.value}: blocks must be [B, {lay.block_bytes}] bytes, got {raw.shape}")
    n = raw.shape[0]
    if fmt is BlockFormat.Q8_0:
        d = _f16(raw[:, 0:2].reshape(n, 1, 2))
        q = raw[:, 2:].view(np.int8)
        return np.ascontiguousarray(q), d[:, :, None]
    if fmt is BlockFormat.Q4_0:
        d = _f16(raw[:, 0:2].reshape(n, 1, 2))
        qs = raw[:, 2:18]
        # weights 0-15 are the low nibbles of bytes 0-15, weights 16-31 the high nibbles
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
        return q, d[:, :, None]
    if fmt is BlockFormat.Q5_0:
        d = _f16(raw[:, 0:2].reshape(n, 1, 2))
        qh = np.ascontiguousarray(raw[:, 2:6]).view("<u4")  # bit i: the fifth bit of weight i
        qs = raw[:, 6:22]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (low | (high << 4)).astype(np.int8) - np.int8(16)
        return q, d[:, :, None]
    if fmt in (BlockFormat.Q4_K, BlockFormat.Q5_K):
        d = _f16(raw[:, 0:2].reshape(n, 1, 2))
        dmin = _f16(raw[:, 2:4].reshape(n, 1, 2))
        sc, m = _k_scales(raw[:, 4:16])
        scale = d * sc.astype(np.float32)  # [B, 8], one rounding, as the reference
        offset = dmin * m.astype(np.float32)
        if fmt is BlockFormat.Q4_K:
            qs = raw[:, 16:144].reshape(n, 4, 32)
            high = None
        else:
            qh = raw[:, 16:48]  # bit s of byte l: the fifth bit of weight l of sub-block s
            qs = raw[:, 48:176].reshape(n, 4, 32)
            high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(n, 256)
        # sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c .. 32c + 31
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
        if high is not None:
            q = q | (high << 4)
        return q.astype(np.int8), np.stack([scale, offset], axis=2)
    if fmt is BlockFormat.Q6_K:
        ql = raw[:, 0:128].reshape(n, 2, 64)
        qh = raw[:, 128:192].reshape(n, 2, 32)
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw[:, 208:210].reshape(n, 1, 2))
        scale = d * sc  # [B, 16]
        # each half of 128 weights: four runs of 32; run i takes the low (i < 2) or high
        # nibble of ql[32 (i % 2) + l] and bits 2i, 2i + 1 of qh[l]
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
        high = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.int8) - np.int8(32)
        return q.reshape(n, 256), scale[:, :, None]
    raise ValueError(f"unknown block format {fmt!r}")


def unpack_matrix(raw: np.ndarray, fmt: BlockFormat, k: int) -> tuple[np.ndarray, np.ndarray]:
    """raw: [N, K / block_weights * block_bytes] uint8 rows -> (q [N, K] int8, factors [N, K / group, P]).

    Raises ValueError when K is not a whole number of blocks or the row width is wrong.
    """
    lay = LAYOUTS[fmt]
    if k % lay.block_weights:
        raise ValueError(f"{fmt.value}: a row of {k} weights is not a whole number of {lay.block_weights}-weight blocks")
    blocks = k // lay.block_weights
    n = raw.shape[0]
    if raw.shape[1] != blocks * lay.block_bytes:
        raise ValueError(f"{fmt.value}: rows of {k} weights take {blocks * lay.block_bytes} bytes, got {raw.shape[1]}")
    q, factors = unpack_blocks(raw.reshape(n * blocks, lay.block_bytes), fmt)
    return q.reshape(n, k), factors.reshape(n, k // lay.group, factors.shape[2])


def widen(q: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """The float32 weights of unpacked rows: q [N, K] int8, factors [N, K / g, P] -> [N, K].

    The same one or two float32 operations per weight as the GEMM and the gather.
    """
    n, k = q.shape
    g = k // factors.shape[1]
    qf = q.astype(np.float32).reshape(n, -1, g)
    w = factors[:, :, 0:1] * qf
    if factors.shape[2] == 2:
        w = w - factors[:, :, 1:2]
    return w.reshape(n, k)
