"""Fused projections and per-row kernels against the primitives, A/B in one process, interleaved.

The same checkpoint is loaded twice: on the host backend (q/k/v and gate/up fused at load, the
fused add + norm and norm + RoPE kernels) and on a HostBackend with those switched off (each linear
its own call, the per-row work composed of primitives, as before the fusion). Decode steps of the
two alternate in rounds, so the machine's drift touches both alike; the logits are the same bits
(tests/test_fusion.py). Prints decode tok/s (median step of all rounds) at 1 and 2 threads and the
per-op profile of a 1-row step, an 8-row verify and a prefill (bench/decode.py's), with the load
average.

    .venv/bin/python bench/fusion.py [--formats bf16,int8-q8] [--rounds 5] [--prefill 512]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from decode import CATEGORIES, our_decode, profile, set_threads
from synth import QWEN3_0P5B, build_random_checkpoint

from engine.model import Model
from kernels.host import HostBackend


class Unfused(HostBackend):
    """The host backend with no fusion of its own: the engine's defaults run instead."""

    fuse_linears = add_rms_norm = norm_rope = None


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


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
    ap.add_argument("--rounds", type=int, default=5, help="decode rounds (profile rounds: 3x for the 1- and "
                    "8-row passes, 1x for the prefill)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512)
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
            steps = {name: [] for name in models}
            loads = [_load()]
            for _ in range(args.rounds):
                for name, model in models.items():
                    steps[name].append(our_decode(model, prompt, args.steps))
            loads.append(_load())
            tok_s = {name: 1 / statistics.median(t) for name, t in steps.items()}
            rows.append(f"| {fmt} | {threads} | {tok_s['unfused']:.1f} | {tok_s['fused']:.1f} | "
                        f"{tok_s['fused'] / tok_s['unfused']:.2f}x | {' -> '.join(loads)} |")
            print(rows[-1], flush=True)
            profiles = interleaved_profiles(models, prompt, long_prompt, args.rounds)
            table = [f"| per-op ms, {fmt}, {threads} threads (load {_load()}), unfused / fused | "
                     + " | ".join(profiles["fused"]) + " |", "|---|" + "---|" * len(profiles["fused"])]
            for cat in CATEGORIES + ["total"]:
                cells = [f"{profiles['unfused'][p].get(cat, 0.0):.2f} / {profiles['fused'][p].get(cat, 0.0):.2f}"
                         for p in profiles["fused"]]
                table.append(f"| {cat} | " + " | ".join(cells) + " |")
            tables.append("\n".join(table))
        del models
    print("\n| format | threads | unfused tok/s | fused tok/s | fused / unfused | load average (1 min) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    for table in tables:
        print("\n" + table)


if __name__ == "__main__":
    main()
