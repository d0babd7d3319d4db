"""What the NPU worker process costs per linear call (one pass here): the backend's `linear` through the pyxrt
SIMULATOR with its arithmetic switched off (tests/fake_pyxrt.py), inline (device calls in
this process) against isolation "process" (npud/kernels/xrt_worker.py: pickled frames over pipes),
alternated in rounds, medians and ranges, the load beside them.

The simulator is not an NPU: the numbers are the host-side cost of the call path (bf16
conversion, buffer writes and syncs, the frames), which is what isolation adds to; a real pass
adds the device's own time, the same either way.

    .venv/bin/python bench/npu_isolation.py [--rounds 5] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fake_pyxrt  # noqa: E402

from npud.kernels import xrt  # noqa: E402
from npud.kernels.base import LinearWeight, WeightFormat  # noqa: E402
from npud.kernels.select import default_backend  # noqa: E402
from npud.kernels.xrt_design import DesignTable  # noqa: E402

SHAPES = [(1024, 1024, 1), (1024, 1024, 32), (1024, 3072, 32), (3072, 1024, 32)]  # K, N, rows


class _Patch:
    def setitem(self, mapping, key, value):
        mapping[key] = value

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    fake_pyxrt.install(_Patch())
    fake_pyxrt.SIM.configure({"mode": "compute", "on": False})
    folder = Path(tempfile.mkdtemp(prefix="npu-iso-"))
    control = folder / "control.json"
    control.write_text(json.dumps({"mode": "compute", "on": False}))
    os.environ["FAKE_PYXRT_CONTROL"] = str(control)
    host = default_backend()
    table = fake_pyxrt.write_design_table(folder, sorted({(k, n) for k, n, _ in SHAPES}), device="npu2",
                                          tile=(8, 64, 32), columns=4)
    rng = np.random.default_rng(0)
    # no start-up check: the simulator computes nothing here
    backends = {iso: xrt.XrtBackend(DesignTable.load(table), host, isolation=iso, check=lambda *a: ([], []))
                for iso in ("inline", "process")}
    weights = {}
    for k, n, _ in SHAPES:
        bits = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for iso, b in backends.items():
            weights[iso, k, n] = b.prepare_linear(LinearWeight(WeightFormat.BF16, bits))
    times = {(iso, s): [] for iso in backends for s in SHAPES}
    load_before = Path("/proc/loadavg").read_text().strip()
    for _ in range(args.rounds):
        for iso in ("inline", "process"):  # A B A B
            for k, n, rows in SHAPES:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                w, b = weights[iso, k, n], backends[iso]
                b.linear(x, w)
                start = time.perf_counter()
                for _ in range(args.calls):
                    b.linear(x, w)
                times[iso, (k, n, rows)].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"load before: {load_before}; after: {Path('/proc/loadavg').read_text().strip()}")
    print(f"{'K':>5} {'N':>5} {'rows':>4} | {'inline us/call':>22} | {'process us/call':>22} | added")
    for s in SHAPES:
        a, b = times["inline", s], times["process", s]
        print(f"{s[0]:5d} {s[1]:5d} {s[2]:4d} | {statistics.median(a):8.0f} ({min(a):5.0f}-{max(a):5.0f}) "
              f"| {statistics.median(b):8.0f} ({min(b):5.0f}-{max(b):5.0f}) | "
              f"{statistics.median(b) - statistics.median(a):6.0f} us")
    for b in backends.values():
        b.close()


if __name__ == "__main__":
    main()
