"""The running batch (npud/batch.py, npud/device_owner.py) in a daemon in this process on the fake
engine (tests/test_npud_support.py): who joins a batch and when, priorities, set-asides, the KV
budget, cancellation, faults, and what tickets record. Real sockets and real SQLite; the fake's
run_batch records every round's prompts (fakes.BATCHES), and its tokens are a pure function of
the prompt, so a sequence that saw another's state, or lost or redid a token, shows in its text.
The same through daemon processes on the real tiny model: test_npud_batching_process.py."""

from __future__ import annotations

import shutil

import pytest
import structlog
import trio

import test_npud_support as fakes
from test_npud_support import make_config, start
from npud.clients.client import AsyncClient
from npud.config import DaemonConfigError, parse_config

SLOW = {"tokens_per_round": 1, "round_sleep_s": 0.01}


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    fakes.BATCHES.clear()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def connect(daemon) -> AsyncClient:
    return await AsyncClient.connect(daemon.cfg.server.socket_path)


async def wait_state(client, job, states=("done",), timeout=30):
    with trio.fail_after(timeout):
        while (status := await client.status(job))["state"] not in states:
            await trio.sleep(0.01)
    return status


async def wait_tokens(client, job, at_least):
    with trio.fail_after(20):
        while (await client.status(job))["tokens"] < at_least:
            await trio.sleep(0.005)


async def texts(client, job) -> list[str]:
    results = (await client.result(job))["results"]
    assert [r["prompt"] for r in results] == list(range(len(results)))  # each prompt once, in order
    return [r["text"] for r in results]


async def tickets(client, job) -> list[dict]:
    return sorted((await client.tickets(job=job))["tickets"], key=lambda t: t["ticket"])


async def complete_together(daemon, requests: dict[str, int]) -> dict[str, dict]:
    """`complete` of each prompt (with its max_tokens) on a connection of its own, all at once;
    {prompt: its result}."""
    done = {}

    async def complete(prompt, n):
        async with await connect(daemon) as mine:
            done[prompt] = await mine.complete(prompt, max_tokens=n).wait()

    async with trio.open_nursery() as clients:
        for prompt, n in requests.items():
            clients.start_soon(complete, prompt, n)
    return done


def rounds_with(prompt: str) -> list[list[str]]:
    return [b for b in fakes.BATCHES if prompt in b]


async def test_a_batch_job_runs_max_batch_prompts_a_round_and_each_result_is_its_own(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 2}, batching={"max_batch": 4}))
    prompts = [f"p{i}" for i in range(10)]
    async with await connect(daemon) as c:
        job = (await c.submit(prompts, max_tokens=3 + 0))["job"]
        status = await wait_state(c, job)
        assert await texts(c, job) == [fakes.expected_text(p, 3) for p in prompts]
        assert max(len(b) for b in fakes.BATCHES) == 4 and all(len(set(b)) == len(b) for b in fakes.BATCHES)
        # 10 prompts of 2 rounds each, 4 at a time: 6 rounds, not 20
        assert len(fakes.BATCHES) == 6
        [ticket] = await tickets(c, job)
        assert ticket["outcome"] == "done" and ticket["jobs"] == [job]
        assert [(s["job"], s["prompt"]) for s in ticket["sequences"]] == [(job, i) for i in range(10)]
        assert ticket["tokens"] == status["tokens"] == 30
    daemon.request_stop()


async def test_interactive_requests_join_the_running_batch_and_get_the_text_they_get_alone(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs=SLOW))
    async with await connect(daemon) as c:
        batch = (await c.submit(["b0", "b1", "b2"], max_tokens=60))["job"]
        await wait_tokens(c, batch, 3)
        done = await complete_together(daemon, {"now": 5, "later": 9})
        assert done["now"]["text"] == fakes.expected_text("now", 5)
        assert done["later"]["text"] == fakes.expected_text("later", 9)
        assert (await c.status(batch))["state"] == "running"  # they rode its ticket: no preemption
        # they ran in the same rounds as the batch job's prompts
        assert any({"b0", "b1", "b2", "now", "later"} <= set(b) for b in fakes.BATCHES)
        await wait_state(c, batch)
        assert await texts(c, batch) == [fakes.expected_text(p, 60) for p in ("b0", "b1", "b2")]
        [held] = await tickets(c, batch)
        assert held["outcome"] == "done" and held["reason"] is None
        assert held["jobs"][0] == batch and set(held["jobs"][1:]) == {done["now"]["job"], done["later"]["job"]}
        assert held["tokens"] == 3 * 60 + 5 + 9
        for prompt in ("now", "later"):
            job = done[prompt]["job"]
            shared, joined = await tickets(c, job)  # the batch's; its own, queued later and left to join
            assert (joined["outcome"], joined["reason"], joined["granted_at"]) == ("joined", f"joined ticket "
                                                                                   f"{held['ticket']}", None)
            assert shared["ticket"] == held["ticket"] and (job, 0) in [(s["job"], s["prompt"])
                                                                      for s in shared["sequences"]]
            status = await c.status(job)
            assert status["tickets"] == 1 and status["state"] == "done"
    daemon.request_stop()


async def test_a_full_batch_sets_a_batch_sequence_aside_for_an_interactive_request_before_waiting_batch_work(
        nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs=SLOW, batching={"max_batch": 2}))
    with structlog.testing.capture_logs() as logs:
        await set_aside_run(daemon, logs)
    daemon.request_stop()


async def set_aside_run(daemon, logs):
    async with await connect(daemon) as c:
        a = (await c.submit(["a0", "a1"], max_tokens=40))["job"]
        await wait_tokens(c, a, 2)
        b = (await c.submit(["q0", "q1"], max_tokens=5))["job"]  # waits: the batch is full
        await trio.sleep(0.05)
        assert (await c.status(b))["state"] == "queued"
        now = await c.complete("now", max_tokens=4).wait()
        assert now["text"] == fakes.expected_text("now", 4)
        first = fakes.BATCHES.index(rounds_with("now")[0])
        assert fakes.BATCHES[first] == ["a0", "now"]  # a1 set aside for it; b still waits
        assert not any(p.startswith("q") for batch in fakes.BATCHES[:first + 1] for p in batch)
        assert [(e["set_aside_job"], e["prompt"]) for e in logs if e["event"] == "sequence_set_aside"] == [(a, 1)]
        await wait_state(c, a)
        await wait_state(c, b)
        # a1's session was kept while aside: nothing redone, nothing skipped
        assert await texts(c, a) == [fakes.expected_text("a0", 40), fakes.expected_text("a1", 40)]
        assert (await c.status(a))["tokens"] == 80
        assert await texts(c, b) == [fakes.expected_text("q0", 5), fakes.expected_text("q1", 5)]
        # one ticket carried all three jobs and generated each token once: a set-aside session
        # was resumed, not restarted
        [held] = await tickets(c, a)
        assert held["jobs"] == [a, now["job"], b] and held["tokens"] == 80 + 4 + 10


async def test_an_interactive_request_keeps_the_batch_beside_it_within_its_round_cost(nursery, workdir):
    # a round of n sequences costs round_costs[n - 1] solo steps: with the limit at 2.0, one batch
    # sequence may ride beside the interactive one (2.0, the limit itself), not two (2.5)
    knobs = dict(SLOW, round_costs=[1.0, 2.0, 2.5, 3.0, 3.5, 4.0])
    daemon = await start(nursery, make_config(workdir, knobs=knobs, batching={"interactive_round_cost": 2.0}))
    with structlog.testing.capture_logs() as logs:
        async with await connect(daemon) as c:
            batch = (await c.submit(["b0", "b1", "b2", "b3"], max_tokens=40))["job"]
            await wait_tokens(c, batch, 4)
            assert len(fakes.BATCHES[-1]) == 4  # alone, the batch runs all four (no interactive: no limit)
            now = await c.complete("now", max_tokens=6).wait()
            assert now["text"] == fakes.expected_text("now", 6)
            joined = rounds_with("now")
            assert len(joined) == 6 and all(b == ["b0", "now"] for b in joined)  # the last to start set aside first
            aside = [(e["set_aside_job"], e["prompt"]) for e in logs if e["event"] == "sequence_set_aside"]
            assert aside == [(batch, 3), (batch, 2), (batch, 1)]
            await wait_state(c, batch)
            after = max(i for i, b in enumerate(fakes.BATCHES) if "now" in b) + 1
            assert sorted(fakes.BATCHES[after]) == ["b0", "b1", "b2", "b3"]  # back together once it ended
            # the set-aside sessions resumed where they stopped, on the same ticket (no preemption)
            assert await texts(c, batch) == [fakes.expected_text(f"b{i}", 40) for i in range(4)]
            [held] = await tickets(c, batch)
            assert held["outcome"] == "done" and held["tokens"] == 4 * 40 + 6
    daemon.request_stop()


async def test_interactive_requests_ride_together_whatever_the_round_costs(nursery, workdir):
    # any batch sequence beside an interactive one is over the limit; two interactive ones are not
    # held to it between themselves
    knobs = dict(SLOW, round_costs=[1.0, 2.0])
    daemon = await start(nursery, make_config(workdir, knobs=knobs, batching={"interactive_round_cost": 1.5}))
    async with await connect(daemon) as c:
        batch = (await c.submit(["b0", "b1"], max_tokens=60))["job"]
        await wait_tokens(c, batch, 2)
        done = await complete_together(daemon, {"i0": 8, "i1": 8})
        assert {p: done[p]["text"] for p in done} == {p: fakes.expected_text(p, 8) for p in ("i0", "i1")}
        assert ["i0", "i1"] in [sorted(b) for b in fakes.BATCHES]  # the two in one round, no batch beside them
        assert not any(("i0" in b or "i1" in b) and ("b0" in b or "b1" in b) for b in fakes.BATCHES)
        await wait_state(c, batch)
        assert await texts(c, batch) == [fakes.expected_text("b0", 60), fakes.expected_text("b1", 60)]
    daemon.request_stop()


async def test_a_cancelled_job_leaves_the_batch_and_the_others_finish_as_alone(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs=SLOW))
    daemon.queue.set_thermal(hold=True, abort=False)  # both queue, then start together
    async with await connect(daemon) as c:
        keep = (await c.submit(["k0", "k1"], max_tokens=50))["job"]
        drop = (await c.submit(["d0", "d1"], max_tokens=50))["job"]
        daemon.queue.set_thermal(hold=False, abort=False)
        await wait_tokens(c, drop, 10)
        assert (await c.cancel(drop))["cancelled"]
        await wait_state(c, drop, ("cancelled",))
        results = (await c.result(drop))["results"]
        assert [r["finish_reason"] for r in results] == ["cancelled", "cancelled"]
        for r in results:
            full = fakes.expected_text(f"d{r['prompt']}", 50)
            assert full.startswith(r["text"]) and len(r["text"]) < len(full)
        await wait_state(c, keep)
        assert await texts(c, keep) == [fakes.expected_text("k0", 50), fakes.expected_text("k1", 50)]
        [held] = await tickets(c, keep)
        assert held["outcome"] == "done" and held["jobs"] == [keep, drop]
        # after the cancel round, d0 and d1 ran no more
        last = max(i for i, b in enumerate(fakes.BATCHES) if "d0" in b)
        assert all("d1" not in b for b in fakes.BATCHES[last + 1:]) and any("k0" in b for b in fakes.BATCHES[last + 1:])
    daemon.request_stop()


async def test_a_fault_mid_batch_requeues_every_job_on_the_ticket_and_commits_nothing_of_it(nursery, workdir):
    fault = workdir / "fault"
    cfg = make_config(workdir, knobs={**SLOW, "fault_file": str(fault), "fault_prompt": "b1", "fault_at_token": 4},
                      device={"backend": "xrt"})  # NPU or nothing: the jobs wait for the clear (no host fallback)
    daemon = await start(nursery, cfg)
    fault.touch()
    daemon.queue.set_thermal(hold=True, abort=False)
    async with await connect(daemon) as c:
        a = (await c.submit(["b0", "b1", "b2"], max_tokens=8))["job"]
        b = (await c.submit(["c0"], max_tokens=3))["job"]
        d = (await c.submit(["d0"], max_tokens=20))["job"]  # still running at the fault
        daemon.queue.set_thermal(hold=False, abort=False)
        await wait_state(c, b)  # c0 finished (3 tokens) before the fault at b1's 5th round
        with trio.fail_after(10):
            while daemon.queue.quarantine is None:
                await trio.sleep(0.01)
        await wait_state(c, a, ("queued",))
        await wait_state(c, d, ("queued",))
        for job in (a, d):  # nothing of the faulted round, nor of their sequences before it
            assert (await c.result(job))["results"] == []
        [faulted] = [t for t in await tickets(c, a) if t["state"] == "released"]
        assert (faulted["outcome"], faulted["reason"]) == ("faulted", "npu_run_failed") and faulted["jobs"] == [a, b, d]
        assert await texts(c, b) == [fakes.expected_text("c0", 3)]  # finished before: kept
        await c.device_clear()
        await wait_state(c, a)
        assert await texts(c, a) == [fakes.expected_text(p, 8) for p in ("b0", "b1", "b2")]
        await wait_state(c, d)
        assert await texts(c, d) == [fakes.expected_text("d0", 20)]
        assert daemon.store.job(a)["tokens"] == 24 and daemon.store.job(d)["tokens"] == 20  # committed once
        # after the fault every unfinished prompt ran again from its start: no session of the
        # faulted ticket was trusted
        after = [t for t in await tickets(c, a) if t["ticket"] > faulted["ticket"]]
        assert sum(t["tokens"] for t in after) == 24 + 20
    daemon.request_stop()


async def test_an_error_line_during_a_round_commits_nothing_that_round_finished(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 1, "round_sleep_s": 0.05}))
    prompts = ["e0", "e1", "e2"]
    async with await connect(daemon) as c:
        job = (await c.submit(prompts, max_tokens=8))["job"]
        await wait_tokens(c, job, 6)  # two rounds of the three; the eighth finishes all three
        with open(workdir / "kmsg", "a") as f:
            f.write(f"3,1,1,-;{fakes.KMSG_ERROR}\n")
        await wait_state(c, job, ("queued",))
        assert (await c.result(job))["results"] == []
        await c.device_clear()
        await wait_state(c, job)
        assert await texts(c, job) == [fakes.expected_text(p, 8) for p in prompts]
    daemon.request_stop()


async def test_the_kv_budget_caps_the_sequences_that_run_together(nursery, workdir):
    # each prompt is 1 token + max_tokens 9 = 10 positions; 25 positions hold two of them
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 3},
                                              batching={"max_batch_positions": 25}))
    prompts = [f"p{i}" for i in range(5)]
    async with await connect(daemon) as c:
        job = (await c.submit(prompts, max_tokens=9))["job"]
        await wait_state(c, job)
        assert await texts(c, job) == [fakes.expected_text(p, 9) for p in prompts]
        assert max(len(b) for b in fakes.BATCHES) == 2
        # a sequence larger than the budget still runs alone
        big = (await c.submit(["big"], max_tokens=40))["job"]
        await wait_state(c, big)
        assert await texts(c, big) == [fakes.expected_text("big", 40)]
    daemon.request_stop()


async def test_work_for_another_model_waits_and_an_interactive_one_preempts_the_batch(nursery, workdir):
    fakes.write_fake_checkpoint(workdir / "other", **SLOW)
    cfg = make_config(workdir, knobs=SLOW, models=[{"name": "fake", "checkpoint_dir": str(workdir / "fake")},
                                                   {"name": "other", "checkpoint_dir": str(workdir / "other")}])
    daemon = await start(nursery, cfg)
    async with await connect(daemon) as c:
        batch = (await c.submit(["b0", "b1"], max_tokens=40))["job"]
        await wait_tokens(c, batch, 2)
        other = await c.complete("elsewhere", model="other", max_tokens=3).wait()
        assert other["text"] == fakes.expected_text("elsewhere", 3)
        assert not rounds_with("elsewhere")[0].count("b0")  # never in a round with the other model's
        await wait_state(c, batch)
        first, second = await tickets(c, batch)
        assert (first["outcome"], first["reason"], second["outcome"]) == ("preempted", "interactive_waiting", "done")
        assert await texts(c, batch) == [fakes.expected_text("b0", 40), fakes.expected_text("b1", 40)]
    daemon.request_stop()


@pytest.mark.parametrize("value, fragment", [(0, "at least 1"), (257, "at most 256"), ("8", "integer"),
                                             (True, "integer")])
def test_batching_settings_are_checked_by_name(tmp_path, value, fragment):
    with pytest.raises(DaemonConfigError) as info:
        parse_config({"batching": {"max_batch": value}})
    assert "batching.max_batch" in str(info.value) and fragment in str(info.value)
    for name in ("max_batch_positions", "prefill_budget"):
        with pytest.raises(DaemonConfigError, match=f"batching.{name}"):
            parse_config({"batching": {name: 0}})
    for value, fragment in ((0.5, "at least 1.0"), (float("inf"), "finite"), ("2", "a number"), (True, "a number")):
        with pytest.raises(DaemonConfigError, match="batching.interactive_round_cost") as info:
            parse_config({"batching": {"interactive_round_cost": value}})
        assert fragment in str(info.value)
    cfg = parse_config({"batching": {"max_batch": 16, "max_batch_positions": 4096, "prefill_budget": 32,
                                     "interactive_round_cost": 1}})
    assert (cfg.batching.max_batch, cfg.batching.max_batch_positions, cfg.batching.prefill_budget,
            cfg.batching.interactive_round_cost) == (16, 4096, 32, 1.0)


def test_a_ticket_is_found_by_every_job_that_rode_it_and_users_see_only_their_own(tmp_path):
    from npud.store import Store
    from npud.tickets import owner_view

    store = Store.open(tmp_path)
    ids = [store.insert_job(owner_uid=uid, priority="batch", interactive=False, model="m", request={},
                            num_prompts=1, created_at=1.0) for uid in (100, 200, 100)]
    ticket = {"ticket": 1, "job": ids[0], "priority": "batch", "state": "released", "outcome": "done",
              "reason": None, "queued_at": 1.0, "granted_at": 2.0, "released_at": 3.0, "thermal_c": None,
              "errors_at_grant": 0, "errors_at_release": 0, "fault_lines": [], "tokens": 9, "drafted": 0,
              "accepted": 0, "sequences": [{"job": ids[0], "prompt": 0, "owner_uid": 100},
                                           {"job": ids[1], "prompt": 0, "owner_uid": 200}]}
    store.save_ticket(ticket)
    assert [t["ticket"] for t in store.tickets(job_id=ids[1])] == [1]  # it rode ticket 1
    assert store.tickets(job_id=ids[2]) == []
    [row] = store.tickets(owner_uid=200)
    assert row["jobs"] == [ids[0], ids[1]] and row["owner_uid"] == 100
    mine = owner_view(row, 200)  # user 200 rode user 100's ticket
    assert (mine["job"], mine["owner_uid"], mine["jobs"], mine["other_sequences"]) == (None, None, [ids[1]], 1)
    assert [s["job"] for s in mine["sequences"]] == [ids[1]]
    lead = owner_view(row, 100)
    assert (lead["job"], lead["jobs"], lead["other_sequences"]) == (ids[0], [ids[0]], 1)
    store.close()
