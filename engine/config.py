"""Model configuration: a checkpoint's config.json read into frozen, validated dataclasses.

Only what the forward pass needs is kept, already resolved per layer (attention kind,
window, RoPE), so the forward pass never looks at the raw JSON again. Defaults and
derived values follow transformers (5.x) for llama, mistral, qwen2 and qwen3.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or not supported."""


class AttentionKind(enum.Enum):
    """How a layer mixes positions; the values are transformers' `layer_types` strings."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"  # gated delta net: parsed by later work, rejected here


_ROPE_SCALINGS = ("default", "linear", "llama3")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary position embedding of one layer (half-split layout, as transformers)."""

    theta: float
    rotary_dim: int  # == head_dim: partial rotary is rejected by parse_config
    scaling: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if not _is_number(self.theta) or self.theta <= 0:
            raise ConfigError(f"RopeSpec.theta must be a positive number, got {self.theta!r}")
        if not _is_int(self.rotary_dim) or self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"RopeSpec.rotary_dim must be a positive even int, got {self.rotary_dim!r}")
        if self.scaling not in _ROPE_SCALINGS:
            raise ConfigError(
                f"RopeSpec.scaling {self.scaling!r} is not supported; expected one of {list(_ROPE_SCALINGS)}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"RopeSpec.{name} must be a positive number, got {value!r}")
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            # the llama3 ramp divides by (high - low)
            raise ConfigError(
                f"RopeSpec.high_freq_factor ({self.high_freq_factor!r}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor!r}) for llama3 scaling"
            )
        if not _is_int(self.original_max_position) or self.original_max_position <= 0:
            raise ConfigError(
                f"RopeSpec.original_max_position must be a positive int, got {self.original_max_position!r}"
            )

    def inv_freq(self) -> np.ndarray:
        """Returns the float32 [rotary_dim // 2] inverse frequencies.

        The arithmetic follows transformers' ROPE_INIT_FUNCTIONS in float32, operation by
        operation. torch's own powf is not correctly rounded (and its vector and scalar
        paths disagree with each other), so the power here is the correctly rounded float32
        one: values can differ from torch's by an ulp (two after llama3 smoothing, which
        is otherwise bit-identical to transformers' given the same unscaled frequencies).
        """
        dim = self.rotary_dim
        exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        power = np.power(np.float64(np.float32(self.theta)), exponent.astype(np.float64)).astype(np.float32)
        inv_freq = np.float32(1.0) / power
        if self.scaling == "linear":
            inv_freq = inv_freq / np.float32(self.factor)
        elif self.scaling == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq.astype(np.float32)

    def _llama3(self, inv_freq: np.ndarray) -> np.ndarray:
        """Llama 3.1 frequency smoothing of float32 `inv_freq`, mirroring transformers' ops.

        torch evaluates `scalar / tensor` as `reciprocal(tensor) * scalar`, and runs
        tensor-scalar ops in float32; both are reproduced so the bits match.
        """
        f32 = np.float32
        factor = f32(self.factor)
        low, high = self.low_freq_factor, self.high_freq_factor
        old_context_len = self.original_max_position
        low_freq_wavelen = f32(old_context_len / low)
        high_freq_wavelen = f32(old_context_len / high)

        wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = ((f32(1.0) / wavelen) * f32(old_context_len) - f32(low)) / f32(high - low)
        smoothed = (f32(1.0) - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)

    def describe(self) -> dict:
        """Returns a JSON-able summary."""
        out: dict[str, Any] = {"theta": self.theta, "rotary_dim": self.rotary_dim, "scaling": self.scaling}
        if self.scaling != "default":
            out["factor"] = self.factor
        if self.scaling == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position"] = self.original_max_position
        return out


@dataclass(slots=True, frozen=True)
class LayerSpec:
    """Attention geometry of one decoder layer."""

    index: int
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # 0: all positions; W > 0: the last W positions, itself included
    kv_owner: int  # == index when the layer owns its KV plane
    rope: RopeSpec

    def __post_init__(self) -> None:
        if not _is_int(self.index) or self.index < 0:
            raise ConfigError(f"LayerSpec.index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.kind, AttentionKind):
            raise ConfigError(f"layer {self.index}: kind must be an AttentionKind, got {self.kind!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"layer {self.index}: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"layer {self.index}: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not _is_int(self.window) or self.window < 0:
            raise ConfigError(f"layer {self.index}: window must be an int >= 0, got {self.window!r}")
        if (self.kind is AttentionKind.SLIDING) != (self.window > 0):
            raise ConfigError(
                f"layer {self.index}: window {self.window} does not fit kind {self.kind.value!r} "
                "(sliding layers need window > 0, other layers window 0)"
            )
        if not _is_int(self.kv_owner) or not 0 <= self.kv_owner <= self.index:
            raise ConfigError(
                f"layer {self.index}: kv_owner must be an earlier layer or the layer itself, got {self.kv_owner!r}"
            )
        if not isinstance(self.rope, RopeSpec):
            raise ConfigError(f"layer {self.index}: rope must be a RopeSpec, got {self.rope!r}")
        if self.rope.rotary_dim != self.head_dim:
            raise ConfigError(
                f"layer {self.index}: rope.rotary_dim ({self.rope.rotary_dim}) must equal head_dim ({self.head_dim})"
            )

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def owns_kv(self) -> bool:
        return self.kv_owner == self.index


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k (per head) before RoPE
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    hidden_act: str
    torch_dtype: str | None

    def __post_init__(self) -> None:
        if self.model_type not in _MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected one of {sorted(_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError(f"ModelConfig.layers must be a non-empty tuple, got {self.layers!r}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerSpec) or layer.index != i:
                raise ConfigError(f"ModelConfig.layers[{i}] must be the LayerSpec with index {i}, got {layer!r}")
        if not _is_number(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ConfigError(f"ModelConfig.rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        for name in ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {value!r}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.eos_token_ids
        ):
            raise ConfigError(f"ModelConfig.eos_token_ids must be a tuple of ints >= 0, got {self.eos_token_ids!r}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ConfigError(f"ModelConfig.{name} must be an int >= 0 or None, got {value!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"ModelConfig.hidden_act {self.hidden_act!r} is not supported; only 'silu' is")
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, str):
            raise ConfigError(f"ModelConfig.torch_dtype must be a str or None, got {self.torch_dtype!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> dict:
        """Returns a JSON-able summary for logs and the daemon's model info."""
        first = self.layers[0]
        ropes = {json.dumps(layer.rope.describe(), sort_keys=True) for layer in self.layers}
        return {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": first.num_heads,
            "num_kv_heads": first.num_kv_heads,
            "head_dim": first.head_dim,
            "layer_kinds": [layer.kind.value for layer in self.layers],
            "windows": [layer.window for layer in self.layers],
            "rope": [json.loads(r) for r in sorted(ropes)],
            "rms_norm_eps": self.rms_norm_eps,
            "qk_norm": self.qk_norm,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": self.hidden_act,
            "torch_dtype": self.torch_dtype,
        }


# transformers' defaults for fields a config.json may leave out
_MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
}


class _Reader:
    """Typed field access on a raw config dict; every error names the source and field."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, field: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: {field} = {value!r}: {why}")

    def has(self, field: str) -> bool:
        return self.raw.get(field) is not None

    def int_(self, field: str, default: Any = ..., minimum: int = 1) -> int:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not _is_int(value):
            raise self.error(field, value, "must be an int")
        if value < minimum:
            raise self.error(field, value, f"must be >= {minimum}")
        return value

    def float_(self, field: str, default: Any = ..., positive: bool = True) -> float:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not _is_number(value):
            raise self.error(field, value, "must be a finite number")
        if positive and value <= 0:
            raise self.error(field, value, "must be > 0")
        return float(value)

    def bool_(self, field: str, default: bool) -> bool:
        value = self.raw.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, value, "must be true or false")
        return value

    def str_(self, field: str, default: Any = ...) -> str:
        value = self.raw.get(field)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {field!r} is missing")
            return default
        if not isinstance(value, str):
            raise self.error(field, value, "must be a string")
        return value

    def token_ids(self, field: str) -> list[int]:
        value = self.raw.get(field)
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not _is_int(item) or item < 0:
                raise self.error(field, value, "must be a token id >= 0 or a list of them")
        return list(items)

    def optional_token_id(self, field: str) -> int | None:
        value = self.raw.get(field)
        if value is None:
            return None
        if not _is_int(value) or value < 0:
            raise self.error(field, value, "must be a token id >= 0 or null")
        return value


def _parse_rope(r: _Reader, head_dim: int, max_position: int) -> RopeSpec:
    """Reads old (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) forms."""
    params: Any = None
    field = "rope_parameters"
    # transformers gives a legacy `rope_scaling` priority over `rope_parameters`
    for name in ("rope_scaling", "rope_parameters"):
        if r.raw.get(name) is not None:
            params, field = r.raw[name], name
            break
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise r.error(field, params, "must be an object")
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
    if model_type not in _MODEL_TYPES:
        raise r.error("model_type", model_type, f"is not supported; expected one of {sorted(_MODEL_TYPES)}")
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

    if generation_config is not None and not isinstance(generation_config, dict):
        raise ConfigError(f"generation_config.json: must be a JSON object, got {type(generation_config).__name__}")
    g = _Reader(generation_config or {}, "generation_config.json")
    eos: list[int] = []
    for token in r.token_ids("eos_token_id") + g.token_ids("eos_token_id"):
        if token not in eos:
            eos.append(token)
    bos = r.optional_token_id("bos_token_id")
    if bos is None:
        bos = g.optional_token_id("bos_token_id")
    pad = r.optional_token_id("pad_token_id")
    if pad is None:
        pad = g.optional_token_id("pad_token_id")

    # transformers 5 writes "dtype", older versions "torch_dtype"
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise r.error("dtype", dtype, "must be a string")

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
