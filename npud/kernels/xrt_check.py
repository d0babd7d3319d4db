"""The start-up check of one NPU GEMM design, on its real (K, N), before any weight uses it.

Two questions, answered separately:

1. Is the device's GEMM the GEMM? Each output is compared with the host GEMM of the same
   bf16-rounded inputs (the host adds a[k] * b[k] for k = 0..K-1 in order in fp32), within
   the design's tolerance policy:
   - "bf16-exact-products" (npu1; npu2 built without emulation): a product of two bf16
     numbers is exact in fp32, so the only differences are the rounding of the K - 1
     additions: any fp32 summation order is within (K - 1) u sum|a_k b_k| of the exact sum
     (u = 2^-24), so two orders differ by at most 2 (K - 1) u sum|a_k b_k|.
   - "bfp16-blocks" (npu2's stock build, which defines AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16):
     the micro-kernel first turns each block of 8 consecutive values along K (of a row of A
     and of a column of B) into bfp16, 8-bit mantissas under the block's largest exponent.
     Taking each value's error as at most d = 2^-6 max|block| (truncation or rounding), the
     products' error is at most sum_k (da_k |b_k| + |a_k| db_k + da_k db_k), to which the
     summation bound above is added for the quantised magnitudes.
   - "int8-rows" (an int8 design, either generation): the host multiplies the int8 weight q
     (scale s per output row) by fp32 activations, y_h = fl(fl-sum_k x_k q_k) * s, one FMA per k.
     The array takes each row quantized, d = max|x| / 127 and xq = round(x / d) (xrt_device.py's
     quantize_rows), sums xq_k q_k exactly in int32 (K <= INT8_MAX_K: no overflow) and the
     result is scaled back, y = fl(fl(float(isum) d) s). With da = d (1/2 + 2^-16) the bound on
     |x_k - d xq_k| (rounding to an integer, plus the fp32 roundings of 1/d and x id), the
     difference is at most
         s [ da sum_k |q_k| (1 + 4u) + 2 (K + 4) u sum_k |x_k q_k| ]
     (the quantization's error, carried through three output roundings; the host's K FMA
     roundings, its scale's and the array's three, gamma_K <= 2 K u for K u <= 1/2).
     The integer sums do not depend on their order, so the outputs must also be the written-down
     arithmetic's bit for bit (the rows quantized and the sums taken here): a saturating or
     shifted accumulator fails the check even where it would stay within the bound.
   An aborted run (zeros), a design compiled for another shape or layout, or a bfp16 design
   checked with the bf16 policy all fall outside, and the design's shape then runs on the host.
2. Does a row's result depend on the rows beside it or on its place in the pass? A batch of
   2M + 3 rows (three passes, the last partial) is compared bit for bit with the same rows
   run one per pass. If they differ, the design is used one row per pass (row-at-a-time).
"""

from __future__ import annotations

import numpy as np

from npud.kernels.base import DeviceFault, LinearWeight, WeightFormat, quantize_int8_rows

U = 2.0**-24  # fp32 unit roundoff
SEED = 20240615
BFP16_BLOCK = 8  # values along K that share one exponent in npu2's bfp16 emulation
BFP16_REL = 2.0**-6  # a value's largest error, relative to its block's largest magnitude


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    from npud.kernels.xrt_device import bf16_bits

    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def tolerance(a: np.ndarray, w: np.ndarray, policy: str = "bf16-exact-products",
              scale: np.ndarray | None = None) -> np.ndarray:
    """Per output, the largest difference from the host GEMM the policy allows, for
    a: [M, K], w: [N, K] -> [M, N] (float64). "bf16-exact-products": two fp32 summation orders,
    2 (K - 1) u sum_k |a[m, k] w[n, k]|; "bfp16-blocks": that over the quantised magnitudes plus
    the block quantisation's error; "int8-rows": w the int8 weight's integers and `scale` its
    scale per output row [N], against the host's int8 GEMM of fp32 rows a (the module's
    docstring). Raises ValueError for an unknown policy or an int8 one without its scale."""
    k = a.shape[1]
    aa, ww = np.abs(a.astype(np.float64)), np.abs(w.astype(np.float64))
    if policy == "bf16-exact-products":
        return 2.0 * max(k - 1, 1) * U * (aa @ ww.T)
    if policy == "int8-rows":
        if scale is None:
            raise ValueError("the int8-rows tolerance needs the weight's scale per output row")
        return int8_rows_bound(aa, ww, np.abs(np.asarray(scale, np.float64)))
    if policy != "bfp16-blocks":
        raise ValueError(f"unknown tolerance policy {policy!r}")
    da, dw = _block_error(aa), _block_error(ww)
    products = da @ ww.T + aa @ dw.T + da @ dw.T
    return products + 2.0 * max(k - 1, 1) * U * ((aa + da) @ (ww + dw).T)


def int8_rows_bound(aa: np.ndarray, qq: np.ndarray, s: np.ndarray) -> np.ndarray:
    """|a| [M, K], |q| [N, K], |s| [N] -> [M, N]: s [da sum|q| (1 + 4u) + 2 (K + 4) u sum|a q|], da =
    d (1/2 + 2^-16), d = max|a| / 127 per row, rounded up by its own fp32 rounding (the module's
    docstring derives it)."""
    k = aa.shape[1]
    d = aa.max(axis=1, initial=0.0) / 127.0 * (1 + U)
    da = d * (0.5 + 2.0**-16)
    tiny = d < np.finfo(np.float32).tiny * (1 + U)  # quantize_rows makes such a row zeros: |x_k - 0| <= 127 d
    da = np.where(tiny, 127.0 * d, da)
    return s[None, :] * (da[:, None] * qq.sum(axis=1)[None, :] * (1 + 4 * U) + 2.0 * (k + 4) * U * (aa @ qq.T))


def _int8_exact(d, x: np.ndarray, q: np.ndarray, scale: np.ndarray, got: np.ndarray) -> list[str]:
    """An int8 design's sums are exact integers, whatever their order: its outputs must be the
    written-down arithmetic's bit for bit (the rows quantized, the sums in int64 here, scaled back),
    which catches what the bound cannot (a saturating or shifted accumulator, a lost low bit)."""
    from npud.kernels.xrt_device import dequantize, quantize_rows

    xq, dx = quantize_rows(x)
    exact = dequantize((xq.astype(np.int64) @ q.astype(np.int64).T).astype(np.int32), dx, scale)
    off = got.view(np.uint32) != exact.view(np.uint32)
    if not off.any():
        return []
    m, n = map(int, np.argwhere(off)[0])
    return [f"K={d.K} N={d.N}: {int(off.sum())} of {off.size} outputs are not the exact int8 sums scaled back "
            f"(first: row {m}, column {n}: {got[m, n]!r} vs {exact[m, n]!r})"]


def _block_error(x: np.ndarray) -> np.ndarray:
    """|x| [R, K] -> each value's largest bfp16 error: BFP16_REL times its block's largest |x|."""
    r, k = x.shape
    pad = -k % BFP16_BLOCK
    blocks = np.pad(x, ((0, 0), (0, pad))).reshape(r, -1, BFP16_BLOCK)
    return np.repeat(blocks.max(axis=2) * BFP16_REL, BFP16_BLOCK, axis=1)[:, :k]


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
    scale = None
    if d.weight_format == "int8":  # the int8 rows an int8 model loads
        q, scale = quantize_int8_rows(w32)
        weight = LinearWeight(WeightFormat.INT8, q, scale)
        wf = q.astype(np.float32)
    else:
        bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
        weight = LinearWeight(WeightFormat.BF16, bits)
        wf = (bits.astype(np.uint32) << 16).view(np.float32)
    want = host.linear(x, host.prepare_linear(weight))  # the host's GEMM of this format
    try:
        handle = runner.upload_weight(weight)
        got = np.concatenate([runner.run(x[r0 : r0 + d.M], handle, timeout_ms) for r0 in range(0, rows, d.M)])
        picked = sorted({0, 1, d.M - 1, d.M, d.M + 1, 2 * d.M, rows - 1})
        single = {i: runner.run(x[i : i + 1], handle, timeout_ms)[0] for i in picked}
        runner.device.forget(handle)  # the check's B buffers go
    except DeviceFault as exc:
        if getattr(exc, "state", None) in ("worker_died", "worker_hung", "worker_lost"):
            raise  # the device is gone, not this design
        return [str(exc)], []
    failures = []
    if not np.any(got) and np.any(want):
        failures.append(f"K={d.K} N={d.N}: the device returned all zeros (an aborted run?)")
    else:
        from npud.kernels.xrt import tolerance_policy

        policy = tolerance_policy(d)
        off = ~(np.abs(got.astype(np.float64) - want) <= tolerance(x, wf, policy, scale))  # a NaN is off too
        if off.any():
            m, n = map(int, np.argwhere(off)[0])
            failures.append(f"K={d.K} N={d.N}: {int(off.sum())} of {off.size} outputs differ from the host "
                            f"by more than the {policy} tolerance (first: row {m}, column {n}: {got[m, n]!r} "
                            f"vs {want[m, n]!r})")
        if d.weight_format == "int8" and not failures:
            failures += _int8_exact(d, x, q, scale, got)
    rowwise = [f"K={d.K} N={d.N} row {i} of {rows}" for i, row in single.items()
               if not np.array_equal(row.view(np.uint32), got[i].view(np.uint32))]
    return failures, rowwise
