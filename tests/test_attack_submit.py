"""Lost acknowledgements (issue 17, defect 9): a `submit` whose reply never reaches the client
is retried with the same idempotency key and gets the job the first attempt made, never a
second one. The in-process daemon on the fake engine, real sockets, and a proxy that loses
replies; and the client library against an npud older than the key."""

from __future__ import annotations

import json
import shutil
import socketserver
import threading

import pytest
import trio

import test_npud_support as fakes
from npud.clients.client import AsyncClient, BadRequest, Client
from npud.store import Store
from test_npud_support import make_config, start


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def raw_submit(path: str, params: dict, *, lose_when=None) -> dict | None:
    """One submit on its own connection; its reply, or with `lose_when` (a predicate) None:
    the client goes away without reading once lose_when() holds, and the reply is lost."""
    stream = await trio.open_unix_socket(path)
    await stream.send_all(json.dumps({"id": 1, "method": "submit", "params": params}).encode() + b"\n")
    if lose_when is not None:
        with trio.fail_after(10):
            while not lose_when():
                await trio.sleep(0.005)
        await stream.aclose()
        return None
    data = b""
    with trio.fail_after(10):
        while not data.endswith(b"\n"):
            data += await stream.receive_some(65536)
    await stream.aclose()
    return json.loads(data)


async def test_a_retried_submit_with_the_same_key_gets_the_same_job(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    daemon.queue.set_thermal(hold=True, abort=False)  # keep jobs queued
    path = daemon.cfg.server.socket_path
    params = {"prompts": ["a", "b"], "max_tokens": 3, "idempotency_key": "batch-7"}
    # the job is made, and the client goes away before it reads the acknowledgement
    assert await raw_submit(path, params, lose_when=lambda: daemon.jobs.active) is None
    retry = await raw_submit(path, params)
    assert retry["ok"], retry
    [job] = daemon.jobs.active
    assert retry["result"]["job"] == job and retry["result"]["state"] == "queued"
    again = await raw_submit(path, params)
    assert again["result"]["job"] == job and len(daemon.jobs.active) == 1
    other = await raw_submit(path, {**params, "prompts": ["c"]})
    assert other["error"]["code"] == "bad_request" and "idempotency_key" in other["error"]["message"]
    fresh = await raw_submit(path, {**params, "idempotency_key": "batch-8"})
    assert fresh["result"]["job"] != job and len(daemon.jobs.active) == 2
    daemon.request_stop()


def test_keys_are_per_owner(tmp_path):
    store = Store.open(tmp_path)
    args = dict(priority="batch", interactive=False, model="m", request={}, num_prompts=1, created_at=1.0)
    first = store.insert_job(owner_uid=1, idempotency_key="k", **args)
    second = store.insert_job(owner_uid=2, idempotency_key="k", **args)
    assert first != second
    assert store.job_by_key(1, "k")["job"] == first and store.job_by_key(2, "k")["job"] == second
    assert store.job_by_key(3, "k") is None
    store.close()


async def lossy_proxy(listener: trio.SocketListener, target: str, lose: list[bool]) -> None:
    """Forward connections to `target`; for a connection while lose[0] is set (then cleared),
    pass the request on but close the client's connection instead of passing the reply."""

    async def handle(client: trio.SocketStream) -> None:
        losing, lose[0] = lose[0], False
        upstream = None
        try:
            upstream = await trio.open_unix_socket(target)
            async with trio.open_nursery() as n:
                async def pump(src, dst, drop: bool) -> None:
                    while data := await src.receive_some(65536):
                        if drop:
                            n.cancel_scope.cancel()  # the daemon answered; the client never hears it
                            return
                        await dst.send_all(data)
                    n.cancel_scope.cancel()

                n.start_soon(pump, client, upstream, False)
                n.start_soon(pump, upstream, client, losing)
        finally:
            if upstream is not None:
                upstream.socket.close()
            client.socket.close()

    await trio.serve_listeners(handle, [listener])


async def test_the_client_library_retries_a_lost_submit_with_its_key(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    daemon.queue.set_thermal(hold=True, abort=False)
    sock = trio.socket.socket(trio.socket.AF_UNIX)
    await sock.bind(str(workdir / "proxy.sock"))
    sock.listen()
    lose = [True]  # the first connection loses its replies
    async with trio.open_nursery() as proxy:
        proxy.start_soon(lossy_proxy, trio.SocketListener(sock), daemon.cfg.server.socket_path, lose)
        async with await AsyncClient.connect(str(workdir / "proxy.sock")) as c:
            status = await c.submit(["a"], max_tokens=2)
            assert list(daemon.jobs.active) == [status["job"]]  # the retry got the job, not a second one
            with pytest.raises(BadRequest, match="idempotency_key"):
                await c.submit(["b"], idempotency_key="x" * 129)
        proxy.cancel_scope.cancel()
    daemon.request_stop()


class OldNpud(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """An npud from before `idempotency_key`: it refuses the parameter as unknown (the reply
    npud's Params.finish gave then) and queues a submit without it; `submits` is what it got."""

    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.submits: list[dict] = []
        super().__init__(path, OldNpudHandler)


class OldNpudHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            req = json.loads(line)
            params = req.get("params", {})
            self.server.submits.append(params)
            if "idempotency_key" in params:
                reply = {"id": req["id"], "ok": False, "error": {
                    "code": "bad_request", "message": "params: unknown parameter(s) ['idempotency_key']"}}
            else:
                reply = {"id": req["id"], "ok": True, "result": {"job": len(self.server.submits), "state": "queued"}}
            self.wfile.write(json.dumps(reply).encode() + b"\n")


@pytest.fixture
def old_npud(workdir):
    server = OldNpud(str(workdir / "old.sock"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_client_library_submits_to_an_npud_older_than_the_key(old_npud):
    with Client(old_npud.server_address, timeout=10) as c:
        # before: the bad_request of the unknown key reached the caller; now one more try without it
        assert c.submit(["a"], max_tokens=2) == {"job": 2, "state": "queued"}
    first, second = old_npud.submits
    assert "idempotency_key" in first and "idempotency_key" not in second
    assert {k: v for k, v in first.items() if k != "idempotency_key"} == second


async def test_the_async_client_submits_to_an_npud_older_than_the_key(old_npud):
    async with await AsyncClient.connect(old_npud.server_address) as c:
        assert await c.submit(["a"], max_tokens=2) == {"job": 2, "state": "queued"}
    assert [("idempotency_key" in s) for s in old_npud.submits] == [True, False]


async def test_a_key_reused_for_another_request_is_not_dropped(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    daemon.queue.set_thermal(hold=True, abort=False)
    async with await AsyncClient.connect(daemon.cfg.server.socket_path) as c:
        await c.submit(["a"], max_tokens=2, idempotency_key="k")
        with pytest.raises(BadRequest, match="already used"):  # not sent again without its key
            await c.submit(["b"], max_tokens=2, idempotency_key="k")
    assert len(daemon.jobs.active) == 1
    daemon.request_stop()
