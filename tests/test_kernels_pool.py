"""The host GEMM pool's bookkeeping (npud/kernels/host/pool.c): that an idle worker sleeps, and the
trace bench/gemm_threads.py reads. The pool's bits and its taking back of a stalled worker's
chunks are in tests/test_kernels.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kernel_fixtures import isa_and_threads  # noqa: F401  (a fixture)

from npud.kernels.host import TILE, native, pack_tiles


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
    # after a burst of calls, an idle worker spins for at most SPIN_WAIT pauses (tens of
    # microseconds) and then sleeps: over the next 300 ms it uses no CPU (a spinning one all of it)
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
    tiles = 256
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
    # the caller's own chunks are all but one; the wait is that one's patience and its compute
    assert 0 <= d["wait_ns"] < d["own_ns"]
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


def test_the_gemm_clock_counts_every_gemm_call_and_its_time():
    """native.gemm_clock: one call and some nanoseconds for each GEMM, on one thread or the pool."""
    rng = np.random.default_rng(24)
    w = pack_tiles(rng.standard_normal((8 * TILE, 64)).astype(np.float32))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for threads in (1, 2):
        native.set_threads(threads)
        try:
            calls, ns = native.gemm_clock()
            for _ in range(3):
                native.gemm(native.FMT_F32, x, w, 8 * TILE, None, None, True)
            after = native.gemm_clock()
        finally:
            native.set_threads(0)
        assert after[0] == calls + 3 and after[1] > ns
