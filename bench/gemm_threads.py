"""Where a decode step's GEMM time goes at 1 and 2 threads: per shape, from DRAM, with the pool's trace.

One "step" is the GEMMs of a Qwen3-0.5B decode step in layer order (q, k, v, o, gate, up, down
for each of `--layers` layers, then lm_head), each layer's weights a distinct copy so that
nothing is left in L3 from the layer before, one activation row each. The thread counts run in
turn within each round (interleaved A/B), and the table gives each shape's median microseconds
a call over the rounds, its GB/s of weights, and the step's total against the read bandwidth
measured in this run (bench/decode.py's numba sum). For 2 threads, a second pass reads the
pool's trace around every call (native.pool_trace): how long the worker took to see a call
after it started, how often it came from sleep, what share of the chunks it computed, and how
long the caller waited for its chunks after the counter ran out.

    .venv/bin/python bench/gemm_threads.py --formats int8-q8,bf16 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
from decode import measure_read_bandwidth
from synth import QWEN3_0P5B

from npud.kernels.base import WeightFormat
from npud.kernels.host import native
from npud.kernels.host.formats import PARALLEL_MIN_BYTES, kernel_for
from npud.kernels.host.resident import resident_copy


def shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's GEMMs in the order a decode step runs them."""
    d, f = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    return [("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q), ("gate", f, d), ("up", f, d), ("down", d, f)]


def step_weights(fmt: WeightFormat, config: dict, layers: int, rng: np.random.Generator) -> list[tuple[str, object]]:
    """The step's (shape name, prepared weight) list: `layers` distinct copies of one layer, then lm_head."""
    kernel = kernel_for(fmt)
    one = {name: dataclasses.replace(kernel.prepare(kernel.sample(rng, n, k)), bias=None)
           for name, n, k in shapes(config)}
    seq = []
    for _ in range(layers):
        for name, w in one.items():
            seq.append((name, dataclasses.replace(w, data=resident_copy(w.data))))
    head = kernel.prepare(kernel.sample(rng, config["vocab_size"], config["hidden_size"]))
    seq.append(("lm_head", dataclasses.replace(head, bias=None)))
    return seq


def run_step(seq, xs: dict[int, np.ndarray], times: dict[str, list[float]] | None, traces=None) -> None:
    """One pass over the step's GEMMs, as the backend calls them; per call, its seconds into
    `times[name]` and (when `traces` is given) the pool trace's change into `traces[name]`."""
    for name, w in seq:
        kernel = kernel_for(w.fmt)
        x = xs[w.in_features]
        parallel = w.data.nbytes >= PARALLEL_MIN_BYTES
        before = native.pool_trace() if traces is not None else None
        t = time.perf_counter()
        kernel.linear(x, w, parallel)
        dt = time.perf_counter() - t
        if times is not None:
            times[name].append(dt)
        if traces is not None:
            after = native.pool_trace()
            acc = traces.setdefault(name, dict.fromkeys(after, 0))
            for key in after:
                acc[key] += after[key] - before[key]
            if after["joined"] > before["joined"]:
                traces.setdefault("_wake " + name, []).append((after["wake_ns"] - before["wake_ns"]) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8-q8,bf16,bf16-bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=QWEN3_0P5B["num_hidden_layers"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-bandwidth", action="store_true")
    args = ap.parse_args()
    config = QWEN3_0P5B
    thread_counts = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    print(f"# isa={native.isa()} loadavg {Path('/proc/loadavg').read_text().strip()}")
    bandwidth = {} if args.no_bandwidth else {n: measure_read_bandwidth(n) for n in thread_counts}
    if bandwidth:
        print("# read bandwidth: " + ", ".join(f"{n} thread(s) {b / 1e9:.1f} GB/s" for n, b in bandwidth.items()))
    names = [s[0] for s in shapes(config)] + ["lm_head"]
    for fmt in map(WeightFormat.parse, args.formats.split(",")):
        seq = step_weights(fmt, config, args.layers, rng)
        nbytes = {name: next(w.data.nbytes for n, w in seq if n == name) for name in names}
        count = {name: sum(1 for n, _ in seq if n == name) for name in names}
        total_bytes = sum(w.data.nbytes for _, w in seq)
        xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in {w.in_features for _, w in seq}}
        times = {n: {name: [] for name in names} for n in thread_counts}
        steps = {n: [] for n in thread_counts}
        for n in thread_counts:  # warm-up: page the copies in, start the workers
            native.set_threads(n)
            run_step(seq, xs, None)
        for _ in range(args.rounds):
            for n in thread_counts:
                native.set_threads(n)
                per_call = {name: [] for name in names}
                t = time.perf_counter()
                run_step(seq, xs, per_call)
                steps[n].append(time.perf_counter() - t)
                for name in names:
                    times[n][name].append(statistics.median(per_call[name]))
        print(f"\n## {fmt.value}: {total_bytes / 1e6:.0f} MB a step, {args.layers} layers, {args.rounds} rounds "
              f"(loadavg {Path('/proc/loadavg').read_text().strip()})")
        print("| shape | N x K | MB | " + " | ".join(f"{n}t us | {n}t GB/s" for n in thread_counts)
              + " | 2t / 1t |" * (len(thread_counts) == 2))
        print("|---|---|---|" + "---|---|" * len(thread_counts) + "---|" * (len(thread_counts) == 2))
        dims = {s[0]: (s[1], s[2]) for s in shapes(config)} | {"lm_head": (config["vocab_size"],
                                                                           config["hidden_size"])}
        for name in names:
            med = {n: statistics.median(times[n][name]) for n in thread_counts}
            cells = " | ".join(f"{med[n] * 1e6:.0f} | {nbytes[name] / med[n] / 1e9:.1f}" for n in thread_counts)
            ratio = f" {med[1] / med[2]:.2f}x |" if len(thread_counts) == 2 else ""
            print(f"| {name} | {dims[name][0]}x{dims[name][1]} | {nbytes[name] / 1e6:.1f} | {cells} |{ratio}")
        for n in thread_counts:
            step = statistics.median(steps[n])
            of_bw = f", {total_bytes / step / bandwidth[n]:.0%} of {n}-thread bandwidth" if n in bandwidth else ""
            calls = sum(count[name] * statistics.median(times[n][name]) for name in names)
            print(f"# {n} thread(s): step {step * 1e3:.2f} ms (median of {args.rounds}; min "
                  f"{min(steps[n]) * 1e3:.2f}), calls alone {calls * 1e3:.2f} ms, "
                  f"{total_bytes / step / 1e9:.1f} GB/s{of_bw}")
        if 2 in thread_counts:
            native.set_threads(2)
            traces: dict[str, dict[str, int]] = {}
            for _ in range(max(1, args.rounds // 2)):
                run_step(seq, xs, None, traces)
            print(f"\n{fmt.value}, 2 threads, the pool's trace per call (means over the calls that went to the pool)")
            print("| shape | calls | worker saw it | wake us | from sleep | worker chunks | caller own us | "
                  "caller wait us | call us | wake us p50 / p90 / max |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for name in names:
                tr = traces[name]
                c = tr["calls"]
                if not c:
                    print(f"| {name} | 0 (one thread: below PARALLEL_MIN_BYTES) |" + " - |" * 7)
                    continue
                mine, theirs = tr["caller_chunks"], tr["worker_chunks"]
                wakes = traces.get("_wake " + name, [0.0])
                print(f"| {name} | {c} | {tr['joined'] / c:.0%} | "
                      f"{tr['wake_ns'] / max(tr['joined'], 1) / 1e3:.1f} | {tr['slept'] / c:.0%} | "
                      f"{theirs / max(theirs + mine, 1):.0%} | "
                      f"{tr['own_ns'] / c / 1e3:.1f} | {tr['wait_ns'] / c / 1e3:.1f} | {tr['call_ns'] / c / 1e3:.1f} | "
                      + " / ".join(f"{np.percentile(wakes, p):.1f}" for p in (50, 90, 100)) + " |")
        del seq
    print(f"\n# loadavg {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
