"""Gemma 4 and Qwen3.5 tensors: which ones a checkpoint must hold, and how they load.

Names are transformers' (Gemma4ForCausalLM, Qwen3_5ForCausalLM) under `cfg.weight_prefix`
("model." for the text checkpoints, "model.language_model." for the multimodal ones, whose
vision and audio towers are not read). Done once at load time, never in the forward:
- Qwen3.5's norms scale by (1 + weight): the 1 is added here in float32, as transformers does
  it in the forward, so the forward runs one RMS-norm form for every model;
- Qwen3.5's q_proj interleaves each head's query and output gate rows; they are split into
  two linears (a row split changes no bits of any output element);
- Gemma4's value norm has no weight: it is stored as ones, and x * 1.0 is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from npud.engine.config import AttentionKind, ModelConfig
from npud.engine.weights.checkpoint import TensorRef
from npud.engine.weights.convert import _convert_matrix, _vector
from npud.engine.weights.layout import AttentionWeights, LayerWeights, LinearAttentionWeights, MlpWeights, ModelWeights
from npud.kernels.base import LinearWeight, WeightFormat



def expected_hybrid_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Returns the tensor names a gemma4 / qwen3_5 model needs with their shapes."""
    d, v, pre = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    out: dict[str, tuple[int, ...]] = {f"{pre}embed_tokens.weight": (v, d), f"{pre}norm.weight": (d,)}
    ple = cfg.per_layer_input_size
    for spec in cfg.layers:
        p = f"{pre}layers.{spec.index}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if cfg.layer_scalar:
            out[f"{p}layer_scalar"] = (1,)
        for name in norms:
            out[f"{p}{name}.weight"] = (d,)
        f = cfg.mlp_width(spec)
        for proj, n, k in (("gate", f, d), ("up", f, d), ("down", d, f)):
            out[f"{p}mlp.{proj}_proj.weight"] = (n, k)
        if ple:
            out[f"{p}per_layer_input_gate.weight"] = (ple, d)
            out[f"{p}per_layer_projection.weight"] = (d, ple)
            out[f"{p}post_per_layer_input_norm.weight"] = (d,)
        if spec.kind is AttentionKind.LINEAR:
            g = spec.linear
            a = f"{p}linear_attn."
            out.update({
                f"{a}in_proj_qkv.weight": (g.conv_dim, d), f"{a}in_proj_z.weight": (g.value_dim, d),
                f"{a}in_proj_b.weight": (g.num_value_heads, d), f"{a}in_proj_a.weight": (g.num_value_heads, d),
                f"{a}conv1d.weight": (g.conv_dim, 1, g.conv_kernel), f"{a}dt_bias": (g.num_value_heads,),
                f"{a}A_log": (g.num_value_heads,), f"{a}norm.weight": (g.value_head_dim,),
                f"{a}out_proj.weight": (d, g.value_dim),
            })
            continue
        a = f"{p}self_attn."
        q_rows = spec.num_heads * spec.head_dim * (2 if cfg.attn_output_gate else 1)
        projs = [("q", q_rows, d), ("o", d, spec.num_heads * spec.head_dim)]
        if spec.owns_kv:
            projs.append(("k", spec.kv_width, d))
            if not spec.k_eq_v:
                projs.append(("v", spec.kv_width, d))
            out[f"{a}k_norm.weight"] = (spec.head_dim,)
        out[f"{a}q_norm.weight"] = (spec.head_dim,)
        for proj, n, k in projs:
            out[f"{a}{proj}_proj.weight"] = (n, k)
            if cfg.o_bias if proj == "o" else cfg.qkv_bias:
                out[f"{a}{proj}_proj.bias"] = (n,)
    if ple:
        n = cfg.num_layers * ple
        out[f"{pre}embed_tokens_per_layer.weight"] = (cfg.per_layer_vocab_size, n)
        out[f"{pre}per_layer_model_projection.weight"] = (n, d)
        out[f"{pre}per_layer_projection_norm.weight"] = (ple,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def load_hybrid_weights(cfg: ModelConfig, refs: dict[str, TensorRef], fmt: WeightFormat, fingerprint: str) -> ModelWeights:
    """Returns the weights of a gemma4 / qwen3_5 model whose tensors were checked already."""
    pre = cfg.weight_prefix
    offset = np.float32(cfg.norm_weight_offset)

    def linear(name: str, has_bias: bool = False) -> LinearWeight:
        data, scale = _convert_matrix(refs[f"{name}.weight"], fmt)
        bias = _vector(refs[f"{name}.bias"]) if has_bias else None
        return LinearWeight(fmt=fmt, data=data, scale=scale, bias=bias)

    def norm(name: str) -> np.ndarray:
        w = _vector(refs[f"{name}.weight"])
        return w + offset if offset else w

    layers = [_layer(cfg, spec, f"{pre}layers.{spec.index}.", refs, linear, norm) for spec in cfg.layers]
    embed = linear(f"{pre}embed_tokens")
    extra: dict[str, Any] = {}
    if cfg.per_layer_input_size:
        extra = dict(
            embed_per_layer=linear(f"{pre}embed_tokens_per_layer"),
            per_layer_model_projection=linear(f"{pre}per_layer_model_projection"),
            per_layer_projection_norm=norm(f"{pre}per_layer_projection_norm"),
        )
    return ModelWeights(
        embed=embed, layers=layers, final_norm=norm(f"{pre}norm"),
        lm_head=embed if cfg.tie_word_embeddings else linear("lm_head"), fingerprint=fingerprint, **extra,
    )


def _layer(cfg: ModelConfig, spec, p: str, refs, linear, norm) -> LayerWeights:
    mlp = MlpWeights(gate=linear(f"{p}mlp.gate_proj"), up=linear(f"{p}mlp.up_proj"), down=linear(f"{p}mlp.down_proj"))
    attn, gdn = None, None
    if spec.kind is AttentionKind.LINEAR:
        a = f"{p}linear_attn."
        conv = _vector(refs[f"{a}conv1d.weight"])
        gdn = LinearAttentionWeights(
            in_qkv=linear(f"{a}in_proj_qkv"), in_z=linear(f"{a}in_proj_z"), in_b=linear(f"{a}in_proj_b"),
            in_a=linear(f"{a}in_proj_a"), conv=np.ascontiguousarray(conv.reshape(conv.shape[0], conv.shape[2])),
            dt_bias=_vector(refs[f"{a}dt_bias"]), a_log=_vector(refs[f"{a}A_log"]),
            norm=_vector(refs[f"{a}norm.weight"]), out=linear(f"{a}out_proj"),
        )
    else:
        a = f"{p}self_attn."
        q, gate = linear(f"{a}q_proj", cfg.qkv_bias), None
        if cfg.attn_output_gate:
            q, gate = _split_query_gate(q, spec.num_heads, spec.head_dim)
        k = linear(f"{a}k_proj", cfg.qkv_bias) if spec.owns_kv else None
        v = linear(f"{a}v_proj", cfg.qkv_bias) if spec.owns_kv and not spec.k_eq_v else None
        attn = AttentionWeights(
            q=q, k=k, v=v, o=linear(f"{a}o_proj", cfg.o_bias), q_norm=norm(f"{a}q_norm"),
            k_norm=norm(f"{a}k_norm") if spec.owns_kv else None,
            v_norm=np.ones(spec.head_dim, np.float32) if cfg.v_norm and spec.owns_kv else None, gate=gate,
        )
    extra: dict[str, Any] = {}
    if cfg.sandwich_norms:
        extra.update(pre_feedforward_norm=norm(f"{p}pre_feedforward_layernorm"),
                     post_feedforward_norm=norm(f"{p}post_feedforward_layernorm"))
    if cfg.layer_scalar:
        extra["layer_scalar"] = _vector(refs[f"{p}layer_scalar"])
    if cfg.per_layer_input_size:
        extra.update(per_layer_gate=linear(f"{p}per_layer_input_gate"),
                     per_layer_projection=linear(f"{p}per_layer_projection"),
                     post_per_layer_norm=norm(f"{p}post_per_layer_input_norm"))
    return LayerWeights(input_norm=norm(f"{p}input_layernorm"), attn=attn,
                        post_attention_norm=norm(f"{p}post_attention_layernorm"), mlp=mlp, linear_attn=gdn, **extra)


def _split_query_gate(w: LinearWeight, num_heads: int, head_dim: int) -> tuple[LinearWeight, LinearWeight]:
    """q_proj rows are [head 0 query, head 0 gate, head 1 query, ...], head_dim rows each."""
    rows = np.arange(num_heads * 2 * head_dim).reshape(num_heads, 2, head_dim)
    parts = []
    for half in (0, 1):
        idx = rows[:, half, :].reshape(-1)
        parts.append(LinearWeight(
            fmt=w.fmt, data=np.ascontiguousarray(w.data[idx]),
            scale=None if w.scale is None else np.ascontiguousarray(w.scale[idx]),
            bias=None if w.bias is None else np.ascontiguousarray(w.bias[idx]),
        ))
    return parts[0], parts[1]
