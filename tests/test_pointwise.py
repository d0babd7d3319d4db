"""The C per-row kernels (npud/kernels/host/pointwise.c): RMS norm, RoPE, SiLU- and GELU-and-multiply, and the fused
residual add + RMS norm and head norm + RoPE.

Row i of an M-row call has the bits of a one-row call on every kernel path and thread count; the
bits follow the order pointwise.c's header documents (RMS norm, RoPE) and are close to float64;
a fused kernel gives the bits of the calls it replaces, its inputs read where they lie in a wider
matrix (the column blocks of a fused projection's output)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernel_fixtures import isa_and_threads  # noqa: F401  (a fixture)

from npud.kernels.host import HostBackend, native, pointwise
from npud.kernels.host.check import check_rowwise_invariance

ROWS = [*range(1, 17), 37, 512]  # decode, verify, a prefill chunk, a prefill


def _paths() -> list[str]:
    return list(native.ISA_NAMES[: native.ISA_NAMES.index(native.best_isa()) + 1])


def _inv_freq(half: int, dh: int) -> np.ndarray:
    return (1.0 / 10000.0 ** (np.arange(0, 2 * half, 2) / dh)).astype(np.float32)


def _cases(rng):
    """(name, call(rows, parallel) -> output) of each kernel on inputs of 512 rows whose sizes
    leave vector tails (D = 1000, half = 56 of Dh = 120 with 8 dimensions passed through); the
    fused kernels and silu_mul read column blocks of wider matrices, as a fused projection's."""
    x = rng.standard_normal((512, 1000)).astype(np.float32)
    x[5] *= 1e-3  # a row of another magnitude
    w = rng.standard_normal(1000).astype(np.float32)
    q = rng.standard_normal((512, 5, 120)).astype(np.float32)
    pos = rng.integers(0, 40000, 512)
    inv = _inv_freq(56, 120)
    up = rng.standard_normal((512, 1000)).astype(np.float32)
    gate = (x * 4).astype(np.float32)
    delta = rng.standard_normal((512, 1000)).astype(np.float32)
    wide = rng.standard_normal((512, 64 + 5 * 120 + 40)).astype(np.float32)  # [other, q, other] columns
    q_wide = wide[:, 64 : 64 + 5 * 120].reshape(512, 5, 120)
    head_w = rng.standard_normal(120).astype(np.float32)
    gate_up = np.concatenate([gate, np.zeros((512, 24), np.float32), up], axis=1)  # halves 1024 apart
    return [
        ("rms_norm", lambda a, b, par: pointwise.rms_norm(x[a:b], w, 1e-6, par)),
        ("rope", lambda a, b, par: pointwise.rope(q[a:b], pos[a:b], inv, par)),
        ("silu_mul", lambda a, b, par: pointwise.silu_mul(gate[a:b], up[a:b], par)),
        ("add_rms_norm", lambda a, b, par: np.concatenate(pointwise.add_rms_norm(x[a:b], delta[a:b], w, 1e-6, par))),
        ("norm_rope", lambda a, b, par: pointwise.norm_rope(q_wide[a:b], wide.shape[1], head_w, 1e-6, pos[a:b],
                                                            inv, par)),
        ("silu_mul strided", lambda a, b, par: pointwise.silu_mul(gate_up[a:b, :1000], gate_up[a:b, 1024:], par,
                                                                  1024 + 1000, 1024 + 1000)),
        ("gelu_tanh_mul strided", lambda a, b, par: pointwise.gelu_tanh_mul(
            gate_up[a:b, :1000], gate_up[a:b, 1024:], par, 1024 + 1000, 1024 + 1000)),
    ], {  # what the fused kernels replace: the composed calls on contiguous copies
        "add_rms_norm": lambda a, b, par: np.concatenate(
            [x[a:b] + delta[a:b], pointwise.rms_norm(x[a:b] + delta[a:b], w, 1e-6, par)]),
        "norm_rope": lambda a, b, par: pointwise.rope(
            pointwise.rms_norm(q_wide[a:b].reshape(-1, 120).copy(), head_w, 1e-6, par).reshape(-1, 5, 120),
            pos[a:b], inv, par),
        "silu_mul strided": lambda a, b, par: pointwise.silu_mul(gate[a:b], up[a:b], par),
        "gelu_tanh_mul strided": lambda a, b, par: pointwise.gelu_tanh_mul(gate[a:b], up[a:b], par),
    }


@pytest.mark.parametrize("kernel", range(7))
def test_rows_have_the_bits_of_one_row_calls_on_every_path_and_thread_count(kernel, isa_and_threads, monkeypatch):
    # with the threshold at 1 every M of two rows or more is split across the threads in blocks
    monkeypatch.setattr(pointwise, "POINTWISE_PARALLEL_MIN", 1)
    cases, _ = _cases(np.random.default_rng(kernel))
    name, call = cases[kernel]
    reference = None
    for path in _paths():
        assert native.set_isa(path) == path
        rows = [call(i, i + 1, False) for i in range(512)]
        # add_rms_norm's output is its sums' rows, then its normed rows: both halves of each single
        single = np.concatenate([r[:1] for r in rows] + [r[1:] for r in rows] if name == "add_rms_norm" else rows)
        if reference is None:
            reference = single
        assert np.array_equal(single.view(np.uint32), reference.view(np.uint32)), (name, path)
        for threads in (1, 2):
            native.set_threads(threads)
            for m in ROWS:
                got = call(0, m, True)
                want = single[:m] if name != "add_rms_norm" else np.concatenate([single[:m], single[512 : 512 + m]])
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, path, threads, m)


@pytest.mark.parametrize("name", ["add_rms_norm", "norm_rope", "silu_mul strided", "gelu_tanh_mul strided"])
def test_fused_kernels_give_the_bits_of_the_calls_they_replace(name, isa_and_threads, monkeypatch):
    monkeypatch.setattr(pointwise, "POINTWISE_PARALLEL_MIN", 1)
    cases, composed = _cases(np.random.default_rng(7))
    fused = dict(cases)[name]
    for path in _paths():
        native.set_isa(path)
        for threads in (1, 2):
            native.set_threads(threads)
            for m in (1, 2, 7, 512):
                got, want = fused(0, m, True), composed[name](0, m, True)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, path, threads, m)


def test_prefill_sized_calls_take_the_threads(isa_and_threads, monkeypatch):
    # the default threshold: a 512-row call of these sizes is split into blocks of whole rows
    native.set_threads(2)
    blocks = []
    monkeypatch.setattr(native, "on_threads", lambda n, units, call: blocks.append(n) or [call(u) for u in units])
    cases = _cases(np.random.default_rng(0))[0]
    for _, call in cases:
        call(0, 512, True)
        call(0, 1, True)
    assert blocks == [2] * len(cases)


def _rms_in_order(x, w, eps):
    """pointwise.c's RMS norm: sixteen float64 lanes (d mod 16) adding squares in d order, the
    halving tree, 1 / sqrt(sum / D + eps) rounded to float32, then w * (x * inv) in float32."""
    m, d = x.shape
    pad = np.zeros((m, -(-d // 16) * 16))
    pad[:, :d] = x
    part = np.zeros((m, 16))
    for j in range(0, pad.shape[1], 16):
        part = part + pad[:, j : j + 16] ** 2  # each square exact in float64: one rounding, as the FMA
    for s in (8, 4, 2, 1):
        part = part[:, :s] + part[:, s : 2 * s]
    inv = (1.0 / np.sqrt(part[:, 0] / d + eps)).astype(np.float32)[:, None]
    return w * (x * inv)


@pytest.mark.parametrize("d", [8, 20, 1000, 1024])
def test_rms_norm_follows_the_documented_order_and_float64(d, isa_and_threads):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((9, d)).astype(np.float32)
    x[1] *= 1e-3  # eps (1e-5) is a tenth of this row's mean square: where it goes matters
    w = rng.standard_normal(d).astype(np.float32)
    want = _rms_in_order(x, w, 1e-5)
    x64 = x.astype(np.float64)
    exact = w * x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5)
    for path in _paths():
        native.set_isa(path)
        got = HostBackend().rms_norm(x, w, 1e-5)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path
        ulps = np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32))
        assert ulps.max() <= 3.0, path  # three float32 roundings after the float64 sum


def _rope_in_order(x, pos, inv):
    """pointwise.c's RoPE: the float32 angle, libm cos and sin in float64 rounded to float32, the
    rotation in float32 with rounded products, the dimensions past 2 half copied."""
    half = inv.shape[0]
    out = x.copy()
    for m, p in enumerate(pos):
        angle = np.float32(p) * inv
        c = np.float32([math.cos(float(a)) for a in angle])
        s = np.float32([math.sin(float(a)) for a in angle])
        a, b = x[m, :, :half], x[m, :, half : 2 * half]
        out[m, :, :half] = a * c - b * s
        out[m, :, half : 2 * half] = b * c + a * s
    return out


@pytest.mark.parametrize("half, dh", [(64, 128), (56, 120), (8, 16), (5, 32)])
def test_rope_follows_the_documented_order_and_float64(half, dh, isa_and_threads):
    rng = np.random.default_rng(dh)
    x = rng.standard_normal((11, 3, dh)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 100, 513, 4095, 8191, 32767, 100000, 5], np.int64)
    inv = _inv_freq(half, dh)
    want = _rope_in_order(x, pos, inv)
    angle = (np.float32(pos)[:, None] * inv)[:, None, :].astype(np.float64)
    a, b = x[..., :half].astype(np.float64), x[..., half : 2 * half].astype(np.float64)
    exact = np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=2)
    for path in _paths():
        native.set_isa(path)
        got = HostBackend().rope(x, pos, inv)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), path
        # c, s, two products and a sum rounded: a few float32 epsilons of |a| + |b|
        bound = 2.0**-22 * np.concatenate([np.abs(a) + np.abs(b)] * 2, axis=2)
        assert (np.abs(got[..., : 2 * half] - exact) <= bound).all(), path
        assert np.array_equal(got[..., 2 * half :], x[..., 2 * half :])


def test_rope_table_is_reused_only_for_the_same_positions_and_frequencies():
    backend = HostBackend(parallel=False)
    x = np.random.default_rng(0).standard_normal((4, 2, 16)).astype(np.float32)
    inv = _inv_freq(8, 16)
    first = backend.rope(x, np.arange(4), inv)
    assert np.array_equal(backend.rope(x, np.arange(4), inv), first)
    assert not np.array_equal(backend.rope(x, np.arange(1, 5), inv), first)  # new positions: a new table
    assert not np.array_equal(backend.rope(x, np.arange(4), inv * 2), first)  # another array: its own table


def test_silu_is_within_3_ulp_of_float64_and_the_same_on_every_path(isa_and_threads):
    # npud_exp of -|g| only (never overflows); measured 2.98 ulp at most over these 3M points
    g = np.concatenate([np.linspace(-87, 87, 2_000_000, dtype=np.float32),
                        (np.random.default_rng(0).standard_normal(1_000_000) * 3).astype(np.float32)])
    g = g.reshape(-1, 1000)
    g64 = g.astype(np.float64)
    exact = g64 / (1 + np.exp(-g64))
    results = []
    for path in _paths():
        native.set_isa(path)
        results.append(pointwise.silu_mul(g, np.ones_like(g), False))
        assert np.array_equal(results[-1].view(np.uint32), results[0].view(np.uint32)), path
    ulps = np.abs(results[0] - exact) / np.spacing(np.abs(exact).astype(np.float32))
    assert ulps.max() <= 3.0
    edge = np.float32([[-88, -1e4, 88, 1e4, np.inf, np.nan, 0, -0.0]])
    got = pointwise.silu_mul(edge, np.ones_like(edge), False)[0]
    assert np.array_equal(got[:5], np.float32([-0.0, -0.0, 88, 1e4, np.inf])) and np.signbit(got[:2]).all()
    assert np.isnan(got[5]) and got[6] == 0 and got[7] == 0


def test_gelu_tanh_is_within_1e_5_of_float64_and_the_same_on_every_path(isa_and_threads):
    # gelu_tanh(g) = g / (1 + exp(-z)), z = 2 sqrt(2/pi) (g + 0.044715 g^3): in float64 without the
    # cancellation of 1 + tanh(z / 2) for negative g, which costs torch's float32 form 1.2e-5 of
    # relative error already above g = -3 (and all of it near g = -10). Measured here: 8.0e-7
    # above g = -3, 1.06e-5 down to g = -12 where the value exceeds 1e-35, 1.7e-37 below that.
    g = np.concatenate([np.linspace(-12, 12, 2_000_000, dtype=np.float32),
                        (np.random.default_rng(0).standard_normal(1_000_000) * 3).astype(np.float32)])
    g = g.reshape(-1, 1000)
    g64 = g.astype(np.float64)
    exact = g64 / (1 + np.exp(-2 * math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3)))
    results = []
    for path in _paths():
        native.set_isa(path)
        results.append(pointwise.gelu_tanh_mul(g, np.ones_like(g), False))
        assert np.array_equal(results[-1].view(np.uint32), results[0].view(np.uint32)), path
    err = np.abs(results[0] - exact)
    sizable = np.abs(exact) > 1e-35
    moderate = sizable & (g64 > -3)
    assert (err[moderate] / np.abs(exact[moderate])).max() <= 1e-6
    assert (err[sizable] / np.abs(exact[sizable])).max() <= 1.5e-5
    assert err[~sizable].max() <= 1e-36
    edge = np.float32([[-1e4, 1e4, 1e20, np.inf, np.nan, 0, -0.0]])
    got = pointwise.gelu_tanh_mul(edge, np.ones_like(edge), False)[0]
    assert np.array_equal(got[:4], np.float32([-0.0, 1e4, 1e20, np.inf])) and np.signbit(got[0])
    assert np.isnan(got[4]) and got[5] == 0 and got[6] == 0


class _BatchedNormBackend(HostBackend):
    """Negative control: an RMS norm whose eps grows with the call's row count."""

    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, eps * (1 + x.shape[0]))


def test_self_check_covers_the_per_row_kernels():
    rng = np.random.default_rng(0)
    assert check_rowwise_invariance(HostBackend(), 20, rng) == []
    failures = check_rowwise_invariance(_BatchedNormBackend(), 20, rng)
    assert failures == [f"rms_norm M={m}" for m in range(2, 21)]
