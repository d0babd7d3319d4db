"""The start-up check of one NPU GEMM design, on its real (K, N), before any weight uses it.

Two questions, answered separately:

1. Is the device's GEMM the GEMM? Each output is compared with the host GEMM of the same
   bf16-rounded inputs (the host adds a[k] * b[k] for k = 0..K-1 in order in fp32). A
   product of two bf16 numbers is exact in fp32, so the only differences are the rounding
   of the K - 1 additions: any fp32 summation order is within (K - 1) u sum|a_k b_k| of the
   exact sum (u = 2^-24), so two orders differ by at most 2 (K - 1) u sum|a_k b_k|. That is
   the tolerance. An aborted run (zeros), a design compiled for another shape or layout, or
   inputs quantised further than bf16 (npu2's bfp16 emulation, where 8 values share one
   exponent) all fall outside it, and the design's shape then runs on the host.
2. Does a row's result depend on the rows beside it or on its place in the pass? A batch of
   2M + 3 rows (three passes, the last partial) is compared bit for bit with the same rows
   run one per pass. If they differ, the design is used one row per pass (row-at-a-time).
"""

from __future__ import annotations

import numpy as np

from kernels.base import DeviceFault, LinearWeight, WeightFormat

U = 2.0**-24  # fp32 unit roundoff
SEED = 20240615


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    from kernels.xrt import _bf16_bits

    return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def tolerance(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output, the largest difference two fp32 summation orders of a @ w.T can have:
    2 (K - 1) u sum_k |a[m, k] w[n, k]|, for a: [M, K], w: [N, K] -> [M, N] (float64)."""
    k = a.shape[1]
    return 2.0 * max(k - 1, 1) * U * (np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


def check_design(runner, host, timeout_ms: int, seed: int = SEED) -> tuple[list[str], list[str]]:
    """Run the design of `runner` against the host GEMM and against itself one row per pass.

    Returns (failures, rowwise): failures say why the device's GEMM cannot be used (off the
    tolerance, all zeros, a run that did not complete); rowwise say which rows changed bits
    between the batched and the one-row passes. Both empty: the design is good as it is.
    """
    d = runner.design
    rng = np.random.default_rng(seed)
    rows = 2 * d.M + 3
    x = bf16_round(rng.standard_normal((rows, d.K)).astype(np.float32))
    w32 = (rng.standard_normal((d.N, d.K)) / np.sqrt(d.K)).astype(np.float32)
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
    weight = LinearWeight(WeightFormat.BF16, bits)
    want = host.linear(x, host.prepare_linear(weight))  # in-order fp32 sums of exact products
    wf = (bits.astype(np.uint32) << 16).view(np.float32)
    try:
        bo_b = runner.upload_weight(weight)
        got = np.concatenate([runner.run(x[r0 : r0 + d.M], bo_b, timeout_ms) for r0 in range(0, rows, d.M)])
        picked = sorted({0, 1, d.M - 1, d.M, d.M + 1, 2 * d.M, rows - 1})
        single = {i: runner.run(x[i : i + 1], bo_b, timeout_ms)[0] for i in picked}
    except DeviceFault as exc:
        return [str(exc)], []
    failures = []
    if not np.any(got) and np.any(want):
        failures.append(f"K={d.K} N={d.N}: the device returned all zeros (an aborted run?)")
    else:
        off = ~(np.abs(got.astype(np.float64) - want) <= tolerance(x, wf))  # a NaN is off too
        if off.any():
            m, n = map(int, np.argwhere(off)[0])
            failures.append(f"K={d.K} N={d.N}: {int(off.sum())} of {off.size} outputs differ from the host "
                            f"by more than 2(K-1)u sum|ab| (first: row {m}, column {n}: {got[m, n]!r} vs {want[m, n]!r})")
    rowwise = [f"K={d.K} N={d.N} row {i} of {rows}" for i, row in single.items()
               if not np.array_equal(row.view(np.uint32), got[i].view(np.uint32))]
    return failures, rowwise
