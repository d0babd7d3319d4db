"""GMAC/s of one host GEMM per weight format, row count and thread count (interleaved repeats).

For each (M, threads): every format's GEMM runs in turn, `--repeats` rounds, and the best
round counts (the machine is shared: the best is the least disturbed). The load average is
printed before and after. Default shape: Qwen3-0.5B's gate/up projection (N 3072, K 1024).

    .venv/bin/python bench/gemm_formats.py --formats bf16,bf16-bf16 --rows 1,8,64,512
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from npud.kernels.base import WeightFormat
from npud.kernels.host import native
from npud.kernels.host.formats import kernel_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,bf16-bf16")
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("-n", type=int, default=3072)
    ap.add_argument("-k", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    formats = [WeightFormat.parse(f) for f in args.formats.split(",")]
    weights = {f: kernel_for(f).prepare(kernel_for(f).sample(rng, args.n, args.k)) for f in formats}
    print(f"# N={args.n} K={args.k} isa={native.isa()} loadavg {Path('/proc/loadavg').read_text().strip()}")
    for threads in map(int, args.threads.split(",")):
        native.set_threads(threads)
        for m in map(int, args.rows.split(",")):
            x = rng.standard_normal((m, args.k)).astype(np.float32)
            calls = max(1, 2048 // m)
            best = {f: float("inf") for f in formats}
            for _ in range(args.repeats):
                for f in formats:
                    kernel, w = kernel_for(f), weights[f]
                    kernel.linear(x, w, True)
                    t = time.perf_counter()
                    for _ in range(calls):
                        kernel.linear(x, w, True)
                    best[f] = min(best[f], (time.perf_counter() - t) / calls)
            cells = "  ".join(f"{f.value} {m * args.n * args.k / best[f] / 1e9:6.1f}" for f in formats)
            print(f"threads={threads} M={m:4d}  GMAC/s: {cells}", flush=True)
    print(f"# loadavg {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
