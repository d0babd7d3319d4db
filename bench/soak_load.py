"""The load bench/soak.py puts on npud: socket clients, a frame fuzzer, HTTP clients (on
http.sock and on the loopback TCP listener) and an idle-connection attacker, each a thread
(the attacker a process) that counts what it saw in one Tally.

A socket client's batch submits carry an idempotency key and are retried with it until one
reply names the job; what a client sent and never saw acknowledged is kept in `Tally.pending`
so that the end of the run settles it (bench/soak.py) instead of counting it lost. HTTP
completions are checked whole: a plain reply has a choice with a finish reason, a stream ends
with a finish chunk and `data: [DONE]`; a reply cut short counts as a lost result.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid

from npud.clients.client import Client, ConnectionLost, NotRunning, NpudError
from npud.protocol import ErrorCode

STABLE = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL_ERROR.value}
STABLE |= {"unauthorized", "method_not_allowed", "request_too_large", "request_timeout"}  # HTTP's own
TOKEN = "soak-bearer-token-0123456789abcdef"


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: collections.Counter[str] = collections.Counter()
        self.frames = 0
        self.hangs = 0
        self.down = 0  # requests that met a connection the daemon closed (or a daemon restarting)
        self.acked: dict[int, int] = {}  # batch job -> prompts
        self.pending: dict[str, dict] = {}  # idempotency key -> submit params, until a reply names the job
        self.cancelled: set[int] = set()  # a cancel's reply said it cancelled the job
        self.cancel_sent: set[int] = set()  # a cancel was sent (its reply may have been lost)
        self.fuzz_cancels: set[int] = set()  # jobs a fuzzed frame asked to cancel (ids like 1 and 8)
        self.http_done = 0  # HTTP completions answered whole
        self.http_cut = 0  # HTTP completions answered 200 but cut short (a lost result)
        self.completes = 0  # socket `complete`s answered with a result

    def code(self, code: str) -> None:
        with self.lock:
            self.codes[code] += 1

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


def reply_code(fn, tally: Tally, hang_s: float):
    """Run one client call; returns its result or None, counting its code, hang or down."""
    started = time.monotonic()
    try:
        out = fn()
        tally.code("ok")
        return out
    except (ConnectionLost, NotRunning):
        tally.add("down")
        return None
    except NpudError as exc:
        tally.code(exc.code)
        return None
    except socket.timeout:
        tally.add("hangs")
        return None
    except OSError:
        tally.add("down")
        return None
    finally:
        if time.monotonic() - started > hang_s:
            tally.add("hangs")


def submit_acked(socket_path: str, params: dict, key: str, tally: Tally, hang_s: float,
                 stop: threading.Event | None) -> dict | None:
    """Submit with `key` until a reply names the job (a lost reply is retried with the same key,
    which makes no second job); None when the daemon refused it or `stop` came first."""
    while stop is None or not stop.is_set():
        try:
            with Client(socket_path, timeout=hang_s) as s:
                status = s.submit(**params, idempotency_key=key)
            tally.code("ok")
            return status
        except (ConnectionLost, NotRunning, OSError):
            tally.add("down")
            time.sleep(0.2)
        except NpudError as exc:
            tally.code(exc.code)
            with tally.lock:
                tally.pending.pop(key, None)  # refused (queue_full, ...): no job was made
            return None
    return None


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
                    # priority interactive marks the soak's own batch jobs (the fuzzer's are batch)
                    params = {"prompts": [f"def f{rng.randrange(10**6)}(x):" for _ in range(rng.randrange(1, 6))],
                              "max_tokens": rng.randrange(4, 40), "priority": "interactive"}
                    key = uuid.uuid4().hex
                    with tally.lock:
                        tally.pending[key] = params
                    status = submit_acked(socket_path, params, key, tally, hang_s, stop)
                    if status is not None:
                        with tally.lock:
                            tally.acked[status["job"]] = len(params["prompts"])
                            del tally.pending[key]
                elif action < 0.45:
                    out = reply_code(lambda: c.complete(f"x = {rng.randrange(1000)}",
                                                        max_tokens=rng.randrange(1, 16)).wait(), tally, hang_s)
                    if out is not None:
                        tally.add("completes")
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
        text = text.replace('"@@"', rng.choice(ODD + ["1", '"a"', '["a b"]', "0.5", "8", '"0123456789abcdef"']), 1)
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        data = bytearray(data)
        data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    return data.replace(b"\n", b" ") + b"\n"


def cancelled_by(data: bytes) -> int | None:
    """The job a fuzzed frame cancels if the daemon reads it as a well-formed `cancel`."""
    try:
        msg = json.loads(data)
        job = msg["params"]["job"] if msg["method"] == "cancel" else None
    except (ValueError, TypeError, KeyError, RecursionError):  # the daemon refuses what json refuses
        return None
    return job if isinstance(job, int) and not isinstance(job, bool) else None


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
                data = frame(rng)
                job = cancelled_by(data)
                if job is not None:  # the daemon reads it as a cancel of one of the soak's jobs, maybe
                    with tally.lock:
                        tally.fuzz_cancels.add(job)
                s.sendall(data + json.dumps({"id": probe, "method": "hello"}).encode() + b"\n")
                tally.add("frames")
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
            tally.add("hangs")
        except (OSError, ConnectionError, ValueError):
            tally.add("down")
        finally:
            s.close()


def http_call(where, request: bytes, hang_s: float) -> tuple[str, str, bytes]:
    """One HTTP exchange on a new connection (Connection: close): (status, error code or "", body)."""
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
    return status, code, data.partition(b"\r\n\r\n")[2]


def whole_completion(body: bytes, stream: bool) -> bool:
    """Whether a 200 completion's body is all there: a choice with a finish reason (a stream: a
    finish chunk, then [DONE])."""
    try:
        if not stream:
            return json.loads(body)["choices"][0]["finish_reason"] is not None
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        return events[-1] == b"[DONE]" and any(json.loads(e)["choices"] and json.loads(e)["choices"][0]["finish_reason"]
                                              for e in events[:-1])
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def http_worker(where, token: str | None, tally: Tally, stop: threading.Event, seed: int, hang_s: float) -> None:
    rng = random.Random(seed)
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    while not stop.is_set():
        action = rng.random()
        stream = rng.random() < 0.5
        if action < 0.5:
            body = json.dumps({"model": "tiny", "prompt": f"x = {rng.randrange(1000)}", "max_tokens": rng.randrange(1, 16),
                               "stream": stream}).encode()
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth +
                       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        elif action < 0.6:
            request = b"HEAD /v1/models HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth + b"\r\n"
        else:
            path = rng.choice([b"/health", b"/v1/models"])
            request = b"GET " + path + b" HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n" + auth + b"\r\n"
        started = time.monotonic()
        try:
            status, code, body = http_call(where, request, hang_s)
            if 0.5 <= action < 0.6:
                code = "ok" if status in ("405", "200") else code  # HEAD: headers only, no code to read
            tally.code("ok" if status == "200" else (code or f"http_{status}"))
            if action < 0.5 and status == "200":
                tally.add("http_done" if whole_completion(body, stream) else "http_cut")
        except socket.timeout:
            tally.add("hangs")
        except OSError:
            tally.add("down")
            time.sleep(0.2)
        if time.monotonic() - started > hang_s:
            tally.add("hangs")


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
