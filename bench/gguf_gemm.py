"""gemma-3-270m Q4_K_M's gguf-q8 GEMMs alone: time, GMAC/s and GB/s per layer type, row count and threads.

The real model's own prepared weights (npud/kernels/host/blockq8.c's layout): one layer's fused q/k,
v, o, gate/up and down, and the output layer, each at M rows, fastest of --repeats rounds
(the machine is shared: the least disturbed round counts), the load average printed beside.
GB/s counts the prepared weight bytes (q tiles and factor tiles) once per call: at M = 1 that
is the bandwidth a step streams at; GMAC/s at M = 64 is a prefill chunk's rate.

    .venv/bin/python bench/gguf_gemm.py [--rows 1,8,64] [--threads 1,2] [--repeats 7] [--base REV]
--base REV: the same calls with the kernels of git revision REV too (bench/kernels_ab.py's build),
the two libraries taking turns within every repeat; the table gains A (REV) / B (this checkout).
REV must call npud_linear_bq8 as this checkout does (the packed tiles' arguments came with 86bd999).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from npud.engine.model import Model  # noqa: E402
from npud.engine.weights import weight_arrays  # noqa: E402
from npud.kernels.base import LinearWeight  # noqa: E402
from npud.kernels.host import native  # noqa: E402


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def weights_of(model: Model) -> list[tuple[str, LinearWeight]]:
    layer = model.weights.layers[0]
    seen, out = set(), []
    for w in weight_arrays(layer):
        if isinstance(w, LinearWeight) and id(w.data) not in seen:
            seen.add(id(w.data))
            out.append((f"{w.fmt.value} {w.out_features}x{w.in_features}", w))
    out.append((f"head {model.weights.lm_head.fmt.value} {model.weights.lm_head.out_features}x640", model.weights.lm_head))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--format", default="gguf-q8")
    ap.add_argument("--base", default="", help="a git revision whose kernels run beside this checkout's")
    ap.add_argument("--only", default="", help="weights whose name contains this (e.g. head)")
    args = ap.parse_args()
    from demo import gemma_path

    libs = {"": None}
    if args.base:
        import tempfile

        from kernels_ab import library_of

        with tempfile.TemporaryDirectory(prefix="npud-ab-") as tmp:
            libs = {f"A {args.base}": library_of(args.base, Path(tmp)), "B this checkout": native.library()}

    model = Model.load(gemma_path(), args.format)
    b = model.backend
    native.library()
    rng = np.random.default_rng(0)
    print(f"# gemma-3-270m {args.format}, isa {native.isa()}, load before {load()}")
    print("| weight | kernels | threads | M | ms | GMAC/s | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for threads in map(int, args.threads.split(",")):
        native.set_threads(threads)
        for name, w in weights_of(model):
            if args.only not in name:
                continue
            nbytes = w.data.nbytes + w.scale.nbytes
            for m in map(int, args.rows.split(",")):
                x = rng.standard_normal((m, w.in_features)).astype(np.float32)
                calls = max(1, int(4e6 // (w.data.nbytes * max(1, m // 8))))
                best = {lib: float("inf") for lib in libs}
                for rep in range(args.repeats):
                    for lib in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
                        if libs[lib] is not None:
                            native._lib = libs[lib]
                        b.linear(x, w)
                        t = time.perf_counter()
                        for _ in range(calls):
                            b.linear(x, w)
                        best[lib] = min(best[lib], (time.perf_counter() - t) / calls)
                macs = m * w.out_features * w.in_features
                for lib, sec in best.items():
                    print(f"| {name} | {lib or 'this checkout'} | {threads} | {m} | {sec * 1e3:.3f} | "
                          f"{macs / sec / 1e9:.1f} | {nbytes / sec / 1e9:.1f} |", flush=True)
    print(f"# load after {load()}")


if __name__ == "__main__":
    main()
