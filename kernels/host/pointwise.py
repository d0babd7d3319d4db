"""Host kernels other than the GEMM and attention (C): norms, RoPE, activations (numba, cached).

Each output element (or row, or (row, head)) is one fixed sequence of operations over its
own row, so row i of an M-row call has the bits of a one-row call. No fastmath: LLVM may
neither reassociate nor contract. Every kernel is a top-level function with cache=True, so
numba compiles it once per machine into the cache directory (kernels/host/cache.py).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

@njit(inline="always")
def inv_rms(x, m, eps):
    # 1 / sqrt(mean(x[m]^2) + eps): squares accumulated in float64 in index order
    D = x.shape[1]
    ss = 0.0
    for d in range(D):
        v = np.float64(x[m, d])
        ss += v * v
    return np.float32(1.0 / math.sqrt(ss / D + eps))


@njit(cache=True, fastmath=False, nogil=True)
def rms_norm(x, weight, eps, out):
    # x: [M, D] -> out [M, D]
    M, D = x.shape
    for m in prange(M):
        inv = inv_rms(x, m, eps)
        for d in range(D):
            out[m, d] = weight[d] * (x[m, d] * inv)


@njit(cache=True, fastmath=False, nogil=True)
def rope(x, positions, inv_freq, out):
    # x: [M, H, Dh] half-split layout: pairs (i, i + Dh/2) rotate by angle pos * inv_freq[i]
    M, H, Dh = x.shape
    half = inv_freq.shape[0]
    for m in prange(M):
        pos = np.float32(positions[m])
        for i in range(half):
            angle = pos * inv_freq[i]  # float32 product, as the reference computes it
            c = np.float32(math.cos(np.float64(angle)))
            s = np.float32(math.sin(np.float64(angle)))
            for h in range(H):
                a = x[m, h, i]
                b = x[m, h, i + half]
                out[m, h, i] = a * c - b * s
                out[m, h, i + half] = b * c + a * s
        for h in range(H):
            for i in range(2 * half, Dh):
                out[m, h, i] = x[m, h, i]


@njit(cache=True, fastmath=False, nogil=True)
def silu_mul(gate, up, out):
    # gate, up: [M, F] -> silu(gate) * up
    M, F = gate.shape
    for m in prange(M):
        for f in range(F):
            g = gate[m, f]
            out[m, f] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * up[m, f]

