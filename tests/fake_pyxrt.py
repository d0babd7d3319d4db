"""A SIMULATOR standing in for pyxrt in tests: never evidence that anything runs on an NPU.

It mimics the part of XRT's Python binding (src/python/pybind11/src/pyxrt.cpp) that the
npud backend uses, and checks the buffer protocol an aiecc-built GEMM design needs, the way
mlir-aie's aie.utils.xrt drives one: the instruction buffer in the kernel's group 1 and
cacheable, A, B, C in groups 3, 4, 5 and host_only, every input synced to the device after
its last write and before the run, C synced from the device before it is read, the call's
arguments (opcode 3, instr, ninstr, A, B, C) matching what the xclbin declares. A breach
raises ProtocolViolation.

The "xclbin" is a JSON file written by `write_design_table` holding what a real xclbin
bakes in: the kernel's name and argument count (aiecc declares 8), the compiled GEMM shape
(refused, as the compiler would refuse it, when it breaks the toolchain's rules) and its
binary instruction stream. A run decodes the bf16 A and B buffers and computes C with fp32
accumulation over K in order (after bfp16 block quantisation for an emulating npu2 build),
so the backend's results can be compared with the host's. An int8 design ("dtype_in": "i8")
computes what the array's int8 kernel does: C[m, n] = sum_k A[m, k] B[k, n], int8 x int8
products summed exactly in an int32 accumulator (two's complement, as the AIE's acc32 lanes;
the design table's INT8_MAX_K keeps a design from overflowing it), stored as int32.

What the real stack refuses or does, it refuses or does here: XRT's ert_cmd_state values
(ert.h); only pyxrt's two sync overloads; `run.wait(ms)` answering TIMEOUT while the command
goes on running, and a run collected while in flight aborting the process (xrt_kernel.cpp
~run_impl; recorded as a violation instead when the simulator runs inside the test process);
amdxdna's hardware-context limit; a wait that keeps the GIL (`Sim.wait_hold_s`).

Failures are injected with `Sim.inject` (in this process) or, for the NPU worker process,
by writing {"mode": ..., "after": n, "times": t} to the file named by FAKE_PYXRT_CONTROL:
the worker's simulator arms it when it sees new contents. Modes: "timeout" (the wait gives
up, the command runs on for `Sim.finish_after_polls` state() calls), "error" and "abort"
(final states, C left zeroed), "raise" (XRT raises), and in a worker "crash" (std::abort),
"segfault" and "hang" (the wait never returns). {"mode": "kmsg", "after": n, "path": file,
"lines": [text, ...]} is no failure: the run completes, and the driver's kernel log (the file)
gets the lines, "{pid}" in each replaced by the process that runs the simulator.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import signal
import sys
import time
import uuid as _uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SIMULATOR = True  # npud/kernels/xrt.py names a backend on this module "xrt-simulator"


class ProtocolViolation(AssertionError):
    """The backend used the simulated XRT in a way a real device would not accept."""


class xclBOSyncDirection(enum.Enum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class ert_cmd_state(enum.Enum):  # XRT's ert.h
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_RUNNING = 3
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8
    ERT_CMD_STATE_NORESPONSE = 9
    ERT_CMD_STATE_SKERROR = 10
    ERT_CMD_STATE_SKCRASHED = 11
    ERT_CMD_STATE_MAX = 12


IN_FLIGHT = (ert_cmd_state.ERT_CMD_STATE_NEW, ert_cmd_state.ERT_CMD_STATE_QUEUED,
             ert_cmd_state.ERT_CMD_STATE_RUNNING, ert_cmd_state.ERT_CMD_STATE_SUBMITTED)
MODES = ("timeout", "error", "abort", "raise", "crash", "segfault", "hang")  # and "gil": Sim.configure


GROUP_BASE = 0x100  # group_id(i) answers GROUP_BASE + i: a memory group, not the index itself


@dataclass
class Sim:
    """The simulated device's state: every call recorded, failures to inject."""

    calls: list = field(default_factory=list)
    registered: set = field(default_factory=set)
    fail_mode: str | None = None  # one of MODES
    fail_after: int = 0  # good runs before the failure
    fail_times: int = 0  # failing runs, then good again
    runs: int = 0
    context_limit: int = 6  # amdxdna's hwctx_limit on npu1 (16 on npu4/5/6)
    contexts_live: int = 0
    contexts_made: int = 0
    finish_after_polls: int = 2  # a timed-out command completes after this many state() calls
    wait_hold_s: float = 0.0  # each wait keeps the GIL this long, as pyxrt's does
    handshake: str | None = None  # a folder where a held wait sees whether another thread ran (_hold_gil)
    # False: no arithmetic; C gets a fixed ramp whose largest value is column 6 of each pass (the
    # benchmarks count and time the calls only; a decode still picks a token, never EOS id 0)
    compute: bool = True
    violations: list = field(default_factory=list)  # breaches seen where raising was impossible
    abort_on_collect: bool = False  # in a worker process: abort as XRT does
    control_seen: str | None = None
    kmsg: tuple | None = None  # (run, path, lines): driver lines logged when that run starts
    queued: int = 0  # runs started and not yet seen final (by wait or state)
    max_queued: int = 0  # the most runs in flight at once: 1 when the backend waits for each before the next
    run_m: list = field(default_factory=list)  # the compiled M of each run started

    def configure(self, spec: dict) -> None:
        """{"mode": "gil", "hold_s": s, "handshake": folder}, or a failure to inject (`inject`'s arguments)."""
        if spec["mode"] == "gil":
            self.wait_hold_s, self.handshake = float(spec["hold_s"]), spec.get("handshake")
        elif spec["mode"] == "compute":
            self.compute = bool(spec["on"])
        elif spec["mode"] == "kmsg":
            self.kmsg = (self.runs + spec.get("after", 0), spec["path"], tuple(spec["lines"]))
        else:
            self.inject(spec["mode"], spec.get("after", 0), spec.get("times", 1))

    def inject(self, mode: str, after: int = 0, times: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.fail_mode, self.fail_after, self.fail_times = mode, self.runs + after, times

    def _failure(self) -> str | None:
        self._read_control()
        if self.fail_mode is None or self.runs < self.fail_after or self.fail_times <= 0:
            return None
        self.fail_times -= 1
        return self.fail_mode

    def _read_control(self) -> None:
        path = os.environ.get("FAKE_PYXRT_CONTROL")
        if not path:
            return
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError:
            return
        if text and text != self.control_seen:
            self.control_seen = text
            self.configure(json.loads(text))


SIM = Sim(abort_on_collect=bool(os.environ.get("FAKE_PYXRT_CONTROL")))  # a worker aborts as XRT does


def reset() -> Sim:
    global SIM
    SIM = Sim(abort_on_collect=bool(os.environ.get("FAKE_PYXRT_CONTROL")))
    return SIM


class device:
    def __init__(self, index: int = 0):
        if index != 0:
            raise RuntimeError(f"simulated device {index} does not exist")
        self.index = index

    def register_xclbin(self, xb: "xclbin"):
        SIM.registered.add(xb.get_uuid())
        SIM.calls.append(("register_xclbin", str(xb.path)))
        return xb.get_uuid()


class _kernel_info:
    def __init__(self, name: str, num_args: int):
        self._name, self._num_args = name, num_args

    def get_name(self) -> str:
        return self._name

    def get_num_args(self) -> int:
        return self._num_args


class xclbin:
    def __init__(self, path: str):
        self.path = Path(path)
        try:
            self.meta = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"simulated xclbin {path}: {exc}") from None
        self._uuid = _uuid.uuid5(_uuid.NAMESPACE_URL, str(self.path.resolve()))

    def get_kernels(self):
        return [_kernel_info(k["name"], k["num_args"]) for k in self.meta["kernels"]]

    def get_uuid(self):
        return self._uuid


class hw_context:
    def __init__(self, dev: device, xclbin_uuid):
        if xclbin_uuid not in SIM.registered:
            raise ProtocolViolation("hw_context for an xclbin that was not registered on the device")
        if SIM.contexts_live >= SIM.context_limit:
            raise RuntimeError(f"simulated: DRM_IOCTL_AMDXDNA_CREATE_HWCTX failed: all {SIM.context_limit} "
                               "hardware contexts of the device are taken")
        self.device, self.uuid = dev, xclbin_uuid
        self._sim = SIM
        SIM.contexts_live += 1
        SIM.contexts_made += 1
        SIM.calls.append(("hw_context", str(xclbin_uuid)))

    def __del__(self):
        if hasattr(self, "_sim"):  # made, not refused
            self._sim.contexts_live -= 1


class bo:
    class flags(enum.Enum):
        normal = 0
        cacheable = 1
        host_only = 2

    normal, cacheable, host_only = flags.normal, flags.cacheable, flags.host_only

    def __init__(self, dev: device, size: int, flags, group: int):
        if not isinstance(dev, device) or size <= 0:
            raise ProtocolViolation(f"bo({dev!r}, {size}): needs the device and a positive size")
        self.arg = group - GROUP_BASE
        if self.arg not in (1, 3, 4, 5, 6, 7):
            raise ProtocolViolation(f"bo group {group} is not a group_id() of a buffer argument")
        want = bo.cacheable if self.arg == 1 else bo.host_only
        if flags is not want:
            raise ProtocolViolation(f"bo for argument {self.arg} made {flags.name}; aie.utils.xrt uses {want.name}")
        self.flags, self._size = flags, int(size)
        SIM.calls.append(("bo", self.arg, self._size, flags.name))
        self.host = np.zeros(self._size, np.uint8)
        self.dev = np.zeros(self._size, np.uint8)
        self.host_dirty = False  # written since the last sync to the device
        self.busy = 0  # runs in flight that use this buffer: no write, sync or read of it until they end
        self.dev_newer = False  # the device wrote since the last sync from the device
        self.dirty: tuple | None = None  # the bytes written since the last sync to the device that covered them
        self.fresh: tuple | None = None  # the bytes synced from the device since it last wrote

    def size(self) -> int:
        return self._size

    def write(self, data, seek: int):
        data = np.asarray(memoryview(data)).view(np.uint8).ravel()
        if seek < 0 or seek + data.size > self._size:
            raise ProtocolViolation(f"write of {data.size} bytes at {seek} into a {self._size}-byte bo")
        if self.busy:
            raise ProtocolViolation(f"bo of argument {self.arg} written while a run that uses it is in flight")
        self.host[seek : seek + data.size] = data
        lo, hi = self.dirty or (seek, seek + data.size)
        self.dirty = (min(lo, seek), max(hi, seek + data.size))
        self.host_dirty = True
        SIM.calls.append(("write", self.arg, data.size))

    def read(self, size: int, skip: int):
        if skip + size > self._size:
            raise ProtocolViolation(f"read of {size} bytes at {skip} from a {self._size}-byte bo")
        if self.busy:
            raise ProtocolViolation(f"bo of argument {self.arg} read while a run that uses it is in flight")
        if self.dev_newer and not (self.fresh and self.fresh[0] <= skip and skip + size <= self.fresh[1]):
            raise ProtocolViolation(f"bo of argument {self.arg} read before a sync from the device")
        SIM.calls.append(("read", self.arg, size))
        return self.host[skip : skip + size].view(np.int8).copy()

    def sync(self, direction, *size_offset):
        # pyxrt binds sync(direction) and sync(direction, size, offset), nothing else
        if not isinstance(direction, xclBOSyncDirection) or len(size_offset) not in (0, 2):
            raise TypeError("sync(): incompatible function arguments; sync(self, dir, size, offset) "
                            "or sync(self, dir)")
        if self.busy:
            raise ProtocolViolation(f"bo of argument {self.arg} synced while a run that uses it is in flight")
        size, offset = size_offset if size_offset else (self._size, 0)
        if offset < 0 or size <= 0 or offset + size > self._size:
            raise ProtocolViolation(f"sync of {size} bytes at {offset} of a {self._size}-byte bo")
        SIM.calls.append(("sync", self.arg, direction.name) + ((size,) if size != self._size else ()))
        end = offset + size
        if direction is xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            self.dev[offset:end] = self.host[offset:end]
            if self.dirty is None or (offset <= self.dirty[0] and self.dirty[1] <= end):
                self.host_dirty, self.dirty = False, None  # else written bytes outside the range stay unsynced
        else:
            self.host[offset:end] = self.dev[offset:end]
            self.fresh = (offset, end)
            if size == self._size:
                self.dev_newer = False


class run:
    """A started command. Until the backend has seen it end (wait() or state() answering a final
    state) it counts as queued and holds its buffers: a write, sync or read of one of them, or
    its C given to another run, is a ProtocolViolation, as it would be a race on a device."""

    def __init__(self, state, polls_to_finish: int | None = None, bos: tuple = ()):
        self._state = state
        self._polls_left = polls_to_finish  # in flight: state() calls until it completes (None: never)
        self._sim = SIM
        self._bos = bos
        for b in bos:
            b.busy += 1
        SIM.queued += 1
        SIM.max_queued = max(SIM.max_queued, SIM.queued)

    def _seen_final(self) -> None:
        for b in self._bos:
            b.busy -= 1
        if self._bos is not None:
            self._sim.queued -= 1
        self._bos = None

    def wait(self, timeout_ms: int = 0):
        if timeout_ms <= 0:
            raise ProtocolViolation("run.wait() without a timeout: a hung run would block the daemon forever")
        _hold_gil(self._sim.wait_hold_s, self._sim.handshake)
        if self._state in IN_FLIGHT:
            return ert_cmd_state.ERT_CMD_STATE_TIMEOUT  # the wait gave up; the command runs on
        if self._bos is not None:
            self._seen_final()
        return self._state

    def state(self):
        if self._state in IN_FLIGHT and self._polls_left is not None:
            self._polls_left -= 1
            if self._polls_left <= 0:
                self._state = ert_cmd_state.ERT_CMD_STATE_COMPLETED
        if self._state not in IN_FLIGHT and self._bos is not None:
            self._seen_final()
        return self._state

    def __del__(self):
        if self._state in IN_FLIGHT:  # xrt::run's destructor on a command in flight: std::abort
            if self._sim.abort_on_collect:
                os.abort()
            self._sim.violations.append("an xrt.run was destroyed while in flight (XRT aborts the process)")


def _hold_gil(seconds: float, handshake: str | None = None) -> None:
    """Spin for `seconds` without letting another thread of this process run, as a pyxrt call
    that keeps the GIL does. With a handshake folder: `counter` holds 8 bytes that a thread
    elsewhere keeps counting up (through mmap: plain memory, no call that lets the GIL go);
    `outcome` then says "released" when it counted while the spin ran, else "held"."""
    if seconds <= 0:
        return
    import mmap

    shared = None
    if handshake is not None:
        with open(Path(handshake, "counter"), "r+b") as f:
            shared = mmap.mmap(f.fileno(), 8)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        first = int.from_bytes(shared[:8], "little") if shared is not None else 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # no call in here lets the GIL go
            pass
        last = int.from_bytes(shared[:8], "little") if shared is not None else 0
    finally:
        sys.setswitchinterval(before)
    if shared is not None:
        shared.close()
        Path(handshake, "outcome").write_text("released" if last > first else "held")


class kernel:
    def __init__(self, ctx: hw_context, name: str):
        if not isinstance(ctx, hw_context):
            raise ProtocolViolation("kernel() needs a hw_context")
        meta = next(xb for xb in _XCLBINS if xb.get_uuid() == ctx.uuid).meta
        info = {k["name"]: k for k in meta["kernels"]}
        if name not in info:
            raise RuntimeError(f"no kernel {name} in the simulated xclbin")
        k = info[name]  # an xclbin of several kernels gives each its GEMM and instruction stream
        self.name, self.num_args = name, k["num_args"]
        self.gemm, self.insts = k.get("gemm", meta.get("gemm")), k.get("insts", meta.get("insts"))

    def group_id(self, arg: int) -> int:
        if not 0 <= arg < self.num_args:
            raise ProtocolViolation(f"group_id({arg}) of a kernel with {self.num_args} arguments")
        return GROUP_BASE + arg

    def __call__(self, *args):
        SIM.calls.append(("run", len(args)))
        self._check_args(args)
        SIM.run_m.append(self.gemm["M"])
        failure = SIM._failure()
        if SIM.kmsg is not None and SIM.runs >= SIM.kmsg[0]:  # the driver prints while the run goes on
            _, path, lines = SIM.kmsg
            SIM.kmsg = None
            with open(path, "a") as f:
                for line in lines:
                    f.write(f"3,{SIM.runs},{SIM.runs},-;{line.replace('{pid}', str(os.getpid()))}\n")
        SIM.runs += 1
        if failure == "raise":
            raise RuntimeError("simulated: DRM_IOCTL_AMDXDNA_EXEC_CMD failed: Input/output error")
        if failure == "crash":
            os.abort()  # std::abort somewhere in the driver stack
        if failure == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if failure == "hang":
            while True:  # a wait that never returns
                time.sleep(3600)
        _, instr, ninstr, a, b, c = args
        bos = (instr, a, b, c)
        if failure in ("timeout", "error", "abort"):
            c.dev[:] = 0
            c.dev_newer, c.fresh = True, None
            if failure == "timeout":
                return run(ert_cmd_state.ERT_CMD_STATE_RUNNING, SIM.finish_after_polls, bos)
            return run(ert_cmd_state.ERT_CMD_STATE_ERROR if failure == "error" else ert_cmd_state.ERT_CMD_STATE_ABORT,
                       None, bos)
        g = self.gemm
        M, K, N = g["M"], g["K"], g["N"]
        int8 = g.get("dtype_in", "bf16") == "i8"
        if not SIM.compute:
            c.dev[: M * N * 4] = _ramp(M, N, int8)
            c.dev_newer, c.fresh = True, None
            return run(ert_cmd_state.ERT_CMD_STATE_COMPLETED, None, bos)
        if int8:
            av = a.dev[: M * K].view(np.int8).reshape(M, K)
            bv = b.dev[: K * N].view(np.int8).reshape((N, K) if g["b_col_major"] else (K, N))
            bk = bv.T if g["b_col_major"] else bv  # [K, N]
            c.dev[: M * N * 4] = int8_gemm(av, bk).view(np.uint8).ravel()
            c.dev_newer, c.fresh = True, None
            return run(ert_cmd_state.ERT_CMD_STATE_COMPLETED, None, bos)
        av = _bf16(a.dev[: M * K * 2]).reshape(M, K)
        bv = _bf16(b.dev[: K * N * 2]).reshape((N, K) if g["b_col_major"] else (K, N))
        bk = bv.T if g["b_col_major"] else bv  # [K, N]
        if g.get("bfp16"):  # npu2's emulation: blocks of 8 along K under one exponent, 8-bit mantissas
            av, bk = _bfp16(av, axis=1), _bfp16(bk, axis=0)
        acc = np.zeros((M, N), np.float32)
        for k in range(K):  # fp32, in order over K, one rounding per multiply and per add
            acc = acc + av[:, k : k + 1] * bk[k : k + 1, :]
        c.dev[: M * N * 4] = acc.view(np.uint8).ravel()
        c.dev_newer, c.fresh = True, None
        return run(ert_cmd_state.ERT_CMD_STATE_COMPLETED, None, bos)

    def _check_args(self, args) -> None:
        if len(args) > self.num_args:
            raise ProtocolViolation(f"{len(args)} arguments to a kernel that declares {self.num_args}")
        if len(args) != 6:
            raise ProtocolViolation(f"a GEMM run takes opcode, instr, ninstr, A, B, C; got {len(args)} arguments")
        opcode, instr, ninstr, a, b, c = args
        if isinstance(c, bo) and c.busy:
            raise ProtocolViolation("C of a run in flight given to another run: the two would write it at once")
        if opcode != 3 or isinstance(opcode, bool):
            raise ProtocolViolation(f"opcode {opcode!r}, expected 3")
        for index, buf in ((1, instr), (3, a), (4, b), (5, c)):
            if not isinstance(buf, bo) or buf.arg != index:
                raise ProtocolViolation(f"argument {index} is not a bo made for group_id({index})")
            if index != 5 and buf.host_dirty:
                raise ProtocolViolation(f"argument {index} was written but not synced to the device")
        if ninstr != instr.size() // 4:
            raise ProtocolViolation(f"ninstr {ninstr} != {instr.size() // 4} words in the instruction bo")
        if instr.dev.view("<u4").tolist() != self.insts:
            raise ProtocolViolation("the instruction bo does not hold this xclbin's instruction stream")
        g = self.gemm
        size = 1 if g.get("dtype_in", "bf16") == "i8" else 2
        for name, buf, want in (("A", a, g["M"] * g["K"] * size), ("B", b, g["K"] * g["N"] * size),
                                ("C", c, g["M"] * g["N"] * 4)):
            if buf.size() != want:
                raise ProtocolViolation(f"{name} bo of {buf.size()} bytes; the design moves {want}")


def int8_gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int8 a [M, K] x int8 b [K, N] -> int32 [M, N]: exact products, summed in a 32-bit
    two's-complement accumulator (what wraps there wraps here)."""
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)  # astype wraps modulo 2^32


_RAMPS: dict = {}


def _ramp(m: int, n: int, int8: bool = False) -> np.ndarray:
    """C's bytes when the arithmetic is off: every row (j % 7) / 1000 over its columns j (an int8
    design's int32 C: j % 7)."""
    if (m, n, int8) not in _RAMPS:
        row = (np.arange(n) % 7).astype(np.int32) if int8 else (np.arange(n) % 7).astype(np.float32) / np.float32(1000)
        _RAMPS[(m, n, int8)] = np.tile(row, m).view(np.uint8)
    return _RAMPS[(m, n, int8)]


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bfp16(x: np.ndarray, axis: int) -> np.ndarray:
    """x with each block of 8 along `axis` truncated to 8-bit mantissas (sign apart, 7 bits
    below the leading one of the block's largest magnitude)."""
    moved = np.moveaxis(x, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, 8).astype(np.float64)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    exp = np.floor(np.log2(np.where(top > 0, top, 1.0)))
    step = 2.0 ** (exp - 6)
    q = np.trunc(blocks / step) * step
    return np.moveaxis(q.reshape(moved.shape).astype(np.float32), -1, axis)


_XCLBINS: list[xclbin] = []
_real_xclbin_init = xclbin.__init__


def _tracked_init(self, path):
    _real_xclbin_init(self, path)
    _XCLBINS.append(self)


xclbin.__init__ = _tracked_init


def npu_wins(runner, handle, host, host_weight, rows, timeout_ms) -> tuple[float, float]:
    """Injected costs (npud/kernels/xrt.py measure_costs' form): the NPU is faster. The
    simulator's wall time says nothing of an NPU's, so a test says which side wins."""
    return 1e-6, 1e-3


def install(monkeypatch) -> Sim:
    """Make this simulator the XRT binding (for one test), in this process (`pyxrt` in
    sys.modules) and in NPU worker processes (npud.kernels.xrt.BINDING); returns its fresh state.
    The placement's costs are `npu_wins` unless the test injects others."""
    from npud.kernels import xrt

    _XCLBINS.clear()
    monkeypatch.setitem(sys.modules, "pyxrt", sys.modules[__name__])
    monkeypatch.setattr(xrt, "BINDING", __name__)
    monkeypatch.setattr(xrt, "measure_costs", npu_wins)
    return reset()


def insts_words(device: str, payload: int, seed: int = 0) -> np.ndarray:
    """An instruction stream as aiecc writes one: the transaction header, then `payload` words."""
    from npud.kernels.xrt_design import TXN_GENERATION

    body = (np.arange(1, payload + 1, dtype=np.uint32) + np.uint32(seed)) * np.uint32(0x01000193)
    columns = 5 if device == "npu1" else 8
    size = (4 + payload) * 4
    head = [6 << 24 | TXN_GENERATION[device] << 16 | 1 << 8, 1 << 8 | columns, payload // 4, size]
    return np.concatenate([np.array(head, np.uint32), body])


def write_design_table(folder: Path, shapes, *, device: str = "npu2", M: int = 32, tile: tuple = (8, 8, 8),
                       columns: int = 1, b_col_major: bool = False, insts_format: str = "binary",
                       num_args: int = 8, kernel_name: str = "MLIR_AIE", bfp16_emulation: bool | None = None,
                       xclbin_bfp16: bool | None = None, shared_xclbins: bool = False,
                       one_xclbin: bool = False, weight_format: str = "bf16", more_m: tuple = ()) -> Path:
    """design.json plus simulated xclbins and instruction files for (K, N) shapes in `weight_format`
    (a shape (K, N, format) names its own: "bf16" or "int8"); returns its path.

    The compiled K and N are rounded up to the tile rules (tile_k, tile_n * columns); an N past
    what one pass can move is split into passes (npud/kernels/xrt_rules.py). `xclbin_bfp16`: whether
    the simulated xclbin quantises as npu2's emulation does (default: as the table says).
    `shared_xclbins`: shapes with the same compiled shape share one xclbin, as the build tool
    writes them. `bfp16_emulation` None: as the build tool's default (npu2's stock build
    emulates bf16 with bfp16 blocks, npu1 has no emulation); a test of npu2's exact bf16 path
    says False, as `--no-bfp16-emulation` does. `one_xclbin`: every design a kernel of its own
    (MLIR_AIE_<i>) in one xclbin, as the build tool links a model's designs (one hardware
    context for the model). `more_m`: for each shape, designs of these M as well (the same
    compiled K and N: one weight upload serves them all), as the build tool's `--rows 32,128`."""
    from npud.kernels.xrt_design import GemmDesign, tile_rule_errors, write_table
    from npud.kernels.xrt_rules import split_n

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if bfp16_emulation is None:  # tools/build_npu_designs.py's Tiling default
        bfp16_emulation = device == "npu2"
    tm, tk, tn = tile
    designs = []
    linked = []  # one_xclbin: every design's kernel
    sized = []
    for shape in shapes:
        k, n, fmt = shape if len(shape) == 3 else (*shape, weight_format)
        int8 = fmt == "int8"
        ck = -(-k // tk) * tk
        found = split_n(n, M, ck, tm, tk, tn, columns, b_col_major, in_bytes=1 if int8 else 2)
        passes, cn = found if found is not None else (1, -(-n // (tn * columns)) * (tn * columns))
        sized += [(k, n, fmt, int8, ck, cn, passes, rows) for rows in (M, *more_m)]
    for i, (k, n, fmt, int8, ck, cn, passes, rows) in enumerate(sized):
        stem = (f"{ck}x{cn}" + ("_i8" if int8 else "") if shared_xclbins else f"{k}x{n}" + ("_i8" if int8 else "")) \
            + (f"_m{rows}" if rows != M else "")
        xb = folder / f"gemm_{stem}.xclbin"
        ins = folder / (f"insts_{stem}." + ("txt" if insts_format == "hex" else "bin"))
        words = insts_words(device, 12 + i if not shared_xclbins else 12, seed=0 if shared_xclbins else i)
        emulation = bfp16_emulation and not int8  # an int8 kernel multiplies integers
        gemm = {"M": rows, "K": ck, "N": cn, "b_col_major": b_col_major,
                "bfp16": emulation if xclbin_bfp16 is None else xclbin_bfp16, "dtype_in": "i8" if int8 else "bf16"}
        name = "MLIR_AIE"  # what the table names; `kernel_name` is what the xclbin declares
        if one_xclbin:
            xb, name = folder / "model.xclbin", f"{kernel_name}_{i}"
            linked.append({"name": name, "num_args": num_args, "gemm": gemm, "insts": [int(w) for w in words]})
        else:
            xb.write_text(json.dumps({"kernels": [{"name": kernel_name, "num_args": num_args}], "gemm": gemm,
                                      "insts": [int(w) for w in words]}))
        if insts_format == "hex":
            ins.write_text("".join(f"{w:08x}\n" for w in words))
        else:
            ins.write_bytes(words.astype("<u4").tobytes())
        design = GemmDesign(K=k, N=n, weight_format=fmt, xclbin=xb, insts=ins, kernel=name, M=rows,
                            compiled_K=ck, compiled_N=cn, tile_m=tm, tile_k=tk, tile_n=tn, columns=columns,
                            dtype_in="i8" if int8 else "bf16", dtype_out="i32" if int8 else "f32",
                            b_col_major=b_col_major, bfp16_emulation=emulation, n_passes=passes,
                            insts_format=insts_format)
        errors = tile_rule_errors(device, design)
        if errors:  # the compiler would not have built it: no xclbin either
            raise ValueError(f"K={k} N={n}: " + "; ".join(errors))
        designs.append(design)
    if one_xclbin:
        (folder / "model.xclbin").write_text(json.dumps({"kernels": linked}))
    write_table(folder / "design.json", device, designs)
    return folder / "design.json"


def build_tool():
    """tools/build_npu_designs.py as a module (tools/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "build_npu_designs.py"
    spec = importlib.util.spec_from_file_location("build_npu_designs", path)
    module = sys.modules.setdefault("build_npu_designs", importlib.util.module_from_spec(spec))
    if not hasattr(module, "main"):
        spec.loader.exec_module(module)  # registered first: its dataclasses look themselves up there
    return module
