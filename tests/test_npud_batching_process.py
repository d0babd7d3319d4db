"""Batching as it runs: daemon processes on the real tiny model that batch (max_batch 8), real
sockets (the protocol's and the HTTP front end's), real SQLite. Every output is compared with the
engine run alone on the same prompt (test_npud_process.reference), so a sequence whose text
depended on its neighbours, or a result lost, duplicated or resumed wrongly, shows."""

from __future__ import annotations

import shutil
import threading

import pytest

from test_npud_support import DaemonProc, short_tempdir, wait_for

pytestmark = pytest.mark.slow  # daemon processes and model loads: tens of seconds

pytest.importorskip("npud.engine.session", reason="the engine's session API is needed to serve the tiny model")
httpx = pytest.importorskip("httpx2")

from test_npud_process import PROMPTS, check_results, reference, tiny_model, wait_state  # noqa: E402,F401

MAX_TOKENS = 160


@pytest.fixture
def batching_daemon(tiny_model):
    made = []

    def make(**sections) -> DaemonProc:
        sections.setdefault("batching", {"max_batch": 8})
        d = DaemonProc(short_tempdir(), [{"name": "tiny", "checkpoint_dir": str(tiny_model),
                                          "weight_format": "fp32"}], **sections)
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


def http_complete(sock: str, prompt: str, max_tokens: int) -> dict:
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://npud", timeout=120) as h:
        reply = h.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_socket_and_http_clients_beside_a_batch_job_each_get_the_text_it_gets_alone(batching_daemon, reference):
    d = batching_daemon()
    batch_prompts = PROMPTS[:12]
    asked = {"socket": [(PROMPTS[40 + i], 24 + 8 * i) for i in range(3)],
             "http": [(PROMPTS[50 + i], 20 + 8 * i) for i in range(2)]}
    got: dict[tuple[str, int], str] = {}
    jobs: list[int] = []
    failures: list[BaseException] = []

    def socket_client(prompt, n):
        with d.client() as c:
            out = c.complete(prompt, max_tokens=n).wait()
        got["socket", asked["socket"].index((prompt, n))] = out["text"]
        jobs.append(out["job"])

    def http_client(prompt, n):
        out = http_complete(str(d.dir / "http.sock"), prompt, n)
        got["http", asked["http"].index((prompt, n))] = out["choices"][0]["text"]
        with d.client() as c:  # the reply names the job by reference; status gives its id
            jobs.append(c.status(out["npud"]["job"])["job"])

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            failures.append(exc)

    with d.client() as c:
        batch = c.submit(batch_prompts, max_tokens=MAX_TOKENS)["job"]
        wait_for(lambda: c.status(batch)["tokens"] >= 8, 120, what="the batch job to run")
        threads = [threading.Thread(target=guarded, args=(socket_client, *a)) for a in asked["socket"]]
        threads += [threading.Thread(target=guarded, args=(http_client, *a)) for a in asked["http"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not failures, failures
        for kind, requests in asked.items():
            for i, (prompt, n) in enumerate(requests):
                assert got[kind, i] == reference(prompt, n), f"{kind} request {i} differs from the prompt run alone"
        wait_state(c, batch, timeout=300)
        check_results(c, batch, batch_prompts, MAX_TOKENS, reference)
        # they shared the batch job's ticket: joined at a round boundary, no preemption
        held = [t for t in c.tickets(job=batch)["tickets"] if t["job"] == batch]
        assert all(t["outcome"] == "done" for t in held)
        riders = {j for t in held for j in t["jobs"]}
        assert set(jobs) <= riders, "an interactive request did not ride the batch job's ticket"
        assert all(c.status(j)["state"] == "done" for j in jobs)


def test_kill_9_mid_batch_resumes_with_every_prompt_once_and_as_alone(batching_daemon, reference):
    d = batching_daemon()
    prompts = PROMPTS[:24]
    with d.client() as c:
        job = c.submit(prompts, max_tokens=MAX_TOKENS)["job"]
        wait_for(lambda: c.status(job)["done_prompts"] >= 3, 180, what="three prompts done")
    d.kill9()
    d.start()
    with d.client() as c:
        before = c.status(job)
        assert 3 <= before["done_prompts"] < len(prompts), "the kill did not land mid-batch"
        [interrupted] = [t for t in c.tickets(job=job)["tickets"] if t["reason"] == "restart"]
        # committed with each result: the interrupted ticket says it ran several prompts at once
        assert len(interrupted["sequences"]) > 3
        status = wait_state(c, job, timeout=300)
        check_results(c, job, prompts, MAX_TOKENS, reference)  # every prompt exactly once, as alone
        results = c.result(job)["results"]
        assert status["tokens"] == sum(len(r["token_ids"]) for r in results)  # no result counted twice
    assert d.events("job_requeued") and not d.events("store_failed")
    assert [e["job"] for e in d.events("job_done")] == [job]
