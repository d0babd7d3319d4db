"""config.json of Gemma 3 (text) read into npud.engine.config's dataclasses.

Follows transformers (5.x) configuration_gemma3.py / modeling_gemma3.py, defaults included:
sliding and full layers from `layer_types` (else every `sliding_window_pattern`-th layer,
6 by default, is full), RoPE per layer type (`rope_parameters` keyed by layer type, or the
legacy rope_theta / rope_local_base_freq / rope_scaling, where the scaling applies to the
full layers), attention scaled by query_pre_attn_scalar ** -0.5, q/k RMS norms, the four
norms per layer, norms that scale by (1 + weight), embeddings times sqrt(hidden_size),
GELU-tanh MLP. The multimodal wrapper `gemma3` is read through its `text_config`; only
its language model (tensors under `model.language_model.`) is served.
"""

from __future__ import annotations

from npud.engine.config.reader import _Reader
from npud.engine.config.specs import ACTIVATIONS, AttentionKind, LayerSpec, ModelConfig, RopeSpec

GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")

_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
_THETA = {AttentionKind.FULL: ("rope_theta", 1_000_000.0), AttentionKind.SLIDING: ("rope_local_base_freq", 10_000.0)}


def parse_gemma3(r: _Reader, model_type: str, prefix: str, common: dict) -> ModelConfig:
    """Returns the ModelConfig of a gemma3_text config (r: the text config's reader, prefix:
    where its tensors sit, common: the special-token and dtype fields). Raises ConfigError."""
    merged = dict(_DEFAULTS)
    merged.update(r.raw)
    r = _Reader(merged, r.source)
    if r.bool_("use_bidirectional_attention", False):
        raise r.error("use_bidirectional_attention", True, "only causal attention is supported")
    if r.raw.get("attn_logit_softcapping") is not None:
        raise r.error("attn_logit_softcapping", r.raw["attn_logit_softcapping"], "attention logit soft-capping is not supported")
    activation = r.str_("hidden_activation")
    if activation not in ACTIVATIONS:
        raise r.error("hidden_activation", activation, f"is not supported; expected one of {list(ACTIVATIONS)}")
    num_layers = r.int_("num_hidden_layers")
    num_heads = r.int_("num_attention_heads")
    num_kv_heads = r.int_("num_key_value_heads")
    if num_heads % num_kv_heads:
        raise r.error("num_key_value_heads", num_kv_heads, f"does not divide num_attention_heads ({num_heads})")
    head_dim = r.int_("head_dim")
    if head_dim % 2:
        raise r.error("head_dim", head_dim, "must be even for rotary embeddings")
    hidden_size = r.int_("hidden_size")
    max_position = r.int_("max_position_embeddings")
    pattern = r.int_("sliding_window_pattern", default=6)
    types = r.raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise r.error("layer_types", types, f"must be a list of {num_layers} layer types")
    kinds = []
    for i, name in enumerate(types):
        if name not in (AttentionKind.FULL.value, AttentionKind.SLIDING.value):
            raise r.error(f"layer_types[{i}]", name, "is not supported; expected 'full_attention' or 'sliding_attention'")
        kinds.append(AttentionKind(name))
    window = r.int_("sliding_window")
    ropes = {kind: _rope(r, kind, head_dim, max_position) for kind in set(kinds)}
    scale = r.float_("query_pre_attn_scalar") ** -0.5
    layers = tuple(
        LayerSpec(index=i, kind=kind, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  window=window if kind is AttentionKind.SLIDING else 0, kv_owner=i, rope=ropes[kind],
                  attention_scale=scale)
        for i, kind in enumerate(kinds)
    )
    attention_bias = r.bool_("attention_bias", False)
    return ModelConfig(
        model_type=model_type, vocab_size=r.int_("vocab_size"), hidden_size=hidden_size,
        intermediate_size=r.int_("intermediate_size"), layers=layers, rms_norm_eps=r.float_("rms_norm_eps"),
        qk_norm=True, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True), max_position_embeddings=max_position,
        hidden_act=activation, weight_prefix=prefix, norm_weight_offset=1.0, embed_scale=hidden_size**0.5,
        sandwich_norms=True, final_logit_softcapping=r.float_("final_logit_softcapping", default=None), **common,
    )


def _rope(r: _Reader, kind: AttentionKind, head_dim: int, max_position: int) -> RopeSpec:
    """The RoPE of one layer type: rope_parameters[kind] or the legacy fields."""
    params = r.raw.get("rope_parameters")
    theta_field, theta_default = _THETA[kind]
    if params is not None and not isinstance(params, dict):
        raise r.error("rope_parameters", params, "must be an object")
    if params and kind.value in params:
        sub_params = params[kind.value]
        field = f"rope_parameters.{kind.value}"
        if not isinstance(sub_params, dict):
            raise r.error(field, sub_params, "must be an object")
    elif params and any(k in params for k in ("rope_type", "rope_theta", "type")):
        # one set of parameters for every layer type is not what transformers' Gemma 3 reads
        raise r.error("rope_parameters", params, "must be keyed by layer type for gemma3")
    else:
        sub_params = dict(r.raw.get("rope_scaling") or {}) if kind is AttentionKind.FULL else {}
        field = "rope_scaling"
    sub = _Reader(sub_params, f"{r.source}: {field}")
    theta = sub.float_("rope_theta", default=None)
    if theta is None:
        theta = r.float_(theta_field, default=theta_default)
    rope_type = sub_params.get("rope_type", sub_params.get("type", "default"))
    if rope_type == "default":
        return RopeSpec(theta=theta, rotary_dim=head_dim, original_max_position=max_position)
    if rope_type == "linear":
        return RopeSpec(theta=theta, rotary_dim=head_dim, scaling="linear", factor=sub.float_("factor"),
                        original_max_position=max_position)
    raise sub.error("rope_type", rope_type, "is not supported for gemma3; expected 'default' or 'linear'")
