"""Loading a GGUF checkpoint: config and weights in one read of the file's header.

The weights laid out for a backend are kept between starts (npud/engine/gguf/packed_cache.py): a
start that finds them reads them back whole and leaves the file's tensors unread."""

from __future__ import annotations

import time

import structlog

from npud.engine.config import ModelConfig
from npud.engine.gguf.config import gguf_config
from npud.engine.gguf.describe import describe_file
from npud.engine.gguf.reader import open_gguf
from npud.engine.gguf.weights import load_gguf_weights
from npud.engine.weights import ModelWeights

log = structlog.get_logger(__name__)

GGUF_Q8 = "gguf-q8"  # the weight format that runs a GGUF file's block matrices against q8 activation rows


def load_gguf_model(path, q8: bool = False) -> tuple[ModelConfig, ModelWeights, dict]:
    """Returns (config, weights, describe_gguf's dict) of a .gguf file, read once; q8: block
    matrices against q8 activation rows (npud/kernels/host/blockq8.c), else the exact float path.
    Raises ConfigError or WeightsError."""
    g = open_gguf(path, vocabulary=False)  # the tokenizer is read on its own
    cfg = gguf_config(g)
    weights = load_gguf_weights(g, cfg, q8)
    return cfg, weights, describe_file(g, cfg)


def load_gguf_prepared(path, q8: bool, backend, prepare) -> tuple[ModelConfig, ModelWeights, dict]:
    """load_gguf_model's triple with the weights already laid out for `backend`: read from the
    packed-weights cache, or loaded, passed through `prepare` (weights -> prepared weights) and
    stored there (a host backend's; any other backend's are prepared at each start). A cache that cannot be read or written costs only the build (logged).
    Raises ConfigError or WeightsError."""
    from npud.engine.gguf import packed_cache
    from npud.kernels.cachedir import cache_state
    from npud.kernels.ggml.gemm import LAYOUT_FLOAT, LAYOUT_Q8

    started = time.perf_counter()
    g = open_gguf(path, vocabulary=False)
    cfg = gguf_config(g)
    info = describe_file(g, cfg)
    root = packed_cache.default_root()
    key = None
    # a refused cache directory (npud/kernels/cachedir.py) keeps no packed weights: its stand-in is
    # this process's private directory, and writing a model's packed weights there gains nothing
    if packed_cache.cacheable(backend) and cache_state().trusted:
        try:
            key = packed_cache.entry_key(path, LAYOUT_Q8 if q8 else LAYOUT_FLOAT, backend, root)
        except OSError as exc:  # FingerprintError too
            log.warning("packed_weights_unkeyed", error=str(exc))
    weights = packed_cache.load(key, root) if key is not None else None
    if weights is not None:
        log.info("gguf_weights_loaded", source="packed_cache", seconds=round(time.perf_counter() - started, 3))
        return cfg, weights, info
    weights = prepare(load_gguf_weights(g, cfg, q8))
    del g  # the file's pages go with the mapping
    packed = time.perf_counter()
    if key is not None:
        packed_cache.store(weights, key, root)
    log.info("gguf_weights_loaded", source="packed_now", seconds=round(packed - started, 3),
             store_seconds=round(time.perf_counter() - packed, 3))
    return cfg, weights, info
