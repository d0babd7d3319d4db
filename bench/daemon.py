"""What the daemon costs on top of the engine, measured side by side on this machine.

1. Decode throughput of one prompt: the engine driven directly in this process vs the same
   request through npud's socket (`complete`, streamed), best of a few runs each.
2. Latency of `status` from 100 concurrent clients, on an idle daemon and while a batch job
   holds the device (p50 / p99 / max).
3. Jobs per second for tiny jobs (one prompt, one token): accepted per second (each one is
   a durable SQLite commit) and finished per second.

Run: .venv/bin/python bench/daemon.py [--model 0p5b-8layer|tiny] [--tokens N] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from synth import QWEN3_0P5B, ROOT, build_random_checkpoint

import psutil
import trio

from npud.clients.client import AsyncClient, Client

PROMPT = "def f7(x):\n    return x * 7"  # the tiny test model runs long on it before an end token


def checkpoint(name: str) -> Path:
    if name == "tiny":
        from npud.engine.testing.checkpoints import build_tiny_checkpoint

        out = ROOT / "bench" / "out" / "tiny-qwen3"
        if not (out / "config.json").exists():
            build_tiny_checkpoint(out)
        return out
    # the 0.5B layer shapes with the test tokenizer's vocabulary (generated text must decode)
    config = dict(QWEN3_0P5B, num_hidden_layers=8, vocab_size=320)
    return build_random_checkpoint("qwen3-0.5b-8layer-v320", config)


class Run:
    """One generation timed from the caller's side: first token, decode rate, whole request."""

    def __init__(self, started: float, token_times: list[float], tokens: int, ended: float,
                 cpu_s: float) -> None:
        self.tokens = tokens
        self.cpu_ms_per_token = cpu_s * 1000 / tokens  # CPU of the process doing the work, all threads
        self.first_token_ms = (token_times[0] - started) * 1000
        span = token_times[-1] - token_times[0]
        self.decode_rate = (tokens - 1) / span if span > 0 else float("nan")
        self.rate = tokens / (ended - started)


def direct_session(ckpt: Path, tokens: int):
    """(a function that runs the request once with the engine in this process, load seconds)."""
    from npud.engine.api import GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel

    started = time.perf_counter()
    served = LoadedModel.load("bench", ckpt, weight_format="bf16")
    load_s = time.perf_counter() - started
    params = GenerationParams(max_tokens=tokens, spec=SpecParams(method="none"), use_prefix_cache=False)
    request = GenerateRequest(prompt=PROMPT, params=params)

    def run() -> Run:
        cpu = time.process_time()
        started = time.perf_counter()
        session = served.start(request)
        times = []
        while not session.done:
            if any(e.token_id is not None for e in session.run_round()):
                times.append(time.perf_counter())
        return Run(started, times, len(session.result().token_ids), time.perf_counter(), time.process_time() - cpu)

    run()  # warm-up
    return run, load_s


class Daemon:
    def __init__(self, ckpt: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="npud-bench-", dir="/tmp"))
        self.socket = str(self.dir / "npud.sock")
        (self.dir / "npud.toml").write_text(
            f'[server]\nsocket_path = "{self.socket}"\n[store]\nstate_dir = "{self.dir / "state"}"\n'
            'persist_prefix_cache = false\n[thermal]\nenabled = false\n[errors]\nenabled = false\n'
            '[logging]\nlevel = "warning"\nformat = "json"\n'
            f'[limits]\nmax_queued_jobs_per_user = 100000\n'
            f'[[models]]\nname = "bench"\ncheckpoint_dir = "{ckpt}"\nweight_format = "bf16"\n')
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = open(self.dir / "npud.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "npud", "--config", str(self.dir / "npud.toml")],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                Client(self.socket).close()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError((self.dir / "npud.log").read_text()) from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def socket_run(c: Client, daemon: psutil.Process, tokens: int) -> Run:
    """One streamed `complete` request, timed by the client; CPU is the daemon's."""
    cpu = sum(daemon.cpu_times()[:2])
    started = time.perf_counter()
    stream = c.complete(PROMPT, max_tokens=tokens, spec={"method": "none"}, use_prefix_cache=False)
    times = [time.perf_counter() for e in stream if e.name == "token" and e.data["token_ids"]]
    ended = time.perf_counter()
    return Run(started, times, len(stream.result["token_ids"]), ended, sum(daemon.cpu_times()[:2]) - cpu)


async def status_latencies(socket: str, clients: int, calls: int, job: int) -> tuple[list[float], float]:
    """Per-call latencies of `status` from `clients` concurrent connections, and calls per second."""
    latencies: list[float] = []
    started = time.perf_counter()

    async def one() -> None:
        async with await AsyncClient.connect(socket) as c:
            for _ in range(calls):
                started = time.perf_counter()
                await c.status(job)
                latencies.append(time.perf_counter() - started)

    async with trio.open_nursery() as n:
        for _ in range(clients):
            n.start_soon(one)
    return latencies, len(latencies) / (time.perf_counter() - started)


def percentiles(measured: tuple[list[float], float]) -> tuple[float, float, float, float]:
    """(p50 ms, p99 ms, max ms, calls/s)."""
    values, rate = measured
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100)
    return q[49] * 1000, q[98] * 1000, ordered[-1] * 1000, rate


def tiny_jobs(d: Daemon, n: int) -> tuple[float, float]:
    """(jobs accepted per second, jobs finished per second) for n one-token jobs from one client."""
    with Client(d.socket) as c:
        started = time.perf_counter()
        ids = [c.submit([PROMPT], max_tokens=1)["job"] for _ in range(n)]
        accepted = time.perf_counter() - started
        last = ids[-1]
        while c.status(last)["state"] != "done":
            time.sleep(0.005)
        finished = time.perf_counter() - started
        assert all(j["state"] == "done" for j in c.jobs(state="done", limit=1000)["jobs"][: min(n, 1000)])
    return n / accepted, n / finished


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("0p5b-8layer", "tiny"), default="0p5b-8layer")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--calls", type=int, default=20, help="status calls per client")
    ap.add_argument("--jobs", type=int, default=200)
    args = ap.parse_args()

    ckpt = checkpoint(args.model)
    direct_run, load_s = direct_session(ckpt, args.tokens)
    d = Daemon(ckpt)
    try:
        # side by side: the machine is shared, so the two paths alternate and each keeps its best
        directs, throughs = [], []
        daemon_process = psutil.Process(d.proc.pid)
        with Client(d.socket) as c:
            socket_run(c, daemon_process, args.tokens)  # loads the model in the daemon and warms up
            for _ in range(args.repeats):
                directs.append(direct_run())
                throughs.append(socket_run(c, daemon_process, args.tokens))
        direct = max(directs, key=lambda r: r.rate)
        through = max(throughs, key=lambda r: r.rate)
        with Client(d.socket) as c:
            idle_job = c.submit([PROMPT], max_tokens=1)["job"]
        idle = percentiles(trio.run(status_latencies, d.socket, args.clients, args.calls, idle_job))
        with Client(d.socket) as c:
            busy_job = c.submit([PROMPT] * 64, max_tokens=args.tokens, spec={"method": "none"})["job"]
            while c.status(busy_job)["state"] != "running":
                time.sleep(0.01)
            busy = percentiles(trio.run(status_latencies, d.socket, args.clients, args.calls, busy_job))
            still_running = c.status(busy_job)["state"] == "running"
            c.cancel(busy_job)
            while c.status(busy_job)["state"] == "running":
                time.sleep(0.01)
        accepted_rate, finished_rate = tiny_jobs(d, args.jobs)
    finally:
        d.close()

    print(f"npud over the engine: model {args.model} ({ckpt.name}), greedy, no speculation, best of {args.repeats}; "
          f"engine load {load_s:.1f} s; {os.cpu_count()} cores")
    print()
    print(f"{'':<34} {'tokens':>7} {'first token ms':>15} {'decode tok/s':>13} {'request tok/s':>14} "
          f"{'CPU ms/token':>13}")
    for label, run in (("engine direct", direct), ("through the socket (complete)", through)):
        print(f"{label:<34} {run.tokens:>7} {run.first_token_ms:>15.1f} {run.decode_rate:>13.1f} {run.rate:>14.1f} "
              f"{run.cpu_ms_per_token:>13.2f}")
    cpu_direct = statistics.median(r.cpu_ms_per_token for r in directs)
    cpu_through = statistics.median(r.cpu_ms_per_token for r in throughs)
    print(f"{'daemon overhead':<34} {'':>7} {'':>15} "
          f"{100 * (1 - through.decode_rate / direct.decode_rate):>12.1f}% "
          f"{100 * (1 - through.rate / direct.rate):>13.1f}% {100 * (cpu_through / cpu_direct - 1):>12.1f}%")
    print("(wall-clock columns: best run of each; CPU: median over runs, the one figure a shared machine"
          " does not blur much)")
    print()
    print(f"{'measure':<46} {'value':>12}")
    print(f"{'-' * 46} {'-' * 12}")
    for label, (p50, p99, worst, rate) in ((f"status, {args.clients} clients, idle", idle),
                                           (f"status, {args.clients} clients, device busy", busy)):
        print(f"{label + ', p50 ms':<46} {p50:>12.2f}")
        print(f"{label + ', p99 ms':<46} {p99:>12.2f}")
        print(f"{label + ', max ms':<46} {worst:>12.2f}")
        print(f"{label + ', calls/s':<46} {rate:>12.1f}")
    print(f"{'tiny jobs accepted/s (durable commit each)':<46} {accepted_rate:>12.1f}")
    print(f"{'tiny jobs finished/s (1 prompt, 1 token)':<46} {finished_rate:>12.1f}")
    if not still_running:
        print("note: the busy job finished before the busy measurement ended; raise --tokens")


if __name__ == "__main__":
    main()
