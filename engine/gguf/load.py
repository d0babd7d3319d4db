"""Loading a GGUF checkpoint: config and weights in one read of the file's header."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.gguf.config import gguf_config
from engine.gguf.reader import open_gguf
from engine.gguf.weights import check_gguf_tensors, load_gguf_weights
from engine.weights import ModelWeights


def load_gguf_model(path) -> tuple[ModelConfig, ModelWeights]:
    """Returns (config, weights) of a .gguf file; raises ConfigError or WeightsError."""
    g = open_gguf(path)
    cfg = gguf_config(g)
    return cfg, load_gguf_weights(g, cfg)


def check_gguf(path) -> ModelConfig:
    """Reads the metadata and tensor table only: the config, after checking every tensor the
    model needs is present, of the right shape and of a type npud runs. Raises ConfigError
    or WeightsError."""
    g = open_gguf(path)
    cfg = gguf_config(g)
    check_gguf_tensors(g, cfg)
    return cfg
