"""The batch-invariance self-check every backend passes before it serves (npud/kernels/__init__.py):
the GEMMs of every format, attention, and the per-row kernels (RMS norm, RoPE, SiLU, and the
fused residual add + RMS norm and head norm + RoPE)."""

from __future__ import annotations

import numpy as np
import structlog

from npud.kernels.base import LinearWeight, WeightFormat, add_rms_norm, norm_rope
from npud.kernels.host import native
from npud.kernels.host.formats import KERNELS

log = structlog.get_logger(__name__)

# M = 1..16 covers decode and verify; up to 64 covers every chunk a prefill runs (npud/engine/forward.py's
# prefill_chunk), and rows past the register block (6 float, 4 q8) and, on the float path, past one
# k chunk (K > 256) take the blocked, chunked path of the GEMM (the q8 path's chunks of 512 k:
# tests/test_kernels.py).
CHECK_ROWS = 64


def check_batch_invariance(backend, rows: int = CHECK_ROWS, k: int = 300, n: int = 136, seed: int = 0,
                           formats=None) -> list[str]:
    """Run each GEMM format for M = 1..rows and compare row bits with one-row calls, and the
    M = rows call on the path in use with the generic C path's.

    `formats`: the WeightFormats to check (default: every format the host backend registers).
    Returns a list of failure descriptions (empty when every row of every M matched). N is
    not a multiple of the 64-column tile and K not one of the q8 block, so padding is
    exercised too.
    """
    formats = list(KERNELS) if formats is None else formats
    if WeightFormat.BF16_BF16 in formats:
        check_bf16_dot_hardware()  # first: the invariance check then runs the path that will serve
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[rows // 2] *= 1e-3  # a row of another magnitude: its own quantization scales
    failures = []
    for fmt in formats:
        w = backend.prepare_linear(KERNELS[fmt].sample(rng, n, k))
        single = np.concatenate([backend.linear(x[i : i + 1], w) for i in range(rows)])
        for m in range(1, rows + 1):
            got = np.ascontiguousarray(backend.linear(x[:m], w))
            if not np.array_equal(got.view(np.uint32), single[:m].view(np.uint32)):
                failures.append(f"{fmt.value} M={m}")
        failures += _path_failures(backend, fmt, x, w, single)
    return failures + check_attention_invariance(backend, rows, rng) + check_rowwise_invariance(backend, rows, rng)


def _path_failures(backend, fmt: WeightFormat, x: np.ndarray, w: LinearWeight, want: np.ndarray) -> list[str]:
    """The generic C path's bits for the same rows, against the path in use's: every ISA path
    computes each element's documented chain (gemm.c), so a path that sums a block in another
    order, or scales it at another step, shows here."""
    used = native.isa()
    if used == "generic":
        return []
    native.set_isa("generic")
    try:
        got = np.ascontiguousarray(backend.linear(x, w))
    finally:
        native.set_isa(used)
    return [] if np.array_equal(got.view(np.uint32), want.view(np.uint32)) else [f"{fmt.value} {used} != generic"]


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


def check_rowwise_invariance(backend, rows: int, rng) -> list[str]:
    """RMS norm, RoPE (a partial rotation: 2 x 20 of 44 dimensions), SiLU-and-multiply and the
    fused add + norm and norm + RoPE (the backend's own, or their composition) for M = 1..rows
    against one-row calls; row lengths of 300 and 20 leave vector tails."""
    x = rng.standard_normal((rows, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    q = rng.standard_normal((rows, 3, 44)).astype(np.float32)
    pos = rng.integers(0, 5000, rows)
    inv = (1.0 / 10000.0 ** (np.arange(20) / 20)).astype(np.float32)
    kernels = {
        "rms_norm": lambda a, b: backend.rms_norm(x[a:b], w, 1e-6),
        "rope": lambda a, b: backend.rope(q[a:b], pos[a:b], inv),
        "silu_mul": lambda a, b: backend.silu_mul(x[a:b], x[a:b] * 0.5),
        "add_rms_norm": lambda a, b: np.concatenate(add_rms_norm(backend, x[a:b], x[a:b] * 0.5, w, 1e-6), axis=1),
        "norm_rope": lambda a, b: norm_rope(backend, q[a:b], w[:44], pos[a:b], inv, 1e-6),
    }
    failures = []
    for name, call in kernels.items():
        single = np.concatenate([call(i, i + 1) for i in range(rows)])
        for m in range(1, rows + 1):
            if not np.array_equal(call(0, m).view(np.uint32), single[:m].view(np.uint32)):
                failures.append(f"{name} M={m}")
    return failures


def _adversarial(rng: np.random.Generator, rows: int, cols: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, k] f32 and bf16 weights [cols, k] whose products span the whole fp32 range: each row
    and column has its own scale (2^-66 .. 2^66) and each value a spread around it, so that some
    (row, column) sums stay near FLT_MIN (flushed or not), some overflow, and most cancel in
    part; a row holds a NaN and one an inf. Then columns whose sums land just below FLT_MIN, where
    rounding to 24 bits and rounding on the subnormal grid differ (row 0 carries them)."""
    def spread(n: int) -> np.ndarray:
        scale = rng.integers(-66, 67, (n, 1)) + rng.integers(-10, 11, (n, k))
        return (rng.standard_normal((n, k)) * 2.0**scale).astype(np.float32)

    x, w = spread(rows), spread(cols)
    x[1, 3], x[2, 5] = np.nan, np.inf
    x[0] = 0
    x[0, :4] = [2.0**-63, 0, 2.0**-60, 0]  # with w[c, :4] = (+-2^-63, 0, -+m 2^(60 - e), 0): FLT_MIN - m 2^-e
    for c in range(cols):
        e, m, sign = 140 + c % 18, (1.0, 1.5, 1.75)[c // 18 % 3], (1.0, -1.0)[c // 54 % 2]
        w[c, :4] = [sign * 2.0**-63, 0, -sign * m * 2.0 ** (60 - e), 0]
    return x, (w.view(np.uint32) >> 16).astype(np.uint16)


def check_bf16_dot_hardware(rows: int = 8, k: int = 301, n: int = 136, seed: int = 1) -> bool:
    """Compare bf16-bf16's vdpbf16ps path with its C emulation (bf16dot.c's bd_step) on adversarial
    inputs (_adversarial); where they differ, the format uses the emulation from then on (so its
    bits never depend on the path) and a warning says so. Returns whether the instruction is in use."""
    if not native.bf16_dot_hardware():
        return False
    kernel = KERNELS[WeightFormat.BF16_BF16]
    x, bits = _adversarial(np.random.default_rng(seed), rows, n, k)
    w = kernel.prepare(LinearWeight(WeightFormat.BF16_BF16, bits))
    hardware = kernel.linear(x, w, False).view(np.uint32).copy()
    native.bf16_dot_hardware(False)
    emulated = kernel.linear(x, w, False).view(np.uint32)
    if np.array_equal(hardware, emulated):
        native.bf16_dot_hardware(True)
        return True
    log.warning("bf16_dot_hardware_refused", reason="vdpbf16ps differs from its emulation on this CPU",
                elements=int((hardware != emulated).sum()), isa=native.isa())
    return False
