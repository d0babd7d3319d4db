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
daemon every --kill-every seconds (0: never) and starts it again. At the end every
acknowledged batch job must finish with each prompt's result exactly once.

Prints one table: frames, replies by code, crashes (exits we did not cause), hangs (a reply
that did not come within --hang-s), lost and duplicated prompts, duplicated jobs, RSS at
the start and end of the longest-lived daemon run, with the CPU model and load average.

Run: .venv/bin/python bench/soak.py --minutes 30 [--kill-every 120] [--clients 4] [--http 2] [--idle 200]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from clients.client import Client, ConnectionLost, NotRunning, NpudError
from npud.protocol import ErrorCode

ROOT = Path(__file__).resolve().parent.parent

STABLE = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL_ERROR.value}
STABLE |= {"unauthorized", "method_not_allowed", "request_too_large", "request_timeout"}  # HTTP's own
TOKEN = "soak-bearer-token-0123456789abcdef"
DOWN = (ConnectionLost, NotRunning, ConnectionError, socket.timeout, OSError)  # around a kill


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
        self.runs: list[tuple[float, int, int, int]] = []  # (seconds alive, RSS at start, after warm-up, at end)
        self._rss_start = 0
        self.rss_warm = 0  # set by the main loop --warmup-s after the start

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

    def rss(self) -> int:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.Error:
            return 0

    def end_run(self) -> None:
        self.runs.append((time.monotonic() - self.started_at, self._rss_start, self.rss_warm or self._rss_start,
                          self.rss()))

    def kill9(self) -> None:
        self.end_run()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        self.end_run()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: collections.Counter[str] = collections.Counter()
        self.frames = 0
        self.hangs = 0
        self.down = 0  # requests that met a daemon being killed or restarted
        self.acked: dict[int, int] = {}  # batch job -> prompts
        self.cancelled: set[int] = set()
        self.cancel_sent: set[int] = set()  # a cancel was sent (its reply may have timed out)
        self.keys: set[str] = set()

    def code(self, code: str) -> None:
        with self.lock:
            self.codes[code] += 1


def reply_code(fn, tally: Tally, hang_s: float):
    """Run one client call; returns its result or None, counting its code, hang or down."""
    started = time.monotonic()
    try:
        out = fn()
        tally.code("ok")
        return out
    except NpudError as exc:
        if isinstance(exc, (ConnectionLost, NotRunning)):
            with tally.lock:
                tally.down += 1
            return None
        tally.code(exc.code)
        return None
    except socket.timeout:
        with tally.lock:
            tally.hangs += 1
        return None
    except OSError:
        with tally.lock:
            tally.down += 1
        return None
    finally:
        if time.monotonic() - started > hang_s:
            with tally.lock:
                tally.hangs += 1


def client_worker(socket_path: str, tally: Tally, stop: threading.Event, seed: int, hang_s: float) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            c = Client(socket_path, timeout=hang_s)
        except NpudError:
            time.sleep(0.2)
            continue
        with c:
            for _ in range(rng.randrange(5, 30)):
                if stop.is_set():
                    break
                action = rng.random()
                if action < 0.3:
                    prompts = [f"def f{rng.randrange(10**6)}(x):" for _ in range(rng.randrange(1, 6))]
                    key = uuid.uuid4().hex
                    status = None
                    deadline = time.monotonic() + 180
                    while status is None and not stop.is_set() and time.monotonic() < deadline:
                        try:  # the same key until it is acknowledged: a kill in between makes no second job
                            with Client(socket_path, timeout=hang_s) as s:
                                # priority interactive marks the soak's own batch jobs (the fuzzer's are batch)
                                status = s.submit(prompts, max_tokens=rng.randrange(4, 40), idempotency_key=key,
                                                  priority="interactive")
                            tally.code("ok")
                        except (ConnectionLost, NotRunning, OSError):
                            with tally.lock:
                                tally.down += 1
                            time.sleep(0.2)
                        except NpudError as exc:
                            tally.code(exc.code)
                            break
                    if status is not None:
                        with tally.lock:
                            tally.acked[status["job"]] = len(prompts)
                            tally.keys.add(key)
                elif action < 0.45:
                    reply_code(lambda: c.complete(f"x = {rng.randrange(1000)}", max_tokens=rng.randrange(1, 16)).wait(),
                               tally, hang_s)
                elif action < 0.8:
                    with tally.lock:
                        jobs = list(tally.acked)
                    if jobs:
                        job = rng.choice(jobs)
                        reply_code(lambda: (c.status if rng.random() < 0.5 else c.result)(job), tally, hang_s)
                elif action < 0.83:
                    with tally.lock:
                        jobs = list(tally.acked)
                    if jobs:
                        job = rng.choice(jobs)
                        with tally.lock:
                            tally.cancel_sent.add(job)
                        reply = reply_code(lambda: c.cancel(job), tally, hang_s)
                        if reply is not None and reply["cancelled"]:
                            with tally.lock:
                                tally.cancelled.add(job)
                else:
                    reply_code(rng.choice([c.stats, c.metrics, c.models, c.device_status, lambda: c.jobs(limit=5)]),
                               tally, hang_s)


ODD = ["null", "true", "-1", "1e400", "NaN", "9" * 5000, str(1 << 63), '"\\ud800"', "[]", "{}", "[" * 3000 + "]" * 3000,
       '"' + "x" * 3000 + '"', '[{"role": 1}]']
METHODS = ["hello", "submit", "complete", "stream", "result", "status", "jobs", "cancel", "tickets", "cache.list",
           "cache.pin", "cache.drop", "device.status", "device.clear", "models", "stats", "metrics", "nope"]
PARAMS = ["job", "prompts", "prompt", "chats", "messages", "max_tokens", "sampling", "stop", "spec", "since",
          "until", "limit", "before", "state", "key", "name", "text", "model", "idempotency_key", "format"]


def frame(rng: random.Random) -> bytes:
    """A request with odd ids, methods and params (JSON text, or bytes flipped)."""
    params = {p: "@@" for p in rng.sample(PARAMS, rng.randrange(0, 4))}
    text = json.dumps({"id": rng.choice(["@@", rng.randrange(1 << 31), "s"]), "method": rng.choice(METHODS),
                       "params": params})
    while "@@" in text:
        text = text.replace('"@@"', rng.choice(ODD + ["1", '"a"', '["a b"]', "0.5", "8"]), 1)
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        data = bytearray(data)
        data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    return data.replace(b"\n", b" ") + b"\n"


def fuzz_worker(socket_path: str, tally: Tally, stop: threading.Event, seed: int, hang_s: float) -> None:
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(hang_s)
            s.connect(socket_path)
        except OSError:
            time.sleep(0.2)
            continue
        buf = b""
        try:
            while not stop.is_set():
                n += 1
                probe = f"probe{n}"
                s.sendall(frame(rng) + json.dumps({"id": probe, "method": "hello"}).encode() + b"\n")
                with tally.lock:
                    tally.frames += 1
                while True:
                    while b"\n" not in buf:
                        chunk = s.recv(1 << 20)
                        if not chunk:
                            raise ConnectionError("closed")
                        buf += chunk
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "event" in msg:
                        continue
                    if msg.get("id") == probe:
                        break
                    tally.code("ok" if msg.get("ok") else msg["error"]["code"])
        except socket.timeout:
            with tally.lock:
                tally.hangs += 1
        except (OSError, ConnectionError, ValueError):
            with tally.lock:
                tally.down += 1
        finally:
            s.close()


def http_call(where, request: bytes, hang_s: float) -> tuple[str, str]:
    """One HTTP exchange on a new connection (Connection: close): (status, error code or "")."""
    if isinstance(where, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(hang_s)
        s.connect(where)
    else:
        s = socket.create_connection(where, timeout=hang_s)
    try:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    finally:
        s.close()
    status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "garbled"
    code = ""
    if b'"code":"' in data:
        code = data.split(b'"code":"', 1)[1].split(b'"', 1)[0].decode()
    return status, code


def http_worker(where, token: str | None, tally: Tally, stop: threading.Event, seed: int, hang_s: float) -> None:
    rng = random.Random(seed)
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    while not stop.is_set():
        action = rng.random()
        if action < 0.5:
            body = json.dumps({"model": "tiny", "prompt": f"x = {rng.randrange(1000)}", "max_tokens": rng.randrange(1, 16),
                               "stream": rng.random() < 0.5}).encode()
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth +
                       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        elif action < 0.6:
            request = b"HEAD /v1/models HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth + b"\r\n"
        else:
            path = rng.choice([b"/health", b"/v1/models"])
            request = b"GET " + path + b" HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth + b"\r\n"
        started = time.monotonic()
        try:
            status, code = http_call(where, request, hang_s)
            if action >= 0.5 and action < 0.6:
                code = "ok" if status in ("405", "200") else code  # HEAD: headers only, no code to read
            tally.code("ok" if status == "200" else (code or f"http_{status}"))
        except socket.timeout:
            with tally.lock:
                tally.hangs += 1
        except OSError:
            with tally.lock:
                tally.down += 1
            time.sleep(0.2)
        if time.monotonic() - started > hang_s:
            with tally.lock:
                tally.hangs += 1


IDLER = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
while True:  # keep n connections open, never sending a byte; the daemon closes them, they come back
    held = [s for s in held if s.fileno() != -1]
    while len(held) < n:
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            time.sleep(0.5)
            break
    for s in list(held):
        s.setblocking(False)
        try:
            if s.recv(4096) == b"":
                s.close()
        except BlockingIOError:
            pass
        except OSError:
            s.close()
    time.sleep(0.5)
"""


def idle_attacker(tcp: tuple, n: int) -> subprocess.Popen:
    """A process that holds n idle TCP connections (as uid 65534 when run as root)."""
    as_other = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    python = "/usr/bin/python3" if as_other and os.path.exists("/usr/bin/python3") else sys.executable
    return subprocess.Popen([python, "-c", IDLER, tcp[0], str(tcp[1]), str(n)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd="/", **as_other)


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

    from engine.testing.checkpoints import build_tiny_checkpoint

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

    # every acknowledged batch job ends with each prompt's result exactly once
    lost = duplicated = unfinished = 0
    failed: collections.Counter[str] = collections.Counter()
    cancelled_unasked = 0  # cancelled with no cancel sent: a real loss
    with Client(daemon.socket, timeout=120) as c:
        for job, n in sorted(tally.acked.items()):
            deadline = time.monotonic() + 300
            while (state := c.status(job)["state"]) in ("queued", "running") and time.monotonic() < deadline:
                time.sleep(0.2)
            status = c.status(job)
            prompts = [r["prompt"] for r in c.result(job)["results"]]
            duplicated += len(prompts) - len(set(prompts))
            if state in ("queued", "running"):
                unfinished += 1
            elif state == "done":  # a done job has every prompt's result
                lost += n - len(set(prompts))
            elif state == "failed":
                failed[(status.get("error") or {}).get("code", "?")] += 1
            elif job not in tally.cancel_sent:
                cancelled_unasked += 1
        ours, before = 0, None
        while page := c.jobs(limit=1000, before=before)["jobs"]:  # newest first
            ours += sum(1 for j in page if j["priority"] == "interactive" and not j["interactive"])
            before = page[-1]["job"]
    duplicated_jobs = ours - len(tally.acked)  # a retried submit that made a second job
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
        ("acknowledged batch jobs (cancelled)", f"{len(tally.acked)} ({len(tally.cancelled)})"),
        ("lost prompts (of done jobs)", lost),
        ("failed jobs by code", dict(failed)),
        ("jobs cancelled that no client cancelled", cancelled_unasked),
        ("duplicated prompt results", duplicated),
        ("duplicated jobs (retried submits)", duplicated_jobs),
        ("unfinished at the end", unfinished),
        ("longest daemon run", f"{longest[0]:.0f} s"),
        ("its RSS at start / after warm-up / end", f"{longest[1] / 2**20:.1f} / {longest[2] / 2**20:.1f} / "
                                                 f"{longest[3] / 2**20:.1f} MiB (end vs warm-up "
                                                 f"{(longest[3] / longest[2] - 1) * 100 if longest[2] else float('nan'):+.1f}%)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
