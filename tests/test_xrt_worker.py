"""The NPU worker process (npud/kernels/xrt_worker.py) on the pyxrt SIMULATOR: the same results as
inline; an abort, a segfault or a hang in the driver stack faults the run and leaves this
process alive; the worker's GIL-holding waits do not stall this process. Failures are armed
through the simulator's control file (FAKE_PYXRT_CONTROL), read by the worker."""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import pytest

import fake_pyxrt
from npud.kernels import xrt, xrt_worker
from npud.kernels.base import DeviceFault
from npud.kernels.select import default_backend
from npud.kernels.xrt_check import bf16_round
from test_xrt import bf16_weight, bits, reference


@pytest.fixture
def control(tmp_path, monkeypatch):
    fake_pyxrt.install(monkeypatch)
    path = tmp_path / "control.json"
    monkeypatch.setenv("FAKE_PYXRT_CONTROL", str(path))
    monkeypatch.setattr(xrt_worker, "REPLY_GRACE_S", 1.0)
    return path


@pytest.fixture(scope="module")
def host():
    return default_backend()


def test_the_worker_serves_the_same_bits_as_inline(tmp_path, control, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 100)]), host)
    try:
        assert backend.isolation == "process" and backend.name == "xrt-simulator"
        raw = bf16_weight(100, 64)
        w = backend.prepare_linear(raw)
        x = np.random.default_rng(8).standard_normal((40, 64)).astype(np.float32)
        assert np.array_equal(bits(backend.linear(x, w)), bits(reference(host, x, raw)))  # npu2: bfp16 blocks
    finally:
        backend.close()
    assert backend.device.proc.returncode == 0


@pytest.mark.parametrize("mode, state, said", [("crash", "worker_died", "killed by SIGABRT"),
                                               ("segfault", "worker_died", "killed by SIGSEGV"),
                                               ("hang", "worker_hung", "hung in run and was killed")])
def test_a_worker_that_aborts_segfaults_or_hangs_faults_the_run_not_this_process(tmp_path, control, host, mode,
                                                                                 state, said):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, timeout_ms=200)
    w = backend.prepare_linear(bf16_weight(64, 64))
    control.write_text(json.dumps({"mode": mode}))
    with pytest.raises(xrt.NpuRunError, match=said) as info:
        backend.linear(np.ones((2, 64), np.float32), w)
    assert isinstance(info.value, DeviceFault) and info.value.state == state
    assert backend.device.proc.poll() is not None  # the worker is gone, killed if it hung
    with pytest.raises(xrt.NpuRunError, match="the NPU worker is gone") as again:
        backend.linear(np.ones((2, 64), np.float32), w)  # at once, without a worker to ask
    assert again.value.state == "worker_lost"
    backend.close()


def test_a_timed_out_run_in_the_worker_is_kept_and_the_worker_exits_without_destroying_it(tmp_path, control, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, timeout_ms=200)
    w = backend.prepare_linear(bf16_weight(64, 64))
    control.write_text(json.dumps({"mode": "timeout"}))
    with pytest.raises(xrt.NpuRunError, match="ERT_CMD_STATE_TIMEOUT"):
        backend.linear(np.ones((2, 64), np.float32), w)
    backend.close()  # a destroyed in-flight run would abort the worker (the simulator aborts as XRT does)
    assert backend.device.proc.returncode == 0


def _counted_wait(backend, w, folder):
    """Run one pass whose wait keeps the GIL of the process it runs in, while a thread of this
    process counts in `folder/counter` (shared memory); returns the wait's outcome: "released"
    when the count moved during the wait, "held" when it could not."""
    import mmap

    (folder / "counter").write_bytes(bytes(8))
    stop = threading.Event()
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # no thread here asks the spinning one to let go: only a blocking call would

    def count():
        with open(folder / "counter", "r+b") as f:
            shared = mmap.mmap(f.fileno(), 8)
        n = 0
        while not stop.is_set():
            n += 1
            shared[:8] = n.to_bytes(8, "little")
            time.sleep(0.001)
        shared.close()

    counter = threading.Thread(target=count)
    counter.start()
    try:
        backend.linear(np.ones((1, 64), np.float32), w)
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(before)
    return (folder / "outcome").read_text()


@pytest.mark.parametrize("isolation, outcome", [("process", "released"), ("inline", "held")])
def test_a_wait_that_keeps_the_gil_stalls_this_process_only_inline(tmp_path, control, host, isolation, outcome):
    folder = tmp_path / "handshake"
    folder.mkdir()
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, isolation=isolation,
                               timeout_ms=5000)
    w = backend.prepare_linear(bf16_weight(64, 64))
    spec = {"mode": "gil", "hold_s": 1.0, "handshake": str(folder)}
    if isolation == "inline":
        fake_pyxrt.SIM.configure(spec)
    else:
        control.write_text(json.dumps(spec))
    assert _counted_wait(backend, w, folder) == outcome
    backend.close()


def test_the_reply_deadline_scales_with_the_passes_of_a_layer(tmp_path, control, host):
    # an LM head of 19 passes, each well within the run timeout: the worker answers after all 19,
    # later than one pass's timeout plus the grace, and must not be killed as hung for it
    from npud.kernels.xrt_design import DesignTable

    n = 19 * 512  # one column of tile_n 8: a pass moves at most 64 x 8 = 512 columns
    table = DesignTable.load(fake_pyxrt.write_design_table(tmp_path, [(64, n)]))
    assert table.designs[(64, n, "bf16")].n_passes == 19
    backend = xrt.XrtBackend(table, host, timeout_ms=200, check=lambda *a: ([], []))
    try:
        raw = bf16_weight(n, 64)
        w = backend.prepare_linear(raw)
        control.write_text(json.dumps({"mode": "gil", "hold_s": 0.1}))  # each pass's wait takes 0.1 s
        x = np.random.default_rng(9).standard_normal((1, 64)).astype(np.float32)
        started = time.monotonic()
        got = backend.linear(x, w)  # 19 x 0.1 s > 0.2 s + the 1 s grace
        assert time.monotonic() - started > 0.2 + xrt_worker.REPLY_GRACE_S
        assert np.array_equal(bits(got), bits(reference(host, x, raw)))
        assert backend.device.lost is None
    finally:
        backend.close()


def _call_bytes(backend, call):
    """(pipe bytes, shared-region bytes) of one call through the worker."""
    dev = backend.device
    pipe, shared = dev.pipe_bytes, getattr(dev, "shared_bytes", 0)
    out = call()
    return out, dev.pipe_bytes - pipe, getattr(dev, "shared_bytes", 0) - shared


def test_a_run_s_arrays_go_through_shared_memory_and_the_pipes_carry_a_command(tmp_path, control, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 100)]), host)
    try:
        raw = bf16_weight(100, 64)
        w = backend.prepare_linear(raw)
        for rows in (1, 40, 300):
            x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
            got, pipe, shared = _call_bytes(backend, lambda: backend.linear(x, w))
            assert np.array_equal(bits(got), bits(reference(host, x, raw)))
            assert pipe < 600  # the command and its answer, whatever the rows (pickled: 2 + 4 bytes a value)
            assert shared == rows * 64 * 2 + rows * 100 * 4  # A's bf16 bits in, C's floats out
    finally:
        backend.close()


def test_the_shared_region_grows_to_the_largest_call_and_answers_are_copies(tmp_path, control, host, monkeypatch):
    monkeypatch.setattr(xrt_worker, "SHARED_INITIAL_BYTES", 4096)  # smaller than one answer below
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 100)]), host)
    try:
        assert backend.device.frames.size == 4096
        raw = bf16_weight(100, 64)
        w = backend.prepare_linear(raw)
        x1 = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
        x2 = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)
        first = backend.linear(x1, w)  # 16000 bytes back: the worker grows the region
        kept = first.copy()
        second = backend.linear(x2, w)  # written where the first answer was
        assert backend.device.frames.size >= 40 * 64 * 2 + 40 * 100 * 4
        assert np.array_equal(bits(first), bits(kept))  # the first answer was copied out of the region
        assert np.array_equal(bits(first), bits(reference(host, x1, raw)))
        assert np.array_equal(bits(second), bits(reference(host, x2, raw)))
    finally:
        backend.close()


def test_the_reply_deadline_counts_chunks_of_the_smallest_m(tmp_path, control, host, monkeypatch):
    # designs of M 32 and 128: 40 rows take at most two chunks (of 32), never one a row
    seen = []
    real = xrt_worker.WorkerDevice._call

    def call(self, method, args, timeout_s):
        if method == "run":
            seen.append(timeout_s)
        return real(self, method, args, timeout_s)

    monkeypatch.setattr(xrt_worker.WorkerDevice, "_call", call)
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 100)], more_m=(128,)), host,
                               timeout_ms=1000)
    try:
        w = backend.prepare_linear(bf16_weight(100, 64))
        seen.clear()
        backend.linear(np.ones((40, 64), np.float32), w)
        assert seen == [2 * 1.0 + xrt_worker.REPLY_GRACE_S]
    finally:
        backend.close()
