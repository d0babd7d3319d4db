"""What a GGUF checkpoint is, from its header alone: for --check-config and `npuctl models`.

Returns plain dicts (JSON-able, standard types only), so the daemon never sees a tensor.
"""

from __future__ import annotations

from npud.engine.config import ModelConfig
from npud.engine.gguf.config import gguf_config
from npud.engine.gguf.reader import GgufFile, open_gguf
from npud.engine.gguf.weights import check_gguf_tensors, parameter_count, quant_mix


def describe_gguf(path) -> dict:
    """Architecture, model type, quant mix, parameters, file size and context of a .gguf,
    after checking that npud can run it (architecture, every tensor present with its shape
    and a type npud runs). Raises ConfigError or WeightsError naming what is wrong."""
    g = open_gguf(path)
    cfg = gguf_config(g)
    check_gguf_tensors(g, cfg)
    return describe_file(g, cfg)


def describe_file(g: GgufFile, cfg: ModelConfig) -> dict:
    """describe_gguf's dict for a file already opened and checked."""
    return {
        "format": "gguf",
        "architecture": g.architecture,
        "model_type": cfg.model_type,
        "name": g.metadata.get("general.name"),
        "quant_mix": quant_mix(g),
        "parameters": parameter_count(g),
        "file_bytes": g.file_bytes,
        "context_length": cfg.max_position_embeddings,
    }
