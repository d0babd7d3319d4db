"""A decode step's native calls, its time outside the GEMMs, and decode tok/s: layers in one call vs a call per kernel.

gemma-3-270m Q4_K_M (tests/real_gemma.py's file) on the exact float path ("bf16") and gguf-q8, at 1
and 2 threads (each thread count in a process of its own, NPUD_HOST_THREADS and NUMBA_NUM_THREADS
set), three paths on the same loaded weights: every attention layer of the step in one native call
("step": decoder_stack, npud/kernels/host/layer.py), one native call a layer ("layer": the same
backend with decoder_stack hidden), a call per kernel ("per-op": decoder_stack and decoder_layer
hidden, the path before), alternated in rounds: step, layer, per-op, step, layer, per-op, ...

Per round: a fresh sequence, a 32-token prompt, 2 steps of warm-up, then --tokens greedy steps,
each timed: its wall time and its time outside GEMMs; a step's native calls (every call into
the host library) and GEMM calls are counted in one more step after the timed ones, untimed
(bench/step_profile.py, which the other benches' profile columns share, says how).
Printed: a line per round with /proc/loadavg, then per format and thread count the medians and
ranges over the rounds of the per-round medians.

    NPUD_CACHE_DIR=... .venv/bin/python bench/step_calls.py [--rounds 4] [--tokens 32] [--threads 1,2]
        [--formats bf16,gguf-q8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from isolated import run_isolated  # noqa: E402
from step_profile import decode_profile  # noqa: E402

PROMPT = [(i * 37 + 11) % 2000 + 100 for i in range(32)]
PATHS = ("step", "layer", "per-op")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(fmt: str, rounds: int, tokens: int) -> dict:
    """In a process of its own: rounds of both paths on gemma-3-270m in `fmt`; per round and path
    the median step, its median time outside GEMMs, and the load."""
    from real_gemma import gemma_gguf_path

    from npud.engine.model import Model
    from npud.engine.testing.backends import ONE_CALL_LAYERS, PrimitivesOnly

    model = Model.load(gemma_gguf_path(), fmt)
    backends = {"step": model.backend, "layer": PrimitivesOnly(model.backend, hide={"decoder_stack"}),
                "per-op": PrimitivesOnly(model.backend, hide=ONE_CALL_LAYERS)}

    def one_round(path: str) -> dict:
        model.backend = backends[path]
        return {**decode_profile(model, PROMPT, tokens), "load": load()}

    out = {p: [] for p in PATHS}
    for _ in range(rounds):
        for p in PATHS:
            out[p].append(one_round(p))
    out["checkpoint_info"] = {k: str(v) for k, v in list(model.checkpoint_info.items())[:4]}
    out["layers_native"] = sum(1 for v in model.decoder_layers[0].state["host"].layers.values() if v is not None)
    out["layers"] = len(model.decoder_layers)
    return out


def _span(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default="bf16,gguf-q8")
    args = ap.parse_args()
    print(f"cpu: {os.cpu_count()} vCPUs; load at start {load()}")
    summary = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for fmt in args.formats.split(","):
            os.environ["NPUD_HOST_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = str(threads)
            res = run_isolated("step_calls", "measure", fmt, args.rounds, args.tokens)
            print(f"\n{fmt}, {threads} thread(s): {res['layers_native']} of {res['layers']} layers run natively")
            for r in range(args.rounds):
                for p in PATHS:
                    x = res[p][r]
                    print(f"  round {r + 1} {p:6}  step {x['step_ms']:6.2f} ms  {1e3 / x['step_ms']:6.1f} tok/s  "
                          f"outside GEMMs {x['outside_us']:7.0f} us  native calls {x['calls']:4d} "
                          f"(GEMMs {x['gemm_calls']:3d})  load {x['load']}")
            print("  calls by entry, last round: " + "; ".join(
                f"{p}: " + ", ".join(f"{k[5:]} {v}" for k, v in sorted(res[p][-1]["by_name"].items())) for p in PATHS))
            for p in PATHS:
                rows = res[p]
                summary.append((fmt, threads, p, _span([1e3 / x["step_ms"] for x in rows], "{:.1f}"),
                                _span([x["outside_us"] for x in rows], "{:.0f}"),
                                _span([x["calls"] for x in rows], "{:.0f}"),
                                f"{rows[0]['load']} .. {rows[-1]['load']}"))
    print("\nformat   threads  path    decode tok/s median [range]  outside GEMMs us/step  native calls/step  load")
    for fmt, threads, p, tps, outside, calls, ld in summary:
        print(f"{fmt:8} {threads:7d}  {p:6}  {tps:27}  {outside:21}  {calls:17}  {ld}")
    print(f"\nload at end {load()}")


if __name__ == "__main__":
    main()
