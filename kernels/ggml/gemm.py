"""The host GEMM and row gather for GGML block weights, batch-invariant like kernels/host.py.

The contract is kernels/host.py's: every output element y[m, n] is the float32 sum over
k = 0, 1, ..., K - 1 of x[m, k] * w[n, k], added in that order with one rounding per
multiply and per add (no fastmath: no reassociation, no FMA contraction), vector lanes
across output columns, threads across column tiles. What differs is w[n, k]: it is
widened from the block form of kernels/ggml/blocks.py inside the kernel, as
S * q (or S * q - D), the reference dequantization's own operations, so the sum is the
one a float32 GEMM over `gguf.quants.dequantize`'s weights would add, in the same order.

Layout (done once at load): q tiles [ceil(N / T), K, T] int8 and factor tiles
[ceil(N / T), K / g, P, T] float32, T = 64 output columns; padded columns hold q = 0 and
S = D = 0, so they widen to 0 and are cut off after the call.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.base import LinearWeight
from kernels.ggml.blocks import LAYOUTS, BlockFormat

TILE = 64
PARALLEL_MIN_WEIGHT = 1 << 20  # weight elements from which a GEMM splits its tiles across threads
_PACK_ROWS = TILE * 256  # rows unpacked per step while packing, to bound temporaries


def _make_gemm(parallel):
    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def gemm(x, q, f, out):
        # x: [M, K] f32; q: [tiles, K, T] int8; f: [tiles, K / g, P, T] f32 -> out: [M, tiles * T]
        M, K = x.shape
        tiles = q.shape[0]
        groups = f.shape[1]
        g = K // groups  # 16 or 32: a multiple of 4
        offset = f.shape[2] == 2
        m4 = M - M % 4
        m2 = M - M % 2
        for t in prange(tiles):
            acc = np.zeros((M, TILE), np.float32)
            w4 = np.empty((4, TILE), np.float32)
            for grp in range(groups):
                for k in range(grp * g, (grp + 1) * g, 4):
                    # four weights of each column, widened with the reference's operations
                    for i in range(4):
                        if offset:
                            for j in range(TILE):
                                w4[i, j] = f[t, grp, 0, j] * np.float32(q[t, k + i, j]) - f[t, grp, 1, j]
                        else:
                            for j in range(TILE):
                                w4[i, j] = f[t, grp, 0, j] * np.float32(q[t, k + i, j])
                    # each accumulator still adds x[m, k] * w[k] in increasing k, one rounding per
                    # multiply and per add; four (then two) rows at a time share each weight load
                    for m in range(0, m4, 4):
                        x0, x1, x2, x3 = x[m, k], x[m, k + 1], x[m, k + 2], x[m, k + 3]
                        y0, y1, y2, y3 = x[m + 1, k], x[m + 1, k + 1], x[m + 1, k + 2], x[m + 1, k + 3]
                        u0, u1, u2, u3 = x[m + 2, k], x[m + 2, k + 1], x[m + 2, k + 2], x[m + 2, k + 3]
                        v0, v1, v2, v3 = x[m + 3, k], x[m + 3, k + 1], x[m + 3, k + 2], x[m + 3, k + 3]
                        for j in range(TILE):
                            w0, w1, w2, w3 = w4[0, j], w4[1, j], w4[2, j], w4[3, j]
                            acc[m, j] = (((acc[m, j] + x0 * w0) + x1 * w1) + x2 * w2) + x3 * w3
                            acc[m + 1, j] = (((acc[m + 1, j] + y0 * w0) + y1 * w1) + y2 * w2) + y3 * w3
                            acc[m + 2, j] = (((acc[m + 2, j] + u0 * w0) + u1 * w1) + u2 * w2) + u3 * w3
                            acc[m + 3, j] = (((acc[m + 3, j] + v0 * w0) + v1 * w1) + v2 * w2) + v3 * w3
                    for m in range(m4, m2, 2):
                        x0, x1, x2, x3 = x[m, k], x[m, k + 1], x[m, k + 2], x[m, k + 3]
                        y0, y1, y2, y3 = x[m + 1, k], x[m + 1, k + 1], x[m + 1, k + 2], x[m + 1, k + 3]
                        for j in range(TILE):
                            a = acc[m, j] + x0 * w4[0, j]
                            b = acc[m + 1, j] + y0 * w4[0, j]
                            a = a + x1 * w4[1, j]
                            b = b + y1 * w4[1, j]
                            a = a + x2 * w4[2, j]
                            b = b + y2 * w4[2, j]
                            acc[m, j] = a + x3 * w4[3, j]
                            acc[m + 1, j] = b + y3 * w4[3, j]
                    for m in range(m2, M):
                        x0, x1, x2, x3 = x[m, k], x[m, k + 1], x[m, k + 2], x[m, k + 3]
                        for j in range(TILE):
                            a = acc[m, j] + x0 * w4[0, j]
                            a = a + x1 * w4[1, j]
                            a = a + x2 * w4[2, j]
                            acc[m, j] = a + x3 * w4[3, j]
            base = t * TILE
            for m in range(M):
                for j in range(TILE):
                    out[m, base + j] = acc[m, j]

    return gemm


def _make_gemv(parallel):
    """The one-row GEMM (decode steps): the same sum per element in the same order as `gemm`
    (so the same bits; the self-check compares exactly these two paths), with the group's
    factors held in registers and each weight widened inside the multiply-add."""

    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def gemv(x, q, f, out):
        # x: [1, K] f32; q: [tiles, K, T] int8; f: [tiles, K / g, P, T] f32 -> out: [1, tiles * T]
        K = x.shape[1]
        tiles = q.shape[0]
        groups = f.shape[1]
        g = K // groups
        offset = f.shape[2] == 2
        for t in prange(tiles):
            acc = np.zeros(TILE, np.float32)
            s = np.empty(TILE, np.float32)
            d = np.zeros(TILE, np.float32)
            for grp in range(groups):
                for j in range(TILE):
                    s[j] = f[t, grp, 0, j]
                if offset:
                    for j in range(TILE):
                        d[j] = f[t, grp, 1, j]
                k0 = grp * g
                if offset:
                    for kk in range(0, g, 2):
                        x0, x1 = x[0, k0 + kk], x[0, k0 + kk + 1]
                        for j in range(TILE):
                            a = acc[j] + x0 * (s[j] * np.float32(q[t, k0 + kk, j]) - d[j])
                            acc[j] = a + x1 * (s[j] * np.float32(q[t, k0 + kk + 1, j]) - d[j])
                else:
                    for kk in range(0, g, 2):
                        x0, x1 = x[0, k0 + kk], x[0, k0 + kk + 1]
                        for j in range(TILE):
                            a = acc[j] + x0 * (s[j] * np.float32(q[t, k0 + kk, j]))
                            acc[j] = a + x1 * (s[j] * np.float32(q[t, k0 + kk + 1, j]))
            for j in range(TILE):
                out[0, t * TILE + j] = acc[j]

    return gemv


_GEMM = {p: _make_gemm(p) for p in (False, True)}
_GEMV = {p: _make_gemv(p) for p in (False, True)}


@njit(cache=True, fastmath=False, nogil=True)
def _gather(q, f, tokens, out):
    # q: [tiles, D, T] int8, f: [tiles, D / g, P, T], tokens: [M] -> out [M, D]: row v of the [V, D] table
    M = tokens.shape[0]
    D = q.shape[1]
    g = D // f.shape[1]
    offset = f.shape[2] == 2
    for m in range(M):
        t = tokens[m] // TILE
        j = tokens[m] % TILE
        for d in range(D):
            grp = d // g
            v = f[t, grp, 0, j] * np.float32(q[t, d, j])
            if offset:
                v = v - f[t, grp, 1, j]
            out[m, d] = v


def pack_block_matrix(raw: np.ndarray, fmt: BlockFormat, k: int, rows: np.ndarray | None = None) -> LinearWeight:
    """A [N, K] block matrix (raw GGUF rows, [N, row bytes] uint8) laid out in tiles.

    rows: an optional row order (row i of the result is raw row rows[i]), for checkpoints
    whose rows are stored permuted. Returns a LinearWeight with layout "qtiles". Raises
    ValueError for a row width that does not hold K weights of `fmt`.
    """
    from kernels.ggml.blocks import unpack_matrix

    lay = LAYOUTS[fmt]
    n = raw.shape[0] if rows is None else len(rows)
    if k % lay.block_weights:
        raise ValueError(f"{fmt.value}: a row of {k} weights is not a whole number of {lay.block_weights}-weight blocks")
    tiles = -(-n // TILE)
    parts = 2 if lay.has_offset else 1
    q_tiles = np.zeros((tiles, k, TILE), np.int8)
    f_tiles = np.zeros((tiles, k // lay.group, parts, TILE), np.float32)
    for r0 in range(0, n, _PACK_ROWS):
        r1 = min(n, r0 + _PACK_ROWS)
        chunk = raw[r0:r1] if rows is None else raw[rows[r0:r1]]
        q, factors = unpack_matrix(np.asarray(chunk), fmt, k)
        for i0 in range(r0, r1, TILE):
            i1 = min(r1, i0 + TILE)
            t = i0 // TILE
            q_tiles[t, :, : i1 - i0] = q[i0 - r0 : i1 - r0].T
            f_tiles[t, :, :, : i1 - i0] = factors[i0 - r0 : i1 - r0].transpose(1, 2, 0)
    return LinearWeight(fmt=fmt, data=q_tiles, scale=f_tiles, layout="qtiles", out_features=n, in_features=k)


def block_linear(x: np.ndarray, w: LinearWeight, parallel: bool) -> np.ndarray:
    """x: [M, K] float32, w: a "qtiles" LinearWeight -> [M, N] (+ bias)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x has shape {x.shape}, weight expects [M, {w.in_features}]")
    padded = np.empty((x.shape[0], w.data.shape[0] * TILE), np.float32)
    # by weight size alone, so a step and a verify of the same layer take the same path
    kernels = _GEMV if x.shape[0] == 1 else _GEMM
    kernels[parallel and w.data.size >= PARALLEL_MIN_WEIGHT](x, w.data, w.scale, padded)
    out = padded[:, : w.out_features]
    if w.bias is not None:
        out = out + w.bias  # one add per element, the same for every row
    return out


def block_embed(table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
    """Rows of a "qtiles" table widened to float32: tokens [M] (in range) -> [M, D]."""
    out = np.empty((tokens.shape[0], table.in_features), np.float32)
    _gather(table.data, table.scale, np.ascontiguousarray(tokens, dtype=np.int64), out)
    return out


def dense_weights(w: LinearWeight) -> np.ndarray:
    """The float32 [N, K] weights of a "qtiles" LinearWeight (for tests and references)."""
    return block_embed(w, np.arange(w.out_features, dtype=np.int64))
