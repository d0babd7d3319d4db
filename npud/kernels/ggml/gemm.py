"""The host GEMM and row gather for GGML block weights, batch-invariant like the other host formats.

The contract is the host float path's (npud/kernels/host/gemm.c): every output element y[m, n] is one
chain acc = fma(x[m, k], w[n, k], acc) over k = 0, 1, ..., K - 1 in that order, one rounding per
FMA, vector lanes across output columns, threads across column tiles. What differs is w[n, k]:
it is widened from the block form of npud/kernels/ggml/blocks.py inside the kernel, as S * q (or
S * q - D), the reference dequantization's own operations each rounded, so the chain runs over
exactly `gguf.quants.dequantize`'s weights. The kernel is C (npud/kernels/host/blockgemm.c, on the
host library's ISA paths and thread pool), register-blocked like the float path.

Layout (done once at load): q tiles [ceil(N / T), K, T] int8 and factor tiles
[ceil(N / T), K / g, P, T] float32, T = 64 output columns; padded columns hold q = 0 and
S = D = 0, so they widen to 0 and are cut off after the call. Two smaller forms of the same
numbers (the bits do not depend on the form): Q4_0 / Q5_0 / Q4_K / Q5_K q tiles packed in 4 or
5 bits a weight (npud/kernels/ggml/nibbles.py's pack_rows), and factor tiles in float16 where every
factor is a float16 value (Q8_0 / Q4_0 / Q5_0: S is the block's own fp16 d), both unpacked in
registers. gemma-3-270m Q4_K_M: 292 MiB of tiles become 244.
"""

from __future__ import annotations

import numpy as np

from npud.kernels.base import LinearWeight
from npud.kernels.ggml import nibbles
from npud.kernels.ggml.blocks import LAYOUTS, BlockFormat
from npud.kernels.host import native
from npud.kernels.host.formats import PARALLEL_MIN_BYTES
from npud.kernels.host.resident import resident_copy

TILE = native.TILE
_PACK_ROWS = TILE * 256  # rows unpacked per step while packing, to bound temporaries


LAYOUT_FLOAT, LAYOUT_Q8 = "qtiles", "q8blocks"  # widened into the float chain; integer sums against q8 rows


def half_factors(f_tiles: np.ndarray) -> np.ndarray | None:
    """float16 factor tiles holding exactly the float32 ones (every factor finite and a float16
    value, as gguf's Q8_0 / Q4_0 / Q5_0 scales are), or None where some factor is not."""
    with np.errstate(over="ignore"):
        half = f_tiles.astype(np.float16)
    if np.isfinite(half).all() and np.array_equal(half.astype(np.float32).view(np.uint32), f_tiles.view(np.uint32)):
        return half
    return None


def pack_block_matrix(raw: np.ndarray, fmt: BlockFormat, k: int, rows: np.ndarray | None = None,
                      layout: str = LAYOUT_FLOAT, done=None, compact: bool = True) -> LinearWeight:
    """A [N, K] block matrix (raw GGUF rows, [N, row bytes] uint8) laid out in tiles.

    rows: an optional row order (row i of the result is raw row rows[i]), for checkpoints
    whose rows are stored permuted. layout: "qtiles" (q tiles [T, K, TILE] int8, the exact
    float path: blockgemm.c) or "q8blocks" (q + 128 as uint8 [T, K / 4, TILE, 4], against q8
    activation rows: blockq8.c); both with factor tiles [T, K / g, P, TILE] (float32; float16 in
    "q8blocks" for one factor per 32 weights when every factor is a float16 value, as gguf's
    Q8_0 / Q4_0 / Q5_0 scales are: the same values in half the bytes). done: called with
    each run of raw rows [r0, r1) once it is packed (and never read again), so a mapped file's
    pages can be let go as the copy grows. compact: on "qtiles", pack 4 / 5-bit q and keep float16
    factors where exact (False: int8 q and float32 factors, the same bits; for tests). Raises ValueError for a row width that does not hold
    K weights of `fmt`, or an unknown layout.
    """
    if layout not in (LAYOUT_FLOAT, LAYOUT_Q8):
        raise ValueError(f"unknown block layout {layout!r}")
    from npud.kernels.ggml.blocks import unpack_matrix

    lay = LAYOUTS[fmt]
    n = raw.shape[0] if rows is None else len(rows)
    if k % lay.block_weights:
        raise ValueError(f"{fmt.value}: a row of {k} weights is not a whole number of {lay.block_weights}-weight blocks")
    tiles = -(-n // TILE)
    parts = 2 if lay.has_offset else 1
    q8 = layout == LAYOUT_Q8
    q_tiles = np.full((tiles, k // 4, TILE, 4), 128, np.uint8) if q8 else np.zeros((tiles, k, TILE), np.int8)
    f_tiles = np.zeros((tiles, k // lay.group, parts, TILE), np.float32)
    for r0 in range(0, n, _PACK_ROWS):
        r1 = min(n, r0 + _PACK_ROWS)
        chunk = raw[r0:r1] if rows is None else raw[rows[r0:r1]]
        q, factors = unpack_matrix(np.asarray(chunk), fmt, k)
        for i0 in range(r0, r1, TILE):
            i1 = min(r1, i0 + TILE)
            t = i0 // TILE
            if q8:  # column c's k = 4 i + j at [t, i, c, j]; padded columns hold q = 0 (128)
                part = q[i0 - r0 : i1 - r0].astype(np.int16) + 128
                q_tiles[t, :, : i1 - i0, :] = part.astype(np.uint8).reshape(i1 - i0, k // 4, 4).transpose(1, 0, 2)
            else:
                q_tiles[t, :, : i1 - i0] = q[i0 - r0 : i1 - r0].T
            f_tiles[t, :, :, : i1 - i0] = factors[i0 - r0 : i1 - r0].transpose(1, 2, 0)
        if done is not None and rows is None:
            done(raw[r0:r1])
    if (q8 and parts == 1 and lay.group == 32) or (compact and not q8):  # float16 factors where exact
        half = half_factors(f_tiles)
        f_tiles = f_tiles if half is None else half
    if q8 and fmt in nibbles.PACKED_BITS and (parts == 2 or f_tiles.dtype == np.float16):
        q_tiles = nibbles.pack(q_tiles, fmt)  # 4 / 5 bits a weight, not 8 (npud/kernels/ggml/nibbles.py)
    if compact and not q8 and fmt in nibbles.PACKED_BITS:
        q_tiles = nibbles.pack_rows(q_tiles, fmt)
    if q8:  # huge pages: a one-row call streams them faster (npud/kernels/host/resident.py)
        q_tiles, f_tiles = resident_copy(q_tiles), resident_copy(f_tiles)
    return LinearWeight(fmt=fmt, data=q_tiles, scale=f_tiles, layout=layout, out_features=n, in_features=k)


def block_linear(x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
    """x: [M, K] float32, w: a "qtiles" LinearWeight -> [M, N] (+ bias, one add per element)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x has shape {x.shape}, weight expects [M, {w.in_features}]")
    # by weight size alone, so a step and a verify of the same layer take the same path
    parallel = parallel and w.data.nbytes >= PARALLEL_MIN_BYTES
    if w.layout == LAYOUT_Q8:
        out = native.linear_bq8(x, w.data, w.scale, w.out_features, w.bias, parallel, nibbles.zero_of(w.fmt, w.data))
    else:
        out = native.linear_qtiles(x, w.data, w.scale, w.out_features, w.bias, parallel,
                                   nibbles.row_zero(w.fmt, w.data))
    return out[:, : w.out_features]


def native_block_linear(w: LinearWeight) -> tuple | None:
    """A "qtiles" or "q8blocks" weight as the host's decoder layer (npud/kernels/host/layer.c) calls
    it: block_linear's entry and arguments, and the arrays the call reads; None for another layout."""
    from npud.kernels.host.layer import LIN_BQ8, LIN_QT, Linear

    q, f, k = w.data, w.scale, w.in_features
    lin = Linear(K=k, Kp=k, ntiles=q.shape[0], N=w.out_features, parallel=int(q.nbytes >= PARALLEL_MIN_BYTES),
                 group=k // f.shape[1], parts=f.shape[2], fac16=int(f.dtype == np.float16), w=q.ctypes.data,
                 fac=f.ctypes.data, bias=None if w.bias is None else w.bias.ctypes.data)
    if w.layout == LAYOUT_Q8:  # native.linear_bq8
        lin.kind, lin.zero = LIN_BQ8, nibbles.zero_of(w.fmt, q)
        lin.qbits = 8 if q.ndim == 4 else {1024: 4, 1280: 5}.get(q.shape[2], 0)
    elif w.layout == LAYOUT_FLOAT:  # native.linear_qtiles
        lin.kind, lin.zero = LIN_QT, nibbles.row_zero(w.fmt, q)
        lin.qbits = native.QT_ROW_BITS.get(q.shape[2], 0)
    else:
        return None
    if lin.qbits == 0:
        return None
    return lin, (q, f, w.bias)


def block_embed(table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
    """Rows of a "qtiles" or "q8blocks" table widened to float32: tokens [M] (in range) -> [M, D]."""
    if table.layout == LAYOUT_Q8:
        from npud.kernels.ggml.blocks import widen

        tiles, cols = tokens // TILE, tokens % TILE
        q = nibbles.q_columns(table.data, tiles, cols, nibbles.zero_of(table.fmt, table.data))
        return widen(q, np.ascontiguousarray(table.scale[tiles, :, :, cols], dtype=np.float32))
    return native.gather_qtiles(table.data, table.scale, np.ascontiguousarray(tokens, dtype=np.int64),
                                nibbles.row_zero(table.fmt, table.data))


def dense_weights(w: LinearWeight) -> np.ndarray:
    """The float32 [N, K] weights of a "qtiles" or "q8blocks" LinearWeight (for tests and references)."""
    return block_embed(w, np.arange(w.out_features, dtype=np.int64))
