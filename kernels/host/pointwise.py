"""Host kernels other than the GEMM: norms, RoPE, attention, activations (numba, cached).

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



@njit(inline="always")
def _attention_job(q, k_cache, v_cache, positions, window, scale, out, job):
    # one (row, head): scores over the row's visible keys, softmax, weighted values, in one order
    M, H, Dh = q.shape
    KVH = k_cache.shape[1]
    group = H // KVH
    m = job // H
    h = job % H
    kvh = h // group
    hi = positions[m]
    lo = 0
    if window > 0 and hi - window + 1 > 0:
        lo = hi - window + 1
    n_keys = hi - lo + 1
    scores = np.empty(n_keys, np.float32)
    best = -np.inf
    # eight keys at a time: each score is still its own sum over d in order (one rounded
    # multiply, one rounded add), but eight independent sums keep the core busy where one
    # waited on each add's latency (a 512-token prefill spent half its time here)
    t0 = 0
    while t0 + 8 <= n_keys:
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for d in range(Dh):
            qd = q[m, h, d]
            s0 += qd * k_cache[lo + t0, kvh, d]
            s1 += qd * k_cache[lo + t0 + 1, kvh, d]
            s2 += qd * k_cache[lo + t0 + 2, kvh, d]
            s3 += qd * k_cache[lo + t0 + 3, kvh, d]
            s4 += qd * k_cache[lo + t0 + 4, kvh, d]
            s5 += qd * k_cache[lo + t0 + 5, kvh, d]
            s6 += qd * k_cache[lo + t0 + 6, kvh, d]
            s7 += qd * k_cache[lo + t0 + 7, kvh, d]
        scores[t0], scores[t0 + 1], scores[t0 + 2], scores[t0 + 3] = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        scores[t0 + 4], scores[t0 + 5], scores[t0 + 6], scores[t0 + 7] = s4 * scale, s5 * scale, s6 * scale, s7 * scale
        for i in range(8):
            if scores[t0 + i] > best:
                best = scores[t0 + i]
        t0 += 8
    for t in range(t0, n_keys):
        s = np.float32(0.0)
        for d in range(Dh):
            s += q[m, h, d] * k_cache[lo + t, kvh, d]
        s = s * scale
        scores[t] = s
        if s > best:
            best = s
    denom = np.float32(0.0)
    for t in range(n_keys):
        e = np.float32(math.exp(scores[t] - best))
        scores[t] = e
        denom += e
    for d in range(Dh):
        out[m, h, d] = 0.0
    for t in range(n_keys):
        p = scores[t] / denom
        for d in range(Dh):
            out[m, h, d] += p * v_cache[lo + t, kvh, d]


# Two top-level kernels (not one closure built twice), so numba's cache keeps one entry each.
@njit(cache=True, fastmath=False, nogil=True)
def _attention_serial(q, k_cache, v_cache, positions, window, scale, out):
    # q: [M, H, Dh], k_cache/v_cache: [T, KVH, Dh], positions: [M] -> out [M, H, Dh]
    for job in range(q.shape[0] * q.shape[1]):
        _attention_job(q, k_cache, v_cache, positions, window, scale, out, job)


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _attention_parallel(q, k_cache, v_cache, positions, window, scale, out):
    # the same jobs as _attention_serial, each (row, head) on one thread
    for job in prange(q.shape[0] * q.shape[1]):
        _attention_job(q, k_cache, v_cache, positions, window, scale, out, job)


ATTENTION = {False: _attention_serial, True: _attention_parallel}


@njit(cache=True, fastmath=False, nogil=True)
def silu_mul(gate, up, out):
    # gate, up: [M, F] -> silu(gate) * up
    M, F = gate.shape
    for m in prange(M):
        for f in range(F):
            g = gate[m, f]
            out[m, f] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * up[m, f]

