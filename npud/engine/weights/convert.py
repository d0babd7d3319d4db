"""Stored tensors converted to the kernels' formats (float32, bf16 bits, int8 rows), chunk by chunk."""

from __future__ import annotations

import numpy as np

from npud.engine.weights.checkpoint import TensorRef, WeightsError
from npud.kernels.base import WeightFormat, quantize_int8_rows

# rows converted per step are sized to about this many elements, to bound temporaries
_CHUNK_ELEMENTS = 1 << 20


def _as_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    """Widens a block of stored values to float32 (exactly: f16 and bf16 fit in f32)."""
    if dtype == "BF16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Returns bf16 bits (uint16) of float32 `x`, rounded to nearest even as torch does.

    Every NaN becomes the quiet NaN 0x7FC0 (torch gives 0x7FC0 or 0xFFFF depending on
    its code path); values past the largest bf16 round to infinity, as in torch.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the
    # dropped half is above one half, or equal to it with an odd kept half
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _convert_matrix(ref: TensorRef, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray | None]:
    """Returns (data, scale) of a [N, K] tensor in `fmt`, converting a block of rows at a time."""
    fmt = fmt.storage  # a format that shares another's data (INT8_Q8) converts as that one
    src = ref.array()
    n, k = src.shape
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    if fmt is WeightFormat.FP32:
        out = np.empty((n, k), np.float32)
    elif fmt is WeightFormat.BF16:
        out = np.empty((n, k), np.uint16)
    elif fmt is WeightFormat.INT8:
        out = np.empty((n, k), np.int8)
        scale = np.empty(n, np.float32)
    else:
        raise WeightsError(f"unknown weight format {fmt!r}")
    for r0 in range(0, n, rows):
        block = src[r0:r0 + rows]
        if fmt is WeightFormat.BF16 and ref.dtype == "BF16":
            out[r0:r0 + rows] = block
            continue
        block32 = _as_float32(block, ref.dtype)
        if fmt is WeightFormat.FP32:
            out[r0:r0 + rows] = block32
        elif fmt is WeightFormat.BF16:
            out[r0:r0 + rows] = f32_to_bf16_bits(block32)
        else:
            if not np.all(np.isfinite(block32)):
                bad = r0 + int(np.nonzero(~np.all(np.isfinite(block32), axis=1))[0][0])
                raise WeightsError(
                    f"{ref.path}: tensor {ref.name!r} row {bad} holds NaN or infinity; it cannot be quantized to int8"
                )
            out[r0:r0 + rows], scale[r0:r0 + rows] = quantize_int8_rows(block32)
    return out, (scale if fmt is WeightFormat.INT8 else None)


def _vector(ref: TensorRef) -> np.ndarray:
    return np.ascontiguousarray(_as_float32(ref.array(), ref.dtype), dtype=np.float32)


