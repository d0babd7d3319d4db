"""config.json of Gemma 4 and Qwen3.5 (text; Gemma 3 in npud/engine/config/gemma3.py) read into npud.engine.config's dataclasses.

What each field does follows transformers (5.x): configuration_gemma4.py / modeling_gemma4.py
and configuration_qwen3_5.py / modeling_qwen3_5.py, including their defaults for fields a
config.json leaves out. The multimodal wrappers (`gemma4`, `qwen3_5`) are read through their
`text_config`, and their language model's tensors sit under `model.language_model.`; only
the text model is served (token ids in, logits out; no vision or audio tower is loaded).
A field that would change the computation in a way the forward does not implement (a MoE
block, bidirectional attention, another RoPE type, an unknown per-layer override) is a
ConfigError naming it.
"""

from __future__ import annotations

from typing import Any

from npud.engine.config.reader import _dtype, _Reader, _rope_params, _special_tokens
from npud.engine.config.specs import ACTIVATIONS, AttentionKind, LayerSpec, LinearSpec, ModelConfig, RopeSpec

_WRAPPERS = {"gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text", "gemma3": "gemma3_text"}
_TEXT_PREFIX = "model."
_WRAPPED_PREFIX = "model.language_model."


def parse_hybrid_config(raw: dict, generation_config: dict | None, source: str) -> ModelConfig:
    """Returns the ModelConfig of a gemma4 / gemma4_text / qwen3_5 / qwen3_5_text config.json dict.

    Raises ConfigError naming the source, field and value of the first problem.
    """
    top = _Reader(raw, source)
    model_type = top.str_("model_type")
    text_type = _WRAPPERS.get(model_type, model_type)
    prefix = _TEXT_PREFIX
    r = top
    if model_type in _WRAPPERS:
        text = raw.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, dict):
            raise top.error("text_config", text, "must be an object")
        inner = text.get("model_type", text_type)
        if inner != text_type:
            raise top.error("text_config.model_type", inner, f"must be {text_type!r} in a {model_type!r} config")
        # special tokens and tying may sit on the wrapper; the text config's own values come second
        merged = {**text, **{k: v for k, v in raw.items() if k != "text_config" and v is not None
                             and k in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings",
                                       "dtype", "torch_dtype")}}
        r = _Reader(merged, f"{source}: text_config")
        prefix = _WRAPPED_PREFIX
    if text_type == "gemma3_text":
        from npud.engine.config.gemma3 import parse_gemma3

        return parse_gemma3(r, model_type, prefix, _common(r, generation_config))
    if text_type == "gemma4_text":
        return _gemma4(r, model_type, prefix, generation_config)
    return _qwen3_5(r, model_type, prefix, generation_config)


def _layer_types(r: _Reader, num_layers: int, allowed: tuple[str, ...], default: list[str]) -> list[AttentionKind]:
    types = r.raw.get("layer_types")
    if types is None:
        types = default
    if not isinstance(types, list) or len(types) != num_layers:
        raise r.error("layer_types", types, f"must be a list of {num_layers} layer types")
    for i, name in enumerate(types):
        if name not in allowed:
            raise r.error(f"layer_types[{i}]", name, f"is not supported for this model type; expected one of {list(allowed)}")
    return [AttentionKind(name) for name in types]


def _common(r: _Reader, generation_config: dict | None) -> dict[str, Any]:
    eos, bos, pad = _special_tokens(r, generation_config)
    return dict(eos_token_ids=tuple(eos), bos_token_id=bos, pad_token_id=pad, torch_dtype=_dtype(r))


def _defaults(r: _Reader, defaults: dict[str, Any]) -> _Reader:
    """A reader that sees transformers' class defaults where the config leaves a field out."""
    merged = dict(defaults)
    merged.update(r.raw)  # an explicit null stays null (bos_token_id: null is no BOS)
    return _Reader(merged, r.source)


# ---------------------------------------------------------------------------------- Gemma 4

_GEMMA4_DEFAULTS = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "sliding_window": 512, "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
}
_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def _gemma4(r: _Reader, model_type: str, prefix: str, generation_config: dict | None) -> ModelConfig:
    r = _defaults(r, _GEMMA4_DEFAULTS)
    if r.bool_("enable_moe_block", False):
        raise r.error("enable_moe_block", True, "MoE blocks are not supported")
    bidirectional = r.raw.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        # "vision" only changes attention among image tokens, which a text-only model never sees
        raise r.error("use_bidirectional_attention", bidirectional, "only causal attention (null or 'vision') is supported")
    activation = r.str_("hidden_activation")
    if activation not in ACTIVATIONS:
        raise r.error("hidden_activation", activation, f"is not supported; expected one of {list(ACTIVATIONS)}")

    vocab_size = r.int_("vocab_size")
    hidden_size = r.int_("hidden_size")
    intermediate_size = r.int_("intermediate_size")
    num_layers = r.int_("num_hidden_layers")
    num_heads = r.int_("num_attention_heads")
    num_kv_heads = r.int_("num_key_value_heads", default=4)
    head_dim = r.int_("head_dim")
    k_eq_v = r.bool_("attention_k_eq_v", False)

    default_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    kinds = _layer_types(r, num_layers, ("sliding_attention", "full_attention"), default_types)
    kinds[-1] = AttentionKind.FULL  # transformers forces the last layer to full attention
    window = r.int_("sliding_window")

    per_layer = _gemma4_per_layer(r, kinds, k_eq_v, head_dim, num_kv_heads)
    ropes = _gemma4_ropes(r, kinds, per_layer, r.int_("max_position_embeddings"))

    shared = r.int_("num_kv_shared_layers", default=0, minimum=0)
    owners = _gemma4_kv_owners(r, kinds, shared)
    double_wide = r.bool_("use_double_wide_mlp", False)

    layers = []
    for i, kind in enumerate(kinds):
        dim, kv_heads = per_layer[i]
        if num_heads % kv_heads:
            raise r.error("num_key_value_heads", kv_heads, f"(layer {i}) does not divide num_attention_heads ({num_heads})")
        if dim % 2:
            raise r.error("head_dim", dim, f"(layer {i}) must be even for rotary embeddings")
        layers.append(LayerSpec(
            index=i, kind=kind, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=dim,
            window=window if kind is AttentionKind.SLIDING else 0, kv_owner=owners[i], rope=ropes[kind],
            intermediate_size=2 * intermediate_size if double_wide and owners[i] != i else 0,
            k_eq_v=k_eq_v and kind is AttentionKind.FULL, attention_scale=1.0,
        ))

    ple = r.int_("hidden_size_per_layer_input", default=0, minimum=0)  # 0 or null: no per-layer inputs
    ple_vocab = r.int_("vocab_size_per_layer_input") if ple else 0
    softcap = r.float_("final_logit_softcapping", default=None)
    attention_bias = r.bool_("attention_bias", False)
    return ModelConfig(
        model_type=model_type, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, layers=tuple(layers), rms_norm_eps=r.float_("rms_norm_eps"),
        qk_norm=True, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
        tie_word_embeddings=r.bool_("tie_word_embeddings", True),
        max_position_embeddings=r.int_("max_position_embeddings"), hidden_act=activation,
        weight_prefix=prefix, embed_scale=hidden_size**0.5, sandwich_norms=True, v_norm=True, layer_scalar=True,
        per_layer_input_size=ple, per_layer_vocab_size=ple_vocab, final_logit_softcapping=softcap,
        **_common(r, generation_config),
    )


def _gemma4_per_layer(
    r: _Reader, kinds: list[AttentionKind], k_eq_v: bool, head_dim: int, num_kv_heads: int
) -> list[tuple[int, int]]:
    """(head_dim, num_key_value_heads) per layer, from per_layer_config or global_head_dim."""
    overrides = r.raw.get("per_layer_config")
    if overrides is None:
        # what Gemma4TextConfig builds when the config has no per_layer_config
        global_dim = r.int_("global_head_dim", default=512)
        global_kv = r.int_("num_global_key_value_heads", default=None) if k_eq_v else None
        overrides = {
            str(i): {"head_dim": global_dim, **({"num_key_value_heads": global_kv} if global_kv else {})}
            for i, kind in enumerate(kinds) if kind is AttentionKind.FULL
        }
    if not isinstance(overrides, dict):
        raise r.error("per_layer_config", overrides, "must be an object of layer index -> overrides")
    out = [(head_dim, num_kv_heads)] * len(kinds)
    for key, values in overrides.items():
        field = f"per_layer_config[{key!r}]"
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise r.error(field, values, "the key must be a layer index") from None
        if not 0 <= i < len(kinds):
            raise r.error(field, values, f"layer index outside 0..{len(kinds) - 1}")
        if not isinstance(values, dict):
            raise r.error(field, values, "must be an object")
        for name in values:
            if name not in _PER_LAYER_FIELDS:
                raise r.error(f"{field}.{name}", values[name], f"per-layer overrides of {name!r} are not supported")
        sub = _Reader(values, f"{r.source}: {field}")
        out[i] = (sub.int_("head_dim", default=head_dim), sub.int_("num_key_value_heads", default=num_kv_heads))
    return out


def _gemma4_ropes(
    r: _Reader, kinds: list[AttentionKind], per_layer: list[tuple[int, int]], max_position: int
) -> dict[AttentionKind, RopeSpec]:
    params = r.raw.get("rope_parameters")
    if params is None:
        params = _GEMMA4_ROPE
    if not isinstance(params, dict):
        raise r.error("rope_parameters", params, "must be an object keyed by layer type")
    out = {}
    for kind in sorted(set(kinds), key=lambda k: k.value):
        sub_params = params.get(kind.value)
        if not isinstance(sub_params, dict):
            raise r.error(f"rope_parameters.{kind.value}", sub_params, "must be an object (RoPE parameters per layer type)")
        sub = _Reader(sub_params, f"{r.source}: rope_parameters.{kind.value}")
        dims = {dim for (dim, _), k in zip(per_layer, kinds) if k is kind}
        if len(dims) != 1:
            raise r.error("head_dim", sorted(dims), f"layers of type {kind.value!r} must share one head_dim")
        rope_type = sub.str_("rope_type", default="default")
        theta = sub.float_("rope_theta", default=10_000.0)
        if rope_type == "default":
            # Gemma4's default RoPE ignores partial_rotary_factor and factor
            out[kind] = RopeSpec(theta=theta, rotary_dim=dims.pop(), original_max_position=max_position)
        elif rope_type == "proportional":
            partial = sub.float_("partial_rotary_factor", default=1.0)
            if partial > 1:
                raise sub.error("partial_rotary_factor", partial, "must be in (0, 1]")
            out[kind] = RopeSpec(theta=theta, rotary_dim=dims.pop(), scaling="proportional",
                                 factor=sub.float_("factor", default=1.0), partial_rotary_factor=partial,
                                 original_max_position=max_position)
        else:
            raise sub.error("rope_type", rope_type, "is not supported for gemma4; expected 'default' or 'proportional'")
    return out


def _gemma4_kv_owners(r: _Reader, kinds: list[AttentionKind], shared: int) -> list[int]:
    """Each layer's KV owner: itself, or for the last `shared` layers the last earlier
    non-shared layer of the same type (transformers' kv_sharing_modes)."""
    n = len(kinds)
    if shared >= n:
        raise r.error("num_kv_shared_layers", shared, f"must be less than num_hidden_layers ({n})")
    first_shared = n - shared
    owners = list(range(n))
    for i in range(first_shared, n):
        producers = [j for j in range(first_shared) if kinds[j] is kinds[i]]
        if not producers:
            raise r.error(
                "num_kv_shared_layers", shared,
                f"layer {i} ({kinds[i].value}) shares KV but no earlier layer of that type produces it",
            )
        owners[i] = producers[-1]
    return owners


# ---------------------------------------------------------------------------------- Qwen3.5

_QWEN3_5_DEFAULTS = {
    "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}


def _qwen3_5(r: _Reader, model_type: str, prefix: str, generation_config: dict | None) -> ModelConfig:
    r = _defaults(r, _QWEN3_5_DEFAULTS)
    activation = r.str_("hidden_act")
    if activation != "silu":
        # the same activation runs after the GDN conv, where only silu is implemented
        raise r.error("hidden_act", activation, "is not supported for qwen3_5; only 'silu' is")
    vocab_size = r.int_("vocab_size")
    hidden_size = r.int_("hidden_size")
    intermediate_size = r.int_("intermediate_size")
    num_layers = r.int_("num_hidden_layers")
    num_heads = r.int_("num_attention_heads")
    num_kv_heads = r.int_("num_key_value_heads")
    if num_heads % num_kv_heads:
        raise r.error("num_key_value_heads", num_kv_heads, f"does not divide num_attention_heads ({num_heads})")
    head_dim = r.int_("head_dim")
    max_position = r.int_("max_position_embeddings")
    interval = r.int_("full_attention_interval", default=4)
    default_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    kinds = _layer_types(r, num_layers, ("linear_attention", "full_attention"), default_types)
    linear = LinearSpec(
        conv_kernel=r.int_("linear_conv_kernel_dim"), num_key_heads=r.int_("linear_num_key_heads"),
        num_value_heads=r.int_("linear_num_value_heads"), key_head_dim=r.int_("linear_key_head_dim"),
        value_head_dim=r.int_("linear_value_head_dim"),
    )
    rope = _qwen3_5_rope(r, head_dim, max_position)
    layers = tuple(
        LayerSpec(
            index=i, kind=kind, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=0,
            kv_owner=i, rope=rope, linear=linear if kind is AttentionKind.LINEAR else None,
        )
        for i, kind in enumerate(kinds)
    )
    attention_bias = r.bool_("attention_bias", False)
    return ModelConfig(
        model_type=model_type, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, layers=layers, rms_norm_eps=r.float_("rms_norm_eps"),
        qk_norm=True, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
        tie_word_embeddings=r.bool_("tie_word_embeddings", False), max_position_embeddings=max_position,
        hidden_act=activation, weight_prefix=prefix, norm_weight_offset=1.0, attn_output_gate=True,
        **_common(r, generation_config),
    )


def _qwen3_5_rope(r: _Reader, head_dim: int, max_position: int) -> RopeSpec:
    """Qwen3.5's text RoPE. Its multimodal sections (mrope_section) interleave frequencies of
    three position grids; for text all three positions are the token's, so they drop out."""
    params, field = _rope_params(r)
    sub = _Reader(params, f"{r.source}: {field}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise sub.error("rope_type", rope_type, "is not supported for qwen3_5; only 'default' is")
    theta = sub.float_("rope_theta", default=None)
    if theta is None:
        theta = r.float_("rope_theta", default=10_000.0)
    # rope_parameters wins over a top-level value; transformers' default is 0.25
    partial = sub.float_("partial_rotary_factor", default=None)
    if partial is None:
        partial = r.float_("partial_rotary_factor", default=0.25)
    if partial > 1 or int(head_dim * partial) < 2 or int(head_dim * partial) % 2:
        raise r.error("partial_rotary_factor", partial, f"must rotate an even number of the {head_dim} head dims")
    return RopeSpec(theta=theta, rotary_dim=head_dim, partial_rotary_factor=partial, original_max_position=max_position)
