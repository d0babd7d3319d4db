"""The host GEMM pool's bookkeeping (kernels/host/pool.c): the workers' spin budget, that an idle
worker sleeps, and the trace bench/gemm_threads.py reads. The pool's bits and its taking back of
a stalled worker's chunks are in tests/test_kernels.py."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from kernel_fixtures import isa_and_threads  # noqa: F401  (a fixture)

from kernels.host import TILE, native, pack_tiles

SPIN_MIN_NS, SPIN_MAX_NS = 60_000, 500_000  # pool.c's bounds on a worker's spin
PREEMPTED_NS = 50_000  # pool.c: a clock jump between two looks that says the spin was preempted


def spin_budget(budget: int, waited_ns: int) -> int:
    fn = native.library().npud_pool_spin_budget
    fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_long], ctypes.c_long
    return fn(budget, waited_ns)


def test_the_spin_budget_covers_twice_the_recent_waits_within_its_bounds():
    assert spin_budget(SPIN_MIN_NS, 0) == SPIN_MIN_NS  # never below the floor
    assert spin_budget(SPIN_MIN_NS, 100_000) == 200_000  # twice a longer wait
    assert spin_budget(320_000, 10_000) == 300_000  # a shorter one: 1/16 less a call
    assert spin_budget(SPIN_MIN_NS, 400_000) == SPIN_MAX_NS  # never above the ceiling
    assert spin_budget(SPIN_MAX_NS, SPIN_MAX_NS + 1) == SPIN_MIN_NS  # a longer wait ends the burst


def test_a_worker_spins_within_its_budget_until_it_is_preempted():
    fn = native.library().npud_pool_spin_on
    fn.argtypes, fn.restype = [ctypes.c_long] * 3, ctypes.c_int
    assert fn(0, 0, SPIN_MIN_NS) and fn(SPIN_MIN_NS - 1, 2_000, SPIN_MIN_NS)
    assert not fn(SPIN_MIN_NS, 2_000, SPIN_MIN_NS)  # the budget spent: sleep
    assert fn(100_000, PREEMPTED_NS - 1, 200_000)
    assert not fn(100_000, PREEMPTED_NS, 200_000)  # preempted: another thread wants the CPU


def test_the_spin_budget_bridges_a_layers_longest_gap():
    # a decode layer: six short gaps (Python between GEMMs) and one long one (attention); once
    # the first long gap is seen, every later one is within the budget, so the worker spins
    # through it rather than sleeping
    budget = SPIN_MIN_NS
    for layer in range(28):
        for gap in (10_000,) * 6 + (150_000,):
            if layer > 0:
                assert budget >= gap, (layer, gap, budget)
            budget = spin_budget(budget, gap)


def test_a_worker_spins_through_the_gaps_of_a_burst(isa_and_threads):
    # calls 150 us apart (the caller busy meanwhile, as with a layer's attention): after the
    # first gap the worker's budget covers them, so it takes most calls from its spin and not
    # from sleep (a fixed SPIN_MIN_NS spin would sleep before every one); the bound is loose
    # because a worker or caller the scheduler preempts on a shared machine still sleeps
    rng = np.random.default_rng(24)
    w = pack_tiles(rng.standard_normal((16 * TILE, 256)).astype(np.float32))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    native.set_threads(2)
    before = native.pool_trace()
    for _ in range(200):
        native.gemm(native.FMT_F32, x, w, 16 * TILE, None, None, True)
        until = time.perf_counter() + 150e-6
        while time.perf_counter() < until:
            pass
    d = {key: native.pool_trace()[key] - before[key] for key in before}
    assert d["calls"] == 200 and d["slept"] < 50, d  # about 10 here; over 100 with a fixed spin


def _worker_ticks() -> dict[int, int]:
    """CPU clock ticks (user + system) of each of the pool's workers, by thread id."""
    ticks = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "npud-gemm":
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def test_idle_workers_sleep_after_a_burst_of_calls(isa_and_threads):
    # after a burst of calls that spin the budget up, an idle worker spins at most SPIN_MAX_NS
    # and then sleeps: over the next 300 ms it uses no CPU (a spinning one would use all of it)
    rng = np.random.default_rng(21)
    w = pack_tiles(rng.standard_normal((32 * TILE, 256)).astype(np.float32))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    native.set_threads(2)
    for _ in range(200):
        native.gemm(native.FMT_F32, x, w, 32 * TILE, None, None, True)
        time.sleep(0.0002)
    assert _worker_ticks()  # the workers are there, named
    time.sleep(0.05)
    before = _worker_ticks()
    time.sleep(0.3)
    after = _worker_ticks()
    used = sum(after[tid] - before[tid] for tid in before if tid in after)
    assert used <= 2, used  # clock ticks: 10 ms each where CONFIG_HZ is 100, 30 of them spinning
    slept = native.pool_trace()["slept"]
    native.gemm(native.FMT_F32, x, w, 32 * TILE, None, None, True)
    deadline = time.monotonic() + 10  # the wake may come after the call (the caller does it all)
    while native.pool_trace()["slept"] == slept and time.monotonic() < deadline:
        time.sleep(0.001)
    assert native.pool_trace()["slept"] > slept  # and the trace counts that it slept


def test_the_trace_accounts_for_every_chunk_and_the_callers_time(isa_and_threads):
    # a stalled worker takes the first chunk (the caller waits for that) and sleeps on it: the
    # call counts as joined, after a wake of some nanoseconds, and the caller takes that chunk
    # back; the chunks the caller computed and those workers delivered are all the call's
    rng = np.random.default_rng(22)
    tiles = 64
    w = pack_tiles(rng.standard_normal((tiles * TILE, 256)).astype(np.float32))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    native.set_threads(2)
    native.gemm(native.FMT_F32, x, w, tiles * TILE, None, None, True)  # the workers exist
    before, offered = native.pool_trace(), native.pool_stats()[3]
    native.stall_workers(20_000)
    try:
        native.gemm(native.FMT_F32, x, w, tiles * TILE, None, None, True)
    finally:
        native.stall_workers(0)
    after = native.pool_trace()
    d = {key: after[key] - before[key] for key in after}
    assert d["calls"] == 1 and d["joined"] == 1 and d["wake_ns"] > 0
    assert d["caller_chunks"] >= 1  # the chunk taken back at least
    assert d["caller_chunks"] + d["worker_chunks"] == native.pool_stats()[3] - offered
    assert 0 < d["own_ns"] + d["wait_ns"] <= d["call_ns"]
    assert d["wait_ns"] >= 0 and d["own_ns"] >= 0
    deadline = time.monotonic() + 10
    while native.held_calls() and time.monotonic() < deadline:  # the sleeping worker lets go
        time.sleep(0.01)


def test_a_one_thread_call_is_not_in_the_trace(isa_and_threads):
    rng = np.random.default_rng(23)
    w = pack_tiles(rng.standard_normal((8 * TILE, 64)).astype(np.float32))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    native.set_threads(1)
    before = native.pool_trace()
    native.gemm(native.FMT_F32, x, w, 8 * TILE, None, None, True)
    assert native.pool_trace() == before
