"""Everything that touches pyxrt: the device, its hardware contexts, each design's kernel and
buffers, the runs. It runs in the NPU worker process (npud/kernels/xrt_worker.py) or, for the
protocol tests, inline; the backend (npud/kernels/xrt.py) sees only the methods of DeviceSession.

Each design is called the way mlir-aie's `aie.utils.xrt` calls an aiecc-built kernel:
`kernel(3, instr_bo, num_instr_words, A_bo, B_bo, C_bo)`, the instruction buffer in the
kernel's group 1 (cacheable), A, B, C in groups 3, 4, 5 (host_only). pyxrt's
`kernel.__call__` silently skips an argument it cannot set, so the call passes exactly these
six and the xclbin is checked to declare at least as many (aiecc declares opcode, instr,
ninstr and bo0..bo4: eight).

Hardware contexts are few: 6 per device on npu1 (Phoenix, Hawk Point), 16 on npu4/5/6
(amdxdna's npu*_regs.c hwctx_limit), shared with every other process. ContextPlan opens one
per xclbin (designs of one xclbin share it) and, at the budget, closes the least recently
used one that has no run in flight; its designs reopen on their next call. The buffers stay.
Where the driver tells how many contexts every process holds (npud/kernels/amdxdna.py), the
budget is what the others leave: a context of ours is closed rather than a new one refused.

The runs of one call are queued: every pass of every chunk of a linear, and the linears of one
input in a layer group (q, k, v; gate, up), are started, each with its own A and C buffers, before
the first is waited for (DeviceSession.run_many); the device is never idle between them waiting
for the host.

A run that does not complete in time is not destroyed: destroying an xrt::run in flight
aborts the process (xrt_kernel.cpp), and pyxrt binds no abort. It is kept in `in_flight` and
polled before every later call until its state is final; its design's context is retired
(never used again in this session), and the call raises NpuRunError.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import structlog

from npud.kernels import amdxdna
from npud.kernels.errors import DeviceFault
from npud.kernels.xrt_design import DesignError, GemmDesign, read_insts

log = structlog.get_logger(__name__)

OPCODE = 3  # the opcode aiecc-built kernels expect for "run the instruction stream"
GROUP_INSTR, GROUP_A, GROUP_B, GROUP_C = 1, 3, 4, 5  # kernel argument indices, for group_id()
NUM_CALL_ARGS = 6  # opcode, instr, ninstr, A, B, C
# amdxdna's hwctx_limit per device generation (npu1_regs.c: 6; npu4/5/6_regs.c: 16); the
# design table's device names the generation (npu2 in mlir-aie is npu4..6 in the driver)
CONTEXT_BUDGET = {"npu1": 6, "npu2": 16}
# XRT's ert_cmd_state values (ert.h) after which a run is over and may be destroyed
FINAL_STATES = ("ERT_CMD_STATE_COMPLETED", "ERT_CMD_STATE_ERROR", "ERT_CMD_STATE_ABORT",
                "ERT_CMD_STATE_TIMEOUT", "ERT_CMD_STATE_NORESPONSE", "ERT_CMD_STATE_SKERROR",
                "ERT_CMD_STATE_SKCRASHED")
_HOLDING_RUNS: list = []  # sessions with a run in flight: referenced here until it is over, never collected


class XrtUnavailable(ValueError):
    """The NPU path cannot run here; the message says what is missing (a configuration
    error from the daemon's point of view: the model was asked for a backend it cannot have)."""


class NpuRunError(DeviceFault):
    """A GEMM run on the NPU failed: its state (or the XRT exception) is in the message."""

    def __init__(self, message: str, state: str | None = None):
        super().__init__(message)
        self.state = state


def state_name(state) -> str:
    return getattr(state, "name", None) or str(state)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN kept a NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def activations(design: GemmDesign, x: np.ndarray) -> np.ndarray:
    """What DeviceSession.run takes for `design` from fp32 rows x [rows, K]: bf16 bits for a bf16
    design, the fp32 rows themselves for an int8 one (they are quantized beside the device,
    `quantize_rows`, so that a row's scale comes from its own values, never from bf16 ones)."""
    if design.weight_format == "int8":
        return np.ascontiguousarray(x, np.float32)
    return bf16_bits(x)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 rows x [R, K] -> (int8 q [R, K], fp32 d [R]), symmetric, one scale per row, llama.cpp's
    q8_0 arithmetic with the whole row as the block: d = max|x| / 127, id = 1 / d (0 when d is 0),
    q = round(x * id) half away from zero, each operation in fp32 rounded once. |x - d q| <=
    d (1/2 + 2^-16) (docs/npu.md, "Exactness"). A row holding NaN or infinity gets d = NaN, so its
    outputs are NaN (never numbers made of a clipped infinity); a row whose d would be subnormal
    (max|x| < 127 * 2^-126) quantizes to zeros, d = 0."""
    x = np.ascontiguousarray(x, np.float32)
    finite = np.isfinite(x).all(axis=1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(x), x, 0)).max(axis=1, initial=0), 0).astype(np.float32)
    d = amax / np.float32(127)
    d[d < np.finfo(np.float32).tiny] = 0  # a subnormal d has no 24-bit precision (and 1 / d may overflow):
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)  # such a row (max|x| < 127 * 2^-126) is zeros
    t = np.where(finite[:, None], x, 0) * inv[:, None]  # fp32: one rounding
    whole = np.trunc(t)
    q = whole + np.where(np.abs(t - whole) >= np.float32(0.5), np.sign(t), np.float32(0))  # t - whole is exact
    return np.clip(q, -127, 127).astype(np.int8), np.where(finite, d, np.float32(np.nan)).astype(np.float32)


def dequantize(isum: np.ndarray, d: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int32 sums C [R, N] -> fp32 y = (float(C) * d[r]) * scale[n], each of the three steps
    (int32 to fp32, the two products) rounded once to nearest."""
    return (isum.astype(np.float32) * d[:, None]) * scale.astype(np.float32, copy=False)[None, :]


def chunk_plan(rows: int, ms: list[int]) -> list[tuple[int, int]]:
    """How a call of `rows` rows runs on designs of these M (ascending): [(rows of the chunk, its
    design's M)], whole passes of the largest M while more than it is left, then the smallest M
    that holds the rest (a decode's row on the smallest, a prefill's bulk on the largest)."""
    plan, left = [], int(rows)
    while left > 0:
        fit = next((m for m in ms if m >= left), None)
        if fit is None:
            plan.append((ms[-1], ms[-1]))
            left -= ms[-1]
        else:
            plan.append((left, fit))
            left = 0
    return plan


def kernel_errors(xrt, design: GemmDesign) -> str | None:
    """Why the design's xclbin cannot serve it (no kernel of that name, too few arguments), or None."""
    try:
        kernels = {k.get_name(): k for k in xrt.xclbin(str(design.xclbin)).get_kernels()}
    except Exception as exc:  # XRT refuses a file that is no xclbin (RuntimeError from C++)
        return f"{design.xclbin} does not open as an xclbin: {exc}"
    if design.kernel not in kernels:
        return f"{design.xclbin} has no kernel {design.kernel!r} (it has {sorted(kernels)})"
    declared = kernels[design.kernel].get_num_args()
    if declared < NUM_CALL_ARGS:
        return (f"kernel {design.kernel} of {design.xclbin} declares {declared} arguments; "
                "a GEMM design takes opcode, instr, ninstr, A, B, C")
    return None


@dataclass(slots=True)
class _Context:
    xclbin: str
    context: object
    kernels: dict  # kernel name -> xrt.kernel
    retired: bool = False  # a run of it timed out: never used again


class ContextPlan:
    """One hardware context per xclbin, at most `budget` open (less the contexts other processes
    hold, where `device_contexts` tells), least recently used closed first."""

    def __init__(self, xrt, device, budget: int,
                 device_contexts: Callable[[], amdxdna.ResourceInfo | None] | None = None):
        self.xrt, self.device, self.budget = xrt, device, int(budget)
        self.device_contexts = device_contexts
        self.open: OrderedDict[str, _Context] = OrderedDict()  # xclbin path -> context, oldest first
        self.registered: dict[str, object] = {}  # xclbin path -> its xrt.xclbin (registered once)
        self.retired: list[_Context] = []  # kept referenced: a run of theirs may still be in flight
        self.opened = 0  # contexts created, for the tests and the log
        self.foreign = 0  # contexts other processes held when one was last opened (as the driver said)

    def room(self) -> int:
        """How many contexts this plan may hold now: its budget, less what other processes hold
        where the driver says (every context the driver counts that is not one of ours)."""
        info = None
        if self.device_contexts is not None:
            try:
                info = self.device_contexts()
            except OSError:  # the driver refused the query: no word from it
                info = None
        if info is None:
            return self.budget
        foreign = max(0, info.contexts_in_use - len(self.open) - len(self.retired))
        if foreign != self.foreign:
            log.info("npu_contexts_of_other_processes", held=foreign, device_limit=info.contexts_limit,
                     ours=len(self.open) + len(self.retired))
            self.foreign = foreign
        return min(self.budget, info.contexts_limit - len(self.retired) - foreign)

    def kernel(self, design: GemmDesign, busy: set[str]):
        """The design's kernel in an open context of its xclbin (opening one, closing the least
        recently used idle one at the budget). `busy`: xclbins with a run in flight. Raises
        NpuRunError when the budget is taken by busy contexts, XRT's error when it refuses."""
        path = str(design.xclbin)
        ctx = self.open.get(path)
        if ctx is None:
            room = self.room()
            if room <= 0 and not self.open:
                raise XrtUnavailable(f"other processes hold every hardware context of the NPU ({self.foreign}); "
                                     f"design {design.xclbin.name} cannot open one")
            while len(self.open) >= max(room, 1):
                victim = next((p for p in self.open if p not in busy), None)
                if victim is None:
                    raise NpuRunError(f"all {len(self.open)} hardware contexts of npud's have a run in flight")
                del self.open[victim]  # its runs are over: the context and its kernels go
            xb = self.registered.get(path)
            if xb is None:
                xb = self.xrt.xclbin(path)
                self.device.register_xclbin(xb)
                self.registered[path] = xb
            ctx = _Context(path, self.xrt.hw_context(self.device, xb.get_uuid()), {})
            self.opened += 1
            self.open[path] = ctx
        self.open.move_to_end(path)
        if design.kernel not in ctx.kernels:
            ctx.kernels[design.kernel] = self.xrt.kernel(ctx.context, design.kernel)
        return ctx.kernels[design.kernel]

    def retire(self, design: GemmDesign) -> None:
        ctx = self.open.pop(str(design.xclbin), None)
        if ctx is not None:
            ctx.retired = True
            self.retired.append(ctx)


class _Design:
    """One loaded design: its instruction buffer, A and C buffers, and the B buffers of its weights."""

    def __init__(self, session: "DeviceSession", design: GemmDesign):
        self.design = design
        kernel = session.plan.kernel(design, session.busy())
        try:
            insts = read_insts(design.insts, design.insts_format, session.generation)
        except DesignError as e:
            raise XrtUnavailable(str(e)) from None
        self.num_insts = int(insts.size)  # words, as aie.utils.xrt passes it
        sync = session.xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
        self.bo_insts = session.buffer(kernel, insts.nbytes, GROUP_INSTR, session.xrt.bo.cacheable)
        self.bo_insts.write(insts.view(np.uint8), 0)
        self.bo_insts.sync(sync)
        d = design
        self.session = session
        # A and C buffers, one per run in flight at once (DeviceSession.run_many queues several):
        # the first made now, the others when a call first queues that many
        self.a_slots = [session.buffer(kernel, d.M * d.compiled_K * d.in_bytes, GROUP_A)]
        self.c_slots = [session.buffer(kernel, d.M * d.compiled_N * 4, GROUP_C)]
        self.retired: str | None = None

    @property
    def bo_a(self):
        return self.a_slots[0]

    @property
    def bo_c(self):
        return self.c_slots[0]

    def slot(self, slots: list, i: int, group: int, nbytes: int):
        while len(slots) <= i:
            kernel = self.session.plan.kernel(self.design, self.session.busy())
            slots.append(self.session.buffer(kernel, nbytes, group))
        return slots[i]


class DeviceSession:
    """The NPU as the backend uses it: open designs, upload weights, run passes. Every method
    raises NpuRunError (a DeviceFault) for a failure of the device, XrtUnavailable for a design
    that cannot serve."""

    def __init__(self, xrt, generation: str, device_index: int = 0, context_budget: int | None = None,
                 device_contexts: Callable[[], amdxdna.ResourceInfo | None] | None = None):
        self.xrt = xrt
        self.generation = generation
        self.device = xrt.device(device_index)
        budget = CONTEXT_BUDGET[generation] if context_budget is None else context_budget
        if device_contexts is None and not self.simulator:  # XRT's device i is the i-th accel node
            node = f"/dev/accel/accel{device_index}"
            device_contexts = lambda: amdxdna.resource_info(node)  # noqa: E731
        self.plan = ContextPlan(xrt, self.device, budget, device_contexts)
        self.designs: dict[tuple, _Design] = {}  # shape -> its smallest-M design
        self.variants: dict[tuple, list[_Design]] = {}  # shape -> its designs by M, smallest first
        self.weights: dict[int, tuple[tuple, list]] = {}  # handle -> (design key, B bo per pass)
        self.in_flight: list[tuple[object, str]] = []  # (run, xclbin) of runs that timed out
        self.passes = 0  # kernel runs started
        self.bytes_to_device = 0  # activations written to A buffers (and synced) for runs
        self.bytes_from_device = 0  # outputs read back from C buffers
        self.weight_bytes = 0  # weights written to B buffers (at load)
        self.resident: dict[int, tuple[str, int]] = {}  # handle -> (weight format, bytes of its B buffers)
        self.scales: dict[int, np.ndarray] = {}  # handle -> an int8 weight's fp32 scale per output row [N]
        self._next_handle = 1
        self.groups: dict[int, tuple] = {}  # layer group id -> (spec, handles per layer, head, row steps)
        self._rows_host = None  # the host kernels a layer group's row-wise steps run on (made once)

    @property
    def simulator(self) -> bool:
        return bool(getattr(self.xrt, "SIMULATOR", False))

    def busy(self) -> set[str]:
        return {xclbin for _, xclbin in self.in_flight}

    def buffer(self, kernel, nbytes: int, group: int, flags=None):
        flags = self.xrt.bo.host_only if flags is None else flags
        return self.xrt.bo(self.device, int(nbytes), flags, kernel.group_id(group))

    def kernel_errors(self, design: GemmDesign) -> str | None:
        return kernel_errors(self.xrt, design)

    def open_design(self, design: GemmDesign) -> None:
        """Load `design` (its context, kernel, instruction stream, A and C buffers). Raises
        XrtUnavailable, or XRT's exception when it refuses the xclbin."""
        self.poll()
        entries = self.variants.get(design.key, [])
        if all(e.design.M != design.M for e in entries):
            why = kernel_errors(self.xrt, design)
            if why is not None:
                raise XrtUnavailable(why)
            entries = sorted(entries + [_Design(self, design)], key=lambda e: e.design.M)
            self.variants[design.key] = entries
            self.designs[design.key] = entries[0]  # the smallest M: the one weights are laid out by

    def drop_m(self, key: tuple, m: int) -> None:
        """Stop running the shape's M = `m` design (its rows differ from the smallest M's)."""
        kept = [e for e in self.variants.get(key, []) if e.design.M != m]
        if kept:  # never the last one
            self.variants[key] = kept

    def upload(self, key: tuple, bits: np.ndarray, scale: np.ndarray | None = None) -> int:
        """A weight [N, K] (bf16 bits; an int8 design's: int8 with its fp32 `scale` per output row)
        as the design reads it, one B buffer per pass: [cN, cK] when column-major, else [cK, cN],
        zero-padded. Returns its handle. Raises ValueError for a weight of another format."""
        self.poll()
        entry = self.designs[key]
        d = entry.design
        dtype = np.int8 if d.weight_format == "int8" else np.uint16
        if bits.dtype != dtype or bits.shape != (d.N, d.K):
            raise ValueError(f"GEMM K={d.K} N={d.N} {d.weight_format}: a weight of {bits.dtype} {bits.shape}, "
                             f"the design takes {np.dtype(dtype)} ({d.N}, {d.K})")
        if d.weight_format == "int8" and (scale is None or np.shape(scale) != (d.N,)):
            raise ValueError(f"GEMM K={d.K} N={d.N} int8: the weight needs its scale per output row ({d.N})")
        kernel = self.plan.kernel(d, self.busy())
        bos, nbytes = [], 0
        for p in range(d.n_passes):
            part = bits[p * d.compiled_N : (p + 1) * d.compiled_N]
            if d.b_col_major:
                b = np.zeros((d.compiled_N, d.compiled_K), dtype)
                b[: part.shape[0], : d.K] = part
            else:
                b = np.zeros((d.compiled_K, d.compiled_N), dtype)
                b[: d.K, : part.shape[0]] = part.T
            bo = self.buffer(kernel, b.nbytes, GROUP_B)
            bo.write(b.view(np.uint8).ravel(), 0)
            self.weight_bytes += b.nbytes
            nbytes += b.nbytes
            bo.sync(self.xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
            bos.append(bo)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.weights[handle] = (key, bos)
        self.resident[handle] = (d.weight_format, nbytes)
        if d.weight_format == "int8":
            self.scales[handle] = np.ascontiguousarray(scale, np.float32)
        return handle

    def forget(self, handle: int) -> None:
        self.weights.pop(handle, None)
        self.scales.pop(handle, None)
        self.resident.pop(handle, None)

    def activations(self, handle: int, x: np.ndarray) -> np.ndarray:
        """fp32 rows -> what `run` takes for the weight `handle` (module function `activations`)."""
        return activations(self.designs[self.weights[handle][0]].design, x)

    def run(self, handle: int, a_bits: np.ndarray, timeout_ms: int, step: int | None = None,
            m: int | None = None) -> np.ndarray:
        """a_bits: [rows, K] bf16 bits -> [rows, N] fp32: chunks of rows, each on the smallest M
        of the shape's designs that holds it (`chunk_plan`), or chunks of `step` rows on the
        smallest M (1 for a design whose rows depend on their place); `m`: the design of that M
        only. One pass over each N slice per chunk. One call for a whole linear: the worker is
        asked once. Raises NpuRunError."""
        return self.run_many([(handle, a_bits, step, m)], timeout_ms)[0]

    def run_many(self, calls: list[tuple[int, np.ndarray, int | None]], timeout_ms: int) -> list[np.ndarray]:
        """Independent GEMMs, each (handle, a_bits, step) as `run` takes it: every pass of every
        chunk of every call is started (each its own A and C buffers), then each is waited for
        and read, in order: the device is handed the whole list at once instead of one run at a
        time. A run that does not complete raises NpuRunError; every started run still in flight
        then is kept (never destroyed). Raises NpuRunError."""
        self.poll()
        xrt = self.xrt
        outs, queued = [], []  # queued: (run, entry, out, r0, rows, pass, C buffer)
        scaled = {}  # an int8 call's index -> (its rows' scales, its weight's scales): C holds int32 sums
        used: dict[tuple, list[int]] = {}  # design key -> [A slots, C slots] taken by this call
        try:
            for handle, a_bits, step, *m in calls:
                key, bos = self.weights[handle]
                entries = [e for e in self.variants[key] if not m or m[0] is None or e.design.M == m[0]]
                if not entries:
                    raise XrtUnavailable(f"GEMM K={key[0]} N={key[1]}: no design of M = {m[0]}")
                if entries[0].design.weight_format == "int8":  # each row's own scale: its neighbours change nothing
                    a_bits, dx = quantize_rows(a_bits)
                    scaled[len(outs)] = (dx, self.scales[handle])
                c_type = np.int32 if entries[0].design.dtype_out == "i32" else np.float32
                out = np.empty((a_bits.shape[0], key[1]), c_type)
                outs.append(out)
                if step is None:
                    plan = chunk_plan(a_bits.shape[0], [e.design.M for e in entries])
                else:
                    each = min(int(step), entries[0].design.M)
                    plan = [(min(each, a_bits.shape[0] - r0), entries[0].design.M)
                            for r0 in range(0, a_bits.shape[0], each)]
                by_m = {e.design.M: e for e in entries}
                r0 = 0
                for rows, chunk_m in plan:
                    entry = by_m[chunk_m]
                    d = entry.design
                    if entry.retired is not None:
                        raise NpuRunError(f"GEMM K={d.K} N={d.N}: its context was retired ({entry.retired})",
                                          "retired")
                    if str(d.xclbin) not in self.plan.open and queued:  # a context to open may close one in use
                        self._finish(queued, timeout_ms)
                        queued, used = [], {}
                    kernel = self.plan.kernel(d, self.busy() | {str(e.design.xclbin) for _, e, *_ in queued})
                    slots = used.setdefault((key, d.M), [0, 0])
                    bo_a = entry.slot(entry.a_slots, slots[0], GROUP_A, d.M * d.compiled_K * d.in_bytes)
                    slots[0] += 1
                    # the chunk's rows only (their K padding zeros): a row of C depends on its row of A
                    # alone, so the rows past them (left from earlier calls) give rows nobody reads. A
                    # design run a row at a time (`step`: its rows move with their neighbours) gets its
                    # zero padding rows written too, so its neighbours are always the same.
                    a = np.zeros((rows if step is None else d.M, d.compiled_K), a_bits.dtype)
                    a[:rows, : d.K] = a_bits[r0 : r0 + rows]
                    bo_a.write(a.view(np.uint8).ravel(), 0)
                    bo_a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, a.nbytes, 0)
                    self.bytes_to_device += a.nbytes
                    for p, bo_b in enumerate(bos):
                        bo_c = entry.slot(entry.c_slots, slots[1], GROUP_C, d.M * d.compiled_N * 4)
                        slots[1] += 1
                        self.passes += 1
                        run = kernel(OPCODE, entry.bo_insts, entry.num_insts, bo_a, bo_b, bo_c)
                        queued.append((run, entry, out, r0, rows, p, bo_c))
                    r0 += rows
            self._finish(queued, timeout_ms)
            queued = []
        except NpuRunError:
            self._keep_unfinished(queued)
            raise
        except Exception as exc:  # pyxrt raises RuntimeError (and others) from C++ for driver errors
            self._keep_unfinished(queued)
            d = queued[-1][1].design if queued else None
            where = f"GEMM K={d.K} N={d.N}" if d is not None else "a GEMM"
            raise NpuRunError(f"{where} on the NPU raised {type(exc).__name__}: {exc}") from exc
        for i, (dx, scale) in scaled.items():
            outs[i] = dequantize(outs[i], dx, scale)
        return outs

    def _finish(self, queued: list, timeout_ms: int) -> None:
        """Wait for each queued run in turn (each within the run timeout), then read its C. A run
        that does not complete raises NpuRunError (the runs still in flight: the caller keeps them)."""
        xrt = self.xrt
        ok = xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        for i, (run, entry, out, r0, rows, p, bo_c) in enumerate(queued):
            state = run.wait(int(timeout_ms))
            if state != ok:
                name = state_name(state)
                d = entry.design
                # wait() answers TIMEOUT when it stopped waiting, not when the command ended
                if name not in FINAL_STATES or name == "ERT_CMD_STATE_TIMEOUT":
                    self._keep(run, entry, name)  # still in flight: destroying it would abort
                del queued[: i + 1]  # this one is dealt with; the caller keeps the rest in flight
                raise NpuRunError(f"GEMM K={d.K} N={d.N} on the NPU ended in {name} "
                                  f"(timeout {timeout_ms} ms)", name)
        for run, entry, out, r0, rows, p, bo_c in queued:
            d = entry.design
            size = rows * d.compiled_N * 4  # C is row-major [M, cN]: the chunk's rows come first
            bo_c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, size, 0)
            raw = bo_c.read(size, 0)
            self.bytes_from_device += size
            c = np.frombuffer(bytes(raw), out.dtype).reshape(rows, d.compiled_N)
            n0 = p * d.compiled_N
            width = min(d.compiled_N, d.N - n0)
            out[r0 : r0 + rows, n0 : n0 + width] = c[:rows, :width]

    def _keep_unfinished(self, queued: list) -> None:
        """Keep every started run whose state is not final (a failure cut the call short)."""
        for run, entry, *_ in queued:
            try:
                name = state_name(run.state())
            except Exception:
                name = None
            if name is None or name not in FINAL_STATES:
                self._keep(run, entry, name or "an unknown state")

    def define_layer_group(self, spec, handles: list[dict[str, int]], head: int, steps: dict[int, int]) -> int:
        """Keep a model's layer group (npud/kernels/layers.py): its row-wise weights here, its GEMMs'
        weight handles (uploaded already), the row step of the designs that run one row a pass.
        Returns its id. The host kernels come from npud.kernels.select, as in npud itself."""
        if self._rows_host is None:
            from npud.kernels.select import default_backend

            self._rows_host = default_backend()
        gid = len(self.groups) + 1
        self.groups[gid] = (spec, handles, head, steps)
        return gid

    def layer_step(self, gid: int, i: int, attn: np.ndarray, x: np.ndarray, picked: np.ndarray,
                   timeout_ms: int) -> tuple:
        """npud/kernels/layers.py step() on this device. Raises NpuRunError."""
        from npud.kernels import layers

        spec, *_ = self.groups[gid]
        return layers.step(spec, self._rows_host, self._group_linear(gid, timeout_ms), i, attn, x, picked)

    def _group_linear(self, gid: int, timeout_ms: int):
        """The layer group's linears (layers.py's Linears): the GEMMs of one input queued together."""
        spec, handles, head, steps = self.groups[gid]

        def linears(i: int, names: tuple[str, ...], x: np.ndarray) -> tuple[np.ndarray, ...]:
            chosen = [head if name == "lm_head" else handles[i][name] for name in names]
            outs = self.run_many([(h, self.activations(h, x), steps.get(h)) for h in chosen], timeout_ms)
            for name, out in zip(names, outs):
                bias = None if name == "lm_head" else dict(spec.layers[i].biases).get(name)
                if bias is not None:
                    out += bias
            return tuple(outs)

        return linears

    def stats(self) -> dict:
        """{"passes": runs started, "contexts_opened": contexts created, "contexts_open": held now,
        "in_flight": runs kept, "bytes_to_device" / "bytes_from_device": activations written to A
        and outputs read from C, "weight_bytes": weights written to B, "weight_bytes_resident": the B
        buffers of the weights held now, per weight format} (after a poll)."""
        self.poll()
        return {"passes": self.passes, "contexts_opened": self.plan.opened, "contexts_open": len(self.plan.open),
                "in_flight": len(self.in_flight), "bytes_to_device": self.bytes_to_device,
                "bytes_from_device": self.bytes_from_device, "weight_bytes": self.weight_bytes,
                "weight_bytes_resident": self.resident_bytes()}

    def resident_bytes(self) -> dict[str, int]:
        """{weight format: bytes of the B buffers of the weights held now} (a forgotten weight's go)."""
        out: dict[str, int] = {}
        for fmt, nbytes in self.resident.values():
            out[fmt] = out.get(fmt, 0) + nbytes
        return out

    def _keep(self, run, entry: _Design, state: str) -> None:
        self.in_flight.append((run, str(entry.design.xclbin)))
        if self not in _HOLDING_RUNS:  # a backend dropped meanwhile must not take the run with it
            _HOLDING_RUNS.append(self)
        entry.retired = f"a run ended in {state} and may still be running"
        for other in (e for es in self.variants.values() for e in es):
            if other.design.xclbin == entry.design.xclbin:
                other.retired = entry.retired
        self.plan.retire(entry.design)

    def poll(self) -> int:
        """Drop the kept runs whose state is now final; returns how many are still in flight."""
        still = []
        for run, xclbin in self.in_flight:
            try:
                name = state_name(run.state())
            except Exception:  # the driver gave up on it: keep it, it is never destroyed here
                name = None
            if name is None or name not in FINAL_STATES:  # state() TIMEOUT: the driver ended it
                still.append((run, xclbin))
        self.in_flight = still
        if not still and self in _HOLDING_RUNS:
            _HOLDING_RUNS.remove(self)
        busy = self.busy()
        self.plan.retired = [c for c in self.plan.retired if c.xclbin in busy]  # the others close now
        return len(still)

    def close(self) -> None:
        """Let go of everything but the runs still in flight (kept referenced until they end)."""
        if self.poll():
            return
        self.weights.clear()
        self.scales.clear()
        self.resident.clear()
        self.designs.clear()
        self.variants.clear()
