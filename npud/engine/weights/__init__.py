"""Checkpoint weights: safetensors files read by hand, converted tensor by tensor.

checkpoint.py reads safetensors headers, maps tensors and fingerprints a checkpoint;
layout.py holds the dataclasses the forward pass reads; convert.py turns stored tensors
into the kernels' formats; load.py checks and loads a dense model, hybrid.py a Gemma 4 or
Qwen3.5 one. The names below are the package's public surface (`from npud.engine.weights import ...`).
"""

from npud.engine.weights.checkpoint import (
    TensorRef,
    WeightsError,
    checkpoint_files,
    checkpoint_fingerprint,
    open_checkpoint,
    read_safetensors_header,
)
from npud.engine.weights.convert import f32_to_bf16_bits, quantize_int8_rows
from npud.engine.weights.layout import (
    AttentionWeights,
    LayerWeights,
    LinearAttentionWeights,
    MlpWeights,
    ModelWeights,
    fuse_projections,
    prepare_linears,
    weight_arrays,
)
from npud.engine.weights.load import load_weights

__all__ = [
    "AttentionWeights",
    "LayerWeights",
    "LinearAttentionWeights",
    "MlpWeights",
    "ModelWeights",
    "TensorRef",
    "WeightsError",
    "checkpoint_files",
    "checkpoint_fingerprint",
    "f32_to_bf16_bits",
    "fuse_projections",
    "load_weights",
    "open_checkpoint",
    "prepare_linears",
    "quantize_int8_rows",
    "read_safetensors_header",
    "weight_arrays",
]
