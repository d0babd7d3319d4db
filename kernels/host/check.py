"""The batch-invariance self-check every backend passes before it serves (kernels/__init__.py)."""

from __future__ import annotations

import numpy as np

from kernels.host.formats import KERNELS

# M = 1..16 covers decode and verify; up to 64 covers every chunk a prefill runs (engine/forward.py's
# prefill_chunk), and rows past the register block (6 float, 4 q8) and, on the float path, past one
# k chunk (K > 256) take the blocked, chunked path of the GEMM (the q8 path's chunks of 512 k:
# tests/test_kernels.py).
CHECK_ROWS = 64


def check_batch_invariance(backend, rows: int = CHECK_ROWS, k: int = 300, n: int = 136, seed: int = 0,
                           formats=None) -> list[str]:
    """Run each GEMM format for M = 1..rows and compare row bits with one-row calls.

    `formats`: the WeightFormats to check (default: every format the host backend registers).
    Returns a list of failure descriptions (empty when every row of every M matched). N is
    not a multiple of the 64-column tile and K not one of the q8 block, so padding is
    exercised too.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[rows // 2] *= 1e-3  # a row of another magnitude: its own quantization scales
    failures = []
    for fmt in formats if formats is not None else list(KERNELS):
        w = backend.prepare_linear(KERNELS[fmt].sample(rng, n, k))
        single = np.concatenate([backend.linear(x[i : i + 1], w) for i in range(rows)])
        for m in range(1, rows + 1):
            got = np.ascontiguousarray(backend.linear(x[:m], w))
            if not np.array_equal(got.view(np.uint32), single[:m].view(np.uint32)):
                failures.append(f"{fmt.value} M={m}")
    return failures
