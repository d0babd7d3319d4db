"""Host kernels of gemma4 and qwen3_5 layers: the sigmoid gate, softcap, l2 norm, the gated delta
net (gemma's GELU is C: pointwise.c).

Each output element (or each row, or each (row, head)) is computed by one fixed sequence of
operations that reads only its own row (and, for the recurrent kernels, the state carried
from the row before), so row i of an M-row call has the bits of a one-row call. Inner loops
run over one row at a time: where LLVM vectorises them, the split into vector body and tail
depends on the row length, never on M. Transcendentals are taken in float64 and rounded once.
"""

from __future__ import annotations

import math
import os

import numpy as np

from npud.kernels.host.cache import use_for_numba

use_for_numba()  # before numba compiles or loads anything below

from numba import njit, prange  # noqa: E402


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
def sigmoid_mul(x, gate, out):
    # x, gate: [M, F] -> x * sigmoid(gate)
    M, F = x.shape
    for m in range(M):
        for f in range(F):
            s = np.float32(1.0 / (1.0 + math.exp(-np.float64(gate[m, f]))))
            out[m, f] = x[m, f] * s


@njit(cache=True, fastmath=False, nogil=True)
def softcap(x, cap, out):
    # x: [M, V] -> cap * tanh(x / cap), each op rounded to float32 as the reference does
    M, V = x.shape
    for m in range(M):
        for j in range(V):
            t = x[m, j] / cap
            out[m, j] = np.float32(math.tanh(np.float64(t))) * cap


@njit(cache=True, fastmath=False, nogil=True)
def l2_norm(x, eps, out):
    # x: [R, D] -> x / sqrt(sum x^2 + eps) per row; the sum in float64, in index order
    R, D = x.shape
    for r in range(R):
        ss = 0.0
        for d in range(D):
            v = np.float64(x[r, d])
            ss += v * v
        inv = np.float32(1.0 / math.sqrt(ss + eps))
        for d in range(D):
            out[r, d] = x[r, d] * inv


@njit(cache=True, fastmath=False, nogil=True)
def causal_conv1d_silu(x, state, w, out, states):
    # x: [M, C] new inputs; state: [C, K-1] the inputs before row 0; w: [C, K] depthwise taps
    # -> out [M, C] = silu(sum_j w[c, j] * input[row - (K-1) + j]), states [M, C, K-1]: the
    # last K-1 inputs up to and including each row
    M, C = x.shape
    K = w.shape[1]
    hist = np.empty(K - 1 + M, np.float32)
    for c in range(C):
        for j in range(K - 1):
            hist[j] = state[c, j]
        for m in range(M):
            hist[K - 1 + m] = x[m, c]
        for m in range(M):
            acc = np.float32(0.0)
            for j in range(K):
                acc += w[c, j] * hist[m + j]
            out[m, c] = acc / (np.float32(1.0) + np.float32(math.exp(-np.float64(acc))))
            for j in range(K - 1):
                states[m, c, j] = hist[m + 1 + j]


@njit(cache=True, fastmath=False, nogil=True)
def gdn_gates(a, b, a_log, dt_bias, log_decay, beta):
    # a, b: [M, H] -> log_decay = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b)
    # (softplus as torch's: x above 20 is its own value)
    M, H = a.shape
    for m in range(M):
        for h in range(H):
            t = a[m, h] + dt_bias[h]
            sp = t if t > 20.0 else np.float32(math.log1p(math.exp(np.float64(t))))
            log_decay[m, h] = -np.float32(math.exp(np.float64(a_log[h]))) * sp
            beta[m, h] = np.float32(1.0 / (1.0 + math.exp(-np.float64(b[m, h]))))




@njit(inline="always")
def _gated_delta_head(q, k, v, log_decay, beta, state, out, states, h):
    # value head h over the M rows in order, from state[h]
    M, HV, DV = v.shape
    HK, DK = q.shape[1], q.shape[2]
    kh = h // (HV // HK)
    s = state[h].copy()
    mem = np.empty(DV, np.float32)
    for m in range(M):
        decay = np.float32(math.exp(np.float64(log_decay[m, h])))
        for i in range(DK):
            for j in range(DV):
                s[i, j] = s[i, j] * decay
        # what the state predicts for this key, and the correction it is moved by
        for j in range(DV):
            mem[j] = 0.0
        for i in range(DK):
            ki = k[m, kh, i]
            for j in range(DV):
                mem[j] += s[i, j] * ki
        bt = beta[m, h]
        for j in range(DV):
            mem[j] = (v[m, h, j] - mem[j]) * bt
        for i in range(DK):
            ki = k[m, kh, i]
            for j in range(DV):
                s[i, j] = s[i, j] + ki * mem[j]
        for j in range(DV):
            out[m, h, j] = 0.0
        for i in range(DK):
            qi = q[m, kh, i]
            for j in range(DV):
                out[m, h, j] += s[i, j] * qi
        states[m, h] = s


# q, k: [M, HK, DK] (q l2-normed and scaled, k l2-normed); v: [M, HV, DV]; log_decay, beta:
# [M, HV]; state: [HV, DK, DV] before row 0 -> out [M, HV, DV], states [M, HV, DK, DV]: the
# state after each row. Value heads are independent jobs; two top-level kernels so that
# numba's cache keeps one entry each.
@njit(cache=True, fastmath=False, nogil=True)
def _gated_delta_serial(q, k, v, log_decay, beta, state, out, states):
    for h in range(v.shape[1]):
        _gated_delta_head(q, k, v, log_decay, beta, state, out, states, h)


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _gated_delta_parallel(q, k, v, log_decay, beta, state, out, states):
    for h in prange(v.shape[1]):
        _gated_delta_head(q, k, v, log_decay, beta, state, out, states, h)


def gated_delta(parallel: bool):
    """The gated delta rule kernel, its parallel build with numba's threads started first."""
    if parallel:
        _start_threads_passive()
        return _gated_delta_parallel
    return _gated_delta_serial


_threads_started = False


def _start_threads_passive() -> None:
    """Start numba's parallel threads with OMP_WAIT_POLICY=passive unless the environment sets it.

    On libgomp (numba's threading layer here) the threads spin for about 300k pauses after each
    parallel region when the policy is unset: on a machine with no core to spare they hold the
    core the GEMM pool's worker (pool.c) needs next. libgomp reads the policy once, when it
    loads, so the variable is set for that moment only: left in the environment it would slow
    every other OpenMP runtime that loads later, in this process (torch) or in a child
    (llama.cpp, which a benchmark runs beside us). Started on the first parallel call, not at
    import: only the hybrid (GDN) models have one.
    """
    global _threads_started
    if _threads_started:
        return
    from numba.np.ufunc import parallel

    ours = "OMP_WAIT_POLICY" not in os.environ
    if ours:
        os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        parallel._launch_threads()
    finally:
        if ours:
            del os.environ["OMP_WAIT_POLICY"]
    _threads_started = True


@njit(cache=True, fastmath=False, nogil=True)
def gated_rms_norm(x, z, weight, eps, out):
    # x, z: [R, D] -> weight * (x / sqrt(mean x^2 + eps)) * silu(z), per row
    R, D = x.shape
    for r in range(R):
        inv = inv_rms(x, r, eps)
        for d in range(D):
            g = z[r, d]
            silu = g / (np.float32(1.0) + np.float32(math.exp(-np.float64(g))))
            out[r, d] = (weight[d] * (x[r, d] * inv)) * silu
