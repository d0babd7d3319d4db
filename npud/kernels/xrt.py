"""The NPU backend: GEMMs on an AMD Ryzen AI NPU through XRT (pyxrt), the rest on the host.

The device runs precompiled GEMM designs, one per (K, N) of the model's linears, listed in
a design table (npud/kernels/xrt_design.py). Every device call goes through a DeviceSession
(npud/kernels/xrt_device.py: contexts, buffers, the call protocol), which runs in a worker
process of its own (npud/kernels/xrt_worker.py, isolation "process", the default) so that a
hang, an abort or a segfault in the driver stack faults a run instead of npud, and pyxrt's
GIL-holding waits never stall the daemon; isolation "inline" runs it in this process (the
protocol tests, which watch each call).

A pass runs a design's compiled M rows; a call's rows are cut into chunks, each on the
smallest M of the shape's designs that holds it (the table may hold several M per shape), and
only a chunk's rows are copied to the device and back; a layer wider than one pass runs as the
design's n_passes passes. Every row is computed by the same program whatever the batch, which
is what batch invariance needs; the start-up check (npud/kernels/xrt_check.py) confirms it bit
for bit on the device, a larger M is kept only with the smallest M's bits, and the check
compares with the host GEMM within the design's tolerance policy. A run that
does not end in ERT_CMD_STATE_COMPLETED within the configured timeout, any exception from
XRT, or a worker that dies or hangs, raises NpuRunError (a DeviceFault): an aborted run
leaves zeros in C, which must never reach the logits.

The weight goes to the array in the model's weight format: a bf16 model's to bf16 designs, an
int8 model's (int8 rows with a scale each) to int8 designs, which multiply int8 activations
quantized per row and sum in int32 (npud/kernels/xrt_device.py `quantize_rows`, `dequantize`;
docs/npu.md, "Exactness", writes both formats' arithmetic beside the host's and their bounds).
Shapes without a design, and weight formats other than bf16 and int8, run on the host kernels; each
such shape is logged once with the reason. So does a shape the host computes faster: when a
shape's first weight is uploaded, a decode-sized pass (COST_ROWS rows) of that weight is timed
on the NPU, through the worker as a decode pays it, and on the host (the fastest of
COST_REPEATS runs of each, as npud/engine/pass_costs.py times verify rows), and the shape
stays on the NPU only where the NPU is faster (backend "xrt" keeps it there regardless and
says what it costs). pyxrt ships with XRT and is not on the package
index: it is imported when the backend is built, never at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import structlog

from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.xrt_design import DesignError, DesignTable, GemmDesign
from npud.kernels.xrt_device import DeviceSession, NpuRunError, XrtUnavailable, activations, bf16_bits

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_MS = 5000
COST_ROWS = 1  # the rows of a decode step: the pass placement compares
COST_REPEATS = 5  # runs of each side; the fastest is kept (a preempted run only ever looks slower)
FIRST_PROJECTIONS = ("q", "k", "v")  # layer 0's: run on the host under a layer group (layer_group)
FIRST_ON_HOST = "host (layer 0's projections run beside the embedding under the layer group: one worker round trip fewer a step)"
BINDING = "pyxrt"  # the module that is XRT's Python binding (tests name their simulator)
ISOLATIONS = ("process", "inline")
_bf16_bits = bf16_bits  # the name tests/test_kernels.py checks


def probe(accel_dir: str | Path = "/dev/accel") -> tuple[bool, str]:
    """Whether an amdxdna NPU and the XRT binding are usable here, and why (not)."""
    nodes = sorted(Path(accel_dir).glob("accel*")) if Path(accel_dir).is_dir() else []
    if not nodes:
        return False, f"no NPU device node under {accel_dir}"
    # found, not imported: with isolation "process" XRT's libraries load in the worker only
    if importlib.util.find_spec(BINDING) is None:
        return False, f"{nodes[0]} exists but the XRT Python binding (pyxrt) is not importable: no module {BINDING!r}"
    return True, f"{nodes[0]} with pyxrt"


def _binding():
    try:
        return importlib.import_module(BINDING)
    except ImportError as e:
        raise XrtUnavailable(f"the XRT Python binding (pyxrt) is not importable: {e}") from e


class _Runner:
    """One design as the backend and the start-up check use it: weights in, passes run."""

    def __init__(self, device, design: GemmDesign):
        self.device, self.design = device, design

    def upload_weight(self, w: LinearWeight) -> int:
        if self.design.weight_format == "int8":
            return self.device.upload(self.design.key, w.data, w.scale)
        return self.device.upload(self.design.key, w.data)

    def run(self, x: np.ndarray, handle: int, timeout_ms: int, step: int | None = None) -> np.ndarray:
        """x: [rows, K] fp32 -> [rows, N] fp32: chunks of `step` rows (M by default), one pass per
        N slice each (bf16 bits to a bf16 design, fp32 rows to an int8 one). Raises NpuRunError."""
        return self.device.run(handle, activations(self.design, x), int(timeout_ms), step)


def measure_costs(runner: "_Runner", handle: int, host, host_weight: LinearWeight, rows: int,
                  timeout_ms: int) -> tuple[float, float]:
    """Seconds of a `rows`-row pass of one weight on the NPU (the worker's round trip included:
    what a decode step pays) and on the host: the fastest of COST_REPEATS runs of each. Raises
    NpuRunError."""
    import time

    x = np.random.default_rng(0).standard_normal((rows, host_weight.in_features)).astype(np.float32)

    def fastest(call) -> float:
        best = float("inf")
        for _ in range(COST_REPEATS):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        return best

    return fastest(lambda: runner.run(x, handle, timeout_ms)), fastest(lambda: host.linear(x, host_weight))


class XrtBackend:
    """GEMMs with a design on the NPU (compiled-M-row passes), everything else on `host`.

    `check` is run on each design when its first weight is prepared (npud/kernels/xrt_check.py);
    `strict` (backend "xrt") turns a failed check into XrtUnavailable instead of a move to
    the host. `costs` times a shape on both sides (`measure_costs`; tests inject theirs).
    """

    name = "xrt"

    def __init__(self, table: DesignTable, host, *, device_index: int = 0,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, strict: bool = False, check=None,
                 isolation: str = "process", context_budget: int | None = None, costs=None):
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation {isolation!r}: expected one of {list(ISOLATIONS)}")
        self.isolation = isolation
        if isolation == "inline":
            self.device = DeviceSession(_binding(), table.device, device_index, context_budget)
            simulator = self.device.simulator
        else:
            from npud.kernels.xrt_worker import WorkerDevice

            self.device = WorkerDevice(BINDING, table.device, device_index=device_index,
                                       context_budget=context_budget)
            simulator = self.device.simulator
        if simulator:  # tests/fake_pyxrt.py: never NPU evidence
            self.name = "xrt-simulator"
        self.table = table
        self.host = host
        self.timeout_ms = int(timeout_ms)
        self.strict = strict
        self._runners: dict[tuple, _Runner] = {}
        self._rowwise: set[tuple] = set()  # designs whose rows depend on their place in a pass
        self._weights: dict[int, tuple[_Runner, int]] = {}  # id(prepared data) -> (runner, weight handle)
        self._host_by_group: dict[int, str] = {}  # id(prepared data) -> why the layer group runs it on the host
        self.placement: dict[tuple[int, int, str], str] = {}  # shape -> "npu", "npu-rowwise" or why host
        self.policies: dict[tuple[int, int, str], str] = {}  # shape on the NPU -> its tolerance policy
        self.sizes: dict[tuple[int, int, str], list[int]] = {}  # shape -> the M it runs on, when more than one
        self._m_checked: set[tuple[int, int, str]] = set()  # shapes whose larger M were tried
        self.costs: dict[tuple[int, int, str], tuple[float, float]] = {}  # shape -> (NPU s, host s), COST_ROWS rows
        self._costs = costs if costs is not None else measure_costs
        if check is None:
            from npud.kernels.xrt_check import check_design
            check = check_design
        self._check = check
        try:
            self._read_table()
        except BaseException:
            self.device.close()  # no worker outlives a backend that was never built
            raise

    def _read_table(self) -> None:
        table = self.table
        try:
            self.table_identity = table.identity()  # of the files as loaded now
        except OSError as exc:
            raise XrtUnavailable(f"cannot read the design files of {table.path}: {exc}") from exc
        log.info("npu_design_table", path=str(table.path), device=table.device, designs=len(table.designs),
                 toolchain=table.toolchain or None)
        for key, design in sorted(table.designs.items()):  # every xclbin is read now, used or not
            why = self.device.kernel_errors(design)
            if why is not None and self.strict:
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
                handle = runner.upload_weight(w)
            except NpuRunError:
                raise
            except Exception as exc:  # XRT's "failed to allocate BO": most often the memlock limit
                raise XrtUnavailable(f"cannot place a [{n}, {k}] weight in NPU memory: {exc} (is the memlock "
                                     "limit unlimited? docs/npu.md)") from exc
            if key not in self.costs and not self._placed_by_cost(key, runner, handle, host_copy):
                return host_copy  # the host is faster for this shape: it runs there from now on
            if key not in self._m_checked:  # its first weight: the larger M are tried with it
                self._m_checked.add(key)
                if key not in self._rowwise:  # rows that move with their place run one a pass, on the smallest M
                    self._open_other_m(key, runner.design, handle)
            self._weights[id(host_copy.data)] = (runner, handle)
        return host_copy

    def _placed_by_cost(self, key: tuple[int, int, str], runner: _Runner, handle: int,
                        host_weight: LinearWeight) -> bool:
        """Time the shape on both sides (its first weight) and keep it on the NPU only where the NPU
        is faster, or where backend "xrt" asks for the NPU. Raises NpuRunError."""
        npu_s, host_s = self._costs(runner, handle, self.host, host_weight, COST_ROWS, self.timeout_ms)
        self.costs[key] = (float(npu_s), float(host_s))
        said = f"{COST_ROWS}-row pass: NPU {npu_s * 1e3:.3f} ms, host {host_s * 1e3:.3f} ms"
        if npu_s < host_s or self.strict:
            log.info("npu_shape_placed", K=key[0], N=key[1], weight_format=key[2], npu_ms=round(npu_s * 1e3, 3),
                     host_ms=round(host_s * 1e3, 3), where="npu", strict=self.strict)
            return True
        self.device.forget(handle)
        del self._runners[key]
        self.policies.pop(key, None)
        self._rowwise.discard(key)
        self._to_host(key, f"the host is faster ({said})")
        return False

    def _runner(self, key: tuple[int, int, str]) -> _Runner | None:
        if key in self._runners:
            return self._runners[key]
        if key in self.placement:  # decided before: host, and said so once
            return None
        design, why = self.table.lookup(*key)
        if design is None:
            return self._to_host(key, why)
        try:
            self.device.open_design(design)
            runner = _Runner(self.device, design)
            failures, rowwise = self._check(runner, self.host, self.timeout_ms)
        except NpuRunError:
            raise  # the device itself failed (a dead or hung worker): a fault, not a design to skip
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
            log.info("kernel_self_check_passed", backend="xrt", K=key[0], N=key[1], M=design.M,
                     passes=design.n_passes, tolerance=tolerance_policy(design))
        self.policies[key] = tolerance_policy(design)
        self.placement[key] = "npu-rowwise" if rowwise else "npu"
        self._runners[key] = runner
        return runner

    def _open_other_m(self, key: tuple[int, int, str], first: GemmDesign, handle: int) -> None:
        """Open the shape's designs of larger M (the table's variants), each kept only where its rows,
        over the shape's first weight (`handle`: no upload of its own), are bit for bit those of the
        smallest M's passes: a row's bits must not depend on how many rows share its pass. Raises
        NpuRunError."""
        rng = np.random.default_rng(1)
        for design in self.table.by_m(key)[1:]:
            try:
                self.device.open_design(design)
                x = activations(first, rng.standard_normal((design.M, first.K)).astype(np.float32))
                wide = self.device.run(handle, x, self.timeout_ms, None, design.M)
                narrow = self.device.run(handle, x, self.timeout_ms, None, first.M)
            except NpuRunError:
                raise
            except Exception as exc:  # XRT refusing the design: the smaller M serves the shape alone
                log.warning("npu_design_m_dropped", K=key[0], N=key[1], M=design.M, reason=str(exc))
                continue
            if np.array_equal(wide.view(np.uint32), narrow.view(np.uint32)):
                log.info("npu_design_m_added", K=key[0], N=key[1], M=design.M, smallest=first.M)
                self.sizes.setdefault(key, [first.M]).append(design.M)
            else:
                self.device.drop_m(key, design.M)
                log.warning("npu_design_m_dropped", K=key[0], N=key[1], M=design.M,
                            reason=f"its rows differ from the M = {first.M} design's")

    def _to_host(self, key: tuple[int, int, str], why: str) -> None:
        self.placement[key] = why
        log.info("npu_shape_on_host", K=key[0], N=key[1], weight_format=key[2], reason=why)
        return None

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        # x: [M, K] -> [M, N]; each chunk of the design's M rows is one device pass over W
        entry = self._weights.get(id(w.data))
        if entry is None:
            if id(w.data) in self._host_by_group:
                return self.first_linear(x, w)
            return self.host.linear(x, w)
        runner, handle = entry
        step = 1 if runner.design.key in self._rowwise else None  # None: each chunk on the smallest M that holds it
        out = runner.run(x, handle, self.timeout_ms, step)  # one call to the device for the whole linear
        if w.bias is not None:
            out += w.bias
        return out

    def first_linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        """Layer 0's projections on the host under the layer group: the host GEMM of the
        activations rounded to bf16 where the weight is bf16, as every bf16 GEMM of this backend
        takes them (numerics_id's "activations=bf16"; an int8 weight's host GEMM quantizes its own
        rows); x: [M, K] -> [M, N], the bias added."""
        return self.host.linear(bf16_round(x) if w.fmt is WeightFormat.BF16 else x, w)

    def layer_group(self, spec, layers: list[dict[str, LinearWeight]], lm_head: LinearWeight) -> "NpuLayerGroup | None":
        """The model's layer group on this device (npud/kernels/layers.py: one call per layer,
        one worker round trip), or None when any of its linears does not run on the NPU (then
        the engine calls the ops one by one, as before). `spec` holds the row-wise weights;
        `layers` each layer's q, k, v, o, gate, up, down as prepared; `lm_head` likewise.

        Layer 0's q, k and v are the one stretch with no worker call before it to ride on (the
        first attention needs them, and the token they come from is picked after the previous
        step's last call): they run here on the host, beside the embedding, so a step costs the
        worker L round trips, not L + 1. From then on they run on the host op by op too (their
        device buffers are let go), so the per-op path keeps the group's bits."""
        def handle(w: LinearWeight) -> int | None:
            entry = self._weights.get(id(w.data))
            return None if entry is None else entry[1]

        handles = [{name: handle(w) for name, w in layer.items()} for layer in layers]
        head = handle(lm_head)
        on_device = [h for i, layer in enumerate(handles) for name, h in layer.items()
                     if i > 0 or name not in FIRST_PROJECTIONS]
        if head is None or any(h is None for h in on_device):
            return None
        for name in FIRST_PROJECTIONS:  # layer 0's: the host's from now on
            w = layers[0][name]
            if handles[0][name] is not None:
                del self._weights[id(w.data)]
                self.device.forget(handles[0][name])
                handles[0][name] = None
            self._host_by_group[id(w.data)] = FIRST_ON_HOST
        steps = {h: 1 for layer, ws in zip(handles, layers) for name, h in layer.items()
                 if h is not None and (ws[name].in_features, ws[name].out_features, ws[name].fmt.value) in self._rowwise}
        if (lm_head.in_features, lm_head.out_features, lm_head.fmt.value) in self._rowwise:
            steps[head] = 1
        gid = self.device.define_layer_group(spec, handles, head, steps)
        log.info("npu_layer_group", layers=len(layers), round_trips_per_token=len(layers),
                 first_projections="host")
        first = {name: layers[0][name] for name in FIRST_PROJECTIONS}
        return NpuLayerGroup(self.device, gid, self.timeout_ms, spec, self.host,
                             lambda name, h: self.first_linear(h, first[name]))

    def fuse_linears(self, parts) -> None:
        """Keeps every linear apart: a design is compiled for one layer's (K, N), and a fused shape has
        none. Defined here because __getattr__ would answer with the host's fusion."""
        return None

    def decoder_layer(self, call) -> None:
        """None: a layer's linears go to `linear` one by one (npud.kernels.base.compose_layer), where
        each runs on the NPU or the host by placement. Defined here because __getattr__ would
        answer with the host's one-call layer, which runs every linear on the host."""
        return None

    def decoder_stack(self, call) -> None:
        """None, as decoder_layer: the layers go one by one (the layer group, npud/kernels/layers.py,
        is this backend's one call per layer)."""
        return None

    def numerics_id(self) -> str:
        """What this backend's numbers depend on besides the weights: the design table's identity
        (its program files and tiles), which shapes run where, and the activation path. Defined
        here because __getattr__ would answer with the host's."""
        placement = json.dumps(self.describe_placement(), sort_keys=True)
        first = "/first_projections=host" if self._host_by_group else ""
        int8 = any(fmt == "int8" for (_, _, fmt) in self.table.designs)  # int8 shapes: their own arithmetic
        return (f"{self.name}/designs={self.table_identity}/placement={placement}{first}"
                "/activations=bf16/accumulate=fp32" + ("/int8=activations-int8-per-row/accumulate-int32" if int8 else ""))

    def describe_placement(self) -> dict:
        """Where each GEMM shape runs: {"K x N fmt": "npu" | "npu-rowwise" | why host}."""
        return {f"{k}x{n} {fmt}": where for (k, n, fmt), where in sorted(self.placement.items())}

    def stats(self) -> dict:
        """The device path's counters so far: "worker_round_trips", "pipe_bytes" and "shared_bytes"
        (arrays through the worker's shared region; all 0 inline; read
        before the device is asked, so this call's own round trip is not among them), then the
        device session's (DeviceSession.stats: passes, contexts, bytes to and from the device)."""
        trips, pipe = getattr(self.device, "round_trips", 0), getattr(self.device, "pipe_bytes", 0)
        shared = getattr(self.device, "shared_bytes", 0)
        return {"worker_round_trips": trips, "pipe_bytes": pipe, "shared_bytes": shared, **self.device.stats()}

    def worker_pid(self) -> int:
        """The process that holds the device for this backend: its NPU worker's, or this one's inline."""
        return self.device.pid if self.isolation == "process" else os.getpid()

    def describe_costs(self) -> dict:
        """What each timed shape costs a COST_ROWS-row pass: {"K x N fmt": {"rows", "npu_ms", "host_ms"}}."""
        return {f"{k}x{n} {fmt}": {"rows": COST_ROWS, "npu_ms": round(npu * 1e3, 3), "host_ms": round(host * 1e3, 3)}
                for (k, n, fmt), (npu, host) in sorted(self.costs.items())}

    def where(self, w: LinearWeight) -> str:
        """Where one prepared weight runs: "npu" (or "npu-rowwise"), or why the host."""
        key = (int(w.in_features), int(w.out_features), w.fmt.value)
        where = self.placement.get(key)
        if id(w.data) in self._host_by_group:
            return self._host_by_group[id(w.data)]
        if id(w.data) in self._weights:
            return where or "npu"
        return where if where is not None and not where.startswith("npu") else "host"

    def lost_everywhere(self) -> bool:
        """Whether the NPU runs none of the shapes and at least one was timed and lost: the model
        is better served by the host backend alone."""
        return bool(self.costs) and not any(p.startswith("npu") for p in self.placement.values())

    def describe_tolerance(self) -> dict:
        """The start-up check's tolerance policy of each shape on the NPU: {"K x N fmt": policy}."""
        return {f"{k}x{n} {fmt}": policy for (k, n, fmt), policy in sorted(self.policies.items())}

    def close(self) -> None:
        """Let the device go (the worker ends; runs still in flight are never destroyed)."""
        self.device.close()

    def __getattr__(self, attr):
        # rms_norm, rope, attention, silu_mul, embed, argmax: the host kernels
        if attr.startswith("_") or attr == "host":  # not set yet: a failed __init__
            raise AttributeError(attr)
        return getattr(self.host, attr)


class NpuLayerGroup:
    """A model's layers on the NPU device, one call per layer (npud/kernels/layers.py's shape):
    each call is one worker round trip running the layer's GEMMs and row-wise kernels. `begin`
    (layer 0's input norm and projections) runs here, on the host kernels, with no round trip."""

    def __init__(self, device, gid: int, timeout_ms: int, spec, host, first_linear):
        self.device, self.gid, self.timeout_ms = device, gid, timeout_ms
        self.spec, self.host, self.first_linear = spec, host, first_linear  # first_linear(name, h)

    def begin(self, x: np.ndarray) -> tuple:
        from npud.kernels import layers

        return layers.begin(self.spec, self.host,
                            lambda i, names, h: tuple(self.first_linear(name, h) for name in names),
                            np.ascontiguousarray(x, np.float32))

    def step(self, i: int, attn: np.ndarray, x: np.ndarray, picked: np.ndarray) -> tuple:
        return self.device.layer_step(self.gid, i, np.ascontiguousarray(attn, np.float32),
                                      np.ascontiguousarray(x, np.float32), np.asarray(picked, np.int64),
                                      self.timeout_ms)


def load_backend(design_table: str | Path, host, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 strict: bool = False, isolation: str = "process", context_budget: int | None = None,
                 costs=None) -> XrtBackend:
    """The NPU backend for a design table; raises XrtUnavailable with what is wrong."""
    try:
        table = DesignTable.load(design_table)
    except DesignError as e:
        raise XrtUnavailable(str(e)) from None
    return XrtBackend(table, host, timeout_ms=timeout_ms, strict=strict, isolation=isolation,
                      context_budget=context_budget, costs=costs)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32: the activations
    a GEMM of this backend reads."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def tolerance_policy(design: GemmDesign) -> str:
    """The start-up check's tolerance for `design` (npud/kernels/xrt_check.py says what each means)."""
    if design.weight_format == "int8":
        return "int8-rows"
    return "bfp16-blocks" if design.bfp16_emulation else "bf16-exact-products"
