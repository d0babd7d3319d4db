"""Model configuration: a checkpoint's config.json read into frozen, validated dataclasses.

specs.py holds the dataclasses (ModelConfig, LayerSpec, RopeSpec, LinearSpec) and ConfigError;
load.py reads llama, mistral, qwen2 and qwen3 configs and dispatches the others to hybrid.py
(gemma4, qwen3_5); reader.py is the typed field access both share. The names below are the
package's public surface, importable as `from npud.engine.config import ...`.
"""

from npud.engine.config.load import load_config, parse_config
from npud.engine.config.specs import (
    ACTIVATIONS,
    HYBRID_MODEL_TYPES,
    AttentionKind,
    ConfigError,
    LayerSpec,
    LinearSpec,
    ModelConfig,
    RopeSpec,
)

__all__ = [
    "ACTIVATIONS",
    "HYBRID_MODEL_TYPES",
    "AttentionKind",
    "ConfigError",
    "LayerSpec",
    "LinearSpec",
    "ModelConfig",
    "RopeSpec",
    "load_config",
    "parse_config",
]
