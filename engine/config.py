"""Model configuration: a checkpoint's config.json read into frozen, validated dataclasses.

Only what the forward pass needs is kept, already resolved per layer (attention kind,
window, RoPE), so the forward pass never looks at the raw JSON again. Defaults and
derived values follow transformers (5.x) for llama, mistral, qwen2 and qwen3; gemma4 and
qwen3_5 are read by engine/config_hybrid.py into the same dataclasses.
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
    LINEAR = "linear_attention"  # gated delta net (qwen3_5): recurrent state, no KV rows


_ROPE_SCALINGS = ("default", "linear", "llama3", "proportional")
# the activations the host kernels implement (transformers' ACT2FN names)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary position embedding of one layer (half-split layout, as transformers)."""

    theta: float
    rotary_dim: int  # == head_dim, the width the rotation acts on
    scaling: str = "default"  # "default" | "linear" | "llama3" | "proportional"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # < 1: only part of the head rotates. default/linear/llama3 (qwen3_5): the first
    # int(rotary_dim * f) dims rotate among themselves and the rest pass through;
    # proportional (gemma4): the pairs span the whole head, the last ones at frequency 0
    partial_rotary_factor: float = 1.0

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
        f = self.partial_rotary_factor
        if not _is_number(f) or not 0 < f <= 1:
            raise ConfigError(f"RopeSpec.partial_rotary_factor must be in (0, 1], got {f!r}")
        if f < 1 and self.scaling == "llama3":
            raise ConfigError("RopeSpec.partial_rotary_factor < 1 is not supported with llama3 scaling")
        if self.scaling != "proportional" and (int(self.rotary_dim * f) < 2 or int(self.rotary_dim * f) % 2):
            raise ConfigError(
                f"RopeSpec.partial_rotary_factor {f!r} of rotary_dim {self.rotary_dim} must rotate an even number of dims"
            )

    def inv_freq(self) -> np.ndarray:
        """Returns the float32 inverse frequencies, one per rotating pair.

        [rotary_dim // 2] entries in general; [int(rotary_dim * partial_rotary_factor) // 2]
        for a partial default/linear rope (the dims past them pass through). A proportional
        rope has rotary_dim // 2 entries, theta^(-2i / rotary_dim) for the first
        int(partial_rotary_factor * rotary_dim // 2) and 0 (no rotation) after them.

        The arithmetic follows transformers' ROPE_INIT_FUNCTIONS in float32, operation by
        operation. torch's own powf is not correctly rounded (and its vector and scalar
        paths disagree with each other), so the power here is the correctly rounded float32
        one: values can differ from torch's by an ulp (two after llama3 smoothing, which
        is otherwise bit-identical to transformers' given the same unscaled frequencies).
        """
        dim = self.rotary_dim
        if self.scaling == "proportional":
            rotated = int(self.partial_rotary_factor * dim // 2)
            exponent = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(dim)
        else:
            dim = int(dim * self.partial_rotary_factor)
            exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        power = np.power(np.float64(np.float32(self.theta)), exponent.astype(np.float64)).astype(np.float32)
        inv_freq = np.float32(1.0) / power
        if self.scaling == "proportional":
            inv_freq = np.concatenate([inv_freq, np.zeros(self.rotary_dim // 2 - rotated, np.float32)])
            inv_freq = inv_freq / np.float32(self.factor)
        elif self.scaling == "linear":
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
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.scaling == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position"] = self.original_max_position
        return out


@dataclass(slots=True, frozen=True)
class LinearSpec:
    """Geometry of a gated delta net (GDN) layer, transformers' Qwen3_5GatedDeltaNet.

    A causal depthwise conv of `conv_kernel` taps runs over the q|k|v projection; the
    recurrent state is [num_value_heads, key_head_dim, value_head_dim]; each key head
    serves num_value_heads // num_key_heads consecutive value heads.
    """

    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        for name in ("conv_kernel", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"LinearSpec.{name} must be a positive int, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(
                f"LinearSpec.num_value_heads ({self.num_value_heads}) is not a multiple of "
                f"num_key_heads ({self.num_key_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(slots=True, frozen=True)
class LayerSpec:
    """Geometry of one decoder layer.

    For a LINEAR (GDN) layer, `linear` holds its geometry; its attention fields are the
    model's and unused, and it owns no KV rows (kv_width 0).
    """

    index: int
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # 0: all positions; W > 0: the last W positions, itself included
    kv_owner: int  # == index when the layer owns its KV plane
    rope: RopeSpec
    linear: LinearSpec | None = None  # LINEAR layers only
    intermediate_size: int = 0  # the MLP width when it differs from the model's (gemma4 double-wide); 0: the model's
    k_eq_v: bool = False  # gemma4 attention_k_eq_v: the values are the raw key projection (no v_proj)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (gemma4: 1.0)

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
        if (self.kind is AttentionKind.LINEAR) != isinstance(self.linear, LinearSpec):
            raise ConfigError(
                f"layer {self.index}: linear must be a LinearSpec exactly when kind is linear_attention, "
                f"got {self.linear!r} for {self.kind.value!r}"
            )
        if self.kind is AttentionKind.LINEAR and not self.owns_kv:
            raise ConfigError(f"layer {self.index}: a linear-attention layer cannot share KV (kv_owner {self.kv_owner})")
        if not _is_int(self.intermediate_size) or self.intermediate_size < 0:
            raise ConfigError(
                f"layer {self.index}: intermediate_size must be an int >= 0, got {self.intermediate_size!r}"
            )
        if not isinstance(self.k_eq_v, bool):
            raise ConfigError(f"layer {self.index}: k_eq_v must be a bool, got {self.k_eq_v!r}")
        if self.attention_scale is not None and (not _is_number(self.attention_scale) or self.attention_scale <= 0):
            raise ConfigError(
                f"layer {self.index}: attention_scale must be a positive number or None, got {self.attention_scale!r}"
            )

    @property
    def kv_width(self) -> int:
        """Floats per position in K (and in V); 0 for a linear-attention layer."""
        return 0 if self.kind is AttentionKind.LINEAR else self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        """The factor on q . k before the softmax."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

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
    # gemma4 / qwen3_5 (engine/config_hybrid.py); the defaults are the llama form
    weight_prefix: str = "model."  # the text model's tensors ("model.language_model." in multimodal checkpoints)
    norm_weight_offset: float = 0.0  # qwen3_5: the norms scale by (offset + weight)
    embed_scale: float | None = None  # gemma4: embedding rows times sqrt(hidden_size)
    sandwich_norms: bool = False  # gemma4: attention and MLP outputs normed, and a pre-norm before the MLP
    v_norm: bool = False  # gemma4: values RMS-normed over head_dim (no weight)
    attn_output_gate: bool = False  # qwen3_5: q_proj also gives a gate; attention output times sigmoid(gate)
    layer_scalar: bool = False  # gemma4: each layer's output times its stored scalar
    per_layer_input_size: int = 0  # gemma4 PLE: hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab_size: int = 0  # gemma4 PLE: rows of the per-layer embedding table
    final_logit_softcapping: float | None = None  # gemma4: logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.model_type not in _MODEL_TYPES and self.model_type not in HYBRID_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected one of "
                f"{sorted([*_MODEL_TYPES, *HYBRID_MODEL_TYPES])}"
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
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"ModelConfig.hidden_act {self.hidden_act!r} is not supported; expected one of {list(ACTIVATIONS)}"
            )
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, str):
            raise ConfigError(f"ModelConfig.torch_dtype must be a str or None, got {self.torch_dtype!r}")
        if not isinstance(self.weight_prefix, str):
            raise ConfigError(f"ModelConfig.weight_prefix must be a str, got {self.weight_prefix!r}")
        for name in ("norm_weight_offset",):
            if not _is_number(getattr(self, name)):
                raise ConfigError(f"ModelConfig.{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("embed_scale", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or value <= 0):
                raise ConfigError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        for name in ("sandwich_norms", "v_norm", "attn_output_gate", "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("per_layer_input_size", "per_layer_vocab_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        if (self.per_layer_input_size > 0) != (self.per_layer_vocab_size > 0):
            raise ConfigError(
                f"ModelConfig.per_layer_input_size ({self.per_layer_input_size}) and per_layer_vocab_size "
                f"({self.per_layer_vocab_size}) must both be 0 or both positive"
            )
        for layer in self.layers:
            owner = self.layers[layer.kv_owner]
            if not layer.owns_kv and (
                owner.kind is not layer.kind or not owner.owns_kv or owner.kv_width != layer.kv_width
            ):
                raise ConfigError(
                    f"layer {layer.index}: shares KV with layer {owner.index}, which must be a KV-owning layer "
                    "of the same kind and width"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def mlp_width(self, spec: LayerSpec) -> int:
        """The intermediate size of `spec`'s MLP."""
        return spec.intermediate_size or self.intermediate_size

    def recurrent_state_shapes(self, spec: LayerSpec) -> dict[str, tuple[int, ...]]:
        """The float32 state arrays of a linear-attention layer, by name.

        conv: the last conv_kernel - 1 inputs of the conv, [conv_dim, conv_kernel - 1]
        (zeros before position 0); ssm: the delta-rule state [value heads, key dim, value dim].
        """
        if spec.kind is not AttentionKind.LINEAR or spec.linear is None:
            raise ConfigError(f"layer {spec.index} is {spec.kind.value!r}, not linear_attention: it has no recurrent state")
        g = spec.linear
        return {
            "conv": (g.conv_dim, g.conv_kernel - 1),
            "ssm": (g.num_value_heads, g.key_head_dim, g.value_head_dim),
        }

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
            **self._describe_hybrid(),
        }

    def _describe_hybrid(self) -> dict:
        """The gemma4 / qwen3_5 features in use (nothing for a llama-form model)."""
        out: dict[str, Any] = {}
        heads = {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in self.layers
                 if layer.kind is not AttentionKind.LINEAR}
        if len(heads) > 1:
            out["heads_per_layer"] = [[layer.num_heads, layer.num_kv_heads, layer.head_dim] for layer in self.layers]
        if any(not layer.owns_kv for layer in self.layers):
            out["kv_owners"] = [layer.kv_owner for layer in self.layers]
        linear = [layer.linear for layer in self.layers if layer.linear is not None]
        if linear:
            g = linear[0]
            out["linear_attention"] = {
                "conv_kernel": g.conv_kernel, "num_key_heads": g.num_key_heads, "num_value_heads": g.num_value_heads,
                "key_head_dim": g.key_head_dim, "value_head_dim": g.value_head_dim,
            }
        if any(layer.intermediate_size for layer in self.layers):
            out["intermediate_sizes"] = [self.mlp_width(layer) for layer in self.layers]
        for name in ("embed_scale", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name in ("sandwich_norms", "v_norm", "attn_output_gate", "layer_scalar"):
            if getattr(self, name):
                out[name] = True
        if self.per_layer_input_size:
            out["per_layer_input_size"] = self.per_layer_input_size
            out["per_layer_vocab_size"] = self.per_layer_vocab_size
        if any(layer.k_eq_v for layer in self.layers):
            out["k_eq_v_layers"] = [layer.index for layer in self.layers if layer.k_eq_v]
        if self.norm_weight_offset:
            out["norm_weight_offset"] = self.norm_weight_offset
        return out


# read by engine/config_hybrid.py
HYBRID_MODEL_TYPES = ("gemma4", "gemma4_text", "qwen3_5", "qwen3_5_text", "gemma3", "gemma3_text")

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


def _rope_params(r: _Reader) -> tuple[dict, str]:
    """The RoPE parameter object and the field it came from; `{}` when the config has none.

    transformers gives a legacy `rope_scaling` priority over `rope_parameters`.
    """
    for name in ("rope_scaling", "rope_parameters"):
        if r.raw.get(name) is not None:
            params = r.raw[name]
            if not isinstance(params, dict):
                raise r.error(name, params, "must be an object")
            return params, name
    return {}, "rope_parameters"


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


def _special_tokens(r: _Reader, generation_config: Any) -> tuple[list[int], int | None, int | None]:
    """(eos ids, bos, pad) from config.json, then generation_config.json's dict."""
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
    return eos, bos, pad


def _dtype(r: _Reader) -> str | None:
    # transformers 5 writes "dtype", older versions "torch_dtype"
    dtype = r.raw.get("dtype", r.raw.get("torch_dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise r.error("dtype", dtype, "must be a string")
    return dtype


def parse_config(raw: dict, generation_config: dict | None = None, source: str = "config.json") -> ModelConfig:
    """Returns the ModelConfig of a config.json dict (+ generation_config.json's dict).

    Raises ConfigError naming the source, field and value of the first problem.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a JSON object, got {type(raw).__name__}")
    r = _Reader(raw, source)
    model_type = r.str_("model_type")
    if model_type in HYBRID_MODEL_TYPES:
        from engine.config_hybrid import parse_hybrid_config

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
