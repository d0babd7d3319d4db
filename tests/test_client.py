"""The client library: both APIs against a daemon, error codes to exception classes, and
what a user sees when npud is not there."""

from __future__ import annotations

import errno
import os
import shutil
import socket

import pytest
import trio

import test_npud_support as fakes
from npud.clients import client as npc
from npud.protocol import ErrorCode
from test_npud_support import make_config, start


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_every_error_code_has_its_exception_class():
    assert set(npc.ERRORS) == {code.value for code in ErrorCode}
    for code, cls in npc.ERRORS.items():
        exc = npc.error_from_wire({"code": code, "message": "m"})
        assert type(exc) is cls and exc.code == code and exc.message == "m" and isinstance(exc, npc.NpudError)
    assert isinstance(npc.error_from_wire({"code": "store_full", "message": ""}), npc.StoreError)
    unknown = npc.error_from_wire({"code": "from_the_future", "message": "new"})
    assert type(unknown) is npc.NpudError and unknown.code == "from_the_future"


def test_a_missing_socket_says_npud_is_not_running_and_how_to_start_it(tmp_path):
    with pytest.raises(npc.NotRunning) as info:
        npc.Client(str(tmp_path / "npud.sock"))
    assert "not running" in info.value.message and "systemctl start npud" in info.value.message
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file is there, nobody listens
    with pytest.raises(npc.NotRunning):
        npc.Client(str(stale))


def test_a_path_that_is_not_a_socket_says_so(tmp_path):
    # connecting to a regular file is ECONNREFUSED, the same errno as a socket nobody listens at
    regular = tmp_path / "npud.sock"
    regular.write_text("")
    for path, what in ((regular, "a regular file"), (tmp_path, "a directory")):
        with pytest.raises(npc.NotASocket) as info:
            npc.Client(str(path))
        assert info.value.code == "not_a_socket" and isinstance(info.value, npc.NotRunning)
        assert info.value.message.startswith(f"{path} is not a socket ({what}); point NPUD_SOCKET or --socket")
        assert "not running" not in info.value.message and "nothing listens" not in info.value.message


async def test_the_trio_client_says_so_too(tmp_path):
    with pytest.raises(npc.NotRunning):
        await npc.AsyncClient.connect(str(tmp_path / "npud.sock"))


def test_permission_errors_say_which_group(tmp_path):
    exc = npc._connect_error("/run/npud/npud.sock", PermissionError(errno.EACCES, "Permission denied"))
    assert isinstance(exc, npc.PermissionDenied) and "group" in exc.message


def test_the_socket_path_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NPUD_SOCKET", "/tmp/elsewhere.sock")
    assert npc.default_socket_path() == "/tmp/elsewhere.sock"
    monkeypatch.delenv("NPUD_SOCKET")
    assert npc.default_socket_path() == npc.DEFAULT_SOCKET


def test_framing_matches_replies_to_requests():
    f = npc.Framing()
    req_id, data = f.request("status", {"job": 3, "unused": None})
    assert data == b'{"id":1,"method":"status","params":{"job":3}}\n'
    f.feed(b'{"id":1,"event":"token","data":{"text":"a"}}\n{"id":1,"ok":true,"res')
    assert npc.Framing.interpret(req_id, f.next_message()) == npc.Event("token", {"text": "a"})
    assert f.next_message() is None
    f.feed(b'ult":{"x":1}}\n')
    assert npc.Framing.interpret(req_id, f.next_message()) == ("result", {"x": 1})
    with pytest.raises(npc.Forbidden, match="nope"):
        npc.Framing.interpret(2, {"id": 2, "ok": False, "error": {"code": "forbidden", "message": "nope"}})
    with pytest.raises(npc.BadRequest):  # a reply without an id: the daemon could not read the request
        npc.Framing.interpret(2, {"id": None, "ok": False, "error": {"code": "bad_request", "message": "x"}})
    with pytest.raises(npc.ConnectionLost):
        npc.Framing.interpret(2, {"id": 9, "ok": True, "result": {}})


async def test_sync_client_methods_against_a_daemon(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    path = daemon.cfg.server.socket_path

    def session():
        out = {}
        with npc.Client(path, timeout=30) as c:
            out["hello"] = c.hello("test")
            job = c.submit(["one", "two"], max_tokens=3, sampling={"temperature": 0.0}, stop=["never"],
                           spec={"method": "none"}, use_prefix_cache=False)["job"]
            stream = c.stream(job)
            out["events"] = [e.name for e in stream]
            out["final"] = stream.result
            out["result"] = c.result(job, prompts=[1])
            out["status"] = c.status(job)
            out["jobs"] = c.jobs(state="done", limit=5)
            out["tickets"] = c.tickets(job=job, outcome="done")
            completion = c.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            out["tokens"] = [e.data["text"] for e in completion if e.name == "token"]
            out["completion"] = completion.result
            out["device"] = c.device_status()
            out["models"] = c.models()
            out["stats"] = c.stats()
            out["call"] = c.call("hello")
            with pytest.raises(npc.UnknownMethod):
                c.call("nope")
            with pytest.raises(npc.BadRequest, match="prompts"):
                c.submit(["x"], chats=[[{"role": "user", "content": "y"}]])
            out["cancel"] = c.cancel(c.submit(["z"], max_tokens=2)["job"])
        return out

    out = await trio.to_thread.run_sync(session)
    assert out["hello"]["models"] == ["fake"] and out["call"]["protocol"] == 1
    assert out["events"][0] == "progress" and out["final"]["state"] == "done"
    assert out["result"]["results"] == [
        {"prompt": 1, "text": fakes.expected_text("two", 3), "token_ids": [fakes.token_id("two", i) for i in range(3)],
         "prompt_tokens": 1, "finish_reason": "length", "max_tokens_clamped_to": None,
         "stats": {"rounds": 3, "drafted": 0, "accepted": 0}}]
    assert out["status"]["done_prompts"] == 2 and out["jobs"]["jobs"][0]["state"] == "done"
    assert [t["outcome"] for t in out["tickets"]["tickets"]] == ["done"]
    assert "".join(out["tokens"]) == out["completion"]["text"] == fakes.expected_text("user: hi", 2)
    assert out["device"]["kind"] == "host" and out["models"]["models"][0]["name"] == "fake"
    assert out["stats"]["jobs"]["done"] == 2
    assert out["cancel"]["job"] > 0
    daemon.request_stop()


async def test_trio_client_streams_and_raises_by_code(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    async with await npc.AsyncClient.connect(daemon.cfg.server.socket_path) as c:
        completion = c.complete("hello there", max_tokens=4)
        names = [e.name async for e in completion]
        assert names[:2] == ["ticket", "ticket"] and "token" in names
        assert completion.result["text"] == fakes.expected_text("hello there", 4)
        # the answer is the job's one result exactly as the store keeps it
        [stored] = (await c.result(completion.result["job"]))["results"]
        assert completion.result == {"job": completion.result["job"], **stored} and stored["prompt"] == 0
        with pytest.raises(npc.NotFound):
            await c.status(424242)
        with pytest.raises(npc.BadRequest, match="max_tokens"):
            await c.submit(["x"], max_tokens=0)
    daemon.request_stop()


def test_a_daemon_that_goes_away_is_a_connection_lost(tmp_path):
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    c = npc.Client(path, timeout=5)
    conn, _ = server.accept()
    conn.close()
    server.close()
    with pytest.raises(npc.ConnectionLost):
        c.hello()
    c.close()
    os.unlink(path)
