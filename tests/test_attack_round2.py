"""npud under attack, round two (issue 26): idle connections, reloads, descriptors, SIGTERM's
final words, HTTP framing, and what a restart does with the jobs of clients that are gone.

A daemon process on the fake engine, clients running as other uids (root needed for those),
real sockets. The lock-out test is the attack the issue describes: the daemon gets systemd's
default limit of NOFILE = 1,024 descriptors and the attacker, another uid, holds
IDLE_CONNECTIONS = 1,000 idle TCP connections open (the issue's lock-out came at 600 and the
descriptors ran out at 1,100) while root, an admin and the TCP owner are served.
Before the fix the idle connections counted as the TCP owner's and against
server.max_connections until they sent a request, so they filled both and then the
descriptor table: root, an admin and the owner were all refused or never accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

import test_npud_support as fakes
from test_npud_support import DaemonProc, wait_for, write_fake_checkpoint

pytestmark = pytest.mark.hog  # run again under a CPU hog by .ci/run

TOKEN = "a-test-bearer-token-0123456789"
ATTACKER_UID, ADMIN_UID, OWNER_UID = 64011, 64012, 64013
NOGROUP, ADMIN_GID = 65534, 1  # the admin group is `daemon` (gid 1 on Debian)
NOFILE = 1024  # the daemon's descriptor limit, hard and soft: systemd's default
IDLE_CONNECTIONS = 1000  # with the daemon's own, more than NOFILE: before the fix, they exhausted its descriptors
MAX_CONNECTIONS = 128  # and more than this: before the fix, they filled server.max_connections

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or not shutil.which("prlimit"),
    reason="needs root (clients as other uids), /usr/bin/python3 and prlimit")

ATTACKER = r"""
import json, resource, select, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
held = [socket.create_connection((host, port)) for _ in range(n)]
print("open", flush=True)
sys.stdin.readline()  # the test has been served meanwhile; now count what each connection heard
refused = other = 0
waiting, deadline = {s.fileno(): s for s in held}, time.monotonic() + 120
poll = select.poll()  # select() stops at descriptor 1024
for fd in waiting:
    poll.register(fd, select.POLLIN)
while len(waiting) > 8 and time.monotonic() < deadline:  # a refusal is a 503 at accept; 8 are held, silent
    for fd, _ in poll.poll(1000):
        data = waiting[fd].recv(4096)
        refused += data.startswith(b"HTTP/1.1 503 ")
        other += not data.startswith(b"HTTP/1.1 503 ")
        poll.unregister(fd)
        del waiting[fd]
print(json.dumps({"refused": refused, "other": other, "silent": len(waiting)}), flush=True)
sys.stdin.read()
"""

# each as its own uid: one exchange, its reply on stdout
MAIN_HELLO = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect(sys.argv[1])
s.sendall(b'{"id": 1, "method": "hello"}\n')
data = b""
while not data.endswith(b"\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(data.decode(), flush=True)
"""

HTTP_GET = r"""
import socket, sys
where, path, token = sys.argv[1], sys.argv[2], sys.argv[3]
if where.startswith("/"):
    s = socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect(where)
else:
    host, port = where.rsplit(":", 1); s = socket.create_connection((host, int(port)), timeout=20)
auth = f"Authorization: Bearer {token}\r\n" if token else ""
s.sendall(f"GET {path} HTTP/1.1\r\nHost: npud\r\n{auth}Connection: close\r\n\r\n".encode())
data = b""
while chunk := s.recv(65536):
    data += chunk
print(data.split(b"\r\n")[0].decode(), flush=True)
"""


def run_as(uid: int, gid: int, script: str, *args: str) -> str:
    proc = subprocess.run(["/usr/bin/python3", "-c", script, *args], user=uid, group=gid, extra_groups=[NOGROUP],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


class LimitedDaemon(DaemonProc):
    """A DaemonProc whose descriptor limit is NOFILE, hard and soft."""

    def argv(self) -> list[str]:
        return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *super().argv()]


@pytest.fixture
def daemon():
    workdir = fakes.short_tempdir()
    checkpoint = write_fake_checkpoint(workdir / "fake", tokens_per_round=2)
    d = LimitedDaemon(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True,
                      server={"socket_group": "nogroup", "admin_group": "daemon", "max_connections": MAX_CONNECTIONS},
                      http={"tcp_address": "127.0.0.1:0", "tcp_owner_uid": OWNER_UID, "bearer_token": TOKEN})
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@needs_root
def test_idle_tcp_connections_lock_out_nobody(daemon):
    daemon.write_config(server={"first_request_timeout_s": 300.0})
    daemon.start()
    (listening,) = daemon.events("http_listening")
    host, port = listening["tcp"].rsplit(":", 1)
    attacker = subprocess.Popen(["/usr/bin/python3", "-c", ATTACKER, host, port, str(IDLE_CONNECTIONS)],
                                user=ATTACKER_UID, group=NOGROUP, extra_groups=[], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    try:
        assert attacker.stdout.readline() == "open\n", f"the attacker failed (exit {attacker.poll()})"
        # while the attacker's sockets are open: root, an admin and the TCP owner are served
        hello = json.loads(run_as(0, 0, MAIN_HELLO, daemon.socket))
        assert hello["result"]["admin"] is True
        admin = json.loads(run_as(ADMIN_UID, ADMIN_GID, MAIN_HELLO, daemon.socket))
        assert admin["result"]["uid"] == ADMIN_UID and admin["result"]["admin"] is True
        http_sock = str(daemon.dir / "http.sock")
        assert run_as(ADMIN_UID, ADMIN_GID, HTTP_GET, http_sock, "/v1/models", "") == "HTTP/1.1 200 OK"
        assert run_as(OWNER_UID, NOGROUP, HTTP_GET, f"{host}:{port}", "/v1/models", TOKEN) == "HTTP/1.1 200 OK"
        # all but server.max_pending_per_peer (8) were answered 503 at accept and closed; those 8
        # are held until server.first_request_timeout_s (long here, so that a slow machine's
        # accepts cannot outlast it and let more in)
        attacker.stdin.write("count\n")
        attacker.stdin.flush()
        assert json.loads(attacker.stdout.readline()) == {"refused": IDLE_CONNECTIONS - 8, "other": 0, "silent": 8}
        # the refusals name the attacker, not the TCP owner
        refusals = daemon.events("connection_refused")
        assert refusals and {e["peer"] for e in refusals} == {f"uid {ATTACKER_UID}"}
        # the thermal guard still reads its sensor: descriptors never ran out
        with daemon.client() as c:
            assert c.device_status()["thermal"]["state"] == "ok"
    finally:
        attacker.stdin.close()
        attacker.wait(30)
        attacker.stdout.close()


@needs_root
def test_pending_tcp_connections_close_after_the_first_request_deadline(daemon):
    daemon.write_config(server={"first_request_timeout_s": 0.5, "max_pending_per_peer": 1})
    daemon.start()
    (listening,) = daemon.events("http_listening")
    host, port = listening["tcp"].rsplit(":", 1)
    import socket
    with socket.create_connection((host, int(port)), timeout=60) as s:
        assert s.recv(4096) == b""  # closed without a word, well before server.idle_timeout_s (120 s here)
    # its pending slot is free again: the next connection is held (then closed), not refused
    with socket.create_connection((host, int(port)), timeout=60) as s:
        assert s.recv(4096) == b""
    # and one that sends the token becomes the owner's, leaving the pending slot to the next
    with socket.create_connection((host, int(port)), timeout=60) as authorized:
        authorized.sendall(f"GET /v1/models HTTP/1.1\r\nHost: npud\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        assert authorized.recv(4096).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection((host, int(port)), timeout=60) as s:
            assert s.recv(4096) == b""
    assert not daemon.events("connection_refused")


@needs_root
def test_a_reload_that_would_mix_old_and_new_http_keys_keeps_the_running_config(daemon):
    daemon.start()
    del daemon.config["http"]  # the TCP keys removed: tcp_address is fixed, tcp_owner_uid would be gone
    daemon.config["limits"]["max_tokens"] = 8
    daemon.write_config()
    daemon.hup()
    failed = wait_for(lambda: daemon.events("config_reload_failed"), 20, what="the failed reload")
    assert "http.tcp_owner_uid" in failed[-1]["error"]
    with daemon.client() as c:
        assert c.hello()["limits"]["max_tokens"] == 4096  # the running configuration, unchanged
    assert daemon.proc.poll() is None


# -- SIGTERM: in-flight requests get a final word ------------------------------------------------

def _socket_complete(path: str, out: list) -> None:
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    s.sendall(b'{"id": 1, "method": "complete", "params": {"model": "fake", "prompt": "x", "max_tokens": 4000}}\n')
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    out.extend(json.loads(line) for line in data.splitlines())


def _http_post(path: str, body: dict, out: list) -> None:
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    raw = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    out.append(data)


@pytest.fixture
def slow_daemon():
    workdir = fakes.short_tempdir()
    checkpoint = write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=0.02)
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True,
                   server={"shutdown_grace_s": 0.3},
                   http={"tcp_address": "127.0.0.1:0", "tcp_owner_uid": OWNER_UID, "bearer_token": TOKEN})
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_sigterm_ends_each_inflight_request_with_a_final_word(slow_daemon):
    # before: the streams stopped without a finish chunk, an error event or [DONE], a
    # non-streaming HTTP request got 0 bytes, and a `complete` got its tokens and then EOF
    import threading
    d = slow_daemon.start()
    http_sock = str(d.dir / "http.sock")
    sock_out, stream_out, plain_out = [], [], []
    request = {"model": "fake", "prompt": "x", "max_tokens": 4000}
    threads = [threading.Thread(target=_http_post, args=(http_sock, {**request, "stream": True}, stream_out)),
               threading.Thread(target=_socket_complete, args=(d.socket, sock_out)),
               threading.Thread(target=_http_post, args=(http_sock, request, plain_out))]
    with d.client() as c:
        threads[0].start()  # the stream runs first and has begun (its job has made tokens) ...
        wait_for(lambda: [j for j in c.jobs(["running"])["jobs"] if j["tokens"] > 1], 60, what="the stream")
        for t in threads[1:]:
            t.start()
        # ... and the other two wait behind it (one device)
        wait_for(lambda: len(c.jobs(["queued", "running"])["jobs"]) == 3, 60, what="three jobs")
    assert d.terminate() == 0
    for t in threads:
        t.join(30)
    assert sock_out[-1].get("error", {}).get("code") == "shutting_down", sock_out[-3:]  # the reply, after whatever tokens came
    events = stream_out[0].split(b"\r\n\r\n", 1)[1]
    assert b'"code":"shutting_down"' in events and events.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # chunked
    assert plain_out[0].startswith(b"HTTP/1.1 503 ") and b'"code":"shutting_down"' in plain_out[0]
    # the jobs are over, not run again by the next start
    d.start()
    with d.client() as c:
        assert {j["state"] for j in c.jobs()["jobs"]} == {"cancelled"}


# -- HTTP framing ----------------------------------------------------------------------------------

def _exchange(where, data: bytes, *, shut: bool = False) -> bytes:
    """Send `data`, read until the daemon closes (or 5 s of silence)."""
    import socket
    if isinstance(where, str):
        s = socket.socket(socket.AF_UNIX)
        s.connect(where)
    else:
        s = socket.create_connection(where)
    s.settimeout(5)
    s.sendall(data)
    if shut:
        s.shutdown(socket.SHUT_WR)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except socket.timeout:
        pass
    s.close()
    return out


def _errors_logged(d: DaemonProc) -> list[dict]:
    return [e for e in d.logs() if e.get("level") in ("error", "critical") or e.get("event") == "connection_error"]


def test_head_is_answered_with_headers_only(slow_daemon):
    # before: the headers announced a body that never came and a ~3 KB traceback was logged at
    # error level, on the Unix socket and for the TCP listener's 401 alike
    d = slow_daemon.start()
    http_sock = str(d.dir / "http.sock")
    out = _exchange(http_sock, b"HEAD /v1/models HTTP/1.1\r\nHost: npud\r\n\r\n"
                               b"GET /health HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n\r\n")
    head, rest = out.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 405 ") and b"content-length: " in head
    assert rest.startswith(b"HTTP/1.1 200 ")  # no body in between: the next reply follows the headers
    (listening,) = d.events("http_listening")
    host, port = listening["tcp"].rsplit(":", 1)
    out = _exchange((host, int(port)), b"HEAD /v1/models HTTP/1.1\r\nHost: npud\r\n\r\n")
    head, rest = out.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 401 ") and rest == b""
    assert not _errors_logged(d)


def test_content_length_with_transfer_encoding_is_refused_and_closed(slow_daemon):
    # before: the body was read by Transfer-Encoding and the connection kept, so the bytes after
    # the chunked body ran as a second request
    d = slow_daemon.start()
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: npud\r\n\r\n"
    out = _exchange(str(d.dir / "http.sock"),
                    b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\ncontent-length: 4\r\n"
                    b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n" + smuggled)
    assert out.startswith(b"HTTP/1.1 400 ") and out.count(b"HTTP/1.1 ") == 1
    assert b"Transfer-Encoding" in out


def test_a_client_that_pipelines_too_much_and_leaves_cancels_its_request(slow_daemon):
    # before: past limits.max_line_bytes of pipelined data the connection was no longer read, so
    # its disconnect went unnoticed and the job ran on for nobody
    import socket
    d = slow_daemon.start()
    body = json.dumps({"model": "fake", "prompt": "x", "max_tokens": 4000}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.dir / "http.sock"))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    with d.client() as c:
        wait_for(lambda: c.jobs(["running"])["jobs"], 30, what="the job to run")
        s.sendall(b"G" * (2 * 65536 + 1))  # more than limits.max_line_bytes of a next "request"
        s.close()
        (job,) = wait_for(lambda: c.jobs(["cancelled"])["jobs"], 30, what="the job to be cancelled")
        assert job["tokens"] < 4000


# -- restarts ---------------------------------------------------------------------------------------

def test_interactive_jobs_orphaned_by_kill9_are_cancelled_not_rerun(slow_daemon):
    # before: an HTTP or `complete` job was requeued by the restart and run to its end for nobody
    import threading
    d = slow_daemon.start()
    http_sock = str(d.dir / "http.sock")
    out: list = []
    threads = [threading.Thread(target=_socket_complete, args=(d.socket, out)),
               threading.Thread(target=_http_post, args=(http_sock, {"model": "fake", "prompt": "x",
                                                                     "max_tokens": 4000}, out))]
    for t in threads:
        t.start()
    with d.client() as c:
        batch = c.submit(["y"], max_tokens=5)["job"]  # a batch job: it is run after the restart
        wait_for(lambda: len(c.jobs(["queued", "running"])["jobs"]) == 3, 30, what="three jobs")
    d.kill9()
    for t in threads:
        t.join(30)
    d.start()
    with d.client() as c:
        states = {j["job"]: j for j in c.jobs()["jobs"]}
        wait_for(lambda: c.status(batch)["state"] == "done", 30, what="the batch job")
        interactive = [j for j in c.jobs()["jobs"] if j["job"] != batch]
    assert len(interactive) == 2 and {j["state"] for j in interactive} == {"cancelled"}
    assert {e["job"] for e in d.events("job_orphan_cancelled")} == {j["job"] for j in interactive}
    assert len(states) == 3


async def test_a_failed_job_stays_failed_across_a_restart(workdir_async, monkeypatch):
    # before: a job that failed on a full disk stayed `running` in the store; the next start
    # ran it again to `done`, so a client that resubmitted on `failed` got the work twice
    import trio
    from npud.clients.client import AsyncClient
    from npud import jobs as jobs_module
    from test_attack_store import DiskFull
    from test_npud_support import make_config, start
    monkeypatch.setattr(jobs_module, "STORE_RETRY_S", 3600.0, raising=False)  # only the drain retries
    disk = DiskFull(monkeypatch, results_left=1)
    cfg = make_config(workdir_async, knobs={"tokens_per_round": 1, "round_sleep_s": 0.005})
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        async with await AsyncClient.connect(cfg.server.socket_path) as c:
            job = (await c.submit(["a", "b", "c"], max_tokens=20))["job"]
            with trio.fail_after(20):
                status = await c.stream(job, tokens=False).wait()
        assert status["state"] == "failed" and daemon.store.job(job)["state"] == "running"
        disk.full = False  # space again, before the stop
        daemon.request_stop()
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        async with await AsyncClient.connect(cfg.server.socket_path) as c:
            status = await c.status(job)
        daemon.request_stop()
    assert status["state"] == "failed" and status["error"]["code"] == "store_full"


@pytest.fixture
def workdir_async():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
