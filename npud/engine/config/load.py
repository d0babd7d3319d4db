"""config.json (+ generation_config.json) read into npud.engine.config's dataclasses.

Defaults and derived values follow transformers (5.x) for llama, mistral, qwen2 and qwen3;
gemma4 and qwen3_5 are read by npud/engine/config/hybrid.py into the same dataclasses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from npud.engine.config.hybrid import parse_hybrid_config
from npud.engine.config.reader import _dtype, _Reader, _rope_params, _special_tokens
from npud.engine.config.specs import (
    _MODEL_TYPES,
    _ROPE_SCALINGS,
    HYBRID_MODEL_TYPES,
    AttentionKind,
    ConfigError,
    LayerSpec,
    ModelConfig,
    RopeSpec,
)


def _parse_rope(r: _Reader, head_dim: int, max_position: int) -> RopeSpec:
    """Reads old (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) forms."""
    params, field = _rope_params(r)
    if any(key in {k.value for k in AttentionKind} for key in params):
        raise r.error(field, params, "RoPE parameters per layer type are not supported")
    sub = _Reader(params, f"{r.source}: {field}")

    theta = sub.float_("rope_theta", default=None)
    if theta is None:
        theta = r.float_("rope_theta", default=10000.0)
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in _ROPE_SCALINGS:
        raise r.error(f"{field}.rope_type", scaling, f"is not supported; expected one of {list(_ROPE_SCALINGS)}")
    partial = params.get("partial_rotary_factor", r.raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise r.error("partial_rotary_factor", partial, "partial rotary embeddings are not supported")

    kwargs: dict[str, Any] = {}
    if scaling in ("linear", "llama3"):
        kwargs["factor"] = sub.float_("factor")
    if scaling == "llama3":
        kwargs["low_freq_factor"] = sub.float_("low_freq_factor")
        kwargs["high_freq_factor"] = sub.float_("high_freq_factor")
        if kwargs["high_freq_factor"] <= kwargs["low_freq_factor"]:
            raise r.error(
                f"{field}.high_freq_factor", kwargs["high_freq_factor"],
                f"must be greater than low_freq_factor ({kwargs['low_freq_factor']!r})",
            )
        # transformers falls back to max_position_embeddings, and a top-level value wins
        original = r.int_("original_max_position_embeddings", default=None)
        if original is None:
            original = sub.int_("original_max_position_embeddings", default=max_position)
        kwargs["original_max_position"] = original
    return RopeSpec(theta=theta, rotary_dim=head_dim, scaling=scaling, **kwargs)


def _layer_kinds(r: _Reader, model_type: str, num_layers: int) -> list[tuple[AttentionKind, int]]:
    """Returns (kind, window) per layer, following each model's transformers code."""
    if model_type == "llama":
        return [(AttentionKind.FULL, 0)] * num_layers
    if model_type == "mistral":
        # Mistral applies its window (when set) to every layer and ignores layer_types
        window = r.int_("sliding_window", default=None)
        if window is None:
            return [(AttentionKind.FULL, 0)] * num_layers
        return [(AttentionKind.SLIDING, window)] * num_layers

    # qwen2 / qwen3: the window exists only when use_sliding_window is set
    window = r.int_("sliding_window", default=None) if r.bool_("use_sliding_window", False) else None
    types = r.raw.get("layer_types")
    if types is None:
        first_sliding = r.int_("max_window_layers", default=28, minimum=0)
        types = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise r.error("layer_types", types, f"must be a list of {num_layers} layer types")
    out = []
    for i, name in enumerate(types):
        if name == AttentionKind.FULL.value:
            out.append((AttentionKind.FULL, 0))
        elif name == AttentionKind.SLIDING.value:
            # transformers gives such a layer window None (full) when sliding is switched off
            out.append((AttentionKind.SLIDING, window) if window is not None else (AttentionKind.FULL, 0))
        else:
            raise r.error(f"layer_types[{i}]", name, "is not supported for this model type")
    return out



def parse_config(raw: dict, generation_config: dict | None = None, source: str = "config.json") -> ModelConfig:
    """Returns the ModelConfig of a config.json dict (+ generation_config.json's dict).

    Raises ConfigError naming the source, field and value of the first problem.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a JSON object, got {type(raw).__name__}")
    r = _Reader(raw, source)
    model_type = r.str_("model_type")
    if model_type in HYBRID_MODEL_TYPES:
        return parse_hybrid_config(raw, generation_config, source)
    if model_type not in _MODEL_TYPES:
        raise r.error(
            "model_type", model_type, f"is not supported; expected one of {sorted([*_MODEL_TYPES, *HYBRID_MODEL_TYPES])}"
        )
    defaults = _MODEL_TYPES[model_type]

    vocab_size = r.int_("vocab_size")
    hidden_size = r.int_("hidden_size")
    intermediate_size = r.int_("intermediate_size")
    num_layers = r.int_("num_hidden_layers")
    num_heads = r.int_("num_attention_heads")
    num_kv_heads = r.int_("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise r.error(
            "num_key_value_heads", num_kv_heads, f"does not divide num_attention_heads ({num_heads})"
        )
    # Qwen3Config defaults head_dim to 128 rather than deriving it
    if model_type == "qwen3":
        head_dim = r.int_("head_dim", default=128)
    else:
        head_dim = r.int_("head_dim", default=None)
        if head_dim is None:
            if hidden_size % num_heads:
                raise r.error(
                    "num_attention_heads", num_heads,
                    f"does not divide hidden_size ({hidden_size}) and head_dim is not given",
                )
            head_dim = hidden_size // num_heads
    if head_dim % 2:
        raise r.error("head_dim", head_dim, "must be even for rotary embeddings")
    max_position = r.int_("max_position_embeddings", default=defaults["max_position_embeddings"])
    hidden_act = r.str_("hidden_act", default="silu")
    if hidden_act != "silu":
        raise r.error("hidden_act", hidden_act, "is not supported; only 'silu' is")

    rope = _parse_rope(r, head_dim, max_position)
    layers = tuple(
        LayerSpec(
            index=i, kind=kind, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            window=window, kv_owner=i, rope=rope,
        )
        for i, (kind, window) in enumerate(_layer_kinds(r, model_type, num_layers))
    )

    attention_bias = r.bool_("attention_bias", False)
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type == "mistral":
        qkv_bias = o_bias = False  # transformers' Mistral has no attention biases at all
    else:
        qkv_bias = o_bias = attention_bias
    mlp_bias = r.bool_("mlp_bias", False) if model_type == "llama" else False

    eos, bos, pad = _special_tokens(r, generation_config)
    dtype = _dtype(r)

    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        layers=layers,
        rms_norm_eps=r.float_("rms_norm_eps", default=1e-6),
        qk_norm=model_type == "qwen3",
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=r.bool_("tie_word_embeddings", False),
        max_position_embeddings=max_position,
        eos_token_ids=tuple(eos),
        bos_token_id=bos,
        pad_token_id=pad,
        hidden_act=hidden_act,
        torch_dtype=dtype,
    )


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}") from None


def load_config(checkpoint_dir) -> ModelConfig:
    """Returns the ModelConfig of a checkpoint directory.

    Reads config.json and, when present, generation_config.json. Raises ConfigError.
    """
    directory = Path(checkpoint_dir)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path}: no such file")
    raw = _read_json(config_path)
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    if generation is not None and not isinstance(generation, dict):
        raise ConfigError(f"{generation_path}: must be a JSON object, got {type(generation).__name__}")
    return parse_config(raw, generation, source=str(config_path))
