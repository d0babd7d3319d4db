"""The host (CPU) backend: numba kernels whose bits do not depend on the batch size.

Why not numpy: OpenBLAS takes gemv for one row and gemm for several, and the two sum in
different orders, so row i of a batched call differs in the last bits from the same row
alone; which gemm kernel runs also depends on the CPU. A speculative verify compares the
base's choice in a batched row with what plain decoding would have chosen, so the rows
must be the same computation, not merely close.

How: every output element y[m, n] is the sum over k = 0, 1, ..., K - 1 of x[m, k] * w[n, k],
added in that order, in float32, one multiply and one add each (no fastmath, so LLVM may
neither reassociate nor contract into an FMA). Vector lanes run across output columns,
never across k: the weight is laid out once at load time in column tiles [N / T, K, T], and
for each k the tile's T weights are multiplied by x[m, k] and added into T accumulators,
an axpy that LLVM vectorises without changing any element's order. A row's bits are
therefore a function of that row alone, whatever M is and however threads split the tiles.

Each weight tile is streamed once per call and applied to all M rows, so a verify of M
rows reads the weights once.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels.base import LinearWeight, WeightFormat

TILE = 64  # output columns per weight tile: 4 AVX-512 (8 AVX2) registers of accumulators a row


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """Widen bfloat16 bits (in a uint16) to the float32 with the same value."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        shifted = builder.shl(wide, ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(shifted, ir.FloatType())

    return sig, codegen


def _make_linear(widen, parallel):
    """Build the tiled GEMM for one weight storage type; `widen` maps a stored element to fp32.

    The serial and the parallel build compute every element in the same order (threads
    split tiles, never k), so they give the same bits; the serial one saves the cost of
    waking threads for small matrices.
    """

    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def kernel(x, wt, out):
        # x: [M, K] f32, wt: [tiles, K, TILE] (stored type), out: [M, tiles * TILE] f32
        M, K = x.shape
        tiles = wt.shape[0]
        k4 = K - K % 4
        m2 = M - M % 2
        for t in prange(tiles):
            acc = np.zeros((M, TILE), np.float32)
            w4 = np.empty((4, TILE), np.float32)
            # four k at a time, two rows at a time: each accumulator still adds x[m, k] * w[k]
            # in increasing k with one rounding per multiply and per add, but is loaded and
            # stored once per four k, and two rows give the core independent chains to overlap
            for k in range(0, k4, 4):
                for i in range(4):
                    for j in range(TILE):
                        w4[i, j] = widen(wt[t, k + i, j])
                for m in range(0, m2, 2):
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
            for k in range(k4, K):
                for j in range(TILE):
                    w4[0, j] = widen(wt[t, k, j])
                for m in range(M):
                    xv = x[m, k]
                    for j in range(TILE):
                        acc[m, j] += xv * w4[0, j]
            base = t * TILE
            for m in range(M):
                for j in range(TILE):
                    out[m, base + j] = acc[m, j]

    return kernel


@njit(inline="always")
def _widen_f32(v):
    return v


@njit(inline="always")
def _widen_bf16(v):
    return _bf16_bits_to_f32(v)


@njit(inline="always")
def _widen_i8(v):
    return np.float32(v)


def _make_gemv(widen, parallel):
    """The one-row GEMM (decode steps): the same sum per element as `_make_linear`'s kernel, in
    the same order, so it gives the same bits (the start-up self-check compares exactly these
    two paths); it widens each weight inside the multiply-add instead of through a buffer,
    which one row cannot amortise."""

    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def gemv(x, wt, out):
        # x: [1, K] f32, wt: [tiles, K, TILE] (stored type), out: [1, tiles * TILE] f32
        K = x.shape[1]
        tiles = wt.shape[0]
        k4 = K - K % 4
        for t in prange(tiles):
            acc = np.zeros(TILE, np.float32)
            for k in range(0, k4, 4):
                x0, x1, x2, x3 = x[0, k], x[0, k + 1], x[0, k + 2], x[0, k + 3]
                for j in range(TILE):
                    a = acc[j] + x0 * widen(wt[t, k, j])
                    a = a + x1 * widen(wt[t, k + 1, j])
                    a = a + x2 * widen(wt[t, k + 2, j])
                    acc[j] = a + x3 * widen(wt[t, k + 3, j])
            for k in range(k4, K):
                xv = x[0, k]
                for j in range(TILE):
                    acc[j] += xv * widen(wt[t, k, j])
            for j in range(TILE):
                out[0, t * TILE + j] = acc[j]

    return gemv


_WIDEN = ((WeightFormat.FP32, _widen_f32), (WeightFormat.BF16, _widen_bf16), (WeightFormat.INT8, _widen_i8))
_GEMVS = {(fmt, parallel): _make_gemv(widen, parallel) for fmt, widen in _WIDEN for parallel in (False, True)}
_GEMMS = {(fmt, parallel): _make_linear(widen, parallel) for fmt, widen in _WIDEN for parallel in (False, True)}
PARALLEL_MIN_WORK = 1 << 21  # elements of work below which waking a second thread costs more than it saves
PARALLEL_MIN_WEIGHT = 1 << 20  # weight elements from which a GEMM splits its tiles across threads


def pack_tiles(data: np.ndarray) -> np.ndarray:
    """[N, K] -> [ceil(N / TILE), K, TILE], zero-padded columns past N."""
    n, k = data.shape
    tiles = -(-n // TILE)
    padded = np.zeros((tiles * TILE, k), dtype=data.dtype)
    padded[:n] = data
    return np.ascontiguousarray(padded.reshape(tiles, TILE, k).transpose(0, 2, 1))


@njit(cache=True, fastmath=False, nogil=True)
def _epilogue(out, scale, bias, has_scale, has_bias):
    # out: [M, N] in place; per-column scale (int8) then bias, the same two ops for every row
    M, N = out.shape
    for m in range(M):
        for n in range(N):
            v = out[m, n]
            if has_scale:
                v = v * scale[n]
            if has_bias:
                v = v + bias[n]
            out[m, n] = v


@njit(inline="always")
def _inv_rms(x, m, eps):
    # 1 / sqrt(mean(x[m]^2) + eps): squares accumulated in float64 in index order
    D = x.shape[1]
    ss = 0.0
    for d in range(D):
        v = np.float64(x[m, d])
        ss += v * v
    return np.float32(1.0 / math.sqrt(ss / D + eps))


@njit(cache=True, fastmath=False, nogil=True)
def _rms_norm(x, weight, eps, out):
    # x: [M, D] -> out [M, D]
    M, D = x.shape
    for m in prange(M):
        inv = _inv_rms(x, m, eps)
        for d in range(D):
            out[m, d] = weight[d] * (x[m, d] * inv)


@njit(cache=True, fastmath=False, nogil=True)
def _rope(x, positions, inv_freq, out):
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


def _make_attention(parallel):
    """Causal attention; each (row, head) is one job computed in one fixed order."""

    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def attention(q, k_cache, v_cache, positions, window, scale, out):
        # q: [M, H, Dh], k_cache/v_cache: [T, KVH, Dh], positions: [M] -> out [M, H, Dh]
        M, H, Dh = q.shape
        KVH = k_cache.shape[1]
        group = H // KVH
        for job in prange(M * H):
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
            for t in range(n_keys):
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

    return attention


_ATTENTION = {p: _make_attention(p) for p in (False, True)}


@njit(cache=True, fastmath=False, nogil=True)
def _silu_mul(gate, up, out):
    # gate, up: [M, F] -> silu(gate) * up
    M, F = gate.shape
    for m in prange(M):
        for f in range(F):
            g = gate[m, f]
            out[m, f] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * up[m, f]


def _make_embed(widen):
    """Build the embedding gather for one storage type (rows of a tiled table)."""

    @njit(cache=True, nogil=True)
    def embed(wt, tokens, scale, has_scale, out):
        # wt: [tiles, D, TILE], tokens: [M] -> out [M, D] f32, row v of the [V, D] table
        M = tokens.shape[0]
        D = wt.shape[1]
        for m in prange(M):
            t = tokens[m] // TILE
            j = tokens[m] % TILE
            for d in range(D):
                out[m, d] = widen(wt[t, d, j])
            if has_scale:
                s = scale[tokens[m]]
                for d in range(D):
                    out[m, d] = out[m, d] * s

    return embed


_embed_tiles_plain = _make_embed(_widen_i8)  # float32 and int8 both widen by conversion
_embed_tiles_bf16 = _make_embed(_widen_bf16)


class HostBackend:
    """Exact, batch-invariant CPU kernels (see the module docstring for the argument)."""

    name = "host"

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        if w.layout == "tiles":
            return w
        if w.layout != "rows":
            raise ValueError(f"host backend cannot use weight layout {w.layout!r}")
        return LinearWeight(
            fmt=w.fmt,
            data=pack_tiles(w.data),
            scale=w.scale,
            bias=w.bias,
            layout="tiles",
            out_features=w.out_features,
        )

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        # x: [M, K], w: tiles [N / T, K, T] -> [M, N]
        if w.layout != "tiles":
            w = self.prepare_linear(w)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"linear: x has shape {x.shape}, weight expects [M, {w.in_features}]")
        padded = np.empty((x.shape[0], w.data.shape[0] * TILE), np.float32)
        # by weight size alone, so a step and a verify of the same layer take the same path
        parallel = self.parallel and w.data.size >= PARALLEL_MIN_WEIGHT
        kernels = _GEMVS if x.shape[0] == 1 else _GEMMS
        kernels[w.fmt, parallel](x, w.data, padded)
        out = padded[:, : w.out_features]
        has_scale = w.scale is not None
        has_bias = w.bias is not None
        if has_scale or has_bias:
            out = np.ascontiguousarray(out)
            _epilogue(
                out,
                w.scale if has_scale else _EMPTY,
                w.bias if has_bias else _EMPTY,
                has_scale,
                has_bias,
            )
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = np.empty_like(flat)
        _rms_norm(flat, weight, float(eps), out)
        return out.reshape(shape)

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _rope(x, np.ascontiguousarray(positions, dtype=np.int64), inv_freq, out)
        return out

    def attention(self, q, k_cache, v_cache, positions, window, scale):
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty_like(q)
        work = q.shape[0] * q.shape[1] * k_cache.shape[0] * q.shape[2]
        _ATTENTION[self.parallel and work >= PARALLEL_MIN_WORK](
            q,
            k_cache,
            v_cache,
            np.ascontiguousarray(positions, dtype=np.int64),
            int(window),
            np.float32(scale),
            out,
        )
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        out = np.empty_like(gate)
        _silu_mul(gate, up, out)
        return out

    def embed(self, table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        vocab = table.out_features
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary of {vocab}")
        if table.layout == "rows":
            table = self.prepare_linear(table)
        out = np.empty((tokens.shape[0], table.in_features), np.float32)
        has_scale = table.scale is not None
        scale = table.scale if has_scale else _EMPTY
        if table.fmt is WeightFormat.BF16:
            _embed_tiles_bf16(table.data, tokens, scale, has_scale, out)
        else:
            _embed_tiles_plain(table.data, tokens, scale, has_scale, out)
        return out

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return np.argmax(logits, axis=-1)

    # ---------------------------------------------- gemma4 / qwen3_5 (kernels at the end of the file)

    def gelu_tanh_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        up = np.ascontiguousarray(up, dtype=np.float32)
        out = np.empty_like(gate)
        _gelu_tanh_mul(gate, up, out)
        return out

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _sigmoid_mul(x, np.ascontiguousarray(gate, dtype=np.float32), out)
        return out

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _softcap(x, np.float32(cap), out)
        return out

    def l2_norm(self, x: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        _l2_norm(flat, np.float32(eps), out)
        return out.reshape(x.shape)

    def causal_conv1d_silu(self, x: np.ndarray, state: np.ndarray, weight: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, c = x.shape
        taps = weight.shape[1]
        out = np.empty_like(x)
        states = np.empty((m, c, taps - 1), np.float32)
        _causal_conv1d_silu(x, np.ascontiguousarray(state, dtype=np.float32), weight, out, states)
        return out, states

    def gdn_gates(self, a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray):
        a = np.ascontiguousarray(a, dtype=np.float32)
        log_decay = np.empty_like(a)
        beta = np.empty_like(a)
        _gdn_gates(a, np.ascontiguousarray(b, dtype=np.float32), a_log, dt_bias, log_decay, beta)
        return log_decay, beta

    def gated_delta_rule(self, q, k, v, log_decay, beta, state):
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        m, hv, dv = v.shape
        out = np.empty((m, hv, dv), np.float32)
        states = np.empty((m,) + state.shape, np.float32)
        _GATED_DELTA[self.parallel and m * state.size >= PARALLEL_MIN_WORK // 8](
            q, k, v, np.ascontiguousarray(log_decay), np.ascontiguousarray(beta),
            np.ascontiguousarray(state, dtype=np.float32), out, states,
        )
        return out, states

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _gated_rms_norm(x, np.ascontiguousarray(z, dtype=np.float32), weight, np.float32(eps), out)
        return out


_EMPTY = np.zeros(1, np.float32)


def check_batch_invariance(backend, rows: int = 16, k: int = 300, n: int = 136, seed: int = 0) -> list[str]:
    """Run each GEMM format for M = 1..rows and compare row bits with one-row calls.

    Returns a list of failure descriptions (empty when every row of every M matched).
    N is not a multiple of the tile, so a padded tile is exercised too.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w32 = rng.standard_normal((n, k)).astype(np.float32)
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    scale = (np.abs(w32).max(axis=1) / 127).astype(np.float32)
    q = np.clip(np.rint(w32 / scale[:, None]), -127, 127).astype(np.int8)
    bias = rng.standard_normal(n).astype(np.float32)
    weights = [
        LinearWeight(WeightFormat.FP32, w32, None, bias),
        LinearWeight(WeightFormat.BF16, bits),
        LinearWeight(WeightFormat.INT8, q, scale),
    ]
    failures = []
    for w in weights:
        w = backend.prepare_linear(w)
        single = np.concatenate([backend.linear(x[i : i + 1], w) for i in range(rows)])
        for m in range(1, rows + 1):
            got = backend.linear(x[:m], w)
            if not np.array_equal(got.view(np.uint32), single[:m].view(np.uint32)):
                failures.append(f"{w.fmt.value} M={m}")
    return failures


def num_threads() -> int:
    return numba.get_num_threads()


# ------------------------------------------------------------------ gemma4 / qwen3_5 kernels
# Each output element (or each row, or each (row, head)) is computed by one fixed sequence of
# operations that reads only its own row (and, for the recurrent kernels, the state carried
# from the row before), so row i of an M-row call has the bits of a one-row call. Inner loops
# run over one row at a time: where LLVM vectorises them, the split into vector body and tail
# depends on the row length, never on M. Transcendentals are taken in float64 and rounded once.


@njit(cache=True, fastmath=False, nogil=True)
def _gelu_tanh_mul(gate, up, out):
    # gate, up: [M, F] -> gelu_tanh(gate) * up; gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    M, F = gate.shape
    c = math.sqrt(2.0 / math.pi)
    for m in range(M):
        for f in range(F):
            g = np.float64(gate[m, f])
            act = np.float32(0.5 * g * (1.0 + math.tanh(c * (g + 0.044715 * g * g * g))))
            out[m, f] = act * up[m, f]


@njit(cache=True, fastmath=False, nogil=True)
def _sigmoid_mul(x, gate, out):
    # x, gate: [M, F] -> x * sigmoid(gate)
    M, F = x.shape
    for m in range(M):
        for f in range(F):
            s = np.float32(1.0 / (1.0 + math.exp(-np.float64(gate[m, f]))))
            out[m, f] = x[m, f] * s


@njit(cache=True, fastmath=False, nogil=True)
def _softcap(x, cap, out):
    # x: [M, V] -> cap * tanh(x / cap), each op rounded to float32 as the reference does
    M, V = x.shape
    for m in range(M):
        for j in range(V):
            t = x[m, j] / cap
            out[m, j] = np.float32(math.tanh(np.float64(t))) * cap


@njit(cache=True, fastmath=False, nogil=True)
def _l2_norm(x, eps, out):
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
def _causal_conv1d_silu(x, state, w, out, states):
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
def _gdn_gates(a, b, a_log, dt_bias, log_decay, beta):
    # a, b: [M, H] -> log_decay = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b)
    # (softplus as torch's: x above 20 is its own value)
    M, H = a.shape
    for m in range(M):
        for h in range(H):
            t = a[m, h] + dt_bias[h]
            sp = t if t > 20.0 else np.float32(math.log1p(math.exp(np.float64(t))))
            log_decay[m, h] = -np.float32(math.exp(np.float64(a_log[h]))) * sp
            beta[m, h] = np.float32(1.0 / (1.0 + math.exp(-np.float64(b[m, h]))))


def _make_gated_delta(parallel):
    """The gated delta rule, row after row; value heads are independent jobs."""

    @njit(parallel=parallel, cache=True, fastmath=False, nogil=True)
    def gated_delta(q, k, v, log_decay, beta, state, out, states):
        # q, k: [M, HK, DK] (q l2-normed and scaled, k l2-normed); v: [M, HV, DV];
        # log_decay, beta: [M, HV]; state: [HV, DK, DV] before row 0
        # -> out [M, HV, DV], states [M, HV, DK, DV]: the state after each row
        M, HV, DV = v.shape
        HK, DK = q.shape[1], q.shape[2]
        group = HV // HK
        for h in prange(HV):
            kh = h // group
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

    return gated_delta


_GATED_DELTA = {p: _make_gated_delta(p) for p in (False, True)}


@njit(cache=True, fastmath=False, nogil=True)
def _gated_rms_norm(x, z, weight, eps, out):
    # x, z: [R, D] -> weight * (x / sqrt(mean x^2 + eps)) * silu(z), per row
    R, D = x.shape
    for r in range(R):
        inv = _inv_rms(x, r, eps)
        for d in range(D):
            g = z[r, d]
            silu = g / (np.float32(1.0) + np.float32(math.exp(-np.float64(g))))
            out[r, d] = (weight[d] * (x[r, d] * inv)) * silu
