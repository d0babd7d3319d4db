"""npud under attack for a while (issues 17 and 26): mixed clients, fuzzed frames, idle
connections, reloads, kill -9s and restarts.

One daemon process on the tiny test model (the real engine) and, in this process, threads:
clients that submit batches (with idempotency keys, retried across kills), complete, read
statuses and results, cancel now and then and ask for stats; a fuzzer that sends mutated
frames, each followed by a `hello` probe that must be answered; HTTP clients on http.sock and
on a loopback TCP listener with a bearer token (completions, streamed or not, /health,
/v1/models); idle-connection attackers (a process as uid 65534 when run as root) that keep
--idle TCP connections open without the token; a SIGHUP every --reload-every seconds
(alternating two valid configs, every third one invalid); and a killer that kill -9s the
daemon every --kill-every seconds (0: never) and starts it again (bench/soak_load.py).

At the end every batch submit a client sent is settled: one whose reply never came (the run
stopped while it retried) is sent again with its idempotency key, which names the job it made
or makes it. Then each job must end `done` with each prompt's result exactly once and none an
error, or `cancelled` by a cancel a client sent (or a fuzzed frame that parsed as a cancel of its id:
the fuzzer's job ids 1 and 8 are real ones); anything else is a lost prompt, named by how
(a done job short of results, an error result, a job failed, cancelled by nobody, unfinished).
A duplicated job is one more job of the soak's own than the settled submits.

Prints one table: frames, replies by code, crashes (exits we did not cause), hangs (a reply
that did not come within --hang-s), lost and duplicated prompts, duplicated jobs, RSS and open
descriptors over the longest-lived daemon run, with the CPU model and load average.

Run: .venv/bin/python bench/soak.py --minutes 30 [--kill-every 120] [--clients 4] [--http 2] [--idle 200]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from npud.clients.client import Client, NpudError  # noqa: E402
from soak_load import (STABLE, TOKEN, Tally, client_worker, fuzz_worker, http_worker, idle_attacker,  # noqa: E402
                       submit_acked)

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


class Daemon:
    """One npud process on `checkpoint`, restartable on the same state."""

    def __init__(self, checkpoint: Path, workdir: Path) -> None:
        self.dir = workdir
        self.socket = str(workdir / "npud.sock")
        self.http_socket = str(workdir / "http.sock")
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.tcp = probe.getsockname()
        probe.close()
        self.checkpoint = checkpoint
        (workdir / "kmsg").write_text("")
        self.write_config(0)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        # per run: (seconds alive, RSS at start, after warm-up, at end, fds (min, max) after warm-up, fds at end)
        self.runs: list[tuple] = []
        self._rss_start = 0
        self.rss_warm = 0  # set by the main loop --warmup-s after the start
        self.fds: list[int] = []  # open descriptors, sampled by the main loop after warm-up

    def write_config(self, variant: int) -> None:
        """Variant 0 and 1 differ in limits a reload applies; 2 is invalid (the TCP keys gone)."""
        http = "" if variant == 2 else (f'tcp_address = "127.0.0.1:{self.tcp[1]}"\ntcp_owner_uid = {os.getuid()}\n'
                                        f'bearer_token = "{TOKEN}"\n')
        (self.dir / "npud.toml").write_text(
            f'[server]\nsocket_path = "{self.socket}"\nidle_timeout_s = 30.0\nline_timeout_s = 5.0\n'
            f'[http]\n{http}'
            f'[store]\nstate_dir = "{self.dir / "state"}"\n[thermal]\nenabled = false\n'
            f'[errors]\nsource = "{self.dir / "kmsg"}"\n[limits]\nmax_tokens = {64 + variant % 2}\n'
            'max_queued_jobs_per_user = 256\n[logging]\nlevel = "warning"\nformat = "json"\n'
            f'[[models]]\nname = "tiny"\ncheckpoint_dir = "{self.checkpoint}"\nweight_format = "fp32"\n')

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        log = open(self.dir / "npud.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "npud", "--config", str(self.dir / "npud.toml")],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(self.socket, timeout=60) as c:
                    c.complete("warm up", max_tokens=1).wait()  # the model is loaded
                break
            except (NpudError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"npud did not start: {(self.dir / 'npud.log').read_text()[-2000:]}")
                time.sleep(0.1)
        self.started_at = time.monotonic()
        self._rss_start = self.rss()
        self.rss_warm = 0
        self.fds = []

    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def num_fds(self) -> int:
        try:
            return psutil.Process(self.proc.pid).num_fds()
        except psutil.Error:
            return 0

    def end_run(self) -> None:
        self.runs.append((time.monotonic() - self.started_at, self._rss_start, self.rss_warm or self._rss_start,
                          self.rss(), (min(self.fds, default=0), max(self.fds, default=0)), self.num_fds()))

    def kill9(self) -> None:
        self.end_run()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        self.end_run()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def log_errors(path: Path) -> collections.Counter:
    """The daemon log's error-level events by name (internal_error, connection_error, ...)."""
    out: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("level") in ("error", "critical") and e.get("event") not in ("config_reload_failed",):
            out[e.get("event", "?")] += 1
    return out


def settle(socket_path: str, tally: Tally, hang_s: float) -> dict:
    """The end of a run's accounting (see the module's doc): every submit settled, every job's
    end state read, each prompt counted once. Returns the counts the table shows."""
    a = collections.Counter()
    a["failed"] = collections.Counter()
    for key, params in list(tally.pending.items()):  # sent, never acknowledged: the key names its job
        status = submit_acked(socket_path, params, key, tally, hang_s, None)
        if status is not None:
            tally.acked[status["job"]] = len(params["prompts"])
            a["settled"] += 1
    with Client(socket_path, timeout=120) as c:
        for job, n in sorted(tally.acked.items()):
            deadline = time.monotonic() + 300
            while (state := c.status(job)["state"]) in ("queued", "running") and time.monotonic() < deadline:
                time.sleep(0.2)
            status = c.status(job)
            results = c.result(job)["results"]
            prompts = [r["prompt"] for r in results]
            got = set(prompts) & set(range(n))
            a["jobs"] += 1
            a["prompts"] += n
            a["results"] += len(got)
            a["duplicated"] += len(prompts) - len(set(prompts))
            # a prompt a cancel of ours stopped ends `cancelled` (in a job that ends `done` when
            # its other prompts had finished); anything but these is an error
            asked = job in tally.cancel_sent or job in tally.fuzz_cancels
            fine = ("stop", "length", "cancelled") if asked else ("stop", "length")
            errors = sum(1 for r in results if r.get("error") or r.get("finish_reason") not in fine)
            if state == "done":  # every prompt's result, none an error
                a["done"] += 1
                a["short"] += n - len(got)
                a["errors"] += errors
                a["lost"] += n - len(got) + errors
            elif state == "cancelled" and job in tally.cancelled:
                a["cancelled_acked"] += 1
            elif state == "cancelled" and job in tally.cancel_sent:
                a["cancelled_reply_lost"] += 1  # a cancel we sent did it; its reply came too late
            elif state == "cancelled" and job in tally.fuzz_cancels:
                a["cancelled_by_fuzzer"] += 1  # a fuzzed frame that parsed as a cancel of this job
            else:
                if state == "failed":
                    a["failed"][(status.get("error") or {}).get("code", "?")] += 1
                elif state == "cancelled":
                    a["cancelled_unasked"] += 1
                else:
                    a["unfinished"] += 1
                a["lost"] += n - len(got)
        ours, before = 0, None
        while page := c.jobs(limit=1000, before=before)["jobs"]:  # newest first
            ours += sum(1 for j in page if j["priority"] == "interactive" and not j["interactive"])
            before = page[-1]["job"]
    a["duplicated_jobs"] = ours - len(tally.acked)  # a retried submit that made a second job
    return a


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every", type=float, default=120.0, help="seconds between kill -9s (0: none)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fuzzers", type=int, default=1)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--http", type=int, default=2, help="HTTP clients on http.sock and as many on TCP")
    ap.add_argument("--idle", type=int, default=200, help="idle TCP connections the attacker keeps open")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="RSS drift is measured from this far into a run")
    ap.add_argument("--reload-every", type=float, default=60.0, help="seconds between SIGHUPs (0: none)")
    args = ap.parse_args()

    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    out = ROOT / "bench" / "out" / "tiny-qwen3"
    if not (out / "config.json").exists():
        build_tiny_checkpoint(out)
    workdir = Path(tempfile.mkdtemp(prefix="npud-soak-", dir="/tmp"))
    daemon = Daemon(out, workdir)
    daemon.start()
    tally = Tally()
    stop = threading.Event()
    threads = [threading.Thread(target=client_worker, args=(daemon.socket, tally, stop, i, args.hang_s), daemon=True)
               for i in range(args.clients)]
    threads += [threading.Thread(target=fuzz_worker, args=(daemon.socket, tally, stop, 1000 + i, args.hang_s),
                                 daemon=True) for i in range(args.fuzzers)]
    threads += [threading.Thread(target=http_worker, args=(where, token, tally, stop, 2000 + i, args.hang_s),
                                 daemon=True)
                for i in range(args.http) for where, token in ((daemon.http_socket, None), (daemon.tcp, TOKEN))]
    for t in threads:
        t.start()
    attacker = idle_attacker(daemon.tcp, args.idle) if args.idle else None
    reloads = 0
    next_reload = time.monotonic() + args.reload_every if args.reload_every > 0 else float("inf")
    started = time.monotonic()
    end = started + args.minutes * 60
    next_kill = started + args.kill_every if args.kill_every > 0 else float("inf")
    kills = crashes = 0
    while time.monotonic() < end:
        time.sleep(0.5)
        if not daemon.rss_warm and time.monotonic() - daemon.started_at >= args.warmup_s:
            daemon.rss_warm = daemon.rss()
        if daemon.rss_warm:
            daemon.fds.append(daemon.num_fds())
        if daemon.proc.poll() is not None:  # an exit we did not cause
            crashes += 1
            daemon.end_run()
            daemon.start()
        elif time.monotonic() >= next_kill:
            daemon.kill9()
            kills += 1
            daemon.start()
            next_kill = time.monotonic() + args.kill_every
        elif time.monotonic() >= next_reload:
            variant = reloads % 3  # 0, 1: valid; 2: the TCP keys removed (refused, the running config stays)
            daemon.write_config(variant)
            daemon.proc.send_signal(signal.SIGHUP)
            reloads += 1
            if variant == 2:
                time.sleep(2.0)
                daemon.write_config(0)  # a restart after a kill reads a config with TCP again
            next_reload = time.monotonic() + args.reload_every
    stop.set()
    if attacker is not None:
        attacker.kill()
        attacker.wait()
    for t in threads:
        t.join(args.hang_s + 10)
    ran_s = time.monotonic() - started

    account = settle(daemon.socket, tally, args.hang_s)
    rc = daemon.stop()
    if rc != 0:
        crashes += 1
    longest = max(daemon.runs, key=lambda r: r[0])
    rows = [
        ("duration", f"{ran_s / 60:.1f} min (asked for {args.minutes:g})"),
        ("CPU", cpu_model()),
        ("load average (1/5/15 min)", open("/proc/loadavg").read().split()[:3]),
        ("clients / fuzzers", f"{args.clients} / {args.fuzzers}"),
        ("fuzzed frames", tally.frames),
        ("replies by code", dict(sorted(tally.codes.items()))),
        ("internal_error", tally.codes.get("internal_error", 0)),
        ("codes outside the protocol", sum(n for c, n in tally.codes.items() if c != "ok" and c not in STABLE
                                           and c != "internal_error")),
        ("HTTP clients (unix + tcp) / idle TCP connections", f"{args.http} + {args.http} / {args.idle}"),
        ("reloads (of which refused on purpose)", f"{reloads} ({reloads // 3})"),
        ("refused reloads logged", len([1 for line in (workdir / "npud.log").read_text(errors="replace").splitlines()
                                        if '"config_reload_failed"' in line])),
        ("error-level log events", dict(log_errors(workdir / "npud.log"))),
        ("kill -9s (ours)", kills),
        ("crashes (exits we did not cause, or SIGTERM exit != 0)", crashes),
        ("hangs (no reply within --hang-s)", tally.hangs),
        ("requests that met a killed/restarting daemon", tally.down),
        ("socket completes / HTTP completions answered whole", f"{tally.completes} / {tally.http_done}"),
        ("HTTP completions cut short (lost results)", tally.http_cut),
        ("batch jobs (settled at the end: reply lost while the run stopped)",
         f"{account['jobs']} ({account['settled']})"),
        ("... done / cancelled by a client's cancel (reply seen / lost) / by a fuzzed cancel",
         f"{account['done']} / {account['cancelled_acked']} / {account['cancelled_reply_lost']} / "
         f"{account['cancelled_by_fuzzer']}"),
        ("prompts submitted / with their result", f"{account['prompts']} / {account['results']}"),
        ("lost prompts", account["lost"]),
        ("... done jobs short of results / error results", f"{account['short']} / {account['errors']}"),
        ("... jobs failed (by code) / cancelled by nobody / unfinished",
         f"{dict(account['failed'])} / {account['cancelled_unasked']} / {account['unfinished']}"),
        ("duplicated prompt results", account["duplicated"]),
        ("duplicated jobs (retried submits)", account["duplicated_jobs"]),
        ("longest daemon run", f"{longest[0]:.0f} s"),
        ("its RSS at start / after warm-up / end", f"{longest[1] / 2**20:.1f} / {longest[2] / 2**20:.1f} / "
                                                 f"{longest[3] / 2**20:.1f} MiB (end vs warm-up "
                                                 f"{(longest[3] / longest[2] - 1) * 100 if longest[2] else float('nan'):+.1f}%)"),
        ("its open descriptors after warm-up (min-max) / at the end", f"{longest[4][0]}-{longest[4][1]} / {longest[5]}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
