#!/usr/bin/env python3
"""The first run on a Ryzen AI NPU, in one sitting: each step prints PASS, FAIL, SKIP or INFO
and what it saw; the exit status is 1 when a step failed (docs/npu.md, "First run on hardware").

    .venv/bin/python tools/npu_checklist.py --design /var/lib/npud/designs/qwen3-0.6b/design.json
    .venv/bin/python tools/npu_checklist.py --stand-in --json   # no NPU: bench/npu_stand_in.py's counts

The steps, in order: the driver and its device node, the firmware, access to the node, the
memlock limit, pyxrt, the device generation against the table's, the design table, each
instruction stream's header, the NPU worker, every design's start-up check (with its
tolerance policy), the AIE accumulator's rounding seen from the outputs, ninstr counted in
words, a run that outlives its wait (kept and polled, never destroyed), and the
hardware-context budget of the generation, and what the worker process costs a linear
layer against running pyxrt inline. A step that needs an earlier one is skipped
when that one failed. Nothing here writes to the device beyond running the designs.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npud.kernels import xrt  # noqa: E402
from npud.kernels.base import LinearWeight, WeightFormat  # noqa: E402
from npud.kernels.xrt_check import bf16_round  # noqa: E402
from npud.kernels.xrt_design import DesignError, DesignTable, read_insts  # noqa: E402
from npud.kernels.xrt_device import CONTEXT_BUDGET  # noqa: E402

PCI_GENERATION = {"0x1502": "npu1", "0x17f0": "npu2"}  # Phoenix/Hawk Point; Strix/Krackan (npu4..6)


class Checklist:
    def __init__(self) -> None:
        self.failed = 0
        self.results: list[tuple[str, str, str]] = []

    def say(self, verdict: str, step: str, detail: str) -> bool:
        self.results.append((verdict, step, detail))
        self.failed += verdict == "FAIL"
        print(f"[{verdict:4s}] {step}: {detail}", flush=True)
        return verdict != "FAIL"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def check_host(c: Checklist, accel_dir: Path, sysfs_dir: Path) -> Path | None:
    """The driver, the node, the firmware, access, memlock. Returns the node's sysfs device dir."""
    nodes = sorted(accel_dir.glob("accel*")) if accel_dir.is_dir() else []
    if not c.say("PASS" if nodes else "FAIL", "device node", str(nodes[0]) if nodes else f"none under {accel_dir}"):
        return None
    sysfs = sysfs_dir / nodes[0].name / "device"
    driver = os.path.basename(os.path.realpath(sysfs / "driver")) if (sysfs / "driver").exists() else None
    c.say("PASS" if driver == "amdxdna" else "FAIL", "driver", f"{driver} bound to {nodes[0].name}")
    fw = _read(sysfs / "fw_version")
    c.say("PASS" if fw else "FAIL", "firmware", fw or "no fw_version in sysfs (keep linux-firmware current)")
    ok = os.access(nodes[0], os.R_OK | os.W_OK)
    c.say("PASS" if ok else "FAIL", "access", f"{'can' if ok else 'cannot'} open {nodes[0]} (group render?)")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    c.say("PASS" if soft == resource.RLIM_INFINITY else "FAIL", "memlock",
          "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes: NPU buffers will not allocate")
    return sysfs


def check_generation(c: Checklist, sysfs: Path | None, table: DesignTable) -> None:
    device_id = _read(sysfs / "device") if sysfs else None
    revision = _read(sysfs / "revision") if sysfs else None
    generation = PCI_GENERATION.get(device_id or "")
    if generation is None:
        c.say("SKIP", "generation", f"PCI device {device_id}: not one npud knows")
        return
    c.say("PASS" if generation == table.device else "FAIL", "generation",
          f"PCI {device_id} rev {revision}: {generation} (hw contexts: {CONTEXT_BUDGET[generation]}); "
          f"the design table is for {table.device}")


def check_table(c: Checklist, design: Path) -> DesignTable | None:
    try:
        table = DesignTable.load(design)
    except DesignError as exc:
        c.say("FAIL", "design table", str(exc))
        return None
    c.say("PASS" if table.designs else "FAIL", "design table",
          f"{len(table.designs)} designs for {table.device}, {len(table.on_host)} shapes left to the host")
    t = table.toolchain
    c.say("INFO", "toolchain", ", ".join(f"{k} {v}" for k, v in t.items() if v) if t else
          "design.json does not say what built it (built before tools/build_npu_designs.py recorded it)")
    for key, d in sorted(table.designs.items()):
        try:
            words = read_insts(d.insts, d.insts_format, table.device)
            c.say("PASS", f"instructions {key[0]}x{key[1]}", f"{words.size} words, header 0x{int(words[0]):08x}")
        except DesignError as exc:
            c.say("FAIL", f"instructions {key[0]}x{key[1]}", str(exc))
    return table


def check_designs(c: Checklist, table_path: Path, host, timeout_ms: int) -> xrt.XrtBackend | None:
    """Every design's start-up check on the device, in the NPU worker."""
    try:
        backend = xrt.load_backend(table_path, host, timeout_ms=timeout_ms)
    except xrt.XrtUnavailable as exc:
        c.say("FAIL", "NPU worker", str(exc))
        return None
    c.say("PASS", "NPU worker", f"pid {backend.device.pid}, backend {backend.name}")
    rng = np.random.default_rng(1)
    for (k, n, fmt), design in sorted(backend.table.designs.items()):
        weight = _sample_weight(rng, n, k, fmt)
        try:
            backend.prepare_linear(weight)
        except xrt.NpuRunError as exc:
            c.say("FAIL", f"start-up check {k}x{n}", f"the device failed: {exc}")
            return backend
        where = backend.placement[(k, n, fmt)]
        policy = backend.policies.get((k, n, fmt), "-")
        cost = backend.describe_costs().get(f"{k}x{n} {fmt}")
        cost_said = "" if cost is None else f"; 1-row pass NPU {cost['npu_ms']} ms vs host {cost['host_ms']} ms"
        # a design that passed but lost to the host on time is placed, not broken
        passed = where.startswith("npu") or where.startswith("the host is faster")
        c.say("PASS" if passed else "FAIL", f"start-up check {k}x{n}",
              f"{where} (tolerance {policy}, {design.n_passes} pass(es), M={design.M}{cost_said})")
    return backend


def _sample_weight(rng, n: int, k: int, fmt: str) -> LinearWeight:
    """A random [n, k] weight in the design's format (an int8 design's: int8 rows with their scales)."""
    w32 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    if fmt == "int8":
        from npud.engine.weights import quantize_int8_rows

        return LinearWeight(WeightFormat.INT8, *quantize_int8_rows(w32))
    return LinearWeight(WeightFormat.BF16, (w32.view(np.uint32) >> 16).astype(np.uint16))


def check_rounding(c: Checklist, backend: xrt.XrtBackend, host) -> None:
    """ninstr in words and the accumulator's rounding: the first design on the NPU, against an
    exact (float64) sum. A design that passed its check read ninstr as words (aie.utils.xrt's
    count); the signed error says whether the AIE rounds its fp32 sums to nearest (mean about
    0) or truncates (a bias towards zero)."""
    # the bf16 designs' fp32 sums (an int8 design's int32 sums are exact: nothing to round)
    on_npu = [key for key, where in sorted(backend.placement.items()) if where.startswith("npu") and key[2] == "bf16"]
    if not on_npu:
        c.say("SKIP", "ninstr in words", "no design passed its start-up check")
        c.say("SKIP", "accumulator rounding", "no design passed its start-up check")
        return
    k, n, _ = on_npu[0]
    c.say("PASS", "ninstr in words", f"K={k} N={n} ran with ninstr = the stream's 32-bit word count")
    rng = np.random.default_rng(2)
    x = bf16_round(rng.standard_normal((64, k)).astype(np.float32))
    w32 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    raw = (w32.view(np.uint32) >> 16).astype(np.uint16)
    weight = backend.prepare_linear(LinearWeight(WeightFormat.BF16, raw))
    wf = (raw.astype(np.uint32) << 16).view(np.float32)
    got = backend.linear(x, weight).astype(np.float64)
    exact = x.astype(np.float64) @ wf.astype(np.float64).T
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    signed = (got - exact) * np.sign(exact) / np.where(ulp > 0, ulp, 1)
    same = np.array_equal(got.astype(np.float32), host.linear(x, weight))
    c.say("INFO", "accumulator rounding",
          f"K={k} N={n}: mean signed error {signed.mean():+.3f} ulp (about 0: round to nearest; clearly "
          f"negative: truncation), max |error| {np.abs(signed).max():.1f} ulp; bit-identical to the host's "
          f"in-order sum: {same}")


def check_outlived_wait(c: Checklist, table_path: Path, host) -> None:
    """A run whose wait gives up (a 1 ms timeout) must stay referenced and be polled until it ends."""
    try:  # no start-up check: its runs would time out first
        backend = xrt.XrtBackend(DesignTable.load(table_path), host, timeout_ms=1, check=lambda *a: ([], []))
    except xrt.XrtUnavailable as exc:
        c.say("SKIP", "a run that outlives its wait", str(exc))
        return
    (k, n, _), design = sorted(backend.table.designs.items(), key=lambda kv: -kv[1].K * kv[1].N)[0]
    weight = backend.prepare_linear(_sample_weight(np.random.default_rng(3), n, k, design.weight_format))
    try:
        backend.linear(np.ones((design.M, k), np.float32), weight)
        c.say("SKIP", "a run that outlives its wait", f"K={k} N={n} finished within 1 ms")
    except xrt.NpuRunError as exc:
        if exc.state in ("worker_died", "worker_hung"):
            c.say("FAIL", "a run that outlives its wait", str(exc))
            return
        for _ in range(200):  # up to about 10 s
            stats = backend.device.stats()
            if stats["in_flight"] == 0:
                break
            time.sleep(0.05)
        c.say("PASS" if stats["in_flight"] == 0 else "FAIL", "a run that outlives its wait",
              f"wait gave {exc.state}; the run was kept and polled to its end ({stats})")
    finally:
        backend.close()


def check_worker_cost(c: Checklist, table_path: Path, host, calls: int = 20) -> None:
    """One design's linear (M rows) timed through the worker and inline, medians of `calls`."""
    import statistics

    table = DesignTable.load(table_path)
    (k, n, _), design = sorted(table.designs.items())[0]
    raw = np.zeros((n, k), np.uint16)
    x = np.ones((design.M, k), np.float32)
    medians = {}
    for isolation in ("process", "inline"):  # inline last: pyxrt then lives in this process
        backend = xrt.XrtBackend(DesignTable.load(table_path), host, isolation=isolation,
                                 check=lambda *a: ([], []))
        try:
            weight = backend.prepare_linear(LinearWeight(WeightFormat.BF16, raw))
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                backend.linear(x, weight)
                times.append((time.perf_counter() - start) * 1e6)
            medians[isolation] = statistics.median(times)
        except xrt.NpuRunError as exc:
            c.say("FAIL", "worker cost", f"{isolation}: {exc}")
            return
        finally:
            backend.close()
    c.say("INFO", "worker cost", f"K={k} N={n} M={design.M}: {medians['process']:.0f} us a linear in the worker, "
          f"{medians['inline']:.0f} us inline (load {Path('/proc/loadavg').read_text().split()[0]})")


def _stand_in(args) -> int:
    """bench/npu_stand_in.py, run from here (the stand-in is tests/fake_pyxrt.py: no NPU evidence)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "npu_stand_in.py"
    spec = importlib.util.spec_from_file_location("npu_stand_in", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.main((["--json"] if args.json else []) + ([f"--layers={args.layers}"] if args.layers else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--design", type=Path, help="the design.json built for this machine")
    p.add_argument("--stand-in", action="store_true",
                   help="no NPU needed: decode Qwen3-0.6B- and gemma-3-270m-shaped models on the pyxrt stand-in and "
                        "print what a token costs the NPU path in calls (bench/npu_stand_in.py)")
    p.add_argument("--json", action="store_true", help="with --stand-in: JSON")
    p.add_argument("--layers", type=int, default=None, help="with --stand-in: layers of each model (default theirs)")
    p.add_argument("--accel-dir", type=Path, default=Path("/dev/accel"))
    p.add_argument("--sysfs-dir", type=Path, default=Path("/sys/class/accel"))
    p.add_argument("--timeout-ms", type=int, default=5000)
    args = p.parse_args(argv)
    if args.stand_in:
        return _stand_in(args)
    if args.design is None:
        p.error("--design is needed (or --stand-in)")
    c = Checklist()
    sysfs = check_host(c, args.accel_dir, args.sysfs_dir)
    ok, why = xrt.probe(args.accel_dir)
    c.say("PASS" if ok else "FAIL", "pyxrt", why)
    table = check_table(c, args.design)
    if table is not None:
        check_generation(c, sysfs, table)
    if not ok or table is None or not table.designs:
        c.say("SKIP", "the device steps", "they need the node, pyxrt and a table with designs")
        return 1
    from npud.kernels.select import default_backend

    host = default_backend()
    backend = check_designs(c, args.design, host, args.timeout_ms)
    if backend is not None:
        check_rounding(c, backend, host)
        stats = backend.device.stats()
        budget = CONTEXT_BUDGET[table.device]
        c.say("PASS" if stats["contexts_opened"] <= budget or len(table.designs) > budget else "FAIL",
              "hardware contexts", f"{stats['contexts_opened']} opened for {len(table.designs)} designs "
              f"(budget {budget} on {table.device})")
        backend.close()
        check_outlived_wait(c, args.design, host)
        check_worker_cost(c, args.design, host)
    print(f"{len(c.results)} steps, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
