"""The host (CPU) backend: the Backend interface over the C kernels (GEMMs, attention, norms, RoPE, SiLU,
and a whole attention layer in one call: layer.py) and the numba ones (recurrent.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npud.kernels.base import FusedLinear, LinearWeight, WeightFormat
from npud.kernels.host import layer, native, pointwise
from npud.kernels.host.formats import KERNELS, PARALLEL_MIN_BYTES, kernel_for
from npud.kernels.host.native import PARALLEL_MIN_WORK, TILE


def _recurrent():
    """npud/kernels/host/recurrent.py, imported when a model first needs it: it loads numba, which
    a model without those layers (gemma 3, llama, qwen) never does."""
    from npud.kernels.host import recurrent

    return recurrent


class HostBackend:
    """Exact, batch-invariant CPU kernels (npud/kernels/host/__init__.py gives the argument)."""

    name = "host"

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        kernel = kernel_for(w.fmt)
        if w.layout == kernel.layout:
            return w
        if w.layout != "rows":
            raise ValueError(f"host backend cannot use weight layout {w.layout!r} for {w.fmt.value}")
        return kernel.prepare(w)

    def fuse_linears(self, parts: Sequence[LinearWeight]) -> FusedLinear | None:
        """Loaded weights of one input as one prepared weight, each part starting on a tile, so that
        its own weight is a view of the fused tiles and each column's chain is the part's own (the
        padding between parts is zero columns, computed and never read). None (kept apart) unless
        they are at least two loaded weights of one host format and one K, all with or all without
        scales and biases (a bias of +0 would turn a -0 output into +0)."""
        first = parts[0] if parts else None
        if len(parts) < 2 or first.fmt not in KERNELS or any(
            p.layout != "rows" or p.fmt is not first.fmt or p.in_features != first.in_features
            or (p.scale is None) != (first.scale is None) or (p.bias is None) != (first.bias is None)
            for p in parts
        ):
            return None
        padded = [-(-p.out_features // TILE) * TILE for p in parts]
        starts = np.cumsum([0] + padded[:-1]).tolist()
        n, k = sum(padded), first.in_features
        data = np.zeros((n, k), first.data.dtype)
        scale = None if first.scale is None else np.zeros(n, np.float32)
        bias = None if first.bias is None else np.zeros(n, np.float32)
        for p, s in zip(parts, starts):
            for whole, own in ((data, p.data), (scale, p.scale), (bias, p.bias)):
                if whole is not None:
                    whole[s : s + p.out_features] = own
        fused = self.prepare_linear(LinearWeight(first.fmt, data, scale, bias))
        views = tuple(
            LinearWeight(p.fmt, fused.data[s // TILE : (s + width) // TILE],
                         None if scale is None else scale[s : s + p.out_features],
                         None if bias is None else bias[s : s + p.out_features],
                         fused.layout, p.out_features, k)
            for p, s, width in zip(parts, starts, padded)
        )
        return FusedLinear(fused, views, tuple(starts))

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        # x: [M, K], w: [N, K] in its format's layout -> [M, N]
        kernel = kernel_for(w.fmt)
        if w.layout != kernel.layout:
            w = self.prepare_linear(w)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"linear: x has shape {x.shape}, weight expects [M, {w.in_features}]")
        # by weight size alone, so a step and a verify of the same layer split alike (the
        # bits do not depend on the split either way: threads divide columns, never k)
        return kernel.linear(x, w, self.parallel and w.data.nbytes >= PARALLEL_MIN_BYTES)

    def native_linear(self, w: LinearWeight) -> tuple[layer.Linear, tuple] | None:
        """w (prepared) as layer.c's description of its GEMM call and the arrays the call reads, or
        None where layer.c has none for its layout (then the layer is composed)."""
        return layer.describe_linear(w)

    def decoder_layer(self, call) -> tuple[np.ndarray, np.ndarray] | None:
        """An attention layer over every row of a round in one native call (npud.kernels.base.LayerCall;
        layer.py says which layers), with the bits of the per-op calls; None: compose_layer runs it."""
        return layer.decoder_layer(self, call)

    def decoder_stack(self, call) -> tuple[np.ndarray, np.ndarray] | None:
        """Consecutive attention layers (npud.kernels.base.StackCall) in one native call; None: a layer at a time."""
        return layer.decoder_stack(self, call)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        flat = x.reshape(-1, x.shape[-1])
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        return pointwise.rms_norm(flat, weight, float(eps), self.parallel).reshape(x.shape)

    def add_rms_norm(self, x: np.ndarray, delta: np.ndarray, weight: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        delta = np.ascontiguousarray(delta, dtype=np.float32)
        if x.ndim != 2 or delta.shape != x.shape or weight.shape[0] != x.shape[1]:
            raise ValueError(f"add_rms_norm: x {x.shape}, delta {delta.shape}, weight {weight.shape} do not fit")
        return pointwise.add_rms_norm(x, delta, np.ascontiguousarray(weight, dtype=np.float32), eps, self.parallel)

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float32)
        if x.ndim != 3 or 2 * inv_freq.shape[0] > x.shape[2] or positions.shape != (x.shape[0],):
            raise ValueError(f"rope: x {x.shape}, positions {positions.shape}, inv_freq {inv_freq.shape} do not fit")
        return pointwise.rope(x, np.ascontiguousarray(positions, dtype=np.int64), inv_freq, self.parallel)

    def norm_rope(self, x: np.ndarray, weight: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
                  eps: float) -> np.ndarray:
        # x may be the column block of a fused projection's output: its rows are read where they lie
        ld = pointwise.row_stride(x) if x.dtype == np.float32 else None
        if ld is None:
            x = np.ascontiguousarray(x, dtype=np.float32)
            ld = pointwise.row_stride(x)
        inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float32)
        if (x.ndim != 3 or 2 * inv_freq.shape[0] > x.shape[2] or positions.shape != (x.shape[0],)
                or weight.shape != (x.shape[2],)):
            raise ValueError(f"norm_rope: x {x.shape}, weight {weight.shape}, positions {positions.shape}, "
                             f"inv_freq {inv_freq.shape} do not fit")
        return pointwise.norm_rope(x, ld, np.ascontiguousarray(weight, dtype=np.float32), float(eps),
                                   np.ascontiguousarray(positions, dtype=np.int64), inv_freq, self.parallel)

    def attention(self, q, k_cache, v_cache, positions, window, scale):
        # attention.c: one kernel for a decode step, a verify and a prefill chunk
        q = np.ascontiguousarray(q, dtype=np.float32)
        k_cache = np.ascontiguousarray(k_cache, dtype=np.float32)
        v_cache = np.ascontiguousarray(v_cache, dtype=np.float32)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        keys = k_cache.shape[0]
        if positions.size == 1:  # a decode step: one compare, where two numpy reductions cost 2.5 us a layer
            bad = not 0 <= int(positions[0]) < keys
        else:
            bad = positions.size > 0 and (positions.min() < 0 or positions.max() >= keys)
        if bad:
            raise ValueError(f"attention: positions must lie in 0..{keys - 1} (the keys in the cache)")
        work = q.shape[0] * q.shape[1] * k_cache.shape[0] * q.shape[2]
        return native.attention(q, k_cache, v_cache, positions, int(window), float(scale),
                                self.parallel and work >= PARALLEL_MIN_WORK)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._act_mul("silu_mul", pointwise.silu_mul, gate, up)

    def gelu_tanh_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return self._act_mul("gelu_tanh_mul", pointwise.gelu_tanh_mul, gate, up)

    def _act_mul(self, name: str, kernel, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if gate.ndim != 2 or up.shape != gate.shape:
            raise ValueError(f"{name}: gate {gate.shape} and up {up.shape} must be the same [M, F]")
        # the halves of a fused gate/up output are read where they lie
        ld = [pointwise.row_stride(a) if a.dtype == np.float32 else None for a in (gate, up)]
        if None in ld:
            gate = np.ascontiguousarray(gate, dtype=np.float32)
            up = np.ascontiguousarray(up, dtype=np.float32)
            ld = [gate.shape[1], up.shape[1]]
        return kernel(gate, up, self.parallel, *ld)

    def embed(self, table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        vocab = table.out_features
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary of {vocab}")
        table = self.prepare_linear(table)
        return kernel_for(table.fmt).embed(table, tokens)

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return np.argmax(logits, axis=-1)

    # ---------------------------------------------- gemma4 / qwen3_5 (npud/kernels/host/recurrent.py)

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _recurrent().sigmoid_mul(x, np.ascontiguousarray(gate, dtype=np.float32), out)
        return out

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _recurrent().softcap(x, np.float32(cap), out)
        return out

    def l2_norm(self, x: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        _recurrent().l2_norm(flat, np.float32(eps), out)
        return out.reshape(x.shape)

    def causal_conv1d_silu(self, x: np.ndarray, state: np.ndarray, weight: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, c = x.shape
        taps = weight.shape[1]
        out = np.empty_like(x)
        states = np.empty((m, c, taps - 1), np.float32)
        _recurrent().causal_conv1d_silu(x, np.ascontiguousarray(state, dtype=np.float32), weight, out, states)
        return out, states

    def gdn_gates(self, a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray):
        a = np.ascontiguousarray(a, dtype=np.float32)
        log_decay = np.empty_like(a)
        beta = np.empty_like(a)
        _recurrent().gdn_gates(a, np.ascontiguousarray(b, dtype=np.float32), a_log, dt_bias, log_decay, beta)
        return log_decay, beta

    def gated_delta_rule(self, q, k, v, log_decay, beta, state):
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        m, hv, dv = v.shape
        out = np.empty((m, hv, dv), np.float32)
        states = np.empty((m,) + state.shape, np.float32)
        _recurrent().gated_delta(self.parallel and m * state.size >= PARALLEL_MIN_WORK // 8)(
            q, k, v, np.ascontiguousarray(log_decay), np.ascontiguousarray(beta),
            np.ascontiguousarray(state, dtype=np.float32), out, states,
        )
        return out, states

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        _recurrent().gated_rms_norm(x, np.ascontiguousarray(z, dtype=np.float32), weight, np.float32(eps), out)
        return out


__all__ = ["HostBackend", "WeightFormat"]
