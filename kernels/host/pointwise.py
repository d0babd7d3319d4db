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



@njit(fastmath=False, nogil=True)
def _add_scaled(acc, a, row):
    # acc[j] += a * row[j]: a plain loop over 1-D arrays, which LLVM vectorises (a rounded
    # multiply, then a rounded add, in each lane)
    for j in range(acc.shape[0]):
        acc[j] += a * row[j]


@njit(inline="always")
def _attention_span(positions, window, m):
    # the keys row m sees: lo..hi
    hi = positions[m]
    lo = 0
    if window > 0 and hi - window + 1 > 0:
        lo = hi - window + 1
    return lo, hi


@njit(inline="always")
def _attention_scores(q, k_cache, scale, m, h, kvh, lo, n_keys, scores):
    # scores[t] = (sum over d in order of q[m, h, d] * k[lo + t, kvh, d]) * scale: one rounded
    # multiply, one rounded add per d. Eight keys at a time keep eight independent sums in flight.
    Dh = q.shape[2]
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
        t0 += 8
    for t in range(t0, n_keys):
        s = np.float32(0.0)
        for d in range(Dh):
            s += q[m, h, d] * k_cache[lo + t, kvh, d]
        scores[t] = s * scale


@njit(inline="always")
def _attention_finish(v_cache, m, h, kvh, lo, n_keys, scores, out):
    # softmax over scores[:n_keys] (overwritten by the exponentials), then the weighted values
    Dh = out.shape[2]
    best = -np.inf
    for t in range(n_keys):
        if scores[t] > best:
            best = scores[t]
    denom = np.float32(0.0)
    for t in range(n_keys):
        e = np.float32(math.exp(scores[t] - best))
        scores[t] = e
        denom += e
    for d in range(Dh):
        out[m, h, d] = 0.0
    # four keys per pass over d: out[m, h, d] takes the same four rounded multiply-adds in key
    # order as four passes would give it, with one load and store instead of four
    t = 0
    while t + 4 <= n_keys:
        p0, p1, p2, p3 = scores[t] / denom, scores[t + 1] / denom, scores[t + 2] / denom, scores[t + 3] / denom
        for d in range(Dh):
            o = out[m, h, d]
            o += p0 * v_cache[lo + t, kvh, d]
            o += p1 * v_cache[lo + t + 1, kvh, d]
            o += p2 * v_cache[lo + t + 2, kvh, d]
            o += p3 * v_cache[lo + t + 3, kvh, d]
            out[m, h, d] = o
        t += 4
    for t in range(t, n_keys):
        p = scores[t] / denom
        for d in range(Dh):
            out[m, h, d] += p * v_cache[lo + t, kvh, d]


@njit(inline="always")
def _attention_job(q, k_cache, v_cache, positions, window, scale, out, job):
    # one (row, head): scores over the row's visible keys, softmax, weighted values, in one order
    H = q.shape[1]
    group = H // k_cache.shape[1]
    m = job // H
    h = job % H
    lo, hi = _attention_span(positions, window, m)
    n_keys = hi - lo + 1
    scores = np.empty(n_keys, np.float32)
    _attention_scores(q, k_cache, scale, m, h, h // group, lo, n_keys, scores)
    _attention_finish(v_cache, m, h, h // group, lo, n_keys, scores, out)


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


@njit(inline="always")
def _kv_head_scores(q, k_cache, positions, window, scale, kvh, scores):
    # the keys of kv head kvh transposed to kt[d, t], then for every row and head of its group
    # scores[m, h, t] += q[m, h, d] * kt[d, t] over d in order, vectorised over t: each key's
    # score is its own sum with one rounded multiply and one rounded add per d, as in
    # _attention_scores, so the same bits
    M, H, Dh = q.shape
    T = k_cache.shape[0]
    group = H // k_cache.shape[1]
    kt = np.empty((Dh, T), np.float32)
    for t in range(T):
        for d in range(Dh):
            kt[d, t] = k_cache[t, kvh, d]
    for m in range(M):
        lo, hi = _attention_span(positions, window, m)
        for h in range(kvh * group, (kvh + 1) * group):
            row = scores[m, h, lo : hi + 1]
            row[:] = 0.0
            for d in range(Dh):
                _add_scaled(row, q[m, h, d], kt[d, lo : hi + 1])
            for t in range(row.shape[0]):
                row[t] = row[t] * scale


@njit(inline="always")
def _finish_job(v_cache, positions, window, scores, out, job):
    H = out.shape[1]
    m = job // H
    h = job % H
    lo, hi = _attention_span(positions, window, m)
    _attention_finish(v_cache, m, h, h // (H // v_cache.shape[1]), lo, hi - lo + 1, scores[m, h, lo:], out)


# Many rows (prefill): each key tile is transposed once and scored against all the rows and heads
# of its kv head, then each (row, head) finishes as _attention_job does; scores[m, h, t] holds key
# t's score at its absolute index. The same bits as the job-wise kernels, row for row.
@njit(cache=True, fastmath=False, nogil=True)
def _attention_tiled_serial(q, k_cache, v_cache, positions, window, scale, out):
    scores = np.empty((q.shape[0], q.shape[1], k_cache.shape[0]), np.float32)
    for kvh in range(k_cache.shape[1]):
        _kv_head_scores(q, k_cache, positions, window, scale, kvh, scores)
    for job in range(q.shape[0] * q.shape[1]):
        _finish_job(v_cache, positions, window, scores, out, job)


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _attention_tiled_parallel(q, k_cache, v_cache, positions, window, scale, out):
    # the same as _attention_tiled_serial: kv heads, then (row, head) jobs, spread over threads
    scores = np.empty((q.shape[0], q.shape[1], k_cache.shape[0]), np.float32)
    for kvh in prange(k_cache.shape[1]):
        _kv_head_scores(q, k_cache, positions, window, scale, kvh, scores)
    for job in prange(q.shape[0] * q.shape[1]):
        _finish_job(v_cache, positions, window, scores, out, job)


ATTENTION = {False: _attention_serial, True: _attention_parallel}
ATTENTION_TILED = {False: _attention_tiled_serial, True: _attention_tiled_parallel}


@njit(cache=True, fastmath=False, nogil=True)
def silu_mul(gate, up, out):
    # gate, up: [M, F] -> silu(gate) * up
    M, F = gate.shape
    for m in prange(M):
        for f in range(F):
            g = gate[m, f]
            out[m, f] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * up[m, f]

