"""A loaded model: configuration, weights laid out for one backend, RoPE tables.

Immutable once built and shared by every `Forward` (each job has its own state), so a
second job on the same model costs its KV rows, not another copy of the weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from npud.engine.config import ModelConfig, load_config
from npud.engine.weights import ModelWeights, fuse_projections, load_weights, prepare_linears, weight_arrays
from npud.kernels.select import default_backend
from npud.kernels.base import Backend, DecoderLayer, LinearWeight, WeightFormat


class Model:
    """Config + backend-ready weights. Build with `Model.load(dir)` or from dataclasses."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: Backend | None = None, *,
                 prepared: bool = False):
        self.config = config
        self.backend = backend if backend is not None else default_backend()
        # prepared: `weights` are already laid out for this backend (Model.prepare_weights')
        self.weights = weights if prepared else self.prepare_weights(weights, self.backend)
        self.fingerprint = weights.fingerprint
        # what the checkpoint file says about itself (GGUF: architecture, quant mix, sizes); {} otherwise
        self.checkpoint_info: dict = {}
        # an r-row pass in plain steps (npud/engine/pass_costs.py), set by whoever calibrates it; None: not known
        self.pass_costs = None
        # one RoPE table per distinct spec (sliding and full layers may differ)
        cache: dict = {}
        self.inv_freq = [cache.setdefault(spec.rope, spec.rope.inv_freq()) for spec in config.layers]
        self.decoder_layers = decoder_layers(config, self.weights.layers, self.inv_freq)
        if getattr(self.backend, "layer_group", None) is not None:
            from npud.engine.packed import layer_group_for

            # at load, before any pass: the group decides where some linears run (the NPU's runs
            # layer 0's projections on the host), and every pass, grouped or op by op, sees that
            layer_group_for(self)

    @staticmethod
    def prepare_weights(weights: ModelWeights, backend: Backend) -> ModelWeights:
        # fused first, from the loaded rows: each part is then a view of its fused weight, not a copy
        return prepare_linears(fuse_projections(weights, backend), backend)

    @classmethod
    def load(
        cls,
        checkpoint_dir: str | Path,
        fmt: WeightFormat | str = WeightFormat.BF16,
        backend: Backend | None = None,
    ) -> "Model":
        """Read config.json and the safetensors weights, or a .gguf file; raises ConfigError or
        WeightsError, and ValueError for an unknown format (or "gguf-q8" for a checkpoint that is no
        GGUF file)."""
        from npud.engine.gguf import is_gguf
        from npud.engine.gguf.load import GGUF_Q8

        from npud.engine import progress

        progress.report("reading", 0, 1)
        gguf = is_gguf(checkpoint_dir)
        if fmt == GGUF_Q8 and not gguf:
            raise ValueError(f"weight format {GGUF_Q8!r} is for GGUF files; {checkpoint_dir} is not one")
        if isinstance(fmt, str) and fmt != GGUF_Q8:
            fmt = WeightFormat.parse(fmt)
        if gguf:
            # a GGUF file's weights keep their own types; "gguf-q8" runs them against q8 activation
            # rows, any other `fmt` (it applies to safetensors conversion) on the exact float path
            from npud.engine.gguf.load import load_gguf_prepared

            backend = backend if backend is not None else default_backend()
            config, weights, info = load_gguf_prepared(checkpoint_dir, fmt == GGUF_Q8, backend,
                                                       lambda w: cls.prepare_weights(w, backend))
            progress.report("weights", len(config.layers), len(config.layers))
            model = cls(config, weights, backend, prepared=True)
            model.checkpoint_info = info
            return model
        config = load_config(checkpoint_dir)
        weights = load_weights(config, checkpoint_dir, fmt)
        progress.report("weights", len(config.layers), len(config.layers))
        return cls(config, weights, backend)

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (embedding rows aside): the roofline's numerator."""
        w = self.weights
        total = w.lm_head.nbytes
        if w.per_layer_model_projection is not None:
            total += w.per_layer_model_projection.nbytes
        for layer in w.layers:
            total += sum(obj.nbytes for obj in weight_arrays(layer) if isinstance(obj, LinearWeight))
        return total


def decoder_layers(config: ModelConfig, layers: list, inv_freq: list[np.ndarray]) -> tuple[DecoderLayer, ...]:
    """Each layer's weights and spec numbers as the backends take them (npud.kernels.base.DecoderLayer),
    with one backend state dict shared by the model's layers."""
    state: dict = {}
    activation = "silu" if config.hidden_act == "silu" else "gelu_tanh"
    return tuple(
        DecoderLayer(weights=lw, index=spec.index, kind=spec.kind.value, num_heads=spec.num_heads,
                     num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, window=spec.window, scale=spec.scale,
                     eps=config.rms_norm_eps, activation=activation, kv_owner=spec.kv_owner,
                     sandwich_norms=config.sandwich_norms, inv_freq=freq, state=state)
        for spec, lw, freq in zip(config.layers, layers, inv_freq)
    )


def rows_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality of two float32 arrays (NaNs with equal bits compare equal)."""
    return a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a, np.float32).view(np.uint32), np.ascontiguousarray(b, np.float32).view(np.uint32)
    )
