"""Decode with the host kernels of another git revision beside this checkout's, in one process, in turn.

The model is loaded once per format; each round runs a greedy decode (bench/decode.py's
our_decode) with library A (`--base`, built from that revision's npud/kernels/host sources) and
library B (this checkout's), at every thread count, the order of A and B swapped every round
so that neither always runs second on a machine whose speed drifts. Printed: decode tok/s
(median over rounds), the GEMMs' milliseconds a step and each shape's median microseconds a call
(every linear call of the decode steps timed, in both: the
prefill's, with more rows, left out), the cores the process kept busy (CPU seconds / wall seconds),
and the load average.

    .venv/bin/python bench/kernels_ab.py --base main --formats int8-q8,bf16 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from decode import our_decode, set_threads
from synth import QWEN3_0P5B, ROOT, build_random_checkpoint

from npud.engine.model import Model
from npud.kernels.host import native

PROMPT = list(range(1, 17))


def library_of(rev: str, directory: Path):
    """The host kernel library built from revision `rev`'s sources (loaded with native.py's bindings);
    the revision must have every source file this checkout builds (native.SOURCES)."""
    sources, headers = native.SOURCES, native.HEADERS
    for src in sources + headers:
        text = subprocess.run(["git", "show", f"{rev}:npud/kernels/host/{src.name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (directory / src.name).write_bytes(text)
    native.SOURCES = tuple(directory / s.name for s in sources)
    native.HEADERS = tuple(directory / h.name for h in headers)
    try:
        native._lib = None
        return native.library()
    finally:
        native.SOURCES, native.HEADERS = sources, headers
        native._lib = None


def timing_linear_calls(calls: dict) -> None:
    """Time every GEMM native.py makes into calls[(rows, N, K)]."""
    for name in ("gemm", "linear_q8", "linear_bf16_dot"):
        fn = getattr(native, name)
        first = 1 if name == "gemm" else 0  # gemm(fmt, x, w, n, ...); the others (x, w, n, ...)

        def timed(*args, _fn=fn, _first=first, **kwargs):
            t = time.perf_counter()
            out = _fn(*args, **kwargs)
            x, n = args[_first], args[_first + 2]
            calls[x.shape[0], n, x.shape[1]].append(time.perf_counter() - t)
            return out

        setattr(native, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the git revision whose kernels are A")
    ap.add_argument("--formats", default="int8-q8,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="npud-ab-") as tmp:
        libs = {f"A {args.base}": library_of(args.base, Path(tmp)), "B this checkout": native.library()}
    calls: dict = defaultdict(list)
    timing_linear_calls(calls)
    ckpt = build_random_checkpoint("qwen3-0.5b", dict(QWEN3_0P5B))
    print(f"# isa={native.isa()} loadavg at start {Path('/proc/loadavg').read_text().strip()}")
    for fmt in args.formats.split(","):
        model = Model.load(ckpt, fmt)
        step, busy, gemm_ms = defaultdict(list), defaultdict(list), defaultdict(list)
        per_call = defaultdict(lambda: defaultdict(list))
        for r in range(args.rounds):
            for n in map(int, args.threads.split(",")):
                set_threads(n)
                for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                    native._lib = libs[name]
                    calls.clear()
                    cpu, wall = time.process_time(), time.perf_counter()
                    step[name, n].append(our_decode(model, PROMPT, args.steps))
                    busy[name, n].append((time.process_time() - cpu) / (time.perf_counter() - wall))
                    decode = {shape[1:]: times for shape, times in calls.items() if shape[0] == 1}
                    gemm_ms[name, n].append(sum(map(sum, decode.values())) / args.steps * 1e3)
                    for shape, times in decode.items():
                        per_call[name, n][shape].append(statistics.median(times))
        print(f"\n## {fmt}: {args.rounds} rounds of {args.steps} steps "
              f"(loadavg {Path('/proc/loadavg').read_text().strip()})")
        shapes = sorted(next(iter(per_call.values())), key=lambda s: -s[0] * s[1])
        print("| kernels | threads | decode tok/s | GEMM ms a step | cores busy | "
              + " | ".join(f"{n}x{k} us" for n, k in shapes) + " |")
        print("|---|---|---|---|---|" + "---|" * len(shapes))
        for (name, n), steps in step.items():
            cells = " | ".join(f"{statistics.median(per_call[name, n][s]) * 1e6:.0f}" for s in shapes)
            print(f"| {name} | {n} | {1 / statistics.median(steps):.1f} | {statistics.median(gemm_ms[name, n]):.2f} | "
                  f"{statistics.median(busy[name, n]):.2f} | {cells} |")
        del model
    print(f"\n# loadavg at end {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
