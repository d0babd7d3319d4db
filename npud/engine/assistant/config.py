"""config.json of a Gemma 4 assistant (`gemma4_assistant`) read into one frozen dataclass.

Fields and defaults follow transformers (5.x) configuration_gemma4_assistant.py. The assistant's
`text_config` is a Gemma 4 text model whose every layer is KV-shared: it owns no KV projection
and attends over the base's keys and values. It is read by npud.engine.config's Gemma 4 reader with
`num_kv_shared_layers` set to 0, which gives each layer its geometry (kind, window, heads, head
width, RoPE) without the sharing map; the assistant's forward (npud/engine/assistant/forward.py)
never looks at kv_owner. What transformers' validate_architecture refuses (per-layer inputs, a
MoE block, a double-wide MLP, layers that are not all shared) is a ConfigError here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npud.engine.config import AttentionKind, ConfigError, ModelConfig, parse_config

MODEL_TYPE = "gemma4_assistant"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True, frozen=True)
class AssistantConfig:
    """A Gemma 4 assistant: its text stack, the base width it was trained with, and the
    ordered-embedding ("masked embedder") output path when use_ordered_embeddings is set."""

    text: ModelConfig  # the assistant's own Gemma 4 text stack (hidden_size, layers, vocabulary)
    backbone_hidden_size: int  # the base's hidden_size: inputs are [embedding, hidden] of this width each
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32  # transformers' centroid_intermediate_top_k
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.text, ModelConfig):
            raise ConfigError(f"AssistantConfig.text must be a ModelConfig, got {self.text!r}")
        if not (_is_int(self.backbone_hidden_size) and self.backbone_hidden_size > 0):
            raise ConfigError(f"AssistantConfig.backbone_hidden_size must be a positive int, got {self.backbone_hidden_size!r}")
        for name in ("use_ordered_embeddings", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"AssistantConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.text.per_layer_input_size:
            raise ConfigError(
                f"AssistantConfig: text_config.hidden_size_per_layer_input must be 0 for an assistant, "
                f"got {self.text.per_layer_input_size}"
            )
        for spec in self.text.layers:
            if spec.kind is AttentionKind.LINEAR or spec.intermediate_size:
                raise ConfigError(f"AssistantConfig: layer {spec.index} is not a plain Gemma 4 attention layer")
        if self.use_ordered_embeddings:
            vocab = self.text.vocab_size
            if not (_is_int(self.num_centroids) and self.num_centroids > 0 and vocab % self.num_centroids == 0):
                raise ConfigError(
                    f"AssistantConfig.num_centroids must be a positive int dividing the vocabulary ({vocab}), "
                    f"got {self.num_centroids!r}"
                )
            if not (_is_int(self.centroid_top_k) and 1 <= self.centroid_top_k <= self.num_centroids):
                raise ConfigError(
                    f"AssistantConfig.centroid_top_k must be an int in 1..num_centroids ({self.num_centroids}), "
                    f"got {self.centroid_top_k!r}"
                )

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids

    def kinds(self) -> tuple[AttentionKind, ...]:
        """The layer kinds the assistant attends with, each needing one base KV plane."""
        return tuple(sorted({spec.kind for spec in self.text.layers}, key=lambda k: k.value))

    def describe(self) -> dict:
        """Returns a JSON-able summary."""
        return {
            "model_type": MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "layers": self.text.num_layers,
            "layer_kinds": [spec.kind.value for spec in self.text.layers],
            "vocab_size": self.vocab_size,
            "backbone_hidden_size": self.backbone_hidden_size,
            "use_ordered_embeddings": self.use_ordered_embeddings,
            **({"num_centroids": self.num_centroids, "centroid_top_k": self.centroid_top_k}
               if self.use_ordered_embeddings else {}),
        }


def parse_assistant_config(raw: Any, source: str = "config.json") -> AssistantConfig:
    """Returns the AssistantConfig of a gemma4_assistant config.json dict.

    Raises ConfigError naming the source, field and value of the first problem.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type = {model_type!r}: an assistant checkpoint has {MODEL_TYPE!r}")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config = {text!r}: must be an object (the assistant's Gemma 4 text model)")
    inner = text.get("model_type", "gemma4_text")
    if inner != "gemma4_text":
        raise ConfigError(f"{source}: text_config.model_type = {inner!r}: must be 'gemma4_text'")
    layers = text.get("num_hidden_layers")
    shared = text.get("num_kv_shared_layers")
    if shared not in (None, 0, layers):
        raise ConfigError(
            f"{source}: text_config.num_kv_shared_layers = {shared!r}: every layer of an assistant reads the "
            f"base's KV, so it must be num_hidden_layers ({layers!r})"
        )
    if text.get("hidden_size_per_layer_input"):
        raise ConfigError(f"{source}: text_config.hidden_size_per_layer_input = "
                          f"{text['hidden_size_per_layer_input']!r}: must be 0 for an assistant (no per-layer inputs)")
    for name in ("enable_moe_block", "use_double_wide_mlp"):
        if text.get(name):
            raise ConfigError(f"{source}: text_config.{name} = {text[name]!r}: must be false for an assistant")
    # the layers' geometry without the sharing map (see the module docstring)
    text_cfg = parse_config({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0},
                            source=f"{source}: text_config")

    def field(name: str, default: Any, check, what: str) -> Any:
        value = raw.get(name)
        if value is None:
            return default
        if not check(value):
            raise ConfigError(f"{source}: {name} = {value!r}: must be {what}")
        return value

    positive = lambda v: _is_int(v) and v > 0  # noqa: E731
    try:
        return AssistantConfig(
            text=text_cfg,
            backbone_hidden_size=field("backbone_hidden_size", 1536, positive, "a positive int"),
            use_ordered_embeddings=field("use_ordered_embeddings", False, lambda v: isinstance(v, bool), "true or false"),
            num_centroids=field("num_centroids", 2048, positive, "a positive int"),
            centroid_top_k=field("centroid_intermediate_top_k", 32, positive, "a positive int"),
            tie_word_embeddings=field("tie_word_embeddings", True, lambda v: isinstance(v, bool), "true or false"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_assistant_config(checkpoint_dir) -> AssistantConfig:
    """Returns the AssistantConfig of an assistant checkpoint directory; raises ConfigError."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    return parse_assistant_config(raw, source=str(path))
