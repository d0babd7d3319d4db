"""The batch-invariance self-check every backend passes before it serves (kernels/__init__.py):
the GEMMs of every format, and attention."""

from __future__ import annotations

import numpy as np

from kernels.host.formats import KERNELS

# M = 1..16 covers decode and verify; up to 64 covers every chunk a prefill runs (engine/forward.py's
# prefill_chunk), and rows past the register block (6) and past one k chunk (K > 256) take the
# blocked, chunked path of the GEMM.
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
    return failures + check_attention_invariance(backend, rows, rng)


def check_attention_invariance(backend, rows: int, rng) -> list[str]:
    """Attention for M = 1..rows rows (positions from 11 on, keys up to the last row, a sliding
    window) against one-row calls over the keys up to each row. Groups of 3 heads on 3 kv heads
    (two threads split rows, three split kv heads) and a head size of 88 (five full vectors and a
    partial one); the larger M are enough work to take the threaded split."""
    heads, kv_heads, dh, start, window = 9, 3, 88, 11, 40
    t = start + rows
    q = rng.standard_normal((rows, heads, dh)).astype(np.float32)
    k = rng.standard_normal((t, kv_heads, dh)).astype(np.float32)
    v = rng.standard_normal((t, kv_heads, dh)).astype(np.float32)
    pos = np.arange(start, t)
    single = np.concatenate([backend.attention(q[i : i + 1], k[: p + 1], v[: p + 1], pos[i : i + 1], window, 0.1)
                             for i, p in enumerate(pos)])
    failures = []
    for m in range(1, rows + 1):
        got = backend.attention(q[:m], k[: start + m], v[: start + m], pos[:m], window, 0.1)
        if not np.array_equal(got.view(np.uint32), single[:m].view(np.uint32)):
            failures.append(f"attention M={m}")
    return failures
