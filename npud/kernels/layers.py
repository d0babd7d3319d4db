"""One call per layer: the layer-group interface a backend may offer beside its per-op kernels.

A decode round runs each layer over all rows of the round (every sequence's rows, contiguous
and in order). Between a layer's attention and the next layer's, everything is GEMMs and
row-wise host kernels with no state of its own: the output projection, the residual add and
norms, the MLP, and the next layer's input norm and q/k/v projections (after the last layer,
the final norm and the LM head). A backend whose GEMMs sit behind a process boundary (the NPU
worker, npud/kernels/xrt_worker.py) runs that whole stretch in one call, and the first layer's
projections (`begin`) beside the embedding on the host, so a decode step costs one round trip per
layer instead of one per linear.
The attention itself (RoPE, the KV planes, the per-sequence attention) stays with the engine,
which owns the state.

The shape of a call, for layer i of L, with M rows (all the round's rows, as the engine packs
them):

    begin(x [M, D]) -> (q, k, v) of layer 0                      # input norm, projections
    step(i, attn [M, H*Dh], x [M, D], picked) ->
        i < L - 1: (x' [M, D], (q, k, v) of layer i + 1)           # the residual after layer i
        i = L - 1: (x' [M, D], final [M, D], logits [len(picked), V])

where `attn` is layer i's attention output before its output projection, `x` the residual
stream entering layer i, `final` the normed hidden rows (speculation reads them) and `picked`
the rows whose logits the round asks for. Every row's bits are those of the per-op path: the
same GEMM designs, the same host kernels, in the same order (LayerGroupSpec says which). A host
backend could offer the same call as one native call per layer; the engine sees only this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(slots=True, frozen=True)
class LayerSpecRows:
    """One layer's row-wise weights (norm vectors, float32 [D]) and its linears' biases."""

    input_norm: np.ndarray
    post_attention_norm: np.ndarray
    pre_feedforward_norm: np.ndarray | None = None  # sandwich norms (gemma 3): both or neither
    post_feedforward_norm: np.ndarray | None = None
    biases: tuple[tuple[str, np.ndarray], ...] = ()  # (linear, [N]) for the linears that have one


@dataclass(slots=True, frozen=True)
class LayerGroupSpec:
    """What a layer-group call computes between two attentions, model-wide."""

    layers: tuple[LayerSpecRows, ...]
    final_norm: np.ndarray
    eps: float
    act: str  # "silu" or "gelu_tanh": act(gate) * up
    sandwich: bool  # x += norm(o(attn)); h = norm(x); x += norm(mlp(h)) (else add-and-norm, the add deferred)


# (layer, linear names or ("lm_head",), x) -> each x @ W.T + bias: linears of one input, which a
# device may run together (queued, one wait)
Linears = Callable[[int, tuple[str, ...], np.ndarray], tuple[np.ndarray, ...]]


def begin(spec: LayerGroupSpec, host, linears: Linears, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Layer 0's q, k, v from the embedded rows x [M, D]."""
    h = host.rms_norm(x, spec.layers[0].input_norm, spec.eps)
    return linears(0, ("q", "k", "v"), h)


def step(spec: LayerGroupSpec, host, linears: Linears, i: int, attn: np.ndarray, x: np.ndarray,
         picked: np.ndarray) -> tuple:
    """Layer i from its attention output to the next layer's projections (the module docstring)."""
    layer, eps = spec.layers[i], spec.eps
    (mixed,) = linears(i, ("o",), attn)
    if spec.sandwich:
        x = x + host.rms_norm(mixed, layer.post_attention_norm, eps)
        h = host.rms_norm(x, layer.pre_feedforward_norm, eps)
        x = x + host.rms_norm(_mlp(spec, host, linears, i, h), layer.post_feedforward_norm, eps)
        delta = None
    else:
        x, h = host.add_rms_norm(x, mixed, layer.post_attention_norm, eps)
        delta = _mlp(spec, host, linears, i, h)  # added by the next norm, which does the add too
    last = i == len(spec.layers) - 1
    norm = spec.final_norm if last else spec.layers[i + 1].input_norm
    if delta is None:
        h = host.rms_norm(x, norm, eps)
    else:
        x, h = host.add_rms_norm(x, delta, norm, eps)
    if not last:
        return x, linears(i + 1, ("q", "k", "v"), h)
    rows = h if len(picked) == h.shape[0] else h[picked]
    logits = linears(i, ("lm_head",), rows)[0] if len(picked) else np.empty((0, 0), np.float32)
    return x, h, logits


def _mlp(spec: LayerGroupSpec, host, linears: Linears, i: int, h: np.ndarray) -> np.ndarray:
    gate, up = linears(i, ("gate", "up"), h)
    act = host.silu_mul(gate, up) if spec.act == "silu" else host.gelu_tanh_mul(gate, up)
    return linears(i, ("down",), act)[0]
