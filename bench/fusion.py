"""Fused projections and per-row kernels against the primitives, A/B in one process, interleaved.

The same checkpoint is loaded twice: on the host backend (q/k/v and gate/up fused at load, the
fused add + norm and norm + RoPE kernels) and on a HostBackend with those switched off (each linear
its own call, the per-row work composed of primitives, as before the fusion). Decode steps of the
two alternate one by one, so the machine's drift touches both alike; the logits are the same bits
(tests/test_fusion.py). Prints, at 1 and 2 threads, decode tok/s (median step) with the median
paired speed-up, and the per-op profile of a 1-row step, an 8-row verify and a prefill
(bench/decode.py's, the models taking turns run by run), with the load average.

    .venv/bin/python bench/fusion.py [--formats bf16,int8-q8] [--rounds 3] [--steps 300] [--prefill 512] [--no-profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from decode import CATEGORIES, profile, set_threads
from synth import QWEN3_0P5B, build_random_checkpoint

from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.kernels.host import HostBackend


class Unfused(HostBackend):
    """The host backend with no fusion of its own: the engine's defaults run instead."""

    fuse_linears = add_rms_norm = norm_rope = None


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def paired_steps(models: dict, prompt: list[int], pairs: int) -> tuple[dict[str, float], float]:
    """Decode steps (of fixed tokens) of the two models in pairs, which one goes first alternating,
    each on a forward of its own after `prompt`: the median ms a step of each, and the median of the
    pairs' unfused / fused ratios (a pair is timed close together, so the machine's drift cancels)."""
    forwards = {}
    times = {name: [] for name in models}
    for i in range(pairs):
        if i % 256 == 0:  # a fresh context now and then, so attention's share stays a short prompt's
            for name, model in models.items():
                forwards[name] = Forward(model)
                forwards[name].prefill(prompt)
        for name in sorted(models, reverse=i % 2 == 1):
            f = forwards[name]
            t = time.perf_counter()
            f.step(prompt[i % len(prompt)], f.positions_held)
            times[name].append(time.perf_counter() - t)
    ratios = [u / f for u, f in zip(times["unfused"], times["fused"])]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, statistics.median(ratios)


def interleaved_profiles(models: dict, prompt: list[int], long_prompt: list[int],
                         rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """bench/decode.py's per-op profile of a 1-row pass, an 8-row pass and a prefill for each model,
    the models taking turns run by run; per model and pass, the run of median total."""
    passes = {
        "1-row pass": (lambda f: f.prefill(prompt), lambda f: f.step_batch_all(prompt[:1], len(prompt))),
        "8-row pass": (lambda f: f.prefill(prompt), lambda f: f.step_batch_all(prompt[:8], len(prompt))),
        f"{len(long_prompt)}-token prefill": (lambda f: None, lambda f: f.prefill(long_prompt)),
    }
    out = {name: {} for name in models}
    for label, (prepare, run) in passes.items():
        runs = {name: [] for name in models}
        for _ in range(rounds if "prefill" in label else 3 * rounds):
            for name, model in models.items():
                runs[name].append(profile(model, prepare, run, 1))
        for name, got in runs.items():
            out[name][label] = sorted(got, key=lambda r: r["total"])[len(got) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int8-q8")
    ap.add_argument("--rounds", type=int, default=3, help="profile rounds (3x that for the 1- and 8-row passes)")
    ap.add_argument("--steps", type=int, default=300, help="decode step pairs")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true", help="decode tok/s only")
    args = ap.parse_args()
    ckpt = build_random_checkpoint("qwen3-0.5b", dict(QWEN3_0P5B))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 60000, 16)]
    long_prompt = [int(t) for t in rng.integers(3, 60000, args.prefill)]
    rows, tables = [], []
    for fmt in args.formats.split(","):
        models = {"fused": Model.load(ckpt, fmt, backend=HostBackend()),
                  "unfused": Model.load(ckpt, fmt, backend=Unfused())}
        for threads in (1, 2):
            set_threads(threads)
            loads = [_load()]
            ms, speedup = paired_steps(models, prompt, args.steps)
            loads.append(_load())
            rows.append(f"| {fmt} | {threads} | {1e3 / ms['unfused']:.1f} | {1e3 / ms['fused']:.1f} | "
                        f"{speedup:.3f}x | {' -> '.join(loads)} |")
            print(rows[-1], flush=True)
            if args.no_profile:
                continue
            profiles = interleaved_profiles(models, prompt, long_prompt, args.rounds)
            table = [f"| per-op ms, {fmt}, {threads} threads (load {_load()}), unfused / fused | "
                     + " | ".join(profiles["fused"]) + " |", "|---|" + "---|" * len(profiles["fused"])]
            for cat in CATEGORIES + ["total"]:
                cells = [f"{profiles['unfused'][p].get(cat, 0.0):.2f} / {profiles['fused'][p].get(cat, 0.0):.2f}"
                         for p in profiles["fused"]]
                table.append(f"| {cat} | " + " | ".join(cells) + " |")
            tables.append("\n".join(table))
        del models
    print("\n| format | threads | unfused tok/s | fused tok/s | median paired speed-up | load average (1 min) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    for table in tables:
        print("\n" + table)


if __name__ == "__main__":
    main()
