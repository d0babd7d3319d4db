"""Host kernels: batch invariance by construction, widening, packing; the xrt backend's
host-side pieces (the rest of the NPU backend: tests/test_xrt.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kernel_fixtures import _fma32, isa_and_threads  # noqa: F401  (a fixture)

from npud.kernels.select import RowwiseBackend, select_backend
from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.host import KERNELS, QB, TILE, HostBackend, check_batch_invariance, native, pack_q8, pack_tiles
from npud.kernels.host import check
from npud.kernels.host.formats import pack_bf16_pairs, pair_bf16_columns
from npud.kernels import xrt


@pytest.fixture(scope="module")
def host():
    return HostBackend()


def test_self_check_passes_on_this_machine(host):
    assert check_batch_invariance(host) == []


def test_self_check_covers_every_registered_format_and_the_prefill_rows():
    calls = []

    class Recording(HostBackend):
        def linear(self, x, w):
            calls.append((w.fmt, x.shape[0]))
            return super().linear(x, w)

        def attention(self, q, k_cache, v_cache, positions, window, scale):
            calls.append(("attention", q.shape[0]))
            return super().attention(q, k_cache, v_cache, positions, window, scale)

    assert check_batch_invariance(Recording()) == []
    assert {fmt for fmt, _ in calls} == set(KERNELS) | {"attention"}
    assert set(KERNELS) == set(WeightFormat)
    for kind in {kind for kind, _ in calls}:  # decode, verify and every prefill chunk size
        assert {m for k, m in calls if k == kind} == set(range(1, 65)), kind


def _dense(lw: LinearWeight) -> np.ndarray:
    """The [N, K] float64 matrix a rows-layout weight stands for (scale applied)."""
    if lw.fmt in (WeightFormat.BF16, WeightFormat.BF16_BF16):
        return (lw.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if lw.scale is not None:
        return lw.data.astype(np.float64) * lw.scale[:, None]
    return lw.data.astype(np.float64)


class _NumpyBackend(HostBackend):
    """BLAS GEMM: gemv for one row, gemm for several — the thing the contract rules out."""

    def prepare_linear(self, w):
        return w

    def linear(self, x, w):
        return (x @ _dense(w).astype(np.float32).T + (0 if w.bias is None else w.bias)).astype(np.float32)


def test_self_check_catches_a_blas_gemm():
    # negative control: the self-check must be able to fail
    assert check_batch_invariance(_NumpyBackend(), k=1024, n=256) != []


class _PathDependentBackend(HostBackend):
    """Negative control: GEMM rows invariant in M but one ulp off the generic C path's on any other
    path, as a kernel that scaled a block's integer sum at another step would be."""

    def linear(self, x, w):
        out = super().linear(x, w)
        return out if native.isa() == "generic" else np.nextafter(out, np.float32(np.inf))


def test_self_check_compares_the_path_in_use_with_the_generic_c():
    if native.best_isa() == "generic":
        pytest.skip("this CPU runs the generic C path only")
    assert check_batch_invariance(_PathDependentBackend(), formats=[WeightFormat.INT8_Q16]) == [
        f"int8-q16 {native.isa()} != generic"]
    assert check_batch_invariance(HostBackend(), formats=[WeightFormat.INT8_Q16]) == []


def test_rowwise_fallback_is_invariant():
    assert check_batch_invariance(RowwiseBackend(_NumpyBackend()), k=1024, n=256) == []


class _BatchedSoftmaxBackend(HostBackend):
    """Negative control: attention whose rows depend on the call's row count (a term proportional
    to M in each denominator), which the self-check must refuse."""

    def attention(self, q, k_cache, v_cache, positions, window, scale):
        out = np.empty_like(q)
        for m, p in enumerate(positions):
            lo = 0 if window == 0 else max(0, p - window + 1)
            for h in range(q.shape[1]):
                kvh = h // (q.shape[1] // k_cache.shape[1])
                s = (k_cache[lo : p + 1, kvh] @ q[m, h]) * np.float32(scale)
                e = np.exp(s - s.max())
                out[m, h] = e @ v_cache[lo : p + 1, kvh] / (e.sum() + np.float32(1e-3) * q.shape[0])
        return out


def test_self_check_catches_attention_that_depends_on_the_batch():
    failures = check_batch_invariance(_BatchedSoftmaxBackend(), formats=[])
    assert failures and all(f.startswith("attention M=") for f in failures)
    assert check_batch_invariance(RowwiseBackend(_BatchedSoftmaxBackend()), formats=[]) == []


def _paths() -> list[str]:
    """The kernel paths this CPU can run, from the generic C up to the best."""
    return list(native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1])


def test_self_check_passes_past_one_k_chunk_of_every_path(host):
    # K = 1100: three of the q8 path's k chunks (512) and many of the float path's, with
    # 1, 2, 3 and 4-row blocks, so partial sums wait in the output between chunks
    assert check_batch_invariance(host, rows=12, k=1100) == []


@pytest.mark.parametrize("k", [333, 1100])
@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_every_path_and_thread_count_gives_the_same_bits(host, fmt, k, isa_and_threads):
    # the generic C (fmaf), its AVX2 build and the AVX-512 / VNNI intrinsics compute the
    # same chain per element; threads split columns, never k
    rng = np.random.default_rng(7)
    x = rng.standard_normal((13, k)).astype(np.float32)
    w = host.prepare_linear(KERNELS[fmt].sample(rng, 200, k))
    results = []
    for path in _paths():
        assert native.set_isa(path) == path
        for threads in (1, 2, 3):
            native.set_threads(threads)
            results.append((path, threads, np.ascontiguousarray(host.linear(x, w)).view(np.uint32).copy()))
    for path, threads, bits in results[1:]:
        assert np.array_equal(bits, results[0][2]), (path, threads)


@pytest.mark.parametrize("fmt", list(WeightFormat))
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_chunks_taken_back_from_a_stalled_worker_give_the_same_bits(host, fmt, rows, isa_and_threads):
    # a worker that sleeps on every chunk it takes stands for one descheduled on a shared
    # core: the caller takes those chunks back and computes them itself; the bits are the
    # one-thread bits, and the weights stay alive while the sleeping worker may read them
    rng = np.random.default_rng(11)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    w = host.prepare_linear(KERNELS[fmt].sample(rng, 64 * 64, 512))
    native.set_threads(1)
    want = np.ascontiguousarray(host.linear(x, w)).view(np.uint32).copy()
    native.set_threads(2)
    native.stall_workers(50_000)
    try:
        stolen = native.pool_stats()[1]
        got = np.ascontiguousarray(host.linear(x, w)).view(np.uint32)
        assert native.pool_stats()[1] > stolen  # the caller took the sleeping worker's chunk back
        assert np.array_equal(got, want)
        assert native.held_calls() == 0 or native._held  # weights a worker may read are kept
    finally:
        native.stall_workers(0)
    deadline = time.monotonic() + 10
    while native.held_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native.held_calls() == 0 and not native._held  # released once the worker let go


@pytest.mark.parametrize("k, tiles, chunks", [(64, 100, 50), (1024, 100, 100)])
def test_pool_chunks_are_many_per_thread_and_small(k, tiles, chunks, isa_and_threads):
    # 2 threads: 32 chunks per thread (100 tiles of 16 KiB: 2 tiles a chunk), but no chunk
    # reads more than 256 KiB of weights (a 1024-k fp32 tile is just that: one tile a chunk)
    rng = np.random.default_rng(13)
    w = pack_tiles(rng.standard_normal((tiles * TILE, k)).astype(np.float32))
    x = rng.standard_normal((1, k)).astype(np.float32)
    native.set_threads(1)
    want = native.gemm(native.FMT_F32, x, w, tiles * TILE, None, None, True)
    native.set_threads(2)
    offered = native.pool_stats()[3]
    got = native.gemm(native.FMT_F32, x, w, tiles * TILE, None, None, True)
    assert native.pool_stats()[3] - offered == chunks
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_numbas_openmp_threads_wait_passively_and_nothing_else_inherits_it():
    # spinning OpenMP threads held the core the GEMM pool's worker needed (npud/kernels/host/recurrent.py);
    # libgomp shows the policy it read when OMP_DISPLAY_ENV is set. The variable must not stay in
    # the environment: torch in this process and llama.cpp in a child would read it too.
    code = "import os; from npud.kernels.host import recurrent; recurrent.gated_delta(True); print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_DISPLAY_ENV": "TRUE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr
    assert out.stdout.strip() == "None"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "active"},
                         capture_output=True, text=True, check=True)
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in out.stderr
    assert out.stdout.strip() == "active"


def test_weight_addresses_are_forgotten_with_their_arrays():
    # native.py remembers a weight array's address while it lives; a new array that reuses a
    # freed one's id must not be read at the old address
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    for _ in range(20):
        dense = rng.standard_normal((64, 32)).astype(np.float32)
        w = pack_tiles(dense)
        got = native.gemm(native.FMT_F32, x, w, 64, None, None, False)
        assert np.allclose(got, x.astype(np.float64) @ dense.T, atol=1e-4)
        key = id(w)
        assert key in native._addresses
        del w
        assert key not in native._addresses



def test_activation_addresses_are_the_arrays_own():
    # native._addr takes the buffer protocol's address; arrays it refuses take numpy's way
    a = np.arange(48, dtype=np.float32).reshape(6, 8)
    read_only = a.copy()
    read_only.flags.writeable = False
    cases = [a, a[2:5], a[5:], read_only, np.empty((0, 8), np.float32), a[:, 1:3], np.asfortranarray(a)]
    for x in cases:
        assert native._addr(x) == x.ctypes.data


def test_linear_reads_views_and_read_only_rows_at_their_own_address(host):
    # a row-offset view, a read-only array and an empty one reach the kernel at their own data
    rng = np.random.default_rng(15)
    dense = rng.standard_normal((64, 32)).astype(np.float32)
    w = host.prepare_linear(LinearWeight(WeightFormat.FP32, dense, None, None))
    rows = rng.standard_normal((5, 32)).astype(np.float32)
    want = host.linear(rows.copy(), w).view(np.uint32)
    read_only = rows.copy()
    read_only.flags.writeable = False
    assert np.array_equal(host.linear(rows[2:4], w).view(np.uint32), want[2:4])
    assert np.array_equal(host.linear(read_only, w).view(np.uint32), want)
    assert host.linear(rows[:0], w).shape == (0, 64)
    first, second = host.linear(rows[:1], w), host.linear(rows[1:2], w)  # two results kept: distinct outputs
    assert np.array_equal(first.view(np.uint32), want[:1]) and np.array_equal(second.view(np.uint32), want[1:2])

def test_fma_reference_rounds_once():
    a = np.float32(1 + 2**-12)
    assert _fma32(a, a, -1) == np.float32(2**-11 + 2**-24)  # the product's last bit survives
    assert np.float32(a * a) - np.float32(1) == np.float32(2**-11)  # a rounded multiply loses it
    # 2^40 + 2^17 - (2^16 - 2^-24) rounds to float64 halfway between 2^40 and 2^40 + 2^17: the tie
    # goes to the even 2^40 there, but the exact value lies above it
    a, b = np.float32(2**8 * (1 + 2**-20)), np.float32(-(2**8) * (1 - 2**-20))
    assert _fma32(a, b, 2**40 + 2**17) == np.float32(2**40 + 2**17)
    assert np.float32(float(a) * float(b) + (2**40 + 2**17)) == np.float32(2**40)


@pytest.mark.parametrize("fmt", [WeightFormat.FP32, WeightFormat.BF16, WeightFormat.INT8])
def test_float_path_is_one_fma_per_k_in_k_order(host, fmt):
    # the documented chain, element by element: acc = fma(x[k], w[k], acc) for k = 0..K-1,
    # then * scale, then + bias; a reassociated or contracted kernel fails this
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    lw = KERNELS[fmt].sample(rng, 20, 70)
    w = _dense(LinearWeight(fmt, lw.data)).astype(np.float32)  # widened, unscaled
    acc = np.zeros((3, 20), np.float32)
    for k in range(70):
        acc = _fma32(np.repeat(x[:, k : k + 1], 20, axis=1), np.broadcast_to(w[:, k], (3, 20)), acc)
    if lw.scale is not None:
        acc = acc * lw.scale
    want = acc + lw.bias
    got = host.linear(x, host.prepare_linear(lw))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _q8_rows(x: np.ndarray):
    """llama.cpp's q8_0 activation blocks: per 32 values d = max|x| / 127, q = round(x / d) (half away)."""
    m, k = x.shape
    kp = -(-k // QB) * QB
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    blocks = xp.reshape(m, kp // QB, QB)
    d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    t = (blocks * inv[:, :, None]).astype(np.float32)
    r = np.trunc(t)  # roundf: away from zero when the exact fraction is >= 1/2 (floor(|t| + 0.5) can round up)
    q = np.clip(r + np.sign(t) * (np.abs(t - r) >= 0.5), -127, 127).astype(np.int32)
    return q, d


def test_q8_path_is_exact_integer_block_sums_and_one_fma_per_block(host):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 100)).astype(np.float32)
    lw = KERNELS[WeightFormat.INT8_Q8].sample(rng, 70, 100)
    q, d = _q8_rows(x)
    wq = np.zeros((70, q.shape[1] * QB), np.int32)
    wq[:, :100] = lw.data
    isum = np.einsum("mbk,nbk->mnb", q, wq.reshape(70, -1, QB))  # exact integers
    acc = np.zeros((4, 70), np.float32)
    for b in range(q.shape[1]):
        acc = _fma32(isum[:, :, b].astype(np.float32), np.repeat(d[:, b : b + 1], 70, axis=1), acc)
    want = acc * lw.scale + lw.bias
    got = host.linear(x, host.prepare_linear(lw))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q8_quantization_is_llama_cpps_and_the_same_on_every_path(isa_and_threads):
    # the vectorised quantizer (AVX-512) against the scalar one, on rows that reach its edges:
    # halves that round away from zero, a zero block, padding past K, values so small that
    # 1 / d overflows, infinities and NaNs (whatever the scalar code makes of those, the same)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 75)).astype(np.float32)
    x[0, :32] = np.arange(-16, 16, dtype=np.float32) + 0.5
    x[0, 0] = 127  # d = 1: the others are exact halves
    x[1, 32:64] = 0
    x[2, :32] = np.float32(1e-40) * rng.standard_normal(32).astype(np.float32)
    x[2, 5] = 0
    x[3, 3], x[3, 40] = np.inf, -np.inf
    x[4, 7], x[4, 70] = np.nan, np.nan
    x[5, 33] = np.float32(0.49999997) * x[5, 32:64].max() / np.float32(127)  # just below a half step
    kp = 96
    q, d = _q8_rows(x[[0, 1, 5]])
    results = []
    for path in _paths():
        native.set_isa(path)
        results.append((path, *native.quantize_q8(x, kp)))
    xq, xs, xsum = results[0][1:]
    assert np.array_equal(xq[[0, 1, 5]], q.reshape(3, kp)) and np.array_equal(xs[[0, 1, 5]], d)
    assert np.array_equal(xsum[[0, 1, 5]], q.sum(axis=2))
    assert np.all(xq[:, 75:] == 0)
    for path, *got in results[1:]:
        for want, have in zip((xq, xs, xsum), got):
            assert np.array_equal(want.view(np.uint8), have.view(np.uint8)), path


def _q16_rows(x: np.ndarray):
    """int8-q16's activation blocks (q8pairs.c): per 32 values d = max|x| / 32258, Q = round(x / d)
    (half away), hi = rint(Q / 254), lo = Q - 254 hi."""
    m, k = x.shape
    kp = -(-k // QB) * QB
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    blocks = xp.reshape(m, kp // QB, QB)
    d = (np.abs(blocks).max(axis=2) / np.float32(32258)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    t = (blocks * inv[:, :, None]).astype(np.float32)
    r = np.trunc(t)
    q = np.clip(r + np.sign(t) * (np.abs(t - r) >= 0.5), -32258, 32258).astype(np.float32)
    hi = np.rint((q * np.float32(1 / 254)).astype(np.float32))
    return q.astype(np.int32), hi.astype(np.int32), (q - 254 * hi).astype(np.int32), d


def test_q16_path_is_exact_integer_block_sums_of_the_pairs_and_one_fma_per_block(host):
    # int8-q16: each block's exact integer sum Q . w (Q = 254 hi + lo), then one FMA with the
    # block's d, in increasing block order; a kernel that scaled the hi and lo sums apart, or
    # summed a block in float, has other bits
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 100)).astype(np.float32)
    x[1, 7] = 60.0  # an outlier: its block's step is 60 / 32258
    lw = KERNELS[WeightFormat.INT8_Q16].sample(rng, 70, 100)
    q, hi, lo, d = _q16_rows(x)
    assert np.abs(hi).max() <= 127 and np.abs(lo).max() <= 127 and np.array_equal(254 * hi + lo, q)
    wq = np.zeros((70, q.shape[1] * QB), np.int64)
    wq[:, :100] = lw.data
    isum = np.einsum("mbk,nbk->mnb", q.astype(np.int64), wq.reshape(70, -1, QB))  # exact integers
    acc = np.zeros((4, 70), np.float32)
    for b in range(q.shape[1]):
        acc = _fma32(isum[:, :, b].astype(np.float32), np.repeat(d[:, b : b + 1], 70, axis=1), acc)
    want = acc * lw.scale + lw.bias
    for path in _paths():
        native.set_isa(path)
        got = host.linear(x, host.prepare_linear(lw))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path


def test_q16_rows_are_the_documented_pairs_and_the_same_on_every_path(isa_and_threads):
    # the vectorised quantizer (AVX-512) against the scalar one on the edges of q8's test (halves,
    # a zero block, padding, tiny values, infinities, NaNs) and Q at +-32258 (hi at +-127)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 75)).astype(np.float32)
    x[0, :32] = (np.arange(-16, 16, dtype=np.float32) + 0.5) / 32
    x[0, 0] = -32258 / 32  # d = 1 / 32: the others are exact halves of a step
    x[1, 32:64] = 0
    x[2, :32] = np.float32(1e-40) * rng.standard_normal(32).astype(np.float32)
    x[2, 5] = 0
    x[3, 3], x[3, 40] = np.inf, -np.inf
    x[4, 7], x[4, 70] = np.nan, np.nan
    kp = 96
    q, hi, lo, d = _q16_rows(x[[0, 1, 5]])
    results = []
    for path in _paths():
        native.set_isa(path)
        results.append((path, *native.quantize_q8_pairs(x, kp)))
    xq, xs, xsum = results[0][1:]
    pairs = xq.reshape(6, kp // QB, 2, QB)
    assert np.array_equal(pairs[[0, 1, 5], :, 0], hi) and np.array_equal(pairs[[0, 1, 5], :, 1], lo)
    assert np.array_equal(xs[[0, 1, 5]], d) and np.array_equal(xsum[[0, 1, 5]], q.sum(axis=2))
    assert q[0, 0, 0] == -32258 and hi[0, 0, 0] == -127 and lo[0, 0, 0] == 0
    assert np.all(pairs[:, 2, :, 75 - 64 :] == 0)  # padding past K: hi and lo 0
    for path, *got in results[1:]:
        for want, have in zip((xq, xs, xsum), got):
            assert np.array_equal(want.view(np.uint8), have.view(np.uint8)), path


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_linear_matches_float64_reference(host, fmt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 130)).astype(np.float32)
    lw = KERNELS[fmt].sample(rng, 70, 130)
    got = host.linear(x, host.prepare_linear(lw))
    want = x.astype(np.float64) @ _dense(lw).T + lw.bias
    assert got.shape == (5, 70)
    # q8 activations: each block's values are off by up to half a step of max|block| / 127
    # (int8-q16: of max|block| / 32258); bf16 activations: each value off by up to 2^-9 of itself
    bound = {WeightFormat.INT8_Q8: 1e-2, WeightFormat.INT8_Q16: 1e-4, WeightFormat.BF16_BF16: 4e-3}.get(fmt, 1e-5)
    assert np.abs(got - want).max() < bound * np.abs(want).max()


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even, as spelled out in bf16dot.c's npud_round_bf16."""
    u = x.view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    out = np.where(u & 0x7F800000 == 0, (u >> 16) & 0x8000, out)  # zeros and subnormals: signed zero
    return np.where(np.isnan(x), (u >> 16) | 0x40, out).astype(np.uint16)  # NaN: quieted


def _bd_step(acc: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """vdpbf16ps's step (bf16dot.c's bd_step) for small finite inputs: acc + x w rounded once to 24
    significant bits whatever the exponent (in float64 then float32 at 2^64 times the size: exact
    for the test's inputs, as _fma32), then a result below FLT_MIN flushed to a zero of its sign."""
    s = (acc.astype(np.float64) + x.astype(np.float64) * w.astype(np.float64)) * 2.0**64
    r = s.astype(np.float32)
    return np.where(np.abs(r) < np.float32(2.0**-62), np.copysign(np.float32(0), r), r * np.float32(2.0**-64))


def test_bf16_dot_path_is_flushed_fma_pairs_high_first(host):
    # the documented chain: x rounded to bf16, then per k-pair acc = ftz(fma(x[k+1], w[k+1], acc)),
    # acc = ftz(fma(x[k], w[k], acc)) (vdpbf16ps's order), then + bias; K odd: a zero pair last
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 71)).astype(np.float32)
    x[1] *= np.float32(2.0**-124)  # sums near FLT_MIN: the flushes matter
    lw = KERNELS[WeightFormat.BF16_BF16].sample(rng, 20, 71)
    xb = (_bf16_rne(np.pad(x, ((0, 0), (0, 1)))).astype(np.uint32) << 16).view(np.float32)
    w = np.pad(_dense(lw).astype(np.float32), ((0, 0), (0, 1)))
    acc = np.zeros((3, 20), np.float32)
    for k in range(0, 72, 2):
        for kk in (k + 1, k):
            acc = _bd_step(acc, np.repeat(xb[:, kk : kk + 1], 20, axis=1), np.broadcast_to(w[:, kk], (3, 20)))
    want = acc + lw.bias
    got = host.linear(x, host.prepare_linear(lw))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.any((acc[1] == 0) & (want[1] == lw.bias))  # some sums of row 1 were flushed


@pytest.mark.parametrize("path", ["generic", "best"])
def test_bf16_dot_sums_at_flt_min_round_to_24_bits_then_flush(host, path, isa_and_threads):
    # acc = FLT_MIN from the first pair, then less m 2^-k: on the 24-bit grid (2^-150 below
    # FLT_MIN) a sum in [FLT_MIN - 2^-150, FLT_MIN - 2^-151) rounds below FLT_MIN and is flushed,
    # where IEEE's fma (subnormal grid 2^-149) would give FLT_MIN: the emulation's bd_tiny
    cols = [(k, m, sign) for k in range(140, 176) for m in (1.0, 1.5, 1.75) for sign in (1.0, -1.0)]
    w = np.zeros((len(cols), 4), np.float32)
    for c, (k, m, sign) in enumerate(cols):
        w[c, 0], w[c, 2] = sign * 2.0**-63, -sign * m * 2.0 ** (60 - k)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    x = np.array([[2.0**-63, 0, 2.0**-60, 0]], np.float32)
    native.set_isa(None if path == "best" else "generic")
    got = host.linear(x, host.prepare_linear(LinearWeight(WeightFormat.BF16_BF16, bits)))[0]
    exact = np.array([sign * (2.0**-126 - m * 2.0**-k) for k, m, sign in cols])
    on_grid = np.round(exact * 2.0**150) * 2.0**-150  # 24 bits below FLT_MIN: a 2^-150 grid (ties: even)
    want = np.where(np.abs(on_grid) < 2.0**-126, np.copysign(0.0, exact), on_grid).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert 0 < np.sum(want == 0) < len(cols) and np.any((exact > 2.0**-126 - 2.0**-150) & (want == 0))


def test_round_bf16_is_nearest_even_and_never_subnormal():
    rng = np.random.default_rng(13)
    x = (rng.standard_normal(20_000) * 2.0 ** rng.integers(-130, 126, 20_000)).astype(np.float32)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 2.0**-126, 3.4028235e38,
                        1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20], np.float32)
    x = np.concatenate([x, special])
    got = native.round_bf16(x[None, :])[0]
    assert np.array_equal(got, _bf16_rne(x))
    finite = np.isfinite(x) & (np.abs(x) >= 2.0**-126)  # where torch agrees (it keeps subnormals)
    want = torch.from_numpy(x[finite]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got[finite], want)
    assert not np.any((got & 0x7F80 == 0) & (got & 0x7F != 0))  # no subnormal bf16
    assert list(got[-13:-7]) == [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0, 0x8000]
    assert list(got[-7:]) == [0, 0x8000, 0x0080, 0x7F80, 0x3F80, 0x3F82, 0x3F81]


@pytest.mark.parametrize("path", ["generic", "best"])
def test_bf16_dot_rows_have_the_bits_of_one_row_calls(host, path, isa_and_threads):
    # decode (1 row), verify (up to 16) and prefill-sized calls, 1 and 2 threads, against
    # one-row calls on the best path: the forced generic C emulation gives the same bits.
    # K 601: an odd K (a zero pad) and more k-pairs than one chunk (256) of the blocked path
    rng = np.random.default_rng(14)
    x = rng.standard_normal((200, 601)).astype(np.float32)
    w = host.prepare_linear(KERNELS[WeightFormat.BF16_BF16].sample(rng, 200, 601))
    native.set_isa(None)
    single = np.concatenate([host.linear(x[i : i + 1], w) for i in range(200)]).view(np.uint32)
    native.set_isa(None if path == "best" else "generic")
    for threads in (1, 2):
        native.set_threads(threads)
        for m in [*range(1, 17), 64, 200]:
            got = np.ascontiguousarray(host.linear(x[:m], w)).view(np.uint32)
            assert np.array_equal(got, single[:m]), (path, threads, m)


@pytest.mark.skipif(native.best_isa() != "avx512-bf16", reason="the CPU has no AVX512_BF16")
def test_bf16_dot_hardware_matches_its_emulation(host):
    # what the start-up check compares, at every row count of the self-check and a prefill:
    # inputs spanning the fp32 range (flushed and overflowing sums), cancellation, NaN and inf
    assert check.check_bf16_dot_hardware() and native.bf16_dot_hardware()
    x, bits = check._adversarial(np.random.default_rng(15), 100, 136, 301)
    w = host.prepare_linear(LinearWeight(WeightFormat.BF16_BF16, bits))
    try:
        for m in (1, 2, 7, 13, 64, 100):
            hardware = np.ascontiguousarray(host.linear(x[:m], w)).view(np.uint32).copy()
            native.bf16_dot_hardware(False)
            emulated = np.ascontiguousarray(host.linear(x[:m], w)).view(np.uint32)
            native.bf16_dot_hardware(True)
            assert np.array_equal(hardware, emulated), m
    finally:
        native.bf16_dot_hardware(True)


def test_bf16_dot_check_refuses_a_hardware_path_that_differs(monkeypatch):
    # a CPU whose instruction rounds otherwise than the emulation: the check turns the instruction
    # off for this format (its bits then come from the emulation on every path) and says so
    if native.best_isa() != "avx512-bf16":
        pytest.skip("the CPU has no AVX512_BF16")
    kernel = KERNELS[WeightFormat.BF16_BF16]
    real = kernel.linear

    def off_by_one_ulp_on_hardware(x, w, parallel):
        out = real(x, w, parallel)
        return (out.view(np.uint32) ^ 1).view(np.float32) if native.bf16_dot_hardware() else out

    monkeypatch.setattr(kernel, "linear", off_by_one_ulp_on_hardware)
    try:
        assert check.check_bf16_dot_hardware() is False
        assert native.bf16_dot_hardware() is False
    finally:
        native.bf16_dot_hardware(True)


def test_bf16_pairs_layout():
    w = np.arange(1, 70 * 3 + 1, dtype=np.uint16).reshape(70, 3) | 0x3F00  # [N, K], K odd
    w[2, 1] = 0x8001  # a subnormal: stored as a zero of its sign
    t = pack_bf16_pairs(w)
    assert t.shape == (2, 2, TILE) and t.dtype == np.uint32  # K padded to 4
    assert t[1, 0, 5] & 0xFFFF == w[TILE + 5, 0] and t[1, 0, 5] >> 16 == w[TILE + 5, 1]
    assert t[0, 1, 7] & 0xFFFF == w[7, 2] and t[0, 1, 7] >> 16 == 0  # the padding k holds zero
    assert t[0, 0, 2] >> 16 == 0x8000
    assert np.all(t[1, :, 70 - TILE :] == 0)  # padded columns


def test_pack_tiles_layout():
    w = np.arange(70 * 3, dtype=np.float32).reshape(70, 3)
    t = pack_tiles(w)
    assert t.shape == (2, 3, TILE)
    assert t[1, 2, 5] == w[TILE + 5, 2]
    assert np.all(t[1, :, 70 - TILE :] == 0)  # padded columns


def test_bf16_tiles_hold_columns_in_pairs():
    # each 32-bit word holds columns (c, c + 16) of a group of 32: low half c, high half c + 16
    w = np.arange(130 * 2, dtype=np.uint16).reshape(130, 2)  # [N, K]
    words = pair_bf16_columns(pack_tiles(w)).view(np.uint32)  # [3 tiles, K, 32 words]
    assert words.shape == (3, 2, 32)
    pair = words[1, 1, 16 + 5]  # tile 1, k 1, group 1, pair 5: columns 32 + 5 and 48 + 5
    assert pair & 0xFFFF == w[TILE + 32 + 5, 1] and pair >> 16 == w[TILE + 48 + 5, 1]
    assert words[0, 0, 0] & 0xFFFF == w[0, 0] and words[0, 0, 0] >> 16 == w[16, 0]


def test_pack_q8_layout():
    q = np.random.default_rng(10).integers(-127, 128, (70, 40)).astype(np.int8)
    t = pack_q8(q)
    assert t.shape == (2, 64 // 4, TILE, 4) and t.dtype == np.uint8  # K padded to 64
    assert int(t[1, 37 // 4, 5, 37 % 4]) - 128 == q[TILE + 5, 37]
    assert np.all(t[:, 10:] == 128) and np.all(t[1, :, 70 - TILE :] == 128)  # padding holds 0


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_embed_reads_rows_of_the_prepared_table(host, fmt):
    lw = KERNELS[fmt].sample(np.random.default_rng(2), 200, 45)
    ids = np.array([0, 63, 64, 199])
    got = host.embed(host.prepare_linear(lw), ids)
    assert np.array_equal(got, _dense(lw)[ids].astype(np.float32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        host.embed(host.prepare_linear(lw), np.array([200]))


def test_attention_window_and_gqa_match_reference(host):
    rng = np.random.default_rng(3)
    T, H, KVH, D = 12, 4, 2, 8
    q = rng.standard_normal((3, H, D)).astype(np.float32)
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    pos = np.array([9, 10, 11])
    for window in (0, 4):
        got = host.attention(q, k, v, pos, window, D**-0.5)
        for m, p in enumerate(pos):
            lo = 0 if window == 0 else max(0, p - window + 1)
            for h in range(H):
                s = k[lo : p + 1, h // 2] @ q[m, h] * D**-0.5
                e = np.exp(s - s.max())
                want = (e / e.sum()) @ v[lo : p + 1, h // 2]
                assert np.allclose(got[m, h], want, atol=1e-5)


def _exp32(x):
    """attention.c's exponential, as its header spells it: n = round(x log2 e), r = x - n ln 2 in two
    FMAs, the degree-7 Taylor polynomial by Horner with FMAs, times 2^n; 0 below -87."""
    f = np.float32
    x = np.asarray(x, f)
    xc = np.where(x > f(-87), x, f(-87)).astype(f)
    shifter = f(12582912.0)
    n = ((xc * f(1.44269504088896341) + shifter) - shifter).astype(f)
    r = _fma32(n, f(2.12194440e-4), _fma32(n, f(-0.693359375), xc))  # x - n ln2_hi - n ln2_lo
    p = f(1) / f(5040)
    for c in (f(1) / f(720), f(1) / f(120), f(1) / f(24), f(1) / f(6), f(0.5), f(1), f(1)):
        p = _fma32(p, r, c)
    return np.where(x < f(-87), f(0), p * np.ldexp(f(1), n.astype(np.int32)).astype(f)).astype(f)


def _attention_in_order(q, k, v, p, lo, scale):
    """One (row, head) in attention.c's order (its header): each score one FMA per d in order, then
    times scale; exponentials of score - max; the denominator in sixteen lanes (key lo + i to lane
    i mod 16) and a halving tree; the values one FMA per key in key order, divided by it."""
    s = np.zeros(p + 1 - lo, np.float32)
    for d in range(q.shape[0]):
        s = _fma32(q[d], k[lo : p + 1, d], s)
    s = s * np.float32(scale)
    e = _exp32(s - s.max())
    part = np.zeros(16, np.float32)
    for i, x in enumerate(e):
        part[i % 16] = part[i % 16] + x
    for w in (8, 4, 2, 1):
        part[:w] = part[:w] + part[w : 2 * w]
    acc = np.zeros(q.shape[0], np.float32)
    for t, x in enumerate(e):
        acc = _fma32(x, v[lo + t], acc)
    return acc / part[0]


def test_exp_is_within_one_ulp_of_float64_and_the_same_on_every_path(isa_and_threads):
    # softmax takes exp(score - max) <= 0; measured: at most 0.93 ulp (relative 7.9e-8) from the
    # float64 exp over [-87, 0], where numpy's float32 exp reaches 2.4 ulp
    x = np.concatenate([np.linspace(-87, 0, 1_000_001, dtype=np.float32),
                        -np.logspace(-9, np.log10(87), 100_001).astype(np.float32), np.float32([0, -0.0])])
    results = []
    for path in _paths():
        assert native.set_isa(path) == path
        results.append(native.attention_exp(x).view(np.uint32))
    for bits in results[1:]:
        assert np.array_equal(bits, results[0])
    got = results[0].view(np.float32)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    assert np.array_equal(native.attention_exp(np.float32([-87.0001, -100, -np.inf])), np.zeros(3, np.float32))
    sample = x[::97]
    assert np.array_equal(native.attention_exp(sample).view(np.uint32), _exp32(sample).view(np.uint32))


@pytest.mark.parametrize("D", [8, 20])
@pytest.mark.parametrize("window", [0, 4, 19])
def test_attention_bits_follow_the_documented_order(host, window, D, isa_and_threads):
    # every path, one row and ten, against the order spelled out in attention.c's header: a kernel
    # change that moves any bit must bump NUMERICS_VERSION and this reference with it (a window of
    # 19 puts more than 16 keys from a first key off a multiple of 16 into the denominator's lanes)
    rng = np.random.default_rng(6)
    T, H, KVH = 40, 4, 2
    q = rng.standard_normal((10, H, D)).astype(np.float32)
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    pos = np.arange(T - q.shape[0], T)
    scale = np.float32(D**-0.5)
    want = np.empty_like(q)
    for m, p in enumerate(pos):
        lo = 0 if window == 0 else max(0, p - window + 1)
        for h in range(H):
            want[m, h] = _attention_in_order(q[m, h], k[:, h // 2], v[:, h // 2], p, lo, scale)
    for path in _paths():
        native.set_isa(path)
        for rows in (q.shape[0], 1):
            got = host.attention(q[:rows], k, v, pos[:rows], window, scale)
            assert np.array_equal(got.view(np.uint32), want[:rows].view(np.uint32)), (path, rows)


def _attention_case(rng, rows, start, H, KVH, D):
    T = start + rows
    q = rng.standard_normal((rows, H, D)).astype(np.float32)
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    return q, k, v, np.arange(start, T)


def _one_row_calls(q, k, v, pos, window, scale):
    """Each row alone, as a decode step computes it: its own position, the keys up to it."""
    one = HostBackend(parallel=False)
    return np.concatenate([one.attention(q[m : m + 1], k[: p + 1], v[: p + 1], pos[m : m + 1], window, scale)
                           for m, p in enumerate(pos)])


@pytest.mark.parametrize("D", [5, 8, 16, 24, 32, 64, 128, 256])  # 16 and 32: the tiny test models
@pytest.mark.parametrize("window", [0, 7])
def test_attention_rows_have_the_bits_of_one_row_calls(D, window, isa_and_threads):
    # decode, verify and a prefill chunk: M = 1..16 and 37 rows from position 50 on, a group of 3
    # heads per kv head, every thread split (threads divide kv heads and rows, never a row's keys)
    rng = np.random.default_rng(D + window)
    q, k, v, pos = _attention_case(rng, 37, 50, 6, 2, D)
    scale = D**-0.5
    single = _one_row_calls(q, k, v, pos, window, scale)
    for threads in (1, 2, 3):
        native.set_threads(threads)
        for m in [*range(1, 17), 37]:
            got = native.attention(q[:m], k[: pos[m - 1] + 1], v[: pos[m - 1] + 1], pos[:m], window, scale, True)
            assert np.array_equal(got.view(np.uint32), single[:m].view(np.uint32)), (threads, m)


@pytest.mark.parametrize("window", [0, 300])
def test_prefill_sized_attention_rows_have_the_bits_of_one_row_calls(window):
    rng = np.random.default_rng(window)
    q, k, v, pos = _attention_case(rng, 512, 40, 8, 2, 128)
    got = HostBackend().attention(q, k, v, pos, window, 128**-0.5)
    assert np.array_equal(got.view(np.uint32), _one_row_calls(q, k, v, pos, window, 128**-0.5).view(np.uint32))


@pytest.mark.parametrize("window", [0, 9, 30])
def test_every_path_and_thread_count_gives_the_same_attention_bits(window, isa_and_threads):
    rng = np.random.default_rng(8)
    q, k, v, pos = _attention_case(rng, 37, 60, 6, 2, 72)
    results = []
    for path in _paths():
        assert native.set_isa(path) == path
        for threads in (1, 2, 3):
            native.set_threads(threads)
            results.append((path, threads, native.attention(q, k, v, pos, window, 0.125, True).view(np.uint32)))
    for path, threads, bits in results[1:]:
        assert np.array_equal(bits, results[0][2]), (path, threads)


def test_attention_rejects_positions_outside_the_cache(host):
    kv = np.zeros((4, 1, 8), np.float32)
    for p in ([-1], [4], [0, 4], [-1, 3], [1, 2, 4]):  # one row (a decode step) and several
        with pytest.raises(ValueError, match=r"positions must lie in 0\.\.3"):
            host.attention(np.zeros((len(p), 2, 8), np.float32), kv, kv, np.array(p), 0, 1.0)
    for p in ([0], [3], [0, 3]):  # the first and the last key are in the cache
        assert host.attention(np.zeros((len(p), 2, 8), np.float32), kv, kv, np.array(p), 0, 1.0).shape == (len(p), 2, 8)


def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(4).standard_normal(10_000).astype(np.float32) * 1e3
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(xrt._bf16_bits(x), want)


def test_xrt_probe_reports_what_is_missing(tmp_path):
    ok, why = xrt.probe(tmp_path / "no-accel")
    assert not ok and "no NPU device node" in why
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "accel0").touch()
    ok, why = xrt.probe(tmp_path / "accel")
    assert not ok and "pyxrt" in why  # the binding is not installed on our machines


def test_select_backend_auto_falls_back_to_host_with_reason():
    backend, why = select_backend("auto")
    assert backend.name.startswith("host")
    assert why.startswith("host backend:")
    with pytest.raises(xrt.XrtUnavailable):
        select_backend("xrt")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("gpu")


# the NPU backend's design table, call protocol and device tests: tests/test_xrt.py
