"""npud under attack, at the connection level (issue 17): idle and line deadlines, the
per-uid connection cap and the admin's reserved slots. An in-process daemon on the fake
engine for the timing paths; a daemon process and clients running as other uids for the caps.
Real sockets throughout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import trio

import test_npud_support as fakes
from npud.clients.client import AsyncClient
from test_npud_support import DaemonProc, make_config, start, write_fake_checkpoint

pytestmark = pytest.mark.hog  # run again under a CPU hog by .ci/run


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def read_until_closed(stream: trio.SocketStream, limit_s: float) -> bytes:
    """Everything the daemon sends until it closes (or resets) the connection; fails after limit_s."""
    data = b""
    with trio.fail_after(limit_s):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # a reset after the data: the close raced bytes we still sent
                return data
            if not chunk:
                return data
            data += chunk


async def test_a_connection_that_sent_requests_still_closes_when_idle(nursery, workdir):
    # before: the deadline was infinite while a request was in flight and was never recomputed,
    # so one `hello` let a connection hold its slot for ever
    daemon = await start(nursery, make_config(workdir, server={"idle_timeout_s": 0.3}))
    async with await trio.open_unix_socket(daemon.cfg.server.socket_path) as stream:
        await stream.send_all(b'{"id": 1, "method": "hello"}\n')
        data = await read_until_closed(stream, 60)
    assert json.loads(data)["ok"] is True  # the reply, then the close
    daemon.request_stop()


async def test_a_line_dripped_byte_by_byte_times_out_from_its_first_byte(nursery, workdir):
    # before: line_timeout_s was applied per received chunk, so a slowloris client kept a line open
    daemon = await start(nursery, make_config(workdir, server={"line_timeout_s": 0.5}))
    received = b""

    async def drip(stream: trio.SocketStream):
        try:
            await stream.send_all(b'{"id": 1, "method": "hello", "params": {"client": "')
            while True:  # a byte every 0.05 s, well within the limit each, for ever
                await stream.send_all(b"x")
                await trio.sleep(0.05)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the daemon closed the connection: a send may race its close (a reset on a busy machine)

    async with await trio.open_unix_socket(daemon.cfg.server.socket_path) as stream:  # closed whatever happens
        async with trio.open_nursery() as n:
            n.start_soon(drip, stream)
            received = await read_until_closed(stream, 60)
            n.cancel_scope.cancel()
    reply = json.loads(received.split(b"\n")[0])
    assert reply["error"]["code"] == "bad_request" and "did not end within 0.5 s" in reply["error"]["message"]
    daemon.request_stop()


# -- the per-uid cap, with real uids --------------------------------------------------------------

HOLDER = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
held, out = [], []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(1.0)
    try:
        data = s.recv(4096)  # a refusal comes at once; an accepted connection says nothing
    except socket.timeout:
        held.append(s)
        out.append(None)
        continue
    out.append(json.loads(data)["error"] if data else "closed")
    s.close()
s = held[0] if held else None
if s is not None:  # an accepted connection still answers
    s.settimeout(10.0)
    s.sendall(b'{"id": 1, "method": "hello"}\n')
    out.append(json.loads(s.recv(65536))["result"]["uid"])
print(json.dumps(out), flush=True)
sys.stdin.read()  # hold the connections until the test closes stdin
"""

OTHER_UID, ATTACKER_UID = 64001, 64002  # any uid without a passwd entry is an ordinary user
NOGROUP = 65534


def hold_as(uid: int, path: str, n: int) -> tuple[subprocess.Popen, list]:
    """A process of `uid` (group nogroup) that opens n connections and holds the accepted ones;
    returns it and, per connection, None (held) or the refusal; then the uid a `hello` saw."""
    proc = subprocess.Popen(["/usr/bin/python3", "-c", HOLDER, path, str(n)], user=uid, group=NOGROUP,
                            extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin"}, cwd="/")
    line = proc.stdout.readline()
    assert line, f"the holder as uid {uid} failed (exit {proc.poll()})"
    return proc, json.loads(line)


def release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to run clients as other uids) and /usr/bin/python3")
def test_one_uid_cannot_lock_out_another_or_root():
    workdir = fakes.short_tempdir()
    checkpoint = write_fake_checkpoint(workdir / "fake", tokens_per_round=2)
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True,
                   server={"socket_group": "nogroup", "admin_group": "npud-test-no-such-group",
                           "max_connections": 8, "max_connections_per_uid": 3, "admin_reserved_connections": 2})
    procs = []
    try:
        d.start()
        attacker, seen = hold_as(ATTACKER_UID, d.socket, 5)
        procs.append(attacker)
        assert seen[:3] == [None, None, None] and seen[5] == ATTACKER_UID
        for refusal in seen[3:5]:
            assert refusal["code"] == "overloaded" and "server.max_connections_per_uid" in refusal["message"]
        victim, seen = hold_as(OTHER_UID, d.socket, 4)  # 3 + 3 = 6 = 8 - 2 reserved
        procs.append(victim)
        assert seen[:3] == [None, None, None] and seen[4] == OTHER_UID
        assert seen[3]["code"] == "overloaded"
        # every unreserved slot is taken: root still gets the reserved ones
        with d.client() as c:
            assert c.hello()["admin"] is True
    finally:
        for p in procs:
            release(p)
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
