"""Model configuration dataclasses: what the forward pass needs, resolved per layer and validated.

Only what the forward pass needs is kept, already resolved per layer (attention kind,
window, RoPE), so the forward pass never looks at the raw JSON again. npud/engine/config/load.py
(llama, mistral, qwen2, qwen3) and npud/engine/config/hybrid.py (gemma4, qwen3_5) fill them in.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from npud.engine.api import ConfigError, is_int, is_number


class AttentionKind(enum.Enum):
    """How a layer mixes positions; the values are transformers' `layer_types` strings."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"  # gated delta net (qwen3_5): recurrent state, no KV rows


_ROPE_SCALINGS = ("default", "linear", "llama3", "proportional")
# the activations the host kernels implement (transformers' ACT2FN names)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# transformers' defaults for fields a config.json may leave out (read by npud/engine/config/load.py)
_MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
}
# read by npud/engine/config/hybrid.py
HYBRID_MODEL_TYPES = ("gemma4", "gemma4_text", "qwen3_5", "qwen3_5_text", "gemma3", "gemma3_text")


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
        if not is_number(self.theta) or self.theta <= 0:
            raise ConfigError(f"RopeSpec.theta must be a positive number, got {self.theta!r}")
        if not is_int(self.rotary_dim) or self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"RopeSpec.rotary_dim must be a positive even int, got {self.rotary_dim!r}")
        if self.scaling not in _ROPE_SCALINGS:
            raise ConfigError(
                f"RopeSpec.scaling {self.scaling!r} is not supported; expected one of {list(_ROPE_SCALINGS)}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise ConfigError(f"RopeSpec.{name} must be a positive number, got {value!r}")
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            # the llama3 ramp divides by (high - low)
            raise ConfigError(
                f"RopeSpec.high_freq_factor ({self.high_freq_factor!r}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor!r}) for llama3 scaling"
            )
        if not is_int(self.original_max_position) or self.original_max_position <= 0:
            raise ConfigError(
                f"RopeSpec.original_max_position must be a positive int, got {self.original_max_position!r}"
            )
        f = self.partial_rotary_factor
        if not is_number(f) or not 0 < f <= 1:
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
        _check_heads(self, "LinearSpec.", ("conv_kernel", "num_key_heads", "num_value_heads", "key_head_dim",
                                           "value_head_dim"), "num_value_heads", "num_key_heads")

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


def _check_heads(spec: object, where: str, positive: tuple[str, ...], grouped: str, groups: str) -> None:
    """Raise ConfigError (its message starting with `where`) unless every field in `positive`
    is a positive int and `grouped` heads divide evenly among `groups`."""
    for name in positive:
        value = getattr(spec, name)
        if not is_int(value) or value <= 0:
            raise ConfigError(f"{where}{name} must be a positive int, got {value!r}")
    if getattr(spec, grouped) % getattr(spec, groups):
        raise ConfigError(f"{where}{grouped} ({getattr(spec, grouped)}) is not a multiple of "
                          f"{groups} ({getattr(spec, groups)})")


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
        if not is_int(self.index) or self.index < 0:
            raise ConfigError(f"LayerSpec.index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.kind, AttentionKind):
            raise ConfigError(f"layer {self.index}: kind must be an AttentionKind, got {self.kind!r}")
        _check_heads(self, f"layer {self.index}: ", ("num_heads", "num_kv_heads", "head_dim"),
                     "num_heads", "num_kv_heads")
        if not is_int(self.window) or self.window < 0:
            raise ConfigError(f"layer {self.index}: window must be an int >= 0, got {self.window!r}")
        if (self.kind is AttentionKind.SLIDING) != (self.window > 0):
            raise ConfigError(
                f"layer {self.index}: window {self.window} does not fit kind {self.kind.value!r} "
                "(sliding layers need window > 0, other layers window 0)"
            )
        if not is_int(self.kv_owner) or not 0 <= self.kv_owner <= self.index:
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
        if not is_int(self.intermediate_size) or self.intermediate_size < 0:
            raise ConfigError(
                f"layer {self.index}: intermediate_size must be an int >= 0, got {self.intermediate_size!r}"
            )
        if not isinstance(self.k_eq_v, bool):
            raise ConfigError(f"layer {self.index}: k_eq_v must be a bool, got {self.k_eq_v!r}")
        if self.attention_scale is not None and (not is_number(self.attention_scale) or self.attention_scale <= 0):
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
    # gemma4 / qwen3_5 (npud/engine/config/hybrid.py); the defaults are the llama form
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
            if not is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError(f"ModelConfig.layers must be a non-empty tuple, got {self.layers!r}")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerSpec) or layer.index != i:
                raise ConfigError(f"ModelConfig.layers[{i}] must be the LayerSpec with index {i}, got {layer!r}")
        if not is_number(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ConfigError(f"ModelConfig.rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        for name in ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {value!r}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
            is_int(t) and t >= 0 for t in self.eos_token_ids
        ):
            raise ConfigError(f"ModelConfig.eos_token_ids must be a tuple of ints >= 0, got {self.eos_token_ids!r}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
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
            if not is_number(getattr(self, name)):
                raise ConfigError(f"ModelConfig.{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("embed_scale", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or value <= 0):
                raise ConfigError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        for name in ("sandwich_norms", "v_norm", "attn_output_gate", "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("per_layer_input_size", "per_layer_vocab_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
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

