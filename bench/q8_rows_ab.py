"""What int8-q16's finer activation rows cost beside int8-q8's (and int8's exact float path): one GEMM, in turn.

Both formats hold the same int8 tiles and run the same integer kernels; int8-q16's rows are
16-bit blocks held as byte pairs (npud/kernels/host/q8pairs.c), so each block takes two passes of
byte products; int8 widens the same weights to float against fp32 activations. Each round times
the GEMM (default: Qwen3-0.5B's gate/up projection, N 3072, K 1024) in each format, the order
rotated every round, for each row count and thread count. Printed: median microseconds a call
with the range over rounds, the ratios, and the load. bench/accuracy.py measures what the finer rows buy.

    .venv/bin/python bench/q8_rows_ab.py --rows 1,8,64 --rounds 9 [--clock cpu --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from npud.kernels.base import WeightFormat
from npud.kernels.host import native
from npud.kernels.host.formats import kernel_for

FORMATS = (WeightFormat.INT8_Q8, WeightFormat.INT8_Q16, WeightFormat.INT8)  # the last: exact, floats


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("-n", type=int, default=3072)
    ap.add_argument("-k", type=int, default=1024)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (on a busy machine, what the call cost rather than its wait)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sample = kernel_for(WeightFormat.INT8_Q8).sample(rng, args.n, args.k)
    weights = {f: kernel_for(f).prepare(sample) for f in FORMATS}  # the same int8 weights
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"# N={args.n} K={args.k} isa={native.isa()} clock={args.clock}; load {load()}")
    print("| rows | threads | int8-q8 us (range) | int8-q16 us (range) | int8 us (range) | q16 / q8 | q16 / int8 |")
    print("|---|---|---|---|---|---|---|")
    for threads in map(int, args.threads.split(",")):
        native.set_threads(threads)
        for m in map(int, args.rows.split(",")):
            x = rng.standard_normal((m, args.k)).astype(np.float32)
            calls = max(3, 512 // m)
            times: dict[WeightFormat, list[float]] = {f: [] for f in FORMATS}
            for r in range(args.rounds):
                for f in FORMATS[r % 3:] + FORMATS[: r % 3]:  # each format first in turn
                    kernel = kernel_for(f)
                    kernel.linear(x, weights[f], True)  # warm
                    t0 = clock()
                    for _ in range(calls):
                        kernel.linear(x, weights[f], True)
                    times[f].append((clock() - t0) / calls * 1e6)
            med = {f: statistics.median(times[f]) for f in FORMATS}
            cells = " | ".join(f"{med[f]:.0f} ({min(times[f]):.0f}-{max(times[f]):.0f})" for f in FORMATS)
            q8, q16, i8 = (med[f] for f in FORMATS)
            print(f"| {m} | {threads} | {cells} | {q16 / q8:.2f} | {q16 / i8:.2f} |", flush=True)
    print(f"# load after: {load()}")


if __name__ == "__main__":
    main()
