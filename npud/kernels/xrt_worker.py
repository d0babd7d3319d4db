"""The NPU worker: a process of its own that holds pyxrt, so that nothing the driver stack does
can stop or kill npud.

pyxrt keeps the GIL in wait, call, sync, read and write, so an NPU run in a thread of npud
would stall its event loop (socket, HTTP, watchdog) for the run's length, up to the timeout
on a hang; a std::abort (an xrt::run destroyed in flight) or a segfault in the driver stack
would end npud. Here the device calls run in `python -m npud.kernels.xrt_worker`, which the
backend talks to over two pipes, one pickled frame per call and per answer; the backend
waits on the pipe (no GIL held), and:

- the worker dies (abort, segfault, killed): the call raises NpuRunError naming the signal;
- the worker does not answer within its runs' timeouts plus REPLY_GRACE_S (each chunk of rows
  runs one pass per slice of the layer's N, each pass with its own timeout: the 19-pass LM head
  may take 19 of them): it is killed and the call raises NpuRunError;
- after either, every later call raises NpuRunError at once (the device is lost to this
  backend; the daemon quarantines it and serves on the host).

The frames: 8 bytes of little-endian length, then a pickle of (method, args, reply_at) one way
and ("ok", value) or ("err", kind, message, state) the other. The worker's stdout carries the
frames only (anything printed goes to stderr). The calls a decode makes per layer (SHARED_METHODS:
`run`, `layer_step`) keep their arrays out of the pipes: both processes map one shared-memory
region (a memfd the worker inherits, SharedFrames), the backend writes the call's arrays there
and the command names them (Slot: offset, dtype, shape); the worker reads them in place, writes
its answer's arrays from `reply_at` on (past the inputs) and names them the same way; the backend
copies them out before the next call can overwrite them. The pipes carry commands of a few
hundred bytes, and stay the only way a call is answered: a dead or hung worker is found on the
pipe exactly as before. Setup calls (designs, weights, the layer group) still pickle their arrays.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import numpy as np

from npud.kernels.xrt_device import DeviceSession, NpuRunError, XrtUnavailable

REPLY_GRACE_S = 5.0  # beyond a run's own timeout, for the pipe and the worker's bookkeeping
SETUP_TIMEOUT_S = 300.0  # opening a design, uploading a weight: no run involved
_HEADER = struct.Struct("<Q")
SHARED_METHODS = frozenset({"run", "layer_step"})  # a decode's calls: their arrays go through SharedFrames
SHARED_INITIAL_BYTES = 1 << 20  # the region's first size; it grows to the largest call
_ALIGN = 64


@dataclass(slots=True, frozen=True)
class Slot:
    """An array in the shared region: where it starts, its dtype (numpy's str) and shape."""

    offset: int
    dtype: str
    shape: tuple


class SharedFrames:
    """The shared-memory region both processes map (a memfd): `put` lays a call's arrays out in
    it and answers the object with each array replaced by its Slot, `get` the reverse. Either side
    may grow it (ftruncate); the other maps the new size before its next read or write."""

    def __init__(self, fd: int):
        self.fd, self.map, self.size = fd, None, 0
        self._remap()

    @classmethod
    def create(cls, size: int | None = None) -> "SharedFrames":
        fd = os.memfd_create("npud-npu-frames", os.MFD_CLOEXEC)
        os.ftruncate(fd, SHARED_INITIAL_BYTES if size is None else size)
        return cls(fd)

    def _remap(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.size:  # the old map lives on while arrays still view it
            self.map, self.size = (mmap.mmap(self.fd, size) if size else None), size

    def put(self, obj, start: int = 0) -> tuple[object, int, int]:
        """(obj with its arrays as Slots, the bytes written, the offset past the last array)."""
        arrays: list[np.ndarray] = []
        _walk(obj, lambda a: arrays.append(np.ascontiguousarray(a)) or a)
        end = start
        for a in arrays:
            end = _aligned(end) + a.nbytes
        self._remap()
        if end > self.size:
            os.ftruncate(self.fd, max(end, 2 * self.size))
            self._remap()
        cursor, written = start, 0
        slots = []
        for a in arrays:
            cursor = _aligned(cursor)
            if a.nbytes:
                self.map[cursor : cursor + a.nbytes] = a.view(np.uint8).reshape(-1).data
            slots.append(Slot(cursor, a.dtype.str, a.shape))
            cursor += a.nbytes
            written += a.nbytes
        it = iter(slots)
        return _walk(obj, lambda a: next(it)), written, end

    def get(self, obj, copy: bool) -> tuple[object, int, int]:
        """(obj with its Slots as arrays: copies, or read-only views of the region; the bytes
        read; the offset past the last one)."""
        self._remap()
        counts = [0, 0]

        def array(slot):
            dtype = np.dtype(slot.dtype)
            n = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
            counts[0] += n
            counts[1] = max(counts[1], slot.offset + n)
            if n == 0:
                return np.empty(slot.shape, dtype)
            view = np.ndarray(slot.shape, dtype, buffer=self.map, offset=slot.offset)
            if copy:
                return view.copy()
            view.flags.writeable = False
            return view

        return _walk(obj, array, Slot), counts[0], counts[1]

    def close(self) -> None:
        self.map = None
        try:
            os.close(self.fd)
        except OSError:
            pass


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _walk(obj, fn, kind=np.ndarray):
    """obj with every `kind` inside its tuples and lists replaced by fn(it)."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_walk(o, fn, kind) for o in obj)
    return obj


class WorkerError(RuntimeError):
    """XRT refused something in the worker (its exception's type and text are in the message)."""


def _write_frame(fd: int, obj, deadline: float | None) -> int:
    """Send one frame; returns the bytes written."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    size = len(view)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError
        view = view[os.write(fd, view):]
    return size


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks, have = [], 0
    while have < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - have, 1 << 20))
        if not chunk:
            return None  # the other end closed
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None, sizes: list | None = None):
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0], deadline)
    if sizes is not None and body is not None:
        sizes.append(_HEADER.size + len(body))
    return None if body is None else pickle.loads(body)


class WorkerDevice:
    """DeviceSession's methods, answered by the worker process. Raises XrtUnavailable when the
    worker cannot start or the binding does not import there."""

    def __init__(self, binding: str, generation: str, *, device_index: int = 0, context_budget: int | None = None):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same modules as here
        try:
            self.frames: SharedFrames | None = SharedFrames.create()
        except (AttributeError, OSError):  # no memfd here: every array through the pipes
            self.frames = None
        fds = () if self.frames is None else (self.frames.fd,)
        argv = [] if self.frames is None else ["--frames-fd", str(self.frames.fd)]
        self.proc = subprocess.Popen([sys.executable, "-m", "npud.kernels.xrt_worker", *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True, pass_fds=fds)
        self._to, self._from = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.lost: str | None = None
        self.round_trips = 0  # calls answered (or failed) by the worker, this process's count
        self.pipe_bytes = 0  # frames both ways through the pipes
        self.shared_bytes = 0  # arrays both ways through the shared region (SharedFrames)
        self._passes: dict[tuple, int] = {}  # design key -> passes per chunk of rows
        self._rows: dict[tuple, int] = {}  # design key -> its compiled rows (M) per pass
        self._groups: dict[int, tuple] = {}  # layer group id -> (handles per layer, head, row steps)
        self._handles: dict[int, tuple] = {}  # weight handle -> its design's key
        # a backend dropped without close(): the worker reads the end of its pipe and exits
        self._finalizer = weakref.finalize(self, _end, self.proc, self.frames)
        try:
            self.simulator = self._call("init", (binding, generation, device_index, context_budget),
                                        SETUP_TIMEOUT_S)
        except NpuRunError as exc:
            raise XrtUnavailable(f"the NPU worker did not start: {exc}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _call(self, method: str, args: tuple, timeout_s: float):
        if self.lost is not None:
            raise NpuRunError(f"the NPU worker is gone ({self.lost})", "worker_lost")
        deadline = time.monotonic() + timeout_s
        self.round_trips += 1
        sizes: list[int] = []
        shared = self.frames is not None and method in SHARED_METHODS
        reply_at = None
        if shared:
            args, written, end = self.frames.put(args)
            self.shared_bytes += written
            reply_at = _aligned(end)
        try:
            self.pipe_bytes += _write_frame(self._to, (method, args, reply_at), deadline)
            reply = _read_frame(self._from, deadline, sizes)
            self.pipe_bytes += sum(sizes)
        except TimeoutError:
            self._lose(f"no answer to {method} in {timeout_s:g} s; killed")
            raise NpuRunError(f"the NPU worker hung in {method} and was killed", "worker_hung") from None
        except (BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is None:
            self._lose(self._death())
            raise NpuRunError(f"the NPU worker died in {method}: {self.lost}", "worker_died")
        if reply[0] == "ok":
            if not shared:
                return reply[1]
            value, read, _ = self.frames.get(reply[1], copy=True)  # copied out: the next call overwrites
            self.shared_bytes += read
            return value
        _, kind, message, state = reply
        if kind == "XrtUnavailable":
            raise XrtUnavailable(message)
        if kind == "NpuRunError":
            raise NpuRunError(message, state)
        raise WorkerError(message)

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "its pipe closed"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _lose(self, why: str) -> None:
        """Kill the worker (a hung driver call may keep it in the kernel a while: not waited for
        long) and refuse every later call."""
        self.lost = why
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # in an uninterruptible driver call: reaped by close()
                pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def kernel_errors(self, design) -> str | None:
        return self._call("kernel_errors", (design,), SETUP_TIMEOUT_S)

    def open_design(self, design) -> None:
        self._call("open_design", (design,), SETUP_TIMEOUT_S)
        self._passes[design.key] = design.n_passes
        self._rows[design.key] = min(design.M, self._rows.get(design.key, design.M))  # chunks: at most rows / M

    def upload(self, key, bits, scale=None) -> int:
        args = (key, bits) if scale is None else (key, bits, scale)  # an int8 weight's scale per row
        handle = self._call("upload", args, SETUP_TIMEOUT_S)
        self._handles[handle] = key
        return handle

    def forget(self, handle: int) -> None:
        self._call("forget", (handle,), SETUP_TIMEOUT_S)

    def run(self, handle: int, a_bits, timeout_ms: int, step: int | None = None, m: int | None = None):
        # no step: chunks on the shape's designs by M, never more than of its smallest M
        chunk = step or m or self._design_rows(handle)
        return self._call("run", (handle, a_bits, timeout_ms, step, m),
                          reply_deadline_s(a_bits.shape[0], chunk, self._passes_of(handle), timeout_ms))

    def drop_m(self, key, m: int) -> None:
        self._call("drop_m", (key, m), SETUP_TIMEOUT_S)

    def _passes_of(self, handle: int) -> int:
        return self._passes.get(self._handles.get(handle), 1)

    def define_layer_group(self, spec, handles, head, steps) -> int:
        gid = self._call("define_layer_group", (spec, handles, head, steps), SETUP_TIMEOUT_S)
        self._groups[gid] = (handles, head, steps)
        return gid

    def layer_step(self, gid: int, i: int, attn, x, picked, timeout_ms: int):
        handles, head, steps = self._groups[gid]
        runs = [handles[i][n] for n in ("o", "gate", "up", "down")]
        runs += [handles[i + 1][n] for n in ("q", "k", "v")] if i + 1 < len(handles) else [head]
        return self._call("layer_step", (gid, i, attn, x, picked, timeout_ms),
                          self._group_deadline_s(x.shape[0], runs, steps, timeout_ms))

    def _group_deadline_s(self, rows: int, handles: list[int], steps: dict, timeout_ms: int) -> float:
        """Every pass of every GEMM the call runs may take the run timeout (reply_deadline_s each)."""
        return sum(reply_deadline_s(rows, steps.get(h) or self._design_rows(h), self._passes_of(h), timeout_ms)
                   - REPLY_GRACE_S for h in handles) + REPLY_GRACE_S

    def _design_rows(self, handle: int) -> int | None:
        return self._rows.get(self._handles.get(handle))

    def stats(self) -> dict:
        return self._call("stats", (), SETUP_TIMEOUT_S)

    def close(self) -> None:
        """End the worker: it lets go of everything but runs still in flight, then exits
        without destroying them."""
        if self.lost is None:
            try:
                self._call("close", (), SETUP_TIMEOUT_S)
                self.lost = "closed"
            except (NpuRunError, WorkerError):
                pass
        self._finalizer()  # the pipes close; the worker exits (killed only if it does not)


def reply_deadline_s(rows: int, step: int | None, passes: int, timeout_ms: int) -> float:
    """How long a run of `rows` rows may take the worker: every pass it starts (a chunk of
    `step` rows, or one a row without a step, times the layer's `passes`) may take the run
    timeout, plus REPLY_GRACE_S for the pipe and the worker's bookkeeping."""
    chunks = -(-rows // step) if step else rows
    return chunks * max(1, passes) * timeout_ms / 1000 + REPLY_GRACE_S


def _end(proc: subprocess.Popen, frames: SharedFrames | None = None) -> None:
    if frames is not None:
        frames.close()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    for _ in range(2):
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:  # a worker stuck in the driver: killed, then left to init
            proc.kill()


def _serve(frames_in: int, frames_out: int, shared: SharedFrames | None = None) -> None:
    session: DeviceSession | None = None
    while True:
        frame = _read_frame(frames_in, None)
        if frame is None:
            break
        method, args, reply_at = frame
        try:
            if reply_at is not None:
                args, _, _ = shared.get(args, copy=False)  # read in place, read-only
            if method == "init":
                binding, generation, device_index, budget = args
                try:
                    xrt = __import__(binding)
                except ImportError as e:
                    raise XrtUnavailable(f"the XRT Python binding ({binding}) is not importable: {e}") from e
                session = DeviceSession(xrt, generation, device_index, budget)
                value = session.simulator
            elif method == "close":
                value = None
            else:
                value = getattr(session, method)(*args)
            if reply_at is not None:
                value, _, _ = shared.put(value, reply_at)  # past the inputs: they are never overwritten
            reply = ("ok", value)
        except (XrtUnavailable, NpuRunError) as exc:
            reply = ("err", type(exc).__name__, str(exc), getattr(exc, "state", None))
        except Exception as exc:  # XRT's RuntimeError and the like: the backend decides
            reply = ("err", "other", f"{type(exc).__name__}: {exc}", None)
        args = None  # the views of the region go
        _write_frame(frames_out, reply, None)
        if method == "close":
            break
    if session is not None:
        session.close()
        if session.in_flight:
            os._exit(0)  # never destroy a run in flight: that would abort


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    shared = None
    if argv[:1] == ["--frames-fd"]:
        shared = SharedFrames(int(argv[1]))
    frames_out = os.dup(1)
    os.dup2(2, 1)  # a print in the binding must not corrupt the frames
    _serve(0, frames_out, shared)


if __name__ == "__main__":  # run as the package's module: the Slots the backend pickles are its classes
    from npud.kernels import xrt_worker

    xrt_worker.main()
