"""The NPU backend: GEMMs on an AMD Ryzen AI NPU through XRT (pyxrt), the rest on the host.

The device runs precompiled GEMM designs, one per (K, N) of the model's linears, listed in
a design table (kernels/xrt_design.py). Each is called the way mlir-aie's `aie.utils.xrt`
calls an aiecc-built kernel: `kernel(3, instr_bo, num_instr_words, A_bo, B_bo, C_bo)`, with
the instruction buffer in the kernel's group 1 (cacheable) and A, B, C in groups 3, 4, 5
(host_only). pyxrt's `kernel.__call__` silently skips an argument it cannot set, so the
call passes exactly these six and the design is checked, at load, to declare at least as
many (aiecc declares opcode, instr, ninstr, bo0..bo4).

A call runs the design's compiled M rows; a batch of more rows is cut into chunks of M,
the last one zero-padded. Every row is computed by the same program whatever the batch,
which is what batch invariance needs; the start-up check (kernels/xrt_check.py) confirms it
bit for bit on the device, and compares with the host GEMM within a stated tolerance. A
run that does not end in ERT_CMD_STATE_COMPLETED within the configured timeout, or any
exception from XRT, raises NpuRunError (a DeviceFault): an aborted run leaves zeros in C,
which must never reach the logits.

Shapes without a design, and weight formats other than bf16, run on the host kernels; each
such shape is logged once with the reason. pyxrt ships with XRT and is not on the package
index: it is imported when the backend is built, never at import time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import structlog

from kernels.base import DeviceFault, LinearWeight, WeightFormat
from kernels.xrt_design import DesignError, DesignTable, GemmDesign, read_insts

log = structlog.get_logger(__name__)

OPCODE = 3  # the opcode aiecc-built kernels expect for "run the instruction stream"
GROUP_INSTR, GROUP_A, GROUP_B, GROUP_C = 1, 3, 4, 5  # kernel argument indices, for group_id()
NUM_CALL_ARGS = 6  # opcode, instr, ninstr, A, B, C
DEFAULT_TIMEOUT_MS = 5000


class XrtUnavailable(ValueError):
    """The NPU path cannot run here; the message says what is missing (a configuration
    error from the daemon's point of view: the model was asked for a backend it cannot have)."""


class NpuRunError(DeviceFault):
    """A GEMM run on the NPU failed: its state (or the XRT exception) is in the message."""

    def __init__(self, message: str, state: str | None = None):
        super().__init__(message)
        self.state = state


def probe(accel_dir: str | Path = "/dev/accel") -> tuple[bool, str]:
    """Whether an amdxdna NPU and the XRT binding are usable here, and why (not)."""
    nodes = sorted(Path(accel_dir).glob("accel*")) if Path(accel_dir).is_dir() else []
    if not nodes:
        return False, f"no NPU device node under {accel_dir}"
    try:
        import pyxrt  # noqa: F401
    except ImportError as e:
        return False, f"{nodes[0]} exists but the XRT Python binding (pyxrt) is not importable: {e}"
    return True, f"{nodes[0]} with pyxrt"


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN kept a NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _pyxrt():
    try:
        import pyxrt
    except ImportError as e:
        raise XrtUnavailable(f"the XRT Python binding (pyxrt) is not importable: {e}") from e
    return pyxrt


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


class _DesignRunner:
    """One loaded design: its hardware context, kernel, instruction buffer and A/C buffers."""

    def __init__(self, xrt, device, design: GemmDesign):
        self.xrt = xrt
        self.design = design
        why = kernel_errors(xrt, design)
        if why is not None:
            raise XrtUnavailable(why)
        xclbin = xrt.xclbin(str(design.xclbin))
        device.register_xclbin(xclbin)
        self.context = xrt.hw_context(device, xclbin.get_uuid())
        self.kernel = xrt.kernel(self.context, design.kernel)
        self.device = device
        try:
            insts = read_insts(design.insts)
        except DesignError as e:
            raise XrtUnavailable(str(e)) from None
        self.num_insts = int(insts.size)
        self.bo_insts = self.buffer(insts.nbytes, GROUP_INSTR, xrt.bo.cacheable)
        self.bo_insts.write(insts.view(np.uint8), 0)
        self.bo_insts.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        d = design
        self.bo_a = self.buffer(d.M * d.compiled_K * 2, GROUP_A)
        self.bo_c = self.buffer(d.M * d.compiled_N * 4, GROUP_C)

    def buffer(self, nbytes: int, group: int, flags=None):
        flags = self.xrt.bo.host_only if flags is None else flags
        return self.xrt.bo(self.device, int(nbytes), flags, self.kernel.group_id(group))

    def upload_weight(self, w: LinearWeight):
        """B as the design reads it: [cN, cK] bf16 when column-major (the weight as loaded), else [cK, cN]."""
        d = self.design
        if d.b_col_major:
            b = np.zeros((d.compiled_N, d.compiled_K), np.uint16)
            b[: d.N, : d.K] = w.data
        else:
            b = np.zeros((d.compiled_K, d.compiled_N), np.uint16)
            b[: d.K, : d.N] = w.data.T
        bo = self.buffer(b.nbytes, GROUP_B)
        bo.write(b.view(np.uint8).ravel(), 0)
        bo.sync(self.xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        return bo

    def run(self, x: np.ndarray, bo_b, timeout_ms: int) -> np.ndarray:
        """x: [rows <= M, K] fp32 -> [rows, N] fp32: one device pass. Raises NpuRunError."""
        d, xrt = self.design, self.xrt
        rows = x.shape[0]
        a = np.zeros((d.M, d.compiled_K), np.uint16)  # padding rows and columns are zeros
        a[:rows, : d.K] = _bf16_bits(x)
        ok = xrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        try:
            self.bo_a.write(a.view(np.uint8).ravel(), 0)
            self.bo_a.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
            run = self.kernel(OPCODE, self.bo_insts, self.num_insts, self.bo_a, bo_b, self.bo_c)
            state = run.wait(int(timeout_ms))
            if state != ok:
                raise NpuRunError(f"GEMM K={d.K} N={d.N} on the NPU ended in {_state_name(state)} "
                                  f"(timeout {timeout_ms} ms)", _state_name(state))
            self.bo_c.sync(xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
            raw = self.bo_c.read(d.M * d.compiled_N * 4, 0)
        except NpuRunError:
            raise
        except Exception as exc:  # pyxrt raises RuntimeError (and others) from C++ for driver errors
            raise NpuRunError(f"GEMM K={d.K} N={d.N} on the NPU raised {type(exc).__name__}: {exc}") from exc
        c = np.frombuffer(bytes(raw), np.float32).reshape(d.M, d.compiled_N)
        return c[:rows, : d.N].copy()


def _state_name(state) -> str:
    return getattr(state, "name", None) or str(state)


class XrtBackend:
    """GEMMs with a design on the NPU (compiled-M-row passes), everything else on `host`.

    `check` is run on each design when its first weight is prepared (kernels/xrt_check.py);
    `strict` (backend "xrt") turns a failed check into XrtUnavailable instead of a move to
    the host.
    """

    name = "xrt"

    def __init__(self, table: DesignTable, host, *, device_index: int = 0,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, strict: bool = False, check=None):
        self._xrt = _pyxrt()
        if getattr(self._xrt, "SIMULATOR", False):  # tests/fake_pyxrt.py: never NPU evidence
            self.name = "xrt-simulator"
        self.table = table
        self.host = host
        self.timeout_ms = int(timeout_ms)
        self.strict = strict
        self.device = self._xrt.device(device_index)
        self._runners: dict[tuple, _DesignRunner] = {}
        self._rowwise: set[tuple] = set()  # designs whose rows depend on their place in a pass
        self._weights: dict[int, tuple[_DesignRunner, object]] = {}  # id(prepared data) -> (runner, B bo)
        self.placement: dict[tuple[int, int, str], str] = {}  # shape -> "npu", "npu-rowwise" or why host
        if check is None:
            from kernels.xrt_check import check_design
            check = check_design
        self._check = check
        try:
            self.table_identity = table.identity()  # of the files as loaded now
        except OSError as exc:
            raise XrtUnavailable(f"cannot read the design files of {table.path}: {exc}") from exc
        for key, design in sorted(table.designs.items()):  # every xclbin is read now, used or not
            why = kernel_errors(self._xrt, design)
            if why is not None and strict:
                raise XrtUnavailable(why)
            if why is not None:
                self._to_host(key, f"the design does not load: {why}")

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        """The host's layout of `w` (embeddings and host fallbacks read it); with a design for
        its shape, also its B buffer on the device. Raises XrtUnavailable (strict) or NpuRunError."""
        host_copy = self.host.prepare_linear(w)
        if w.layout != "rows":
            return host_copy
        n, k = w.out_features, w.in_features  # a block-quantised format keeps these too
        key = (int(k), int(n), w.fmt.value)
        runner = self._runner(key)
        if runner is not None:
            try:
                bo = runner.upload_weight(w)
            except Exception as exc:  # XRT's "failed to allocate BO": most often the memlock limit
                raise XrtUnavailable(f"cannot place a [{n}, {k}] weight in NPU memory: {exc} (is the memlock "
                                     "limit unlimited? docs/npu.md)") from exc
            self._weights[id(host_copy.data)] = (runner, bo)
        return host_copy

    def _runner(self, key: tuple[int, int, str]) -> _DesignRunner | None:
        if key in self._runners:
            return self._runners[key]
        if key in self.placement:  # decided before: host, and said so once
            return None
        design, why = self.table.lookup(*key)
        if design is None:
            return self._to_host(key, why)
        try:
            runner = _DesignRunner(self._xrt, self.device, design)
            failures, rowwise = self._check(runner, self.host, self.timeout_ms)
        except Exception as exc:  # XrtUnavailable, or XRT refusing the xclbin (RuntimeError from C++)
            if self.strict:
                raise XrtUnavailable(f"NPU GEMM K={key[0]} N={key[1]}: {exc}") from exc
            return self._to_host(key, f"the design does not load: {exc}")
        if failures:
            if self.strict:
                raise XrtUnavailable(f"NPU GEMM K={key[0]} N={key[1]} failed the start-up check: {failures[0]}")
            log.warning("kernel_self_check_failed", backend="xrt", K=key[0], N=key[1], failures=failures,
                        fallback="host")
            return self._to_host(key, f"failed the start-up check ({failures[0]})")
        if rowwise:
            log.warning("kernel_self_check_failed", backend="xrt", K=key[0], N=key[1], failures=rowwise,
                        fallback="rowwise")
            self._rowwise.add(key)
        else:
            log.info("kernel_self_check_passed", backend="xrt", K=key[0], N=key[1], M=design.M)
        self.placement[key] = "npu-rowwise" if rowwise else "npu"
        self._runners[key] = runner
        return runner

    def _to_host(self, key: tuple[int, int, str], why: str) -> None:
        self.placement[key] = why
        log.info("npu_shape_on_host", K=key[0], N=key[1], weight_format=key[2], reason=why)
        return None

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        # x: [M, K] -> [M, N]; each chunk of the design's M rows is one device pass over W
        entry = self._weights.get(id(w.data))
        if entry is None:
            return self.host.linear(x, w)
        runner, bo_b = entry
        step = 1 if runner.design.key in self._rowwise else runner.design.M
        out = np.empty((x.shape[0], runner.design.N), np.float32)
        for r0 in range(0, x.shape[0], step):
            out[r0 : r0 + step] = runner.run(x[r0 : r0 + step], bo_b, self.timeout_ms)
        if w.bias is not None:
            out += w.bias
        return out

    def fuse_linears(self, parts) -> None:
        """Keeps every linear apart: a design is compiled for one layer's (K, N), and a fused shape has
        none. Defined here because __getattr__ would answer with the host's fusion."""
        return None

    def numerics_id(self) -> str:
        """What this backend's numbers depend on besides the weights: the design table's identity
        (its program files and tiles), which shapes run where, and the activation path. Defined
        here because __getattr__ would answer with the host's."""
        placement = json.dumps(self.describe_placement(), sort_keys=True)
        return (f"{self.name}/designs={self.table_identity}/placement={placement}"
                "/activations=bf16/accumulate=fp32")

    def describe_placement(self) -> dict:
        """Where each GEMM shape runs: {"K x N fmt": "npu" | "npu-rowwise" | why host}."""
        return {f"{k}x{n} {fmt}": where for (k, n, fmt), where in sorted(self.placement.items())}

    def __getattr__(self, attr):
        # rms_norm, rope, attention, silu_mul, embed, argmax: the host kernels
        if attr.startswith("_") or attr == "host":  # not set yet: a failed __init__
            raise AttributeError(attr)
        return getattr(self.host, attr)


def load_backend(design_table: str | Path, host, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 strict: bool = False) -> XrtBackend:
    """The NPU backend for a design table; raises XrtUnavailable with what is wrong."""
    try:
        table = DesignTable.load(design_table)
    except DesignError as e:
        raise XrtUnavailable(str(e)) from None
    return XrtBackend(table, host, timeout_ms=timeout_ms, strict=strict)
