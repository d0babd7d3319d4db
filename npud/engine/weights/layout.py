"""The weights dataclasses the forward pass reads: attention, MLP, gated delta net, layer, model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from npud.kernels.base import Backend, FusedLinear, LinearWeight, fuse_linears


@dataclass(slots=True)
class AttentionWeights:
    q: LinearWeight
    k: LinearWeight | None  # None on a KV-shared layer (gemma4): it reads its owner's rows
    v: LinearWeight | None  # None on a KV-shared layer and where the values are the keys (k_eq_v)
    o: LinearWeight
    q_norm: np.ndarray | None  # float32 [head_dim], qwen3
    k_norm: np.ndarray | None
    v_norm: np.ndarray | None = None  # gemma4: ones [head_dim], an RMS norm without a weight of its own
    gate: LinearWeight | None = None  # qwen3_5: the gate half of q_proj, [num_heads * head_dim, D]
    qkv: FusedLinear | None = None  # q, k, v (and gate) in one weight where the backend fuses them


@dataclass(slots=True)
class MlpWeights:
    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight
    gate_up: FusedLinear | None = None  # gate and up in one weight where the backend fuses them


@dataclass(slots=True)
class LinearAttentionWeights:
    """A gated delta net layer (qwen3_5), geometry in npud.engine.config.LinearSpec."""

    in_qkv: LinearWeight  # [conv_dim, D]
    in_z: LinearWeight  # [value_dim, D], the output gate
    in_b: LinearWeight  # [value heads, D], beta = sigmoid(b)
    in_a: LinearWeight  # [value heads, D], the decay's input
    conv: np.ndarray  # float32 [conv_dim, conv_kernel], depthwise
    dt_bias: np.ndarray  # float32 [value heads]
    a_log: np.ndarray  # float32 [value heads]: decay = exp(-exp(a_log) * softplus(a + dt_bias))
    norm: np.ndarray  # float32 [value_head_dim], the gated RMS norm's weight
    out: LinearWeight  # [D, value_dim]


@dataclass(slots=True)
class LayerWeights:
    input_norm: np.ndarray  # float32 [D]
    attn: AttentionWeights | None  # None on a linear-attention layer
    post_attention_norm: np.ndarray  # float32 [D]; gemma4: the norm of the attention output
    mlp: MlpWeights
    linear_attn: LinearAttentionWeights | None = None
    pre_feedforward_norm: np.ndarray | None = None  # gemma4
    post_feedforward_norm: np.ndarray | None = None  # gemma4
    per_layer_gate: LinearWeight | None = None  # gemma4 PLE: [P, D]
    per_layer_projection: LinearWeight | None = None  # gemma4 PLE: [D, P]
    post_per_layer_norm: np.ndarray | None = None  # gemma4 PLE: [D]
    layer_scalar: np.ndarray | None = None  # gemma4: float32 [1]


@dataclass(slots=True)
class ModelWeights:
    embed: LinearWeight  # [V, D] in the chosen format
    layers: list[LayerWeights]
    final_norm: np.ndarray  # float32 [D]
    lm_head: LinearWeight  # the same object as embed when tied
    fingerprint: str
    embed_per_layer: LinearWeight | None = None  # gemma4 PLE: [per-layer vocab, layers * P]
    per_layer_model_projection: LinearWeight | None = None  # gemma4 PLE: [layers * P, D]
    per_layer_projection_norm: np.ndarray | None = None  # gemma4 PLE: [P]

    @property
    def nbytes(self) -> int:
        """Bytes held by all arrays; a tied lm_head is counted once."""
        seen: set[int] = set()
        total = 0
        for obj in weight_arrays(self):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.nbytes
        return total


def weight_arrays(obj):
    """Every LinearWeight and ndarray held by a weights dataclass (or list of them), depth first.
    A FusedLinear's weight is not among them: the layer's own fields hold its parts (views of
    it), which count the same bytes."""
    if isinstance(obj, (LinearWeight, np.ndarray)):
        yield obj
    elif isinstance(obj, FusedLinear):
        return
    elif isinstance(obj, list):
        for item in obj:
            yield from weight_arrays(item)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from weight_arrays(getattr(obj, f.name))



def fuse_projections(weights: ModelWeights, backend: Backend) -> ModelWeights:
    """`weights` (as loaded) with each layer's q, k, v (and qwen3_5's output gate) and its MLP's gate
    and up as one weight where `backend` fuses them (npud.kernels.base.fuse_linears): the layer's own
    fields become the parts, views into the fused weight. A layer without its own k and v (KV-shared,
    or values that are the keys) keeps its projections apart."""
    layers = []
    for lw in weights.layers:
        attn, mlp = lw.attn, lw.mlp
        if attn is not None and attn.k is not None and attn.v is not None:
            names = ("q", "k", "v") + (("gate",) if attn.gate is not None else ())
            fused = fuse_linears(backend, [getattr(attn, name) for name in names])
            if fused is not None:
                attn = dataclasses.replace(attn, qkv=fused, **dict(zip(names, fused.parts)))
        fused = fuse_linears(backend, [mlp.gate, mlp.up])
        if fused is not None:
            mlp = dataclasses.replace(mlp, gate=fused.parts[0], up=fused.parts[1], gate_up=fused)
        layers.append(dataclasses.replace(lw, attn=attn, mlp=mlp))
    return dataclasses.replace(weights, layers=layers)


def prepare_linears(weights, backend: Backend, keep: tuple[LinearWeight, ...] = ()):
    """`weights` (a weights dataclass, list or value) with every LinearWeight laid out for
    `backend` once: a weight held twice (a tied head) stays one object, and those in `keep`
    stay as they are."""
    seen: dict[int, LinearWeight] = {id(w): w for w in keep}

    def prep(obj):
        if isinstance(obj, LinearWeight):
            if id(obj) not in seen:
                seen[id(obj)] = backend.prepare_linear(obj)
            return seen[id(obj)]
        if isinstance(obj, list):
            return [prep(item) for item in obj]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: prep(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
        return obj

    return prep(weights)
