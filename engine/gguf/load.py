"""Loading a GGUF checkpoint: config and weights in one read of the file's header."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.gguf.config import gguf_config
from engine.gguf.describe import describe_file
from engine.gguf.reader import open_gguf
from engine.gguf.weights import load_gguf_weights
from engine.weights import ModelWeights


GGUF_Q8 = "gguf-q8"  # the weight format that runs a GGUF file's block matrices against q8 activation rows


def load_gguf_model(path, q8: bool = False) -> tuple[ModelConfig, ModelWeights, dict]:
    """Returns (config, weights, describe_gguf's dict) of a .gguf file, read once; q8: block
    matrices against q8 activation rows (kernels/host/blockq8.c), else the exact float path.
    Raises ConfigError or WeightsError."""
    g = open_gguf(path, vocabulary=False)  # the tokenizer is read on its own
    cfg = gguf_config(g)
    weights = load_gguf_weights(g, cfg, q8)
    return cfg, weights, describe_file(g, cfg)

