"""Loading a GGUF checkpoint: config and weights in one read of the file's header."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.gguf.config import gguf_config
from engine.gguf.describe import describe_file
from engine.gguf.reader import open_gguf
from engine.gguf.weights import load_gguf_weights
from engine.weights import ModelWeights


def load_gguf_model(path) -> tuple[ModelConfig, ModelWeights, dict]:
    """Returns (config, weights, describe_gguf's dict) of a .gguf file, read once; raises
    ConfigError or WeightsError."""
    g = open_gguf(path, vocabulary=False)  # the tokenizer is read on its own
    cfg = gguf_config(g)
    weights = load_gguf_weights(g, cfg)
    return cfg, weights, describe_file(g, cfg)

