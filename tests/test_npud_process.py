"""npud as it runs: real daemon processes on the tiny model, real sockets, real SQLite.

One daemon is shared by the tests that leave it as they found it (temperature back to
normal, quarantine cleared); the tests that kill, stop or reconfigure a daemon start their
own. Expected texts come from the engine driven directly in this process (greedy decoding is
deterministic), so a result that the daemon lost, duplicated or resumed wrongly shows.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from test_npud_support import KMSG_FOREIGN_ERROR, DaemonProc, short_tempdir, wait_for

pytestmark = pytest.mark.slow  # daemon processes and a model load each: tens of seconds in all

checkpoints = pytest.importorskip("npud.engine.testing.checkpoints", reason="npud/engine/testing/checkpoints.py builds the tiny model")
pytest.importorskip("npud.engine.session", reason="the engine's session API is needed to serve the tiny model")

from npud.clients.client import DeviceQuarantined  # noqa: E402

PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(64)]
LONG_TOKENS = 400  # ~0.1 s of decode per prompt on the tiny model


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return checkpoints.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def reference(tiny_model):
    """prompt, max_tokens -> the text the engine produces for it, driven directly."""
    from npud.engine.api import GenerateRequest, GenerationParams
    from npud.engine.session import LoadedModel

    served = LoadedModel.load("tiny", tiny_model, weight_format="fp32")
    memo: dict = {}

    def run(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in memo:
            session = served.start(GenerateRequest(prompt=prompt, params=GenerationParams(max_tokens=max_tokens)))
            while not session.done:
                session.run_round()
            memo[prompt, max_tokens] = session.result().text
        return memo[prompt, max_tokens]

    return run


def _models(tiny_model):
    return [{"name": "tiny", "checkpoint_dir": str(tiny_model), "weight_format": "fp32"}]


@pytest.fixture
def new_daemon(tiny_model):
    made = []

    def make(**sections) -> DaemonProc:
        sections.setdefault("batching", {"max_batch": 1})  # the ticket rules without batching (see shared)
        d = DaemonProc(short_tempdir(), _models(tiny_model), **sections)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def shared(tiny_model):
    # max_batch 1: tickets, preemption and quanta as they work without batching, one prompt of one
    # job at a time (test_npud_batching_process.py runs daemons that batch)
    d = DaemonProc(short_tempdir(), _models(tiny_model), server={"socket_group": "", "max_connections": 512},
                   batching={"max_batch": 1})
    try:
        d.start()
        with d.client() as c:  # load the model once, so the tests below do not wait for it
            c.complete(PROMPTS[0], max_tokens=1).wait()
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


@pytest.fixture
def daemon(shared):
    """The shared daemon, checked to be back at rest after each test."""
    yield shared
    shared.set_temp(40.0)
    with shared.client() as c:
        c.device_clear()
        wait_for(lambda: c.stats()["granted"] is None and sum(c.stats()["queue"].values()) == 0, 60,
                 what="the shared daemon to be idle")
    assert shared.alive()


# -- helpers --------------------------------------------------------------------------------

def wait_state(client, job: int, states=("done",), timeout: float = 60.0) -> dict:
    def reached():
        status = client.status(job)
        return status if status["state"] in states else None

    return wait_for(reached, timeout,
                    what=f"job {job} to reach {states}")


def check_results(client, job: int, prompts: list[str], max_tokens: int, reference) -> None:
    """Every prompt has exactly one result, and it is the engine's text."""
    results = client.result(job)["results"]
    assert [r["prompt"] for r in results] == list(range(len(prompts)))
    for r in results:
        assert r["text"] == reference(prompts[r["prompt"]], max_tokens), f"prompt {r['prompt']} differs"


def first_token(daemon: DaemonProc, job: int) -> None:
    """Block until the job has produced a token (it holds the device)."""
    with daemon.client() as c:
        for ev in c.stream(job):
            if ev.name == "token":
                return
    raise AssertionError(f"job {job} ended before a token was seen")


def tickets_of(client, job: int) -> list[dict]:
    return sorted(client.tickets(job=job)["tickets"], key=lambda t: t["ticket"])


# -- a job end to end -----------------------------------------------------------------------

def test_full_job_through_the_socket(daemon, reference):
    prompts = PROMPTS[:3]
    with daemon.client() as c:
        hello = c.hello("pytest")
        assert hello["protocol"] == 1 and hello["models"] == ["tiny"] and hello["device"]["kind"] == "host"
        job = c.submit(prompts, max_tokens=24)
        assert job["state"] == "queued" and job["num_prompts"] == 3
        stream = c.stream(job["job"])
        events = list(stream)
        assert stream.result["state"] == "done" and stream.result["done_prompts"] == 3
        streamed = {}
        for ev in events:
            if ev.name == "token":
                streamed[ev.data["prompt"]] = streamed.get(ev.data["prompt"], "") + ev.data["text"]
        assert [e.data["prompt"] for e in events if e.name == "progress" and "prompt" in e.data] == [0, 1, 2]
        check_results(c, job["job"], prompts, 24, reference)
        results = c.result(job["job"])["results"]
        # a stream that began after the first tokens holds a suffix of each prompt's text
        assert all(results[i]["text"].endswith(text) for i, text in streamed.items())
        assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 24 for r in results)
        [ticket] = c.tickets(job=job["job"])["tickets"]
        assert ticket["outcome"] == "done" and ticket["tokens"] == 72
        assert ticket["errors_at_grant"] == ticket["errors_at_release"] == 0
        assert ticket["queued_at"] <= ticket["granted_at"] <= ticket["released_at"]
        assert ticket["thermal_c"] == 40.0
        assert job["job"] in [j["job"] for j in c.jobs()["jobs"]]
        # an interactive completion streams the same text the batch job produced
        completion = c.complete(prompts[1], max_tokens=24)
        tokens = "".join(e.data["text"] for e in completion if e.name == "token")
        assert completion.result["text"] == tokens == results[1]["text"]
    names = {e["event"] for e in daemon.logs()}
    assert {"job_accepted", "ticket_queued", "ticket_granted", "ticket_released", "job_done"} <= names


# -- ordering, preemption, cancellation ------------------------------------------------------

def test_interactive_before_batch_fifo_within_a_class(daemon, reference):
    with daemon.client() as c:
        daemon.set_temp(95.0)  # held for heat: everything queues, nothing is granted
        wait_for(lambda: c.device_status()["thermal"]["state"] == "hold", what="thermal hold")
        b1 = c.submit(PROMPTS[:2], max_tokens=8)["job"]
        b2 = c.submit(PROMPTS[2:4], max_tokens=8)["job"]
        i1 = c.submit([PROMPTS[4]], max_tokens=8, priority="interactive")["job"]
        b3 = c.submit(PROMPTS[5:6], max_tokens=8)["job"]
        i2 = c.submit([PROMPTS[6]], max_tokens=8, priority="interactive")["job"]
        order = [i1, i2, b1, b2, b3]
        assert [c.status(j)["queue_position"] for j in order] == [0, 1, 2, 3, 4]
        time.sleep(0.3)
        assert all(c.status(j)["state"] == "queued" for j in order)
        daemon.set_temp(80.0)
        for j in order:
            wait_state(c, j)
        granted = sorted((t["granted_at"], t["job"]) for j in order for t in tickets_of(c, j))
        assert [j for _, j in granted] == order
        check_results(c, b2, PROMPTS[2:4], 8, reference)


def test_batch_yields_to_interactive_at_a_round_boundary_and_resumes_its_state(daemon, reference):
    prompts = PROMPTS[8:20]
    with daemon.client() as c:
        batch = c.submit(prompts, max_tokens=LONG_TOKENS)["job"]
        first_token(daemon, batch)
        completion = c.complete(PROMPTS[30], max_tokens=16).wait()
        assert completion["text"] == reference(PROMPTS[30], 16)
        assert c.status(batch)["state"] in ("queued", "running"), "the batch job ended before the interactive one"
        [interactive] = tickets_of(c, completion["job"])
        first = tickets_of(c, batch)[0]
        assert first["outcome"] == "preempted" and first["reason"] == "interactive_waiting"
        assert first["tokens"] > 0
        assert interactive["granted_at"] >= first["released_at"]
        wait_state(c, batch)
        tickets = tickets_of(c, batch)
        assert len(tickets) >= 2 and tickets[-1]["outcome"] == "done"
        # the tokens made under each hold add up to the results: nothing redone, nothing skipped
        results = c.result(batch)["results"]
        assert sum(t["tokens"] for t in tickets) == sum(len(r["token_ids"]) for r in results)
        check_results(c, batch, prompts, LONG_TOKENS, reference)


def test_batch_jobs_share_the_device_a_quantum_at_a_time(new_daemon, reference):
    quantum = 64
    d = new_daemon(scheduler={"quantum_tokens": quantum, "quantum_ms": 600000.0}).start()
    with d.client() as c:
        a = c.submit(PROMPTS[:3], max_tokens=200)["job"]
        b = c.submit(PROMPTS[3:6], max_tokens=200)["job"]
        wait_state(c, a)
        wait_state(c, b)
        tickets = sorted(tickets_of(c, a) + tickets_of(c, b), key=lambda t: t["granted_at"])
        # alternating holds; each preempted hold ended at the first round boundary past the quantum
        assert [t["job"] for t in tickets[:4]] == [a, b, a, b]
        preempted = [t for t in tickets if t["outcome"] == "preempted"]
        assert preempted and all(t["reason"] == "quantum" for t in preempted)
        assert all(quantum <= t["tokens"] <= quantum + 16 for t in preempted), [t["tokens"] for t in preempted]
        check_results(c, a, PROMPTS[:3], 200, reference)
        check_results(c, b, PROMPTS[3:6], 200, reference)


def test_cancel_queued_and_running_jobs(daemon, reference):
    with daemon.client() as c:
        running = c.submit(PROMPTS[20:32], max_tokens=LONG_TOKENS)["job"]
        queued = c.submit(PROMPTS[:2], max_tokens=8)["job"]
        first_token(daemon, running)
        reply = c.cancel(queued)
        assert reply["cancelled"] and reply["state"] == "cancelled"
        [t] = tickets_of(c, queued)
        assert t["outcome"] == "cancelled" and t["granted_at"] is None
        reply = c.cancel(running)
        assert reply["cancelled"] and reply["cancel_requested"]
        status = wait_state(c, running, ("cancelled",), 10)
        assert status["done_prompts"] < 12
        tickets = tickets_of(c, running)
        assert tickets[-1]["outcome"] == "cancelled"
        results = c.result(running)["results"]
        assert [r["prompt"] for r in results] == list(range(len(results)))
        assert results[-1]["finish_reason"] == "cancelled"
        full = reference(PROMPTS[20 + len(results) - 1], LONG_TOKENS)
        assert full.startswith(results[-1]["text"]) and len(results[-1]["text"]) < len(full)
        for r in results[:-1]:
            assert r["text"] == reference(PROMPTS[20 + r["prompt"]], LONG_TOKENS)
        assert c.cancel(running)["cancelled"] is False  # already over
        assert c.result(queued)["results"] == []


# -- guards ---------------------------------------------------------------------------------

def test_thermal_guard_holds_resumes_and_aborts(daemon, reference):
    prompts = PROMPTS[32:44]
    with daemon.client() as c:
        daemon.set_temp(95.0)
        wait_for(lambda: c.device_status()["thermal"]["state"] == "hold", what="thermal hold")
        job = c.submit(prompts, max_tokens=LONG_TOKENS)["job"]
        time.sleep(0.3)
        assert c.status(job)["state"] == "queued" and c.tickets(job=job)["tickets"][0]["state"] == "queued"
        daemon.set_temp(87.0)  # below hold but above resume: still held (hysteresis)
        time.sleep(0.3)
        assert c.status(job)["state"] == "queued"
        daemon.set_temp(80.0)
        first_token(daemon, job)
        daemon.set_temp(101.0)  # abort: stop at the next round boundary and requeue
        wait_for(lambda: any(t["reason"] == "thermal" for t in tickets_of(c, job)), 10, what="thermal abort")
        aborted = next(t for t in tickets_of(c, job) if t["reason"] == "thermal")
        assert aborted["outcome"] == "preempted" and aborted["tokens"] > 0 and aborted["thermal_c"] == 80.0
        time.sleep(0.3)
        status = c.status(job)
        assert status["state"] == "queued" and status["done_prompts"] < len(prompts)
        daemon.set_temp(50.0)
        wait_state(c, job)
        check_results(c, job, prompts, LONG_TOKENS, reference)
    events = [e["event"] for e in daemon.logs()]
    assert {"guard_thermal_hold", "guard_thermal_resume", "guard_thermal_abort"} <= set(events)


def test_amdxdna_errors_fault_the_ticket_and_quarantine_the_device(daemon, reference):
    prompts = PROMPTS[44:56]
    with daemon.client() as c:
        job = c.submit(prompts, max_tokens=LONG_TOKENS)["job"]
        first_token(daemon, job)
        daemon.add_kmsg("usb 1-1: new high-speed USB device")  # not an amdxdna error
        daemon.add_kmsg(KMSG_FOREIGN_ERROR)  # another process's: counted apart, no fault
        daemon.add_kmsg(daemon.kmsg_error)
        # the quarantine is set before the faulted ticket is released (nothing is granted in
        # between), so wait for both
        wait_for(lambda: c.device_status()["quarantine"]
                 and any(t["outcome"] == "faulted" for t in tickets_of(c, job)),
                 10, what="quarantine and the faulted ticket")
        faulted = [t for t in tickets_of(c, job) if t["outcome"] == "faulted"]
        assert len(faulted) == 1
        assert faulted[0]["errors_at_release"] == faulted[0]["errors_at_grant"] + 1
        assert faulted[0]["fault_lines"] == [daemon.kmsg_error]
        quarantine = c.device_status()["quarantine"]
        assert quarantine["ticket"] == faulted[0]["ticket"] and quarantine["lines"] == [daemon.kmsg_error]
        assert c.device_status()["errors"]["foreign_count"] == 1
        # nothing dropped: the job waits, new batch work is accepted and waits, interactive work is refused
        other = c.submit(PROMPTS[:2], max_tokens=8)["job"]
        with pytest.raises(DeviceQuarantined):
            c.complete(PROMPTS[0], max_tokens=4).wait()
        time.sleep(0.3)
        assert c.status(job)["state"] == "queued" and c.status(other)["state"] == "queued"
        done_before = c.status(job)["done_prompts"]
        assert done_before < len(prompts)
        assert c.device_clear() == {"cleared": True}
        wait_state(c, job)
        wait_state(c, other)
        check_results(c, job, prompts, LONG_TOKENS, reference)
        check_results(c, other, PROMPTS[:2], 8, reference)
        assert c.device_status()["quarantine"] is None
    assert {"guard_device_fault", "device_quarantined", "device_cleared"} <= {e["event"] for e in daemon.logs()}


# -- crashes, stops, reloads ----------------------------------------------------------------

def test_kill_9_during_a_batch_job_then_restart_loses_and_duplicates_nothing(new_daemon, reference):
    d = new_daemon().start()
    jobs = {}
    with d.client() as c:
        for name, chunk in (("a", PROMPTS[:16]), ("b", PROMPTS[16:20]), ("c", PROMPTS[20:22])):
            jobs[name] = (c.submit(chunk, max_tokens=LONG_TOKENS)["job"], chunk)
        job_a = jobs["a"][0]
        wait_for(lambda: c.status(job_a)["done_prompts"] >= 2, 60, what="two prompts done")
    d.kill9()
    d.start()
    with d.client() as c:
        before = c.status(job_a)["done_prompts"]
        assert 2 <= before < 16
        for job, chunk in jobs.values():
            wait_state(c, job)
            check_results(c, job, chunk, LONG_TOKENS, reference)
        interrupted = [t for t in tickets_of(c, job_a) if t["reason"] == "restart"]
        assert len(interrupted) == 1 and interrupted[0]["outcome"] == "preempted"
    assert d.events("job_requeued")


def test_a_job_with_per_prompt_settings_keeps_them_across_a_kill_9(new_daemon, reference):
    """One job whose prompts have their own max_tokens: each result is its own prompt's
    text, also for the prompts that ran after the restart read the job back from the store."""
    d = new_daemon().start()
    prompts = PROMPTS[:24]
    own = [None if i % 3 == 0 else 60 + 9 * i for i in range(len(prompts))]  # None: the job's
    lengths = [LONG_TOKENS if n is None else n for n in own]
    with d.client() as c:
        job = c.submit(prompts, max_tokens=LONG_TOKENS,
                       prompt_settings=[None if n is None else {"max_tokens": n} for n in own])["job"]
        wait_for(lambda: c.status(job)["done_prompts"] >= 2, 60, what="two prompts done")
    d.kill9()
    d.start()
    with d.client() as c:
        assert c.status(job)["done_prompts"] < len(prompts)  # some prompts run after the restart
        wait_state(c, job)
        results = c.result(job)["results"]
    assert [r["prompt"] for r in results] == list(range(len(prompts)))
    for r, prompt, n in zip(results, prompts, lengths):
        assert r["text"] == reference(prompt, n), f"prompt {r['prompt']} differs"
        assert len(r["token_ids"]) == n if r["finish_reason"] == "length" else len(r["token_ids"]) < n
    assert sum(r["finish_reason"] == "length" for r in results) >= len(prompts) // 2  # the limits did bite
    assert d.events("job_requeued")


def test_sigterm_drains_requeues_and_the_next_start_resumes(new_daemon, reference):
    d = new_daemon().start()
    prompts = PROMPTS[:16]
    with d.client() as c:
        job = c.submit(prompts, max_tokens=LONG_TOKENS)["job"]
        first_token(d, job)
    assert d.terminate() == 0
    released = [e for e in d.events("ticket_released") if e.get("reason") == "shutdown"]
    assert len(released) == 1 and released[0]["outcome"] == "preempted"
    assert not any(e["event"] == "shutdown_deadline_passed" for e in d.logs())
    d.start()
    with d.client() as c:
        wait_state(c, job)
        check_results(c, job, prompts, LONG_TOKENS, reference)
        assert [t["reason"] for t in tickets_of(c, job)][0] == "shutdown"


def test_sighup_reloads_limits_and_keeps_the_socket(new_daemon):
    d = new_daemon().start()
    with d.client() as c:
        assert c.hello()["limits"]["max_tokens"] == 4096
        d.write_config(limits={"max_tokens": 8}, server={"socket_path": d.socket + ".other"})
        d.hup()
        wait_for(lambda: d.events("config_reloaded"), 10, what="the reload")
        assert c.hello()["limits"]["max_tokens"] == 8
        assert d.events("config_reloaded")[-1]["ignored"] == ["server.socket_path"]
        d.write_config(thermal={"hold_above_c": 10.0, "resume_below_c": 20.0})  # invalid: kept the old one
        d.hup()
        wait_for(lambda: d.events("config_reload_failed"), 10, what="the failed reload")
        assert c.device_status()["thermal"]["hold_above_c"] == 90.0
    with d.client() as c:  # same socket
        assert c.stats()["quarantined"] is False


# -- bad input -------------------------------------------------------------------------------

def _exchange(sock, data: bytes) -> dict:
    sock.sendall(data)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "npud closed the connection"
        buf += chunk
    return json.loads(buf.split(b"\n")[0])


def test_bad_input_gets_a_code_and_the_connection_carries_on(daemon):
    with daemon.raw() as s:
        cases = [
            (b"not json\n", None, "bad_request"),
            (b"[1, 2]\n", None, "bad_request"),
            (b'{"id": 1, "method": "hello", "params": {"client": "\xff\xfe"}}\n', None, "bad_request"),
            (b'{"id": 2, "method": "launch_missiles"}\n', 2, "unknown_method"),
            (b'{"id": 3, "method": "status", "params": {"job": "42"}}\n', 3, "bad_request"),
            (b'{"id": 4, "method": "submit", "params": {"prompts": [1]}}\n', 4, "bad_request"),
            (b'{"id": 5, "method": "submit", "params": {"prompts": ["x"], "max_tokens": "many"}}\n', 5, "bad_request"),
            (b'{"id": 6, "method": "submit", "params": {"prompts": ["x"], "temprature": 1}}\n', 6, "bad_request"),
            (b'{"id": 7, "method": "status", "params": {"job": 999999}}\n', 7, "not_found"),
            (b'{"id": 8, "method": "submit", "params": {"prompts": ["x"], "model": "gpt-9"}}\n', 8, "not_found"),
            (b'{"id": 9, "method": "device.clear", "params": [1]}\n', 9, "bad_request"),
            (b'{"id": true, "method": "hello"}\n', None, "bad_request"),
            (b"x" * 70000 + b"\n", None, "line_too_long"),
        ]
        for data, req_id, code in cases:
            reply = _exchange(s, data)
            assert reply["ok"] is False and reply["id"] == req_id and reply["error"]["code"] == code, (data[:60], reply)
            assert reply["error"]["message"]
        assert "params.job" in _exchange(s, b'{"id": 10, "method": "status", "params": {"job": "1"}}\n')["error"]["message"]
        assert _exchange(s, b'{"id": 11, "method": "hello"}\n')["ok"] is True
    assert daemon.alive()


def test_a_client_that_disconnects_mid_stream_cancels_its_completion(daemon):
    with daemon.raw() as s:
        s.sendall(json.dumps({"id": 1, "method": "complete",
                              "params": {"prompt": PROMPTS[60], "max_tokens": LONG_TOKENS}}).encode() + b"\n")
        buf = b""
        while b'"token"' not in buf:
            buf += s.recv(4096)
        job = json.loads(buf.split(b"\n")[0])["data"]["job"]
    with daemon.client() as c:
        status = wait_state(c, job, ("cancelled",), 10)
        assert status["done_prompts"] <= 1
        assert c.hello()["protocol"] == 1


def test_two_hundred_concurrent_clients(daemon):
    import trio

    from npud.clients.client import AsyncClient

    n_clients = 200

    async def main():
        seen = []
        all_connected, all_asked = trio.Event(), trio.Event()
        counts = {"connected": 0, "asked": 0}

        async def one(i):
            async with await AsyncClient.connect(daemon.socket) as c:
                counts["connected"] += 1
                if counts["connected"] == n_clients:
                    all_connected.set()
                await all_connected.wait()
                hello = await c.hello(f"client-{i}")
                stats = await c.stats()
                seen.append((hello["protocol"], stats["connections"]))
                counts["asked"] += 1
                if counts["asked"] == n_clients:
                    all_asked.set()
                await all_asked.wait()  # every connection stays open until all have been served

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for i in range(n_clients):
                    n.start_soon(one, i)
        return seen

    seen = trio.run(main)
    assert len(seen) == n_clients and all(protocol == 1 for protocol, _ in seen)
    assert max(connections for _, connections in seen) >= n_clients
    with daemon.client() as c:
        job = c.submit(PROMPTS[:1], max_tokens=4)["job"]
        assert wait_state(c, job)["state"] == "done"
    assert daemon.alive()


# -- ownership -------------------------------------------------------------------------------

_AS_USER = r"""
import json, sys
from npud.clients import client as npc
out = {}
def attempt(name, fn):
    try:
        value = fn()
        out[name] = ["ok", value]
    except npc.NpudError as exc:
        out[name] = [exc.code, exc.message]
try:
    c = npc.Client(sys.argv[1], timeout=30)
except npc.NpudError as exc:
    print(json.dumps({"connect": [exc.code, exc.message]}))
    raise SystemExit(0)
job = int(sys.argv[2])
attempt("hello", lambda: c.hello("other-user"))
attempt("status", lambda: c.status(job))
attempt("result", lambda: c.result(job))
attempt("stream", lambda: c.stream(job).wait())
attempt("cancel", lambda: c.cancel(job))
attempt("jobs", lambda: [j["job"] for j in c.jobs()["jobs"]])
attempt("jobs_all", lambda: c.jobs(all_users=True))
attempt("tickets", lambda: sorted({t["job"] for t in c.tickets()["tickets"]}))
attempt("device_clear", lambda: c.device_clear())
own = c.submit(["mine"], max_tokens=2)["job"]
attempt("own_status", lambda: c.status(own)["owner_uid"])
attempt("own_cancel", lambda: c.cancel(own)["cancelled"])
out["own"] = own
print(json.dumps(out))
"""


@pytest.fixture
def system_users():
    """Create users and groups for a test, and remove them afterwards."""
    import grp
    import pwd
    import subprocess

    made: list[tuple[str, str]] = []

    def group(name: str) -> int:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            subprocess.run(["groupadd", name], check=True, capture_output=True)
            made.append(("groupdel", name))
            return grp.getgrnam(name).gr_gid

    def user(name: str, groups: list[str]) -> int:
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            pass
        args = ["useradd", "--no-create-home", "--no-user-group", "--shell", "/usr/sbin/nologin"]
        if groups:
            args += ["--groups", ",".join(groups)]
        subprocess.run([*args, name], check=True, capture_output=True)
        made.append(("userdel", name))
        return pwd.getpwnam(name).pw_uid

    yield group, user
    for command, name in reversed(made):  # users before the groups they are in
        subprocess.run([command, name], capture_output=True)


def _run_as(uid: int, gid: int, extra_groups: list[int], argv: list[str]):
    """Run the client script as another user with an interpreter that user can execute."""
    import subprocess
    import sys

    from test_npud_support import REPO

    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run([python, "-c", "import npud.clients.client"], user=uid, group=gid,
                                   extra_groups=extra_groups, env=env, capture_output=True, cwd="/")
        except PermissionError:  # the interpreter is under a directory that user cannot enter
            continue
        if probe.returncode == 0:
            done = subprocess.run([python, "-c", _AS_USER, *argv], user=uid, group=gid, extra_groups=extra_groups,
                                  env=env, capture_output=True, text=True, cwd="/", timeout=120)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)
    pytest.skip(f"no Python interpreter that uid {uid} may run can import the client (tried {sys.executable})")


def test_another_uid_cannot_read_or_cancel_a_job(new_daemon, system_users):
    import os
    import pwd
    import shutil as sh

    if os.geteuid() != 0 or sh.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    group, user = system_users
    sock_gid = group("npudtest-sock")
    member = user("npudtest-member", ["npudtest-sock"])
    outsider = user("npudtest-outsider", [])
    member_gid, outsider_gid = pwd.getpwuid(member).pw_gid, pwd.getpwuid(outsider).pw_gid
    d = new_daemon(server={"socket_group": "npudtest-sock", "admin_group": "npudtest-admins-absent"}).start()
    st = os.stat(d.socket)
    assert st.st_mode & 0o777 == 0o660 and st.st_gid == sock_gid
    d.set_temp(95.0)  # jobs stay queued: cancellation is meaningful and no model needs loading
    with d.client() as c:
        wait_for(lambda: c.device_status()["thermal"]["state"] == "hold", what="thermal hold")
        job = c.submit(PROMPTS[:2], max_tokens=8)["job"]
        seen = _run_as(member, member_gid, [sock_gid], [d.socket, str(job)])
        assert seen["hello"][0] == "ok" and seen["hello"][1]["uid"] == member and not seen["hello"][1]["admin"]
        for name in ("status", "result", "stream", "cancel"):  # as if it did not exist (issue 17)
            assert seen[name] == ["not_found", f"no job {job}"], (name, seen[name])
        for name in ("jobs_all", "device_clear"):
            assert seen[name][0] == "forbidden", (name, seen[name])
        assert job not in seen["jobs"][1]
        assert seen["tickets"] == ["ok", []]  # asked before it had a job: root's ticket is not shown
        assert seen["own_status"] == ["ok", member] and seen["own_cancel"] == ["ok", True]
        assert c.status(job)["state"] == "queued"  # untouched by the other user
        assert c.status(seen["own"])["owner_uid"] == member  # root reads anyone's job
        assert c.cancel(job)["cancelled"] is True
        refused = _run_as(outsider, outsider_gid, [], [d.socket, str(job)])
        assert refused["connect"][0] == "permission_denied"
