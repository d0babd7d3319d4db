"""The daemon in this process with a fake engine (tests/test_npud_support.py), for the paths that
need control over timing or failure: a full store, bad model files, limits, slow readers,
shutdown deadlines, quarantine across restarts. Real socket and real SQLite throughout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import structlog
import trio

import test_npud_support as fakes
from test_npud_support import make_config, start
from npud.clients.client import (AsyncClient, BadRequest, DeviceQuarantined, FimUnsupported, ModelError, NotFound,
                            Overloaded, PromptTooLong, ShuttingDown, StoreFull, Unsupported)
from npud.engine.api import RequestError
from npud import jobs as jobs_module
from npud.daemon import Daemon
from npud.tickets import Quarantine


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def connect(daemon) -> AsyncClient:
    return await AsyncClient.connect(daemon.cfg.server.socket_path)


async def wait_state(client, job, states=("done",), timeout=20):
    with trio.fail_after(timeout):
        while (status := await client.status(job))["state"] not in states:
            await trio.sleep(0.01)
    return status


async def test_a_full_store_refuses_the_job_clearly_and_the_daemon_carries_on(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    async with await connect(daemon) as c:
        done = (await c.submit(["before"], max_tokens=2))["job"]
        await wait_state(c, done)
        daemon.store.set_page_limit(daemon.store._conn.execute("PRAGMA page_count").fetchone()[0])
        with pytest.raises(StoreFull) as info:
            for i in range(200):  # fill the last free pages, then be refused
                await c.submit(["x" * 2000] * 8, max_tokens=2)
        assert "full" in info.value.message
        assert (await c.status(done))["state"] == "done"
        assert (await c.hello())["protocol"] == 1
        daemon.store.set_page_limit(1 << 30)
        job = (await c.submit(["after"], max_tokens=2))["job"]
        assert (await wait_state(c, job))["done_prompts"] == 1
    daemon.request_stop()


async def test_bad_model_files_fail_the_job_with_model_error(nursery, workdir):
    (workdir / "broken").mkdir()
    (workdir / "broken" / "fake.json").write_text("{ not json")
    cfg = make_config(workdir, models=[{"name": "fake", "checkpoint_dir": str(workdir / "fake")},
                                       {"name": "broken", "checkpoint_dir": str(workdir / "broken")}])
    daemon = await start(nursery, cfg)
    async with await connect(daemon) as c:
        job = (await c.submit(["a"], model="broken"))["job"]
        status = await wait_state(c, job, ("failed",))
        assert status["error"]["code"] == "model_error" and "broken" in status["error"]["message"]
        with pytest.raises(ModelError):
            await c.complete("a", model="broken").wait()
        [ticket] = (await c.tickets(job=job))["tickets"]
        assert ticket["outcome"] == "failed" and ticket["reason"] == "model_error"
        ok = (await c.submit(["a"], max_tokens=3))["job"]  # the other model still serves
        assert (await wait_state(c, ok))["done_prompts"] == 1
    daemon.request_stop()


async def test_a_prompt_too_long_fails_alone(nursery, workdir):
    cfg = make_config(workdir, limits={"max_prompt_tokens": 5})
    daemon = await start(nursery, cfg)
    async with await connect(daemon) as c:
        job = (await c.submit(["short one", "one two three four five six", "also short"], max_tokens=3))["job"]
        await wait_state(c, job)
        results = (await c.result(job))["results"]
        assert results[1]["error"]["code"] == "prompt_too_long" and "max_prompt_tokens" in results[1]["error"]["message"]
        assert results[0]["text"] == fakes.expected_text("short one", 3)
        assert results[2]["text"] == fakes.expected_text("also short", 3)
        with pytest.raises(PromptTooLong):
            await c.complete("one two three four five six", max_tokens=3).wait()
    daemon.request_stop()


async def test_max_tokens_past_the_context_is_clamped_and_only_a_prompt_that_fills_it_fails(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, knobs={"max_context": 10}))
    async with await connect(daemon) as c:
        result = await c.complete("w " * 7, max_tokens=8).wait()  # 7 prompt tokens leave 3 positions
        assert result["finish_reason"] == "length" and result["max_tokens_clamped_to"] == 3
        assert result["text"] == fakes.expected_text("w " * 7, 3)
        fits = await c.complete("w " * 7, max_tokens=3).wait()
        assert fits["max_tokens_clamped_to"] is None and fits["text"] == result["text"]
        job = (await c.submit(["w " * 10, "w"], max_tokens=2))["job"]
        await wait_state(c, job)
        results = (await c.result(job))["results"]
        assert results[0]["error"]["code"] == "prompt_too_long"
        assert "10 tokens" in results[0]["error"]["message"] and "holds 10" in results[0]["error"]["message"]
        assert results[1]["text"] == fakes.expected_text("w", 2)
    daemon.request_stop()


async def test_fill_in_the_middle_params_reach_the_engine_and_are_checked(nursery, workdir):
    cfg = make_config(workdir, models=[{"name": "fake", "checkpoint_dir": str(workdir / "fake")},
                                       {"name": "fim", "checkpoint_dir": str(workdir / "fim")}])
    fakes.write_fake_checkpoint(workdir / "fim", fim=True)
    daemon = await start(nursery, cfg)
    async with await connect(daemon) as c:
        extra = [{"filename": "a.py", "text": "x = 1"}]
        result = await c.complete("def f(", suffix=")\n", fim_extra=extra, model="fim", max_tokens=2).wait()
        assert result["text"] == fakes.expected_text("a.py: x = 1\ndef f(\n<fim>\n)\n", 2)
        job = (await c.submit(["def g("], suffix="", model="fim", max_tokens=2))["job"]
        await wait_state(c, job)
        [stored] = (await c.result(job))["results"]
        assert stored["text"] == fakes.expected_text("def g(\n<fim>\n", 2)
        with pytest.raises(FimUnsupported) as info:  # the fake model has no FIM tokens
            await c.complete("def f(", suffix=")", model="fake", max_tokens=2).wait()
        assert "<|fim_prefix|>" in info.value.message
        models = {m["name"]: m for m in (await c.call("models"))["models"]}
        assert (models["fim"]["fim"], models["fake"]["fim"]) == (True, False)
        assert models["fim"]["context_length"] == 4096
        bad = [
            ({"prompts": ["a", "b"], "suffix": "x"}, "exactly one string prompt"),
            ({"chats": [[{"role": "user", "content": "a"}]], "suffix": "x"}, "exactly one string prompt"),
            ({"prompts": ["a"], "fim_extra": extra}, "needs 'suffix'"),
            ({"prompts": ["a"], "suffix": 3}, "expected a string"),
            ({"prompts": ["a"], "suffix": "", "fim_extra": "x"}, "expected a list"),
            ({"prompts": ["a"], "suffix": "", "fim_extra": [{"text": 1}]}, "fim_extra[0]"),
            ({"prompts": ["a"], "suffix": "", "fim_extra": [{"text": "t", "path": "p"}]}, "fim_extra[0]"),
            ({"prompts": ["a"], "suffix": "", "fim_extra": [{"text": "t", "filename": "p" * 2000}]}, "filename"),
        ]
        for params, words in bad:
            with pytest.raises(BadRequest) as info:
                await c.call("submit", {"model": "fim", **params})
            assert words in info.value.message, params
        with pytest.raises(BadRequest) as info:
            await c.complete(messages=[{"role": "user", "content": "a"}], suffix="x", model="fim").wait()
        assert "exactly one string prompt" in info.value.message
    daemon.request_stop()


class PickyModel(fakes.FakeServedModel):
    """Rejects the prompt "reject" as the engine does bad input, and fails on "bug" as an engine bug would."""

    def start(self, request):
        if request.prompt == "reject":
            raise RequestError("this model cannot run that")
        if request.prompt == "bug":
            raise ValueError("a bug in the engine")  # a ValueError, but not an EngineError
        return super().start(request)


def picky_loader(name, checkpoint_dir, **kwargs):
    return PickyModel(name, json.loads((Path(checkpoint_dir) / "fake.json").read_text()))


async def test_engine_errors_are_bad_requests_and_anything_else_is_internal(nursery, workdir):
    daemon = await start(nursery, make_config(workdir), loader=picky_loader)
    async with await connect(daemon) as c:
        job = (await c.submit(["reject", "fine"], max_tokens=2))["job"]
        await wait_state(c, job)
        rejected, fine = (await c.result(job))["results"]
        assert rejected["error"] == {"code": "bad_request", "message": "this model cannot run that"}
        assert fine["text"] == fakes.expected_text("fine", 2)
        # an engine bug fails its prompt, not the job (issue 17, defect 2): the later prompts run,
        # and the client sees a plain message while the traceback goes to the log
        with structlog.testing.capture_logs() as logs:
            job = (await c.submit(["first", "bug", "last"], max_tokens=2))["job"]
            status = await wait_state(c, job, ("done",))
        assert status["error"] is None and status["done_prompts"] == 3
        first, bug, last = (await c.result(job))["results"]
        assert bug["error"]["code"] == "internal_error"
        assert "ValueError" not in bug["error"]["message"] and "a bug in the engine" not in bug["error"]["message"]
        assert first["text"] == fakes.expected_text("first", 2) and last["text"] == fakes.expected_text("last", 2)
        [failed] = [e for e in logs if e["event"] == "prompt_failed"]
        assert failed["log_level"] == "error" and isinstance(failed["exc_info"], ValueError)
    daemon.request_stop()


async def test_a_prompt_that_is_not_text_is_refused_at_submit_by_its_index(nursery, workdir):
    # a lone surrogate is valid JSON but no tokenizer's text; before, the job was accepted and
    # failed as a whole with internal_error when the tokenizer met it (issue 17, defect 2)
    daemon = await start(nursery, make_config(workdir))
    async with await connect(daemon) as c:
        with pytest.raises(BadRequest, match=r"params\.prompts\[2\]: is not valid text"):
            await c.submit(["a", "b", "c\ud800d"])
        with pytest.raises(BadRequest, match=r"params\.chats\[1\]\[0\]\.content: is not valid text"):
            await c.submit(chats=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "\udfff"}]])
        with pytest.raises(BadRequest, match=r"params\.prompt: is not valid text"):
            await c.complete("\ud800").wait()
        with pytest.raises(BadRequest, match=r"params\.stop\[0\]"):
            await c.submit(["a"], stop=["\ud800"])
        assert (await c.jobs())["jobs"] == []
    daemon.request_stop()


async def test_queued_jobs_per_user_and_connections_are_limited(nursery, workdir):
    cfg = make_config(workdir, limits={"max_queued_jobs_per_user": 2}, server={"max_connections": 3, "admin_reserved_connections": 1})
    daemon = await start(nursery, cfg)
    daemon.queue.set_thermal(hold=True, abort=False)  # keep jobs queued
    async with await connect(daemon) as c:
        await c.submit(["a"])
        await c.submit(["b"])
        with pytest.raises(Overloaded, match="max_queued_jobs_per_user"):
            await c.submit(["c"])
        others = [await connect(daemon) for _ in range(2)]
        extra = await connect(daemon)
        with pytest.raises(Overloaded, match="max_connections"):
            await extra.hello()
        for o in others + [extra]:
            await o.aclose()
        with trio.fail_after(5):
            while daemon.server.connections > 1:
                await trio.sleep(0.01)
        assert (await c.hello())["limits"]["max_queued_jobs_per_user"] == 2
    daemon.request_stop()


async def test_a_line_that_never_ends_times_out(nursery, workdir):
    daemon = await start(nursery, make_config(workdir, server={"line_timeout_s": 0.2}))
    stream = await trio.open_unix_socket(daemon.cfg.server.socket_path)
    await stream.send_all(b'{"id": 1, "method": "hel')
    with trio.fail_after(5):
        data = b""
        while chunk := await stream.receive_some(4096):
            data += chunk
    assert b'"bad_request"' in data and b"did not end" in data
    await stream.aclose()
    daemon.request_stop()


async def test_a_stream_that_falls_behind_is_cut_off_not_the_job(nursery, workdir, monkeypatch):
    monkeypatch.setattr(jobs_module, "SUBSCRIBER_BUFFER", 4)
    tokens = 20_000  # enough events to fill the socket's buffer while the client does not read
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 1, "max_context": 30_000},
                                              limits={"max_tokens": tokens}))
    daemon.queue.set_thermal(hold=True, abort=False)
    async with await connect(daemon) as c:
        job = (await c.submit(["slow reader"], max_tokens=tokens))["job"]
        stream = await trio.open_unix_socket(daemon.cfg.server.socket_path)
        await stream.send_all(b'{"id": 1, "method": "stream", "params": {"job": %d}}\n' % job)
        await trio.sleep(0.1)  # subscribed; now let the rounds run without reading
        daemon.queue.set_thermal(hold=False, abort=False)
        await wait_state(c, job, timeout=120)  # 20000 rounds: slow on a busy machine
        data = b""
        with trio.fail_after(5):
            while b'"ok":false' not in data:
                data += await stream.receive_some(65536)
        assert b'"overloaded"' in data and b"fell behind" in data
        assert len((await c.result(job))["results"][0]["token_ids"]) == tokens
        await stream.aclose()
    daemon.request_stop()


async def test_sigterm_deadline_abandons_the_round_and_requeues(workdir):
    cfg = make_config(workdir, knobs={"tokens_per_round": 1, "round_sleep_s": 1.0},
                      server={"drain_timeout_s": 0.2})
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        async with await connect(daemon) as c:
            job = (await c.submit(["a", "b"], max_tokens=5))["job"]
            with trio.fail_after(5):
                while daemon.owner.holding is None:
                    await trio.sleep(0.01)
            daemon.request_stop()
            with pytest.raises(ShuttingDown):
                await c.submit(["late"])
    again = Daemon(cfg, loader=fakes.load_model)  # the store as the next start sees it
    row = again.store.job(job)
    assert row["state"] == "queued"
    [ticket] = again.store.tickets(job_id=job)
    assert ticket["outcome"] == "preempted" and ticket["reason"] == "shutdown"
    again.store.close()


async def test_quarantine_survives_a_restart_and_blocks_grants(workdir):
    cfg = make_config(workdir)
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        async with await connect(daemon) as c:
            job = (await c.submit(["a"], max_tokens=400))["job"]
            with trio.fail_after(5):
                while daemon.owner.holding is None:
                    await trio.sleep(0.001)
            with open(workdir / "kmsg", "a") as f:
                f.write(f"3,1,1,-;{fakes.KMSG_ERROR}\n")
            with trio.fail_after(5):
                while daemon.queue.quarantine is None:
                    await trio.sleep(0.01)
            await wait_state(c, job, ("queued",))
        daemon.request_stop()
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        assert isinstance(daemon.queue.quarantine, Quarantine)
        async with await connect(daemon) as c:
            assert (await c.device_status())["quarantine"]["lines"] == [fakes.KMSG_ERROR]
            with pytest.raises(DeviceQuarantined):
                await c.complete("x").wait()
            await trio.sleep(0.2)
            assert (await c.status(job))["state"] == "queued"
            assert (await c.device_clear())["cleared"] is True
            assert (await c.device_clear())["cleared"] is False
            await wait_state(c, job)
            [result] = (await c.result(job))["results"]
            assert result["text"] == fakes.expected_text("a", 400)
        daemon.request_stop()


async def test_stream_and_cancel_of_finished_and_unknown_jobs(nursery, workdir):
    daemon = await start(nursery, make_config(workdir))
    async with await connect(daemon) as c:
        job = (await c.submit(["a"], max_tokens=2))["job"]
        await wait_state(c, job)
        stream = c.stream(job)
        assert [e async for e in stream] == [] and stream.result["state"] == "done"
        assert (await c.cancel(job))["cancelled"] is False
        for call in (c.status, c.result, c.cancel):
            with pytest.raises(NotFound):
                await call(10_000)
        with pytest.raises(BadRequest, match="params.state"):
            await c.jobs(state="finished")
        assert [j["job"] for j in (await c.jobs(state=["done"]))["jobs"]] == [job]
        stats = await c.stats()
        assert stats["jobs"] == {"done": 1} and stats["tickets"] == {"done": 1} and stats["tokens_generated"] == 2
        models = (await c.models())["models"]
        assert models[0]["resident"] is True and models[0]["describe"]["fake"] is True
        assert await c.cache_list() == {"models": []}  # the fake model has no prefix cache
        with pytest.raises(Unsupported):
            await c.cache_pin("p", text="some text")
        with pytest.raises(BadRequest, match="exactly one"):
            await c.cache_pin("p")
    daemon.request_stop()


async def test_a_preempted_batch_job_continues_in_a_new_ticket(nursery, workdir):
    # without batching (max_batch 1): a waiting interactive request preempts the batch ticket
    # (test_npud_batching.py has it joining the batch instead)
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 1, "round_sleep_s": 0.01},
                                              batching={"max_batch": 1}))
    async with await connect(daemon) as c:
        batch = (await c.submit(["b0", "b1"], max_tokens=30))["job"]
        with trio.fail_after(5):
            while (await c.status(batch))["tokens"] < 3:
                await trio.sleep(0.005)
        completion = await c.complete("now", max_tokens=3).wait()
        assert completion["text"] == fakes.expected_text("now", 3)
        await wait_state(c, batch)
        tickets = sorted((await c.tickets(job=batch))["tickets"], key=lambda t: t["ticket"])
        assert [t["outcome"] for t in tickets] == ["preempted", "done"]
        assert tickets[0]["reason"] == "interactive_waiting"
        results = (await c.result(batch))["results"]
        assert [r["text"] for r in results] == [fakes.expected_text("b0", 30), fakes.expected_text("b1", 30)]
        assert sum(t["tokens"] for t in tickets) == 60  # the session was kept: nothing redone
    daemon.request_stop()


async def test_a_result_finished_after_an_error_line_is_not_kept(nursery, workdir):
    knobs = {"tokens_per_round": 1, "round_sleep_s": 0.05}
    # one prompt at a time (max_batch 1), so that one is committed before the error line
    daemon = await start(nursery, make_config(workdir, knobs=knobs, batching={"max_batch": 1}))
    prompts = [f"p{i}" for i in range(4)]
    async with await connect(daemon) as c:
        job = (await c.submit(prompts, max_tokens=4))["job"]
        with trio.fail_after(5):
            while (await c.status(job))["done_prompts"] < 1:
                await trio.sleep(0.005)
        with open(workdir / "kmsg", "a") as f:  # while prompt 1 runs
            f.write(f"3,1,1,-;{fakes.KMSG_ERROR}\n")
        await wait_state(c, job, ("queued",))
        assert daemon.queue.quarantine is not None
        assert [r["prompt"] for r in (await c.result(job))["results"]] == [0]
        [faulted] = [t for t in (await c.tickets(job=job))["tickets"] if t["outcome"] == "faulted"]
        assert faulted["fault_lines"] == [fakes.KMSG_ERROR]
        await c.device_clear()
        await wait_state(c, job)
        results = (await c.result(job))["results"]
        assert [r["text"] for r in results] == [fakes.expected_text(p, 4) for p in prompts]
    daemon.request_stop()


async def test_a_failed_npu_run_faults_the_ticket_quarantines_and_commits_nothing_of_it(nursery, workdir):
    fault = workdir / "fault"
    cfg = make_config(workdir, knobs={"tokens_per_round": 2, "fault_file": str(fault), "fault_prompt": "second",
                                      "fault_at_token": 4}, device={"backend": "xrt"},  # NPU or nothing
                     batching={"max_batch": 1})
    daemon = await start(nursery, cfg)  # one prompt at a time: the first is committed before the fault
    daemon.owner.fw_version = "1.5.2.380"  # what sysfs fw_version says on an NPU machine
    fault.touch()
    async with await connect(daemon) as c:
        job = (await c.submit(["first", "second"], max_tokens=8))["job"]
        with trio.fail_after(10):
            while daemon.queue.quarantine is None:
                await trio.sleep(0.01)
        quarantine = (await c.device_status())["quarantine"]
        assert quarantine["reason"].startswith("an NPU run failed (DeviceFault: GEMM K=1024 N=3072 on the NPU "
                                               "ended in ERT_CMD_STATE_TIMEOUT")
        status = await wait_state(c, job, ("queued",))
        assert status["done_prompts"] == 1  # the first prompt was committed before the fault
        results = (await c.result(job))["results"]
        assert [r["prompt"] for r in results] == [0]  # nothing of the faulted prompt
        [ticket] = daemon.store.tickets(job_id=job)
        assert (ticket["outcome"], ticket["reason"]) == ("faulted", "npu_run_failed")
        assert ticket["fw_version"] == "1.5.2.380" and ticket["fault_lines"][0].startswith("DeviceFault: GEMM")
        with pytest.raises(DeviceQuarantined):
            await c.complete("x").wait()
        assert (await c.device_clear())["cleared"] is True
        await wait_state(c, job)
        results = (await c.result(job))["results"]
        assert [r["text"] for r in results] == [fakes.expected_text("first", 8), fakes.expected_text("second", 8)]
        tickets = daemon.store.tickets(job_id=job)
        assert [t["outcome"] for t in tickets] == ["done", "faulted"] and all(t["fw_version"] for t in tickets)
    daemon.request_stop()


async def test_with_backend_auto_a_failed_npu_run_goes_on_on_the_host_until_cleared(nursery, workdir):
    fault = workdir / "fault"
    cfg = make_config(workdir, knobs={"tokens_per_round": 2, "fault_file": str(fault), "fault_prompt": "second",
                                      "fault_at_token": 4})
    backends = []

    def loader(*args, backend="auto", **kw):  # the host has no NPU run to fail
        backends.append(backend)
        if backend == "host":
            fault.unlink(missing_ok=True)
        return fakes.load_model(*args, backend=backend, **kw)

    daemon = await start(nursery, cfg, loader=loader)
    fault.touch()
    async with await connect(daemon) as c:
        job = (await c.submit(["first", "second"], max_tokens=8))["job"]
        await wait_state(c, job, ("done",))  # no clear needed: the job finished on the host
        quarantine = (await c.device_status())["quarantine"]
        assert quarantine["host_fallback"] is True and quarantine["reason"].startswith("an NPU run failed")
        results = (await c.result(job))["results"]
        assert [r["text"] for r in results] == [fakes.expected_text("first", 8), fakes.expected_text("second", 8)]
        assert [t["outcome"] for t in daemon.store.tickets(job_id=job)] == ["done", "faulted"]  # newest first
        assert await c.complete("first", max_tokens=8).wait()  # other clients are served meanwhile
        assert backends == ["auto", "host"]
        assert (await c.device_clear())["cleared"] is True
        await c.complete("first", max_tokens=8).wait()
        assert backends == ["auto", "host", "auto"]  # loaded for the NPU again
    daemon.request_stop()


async def test_an_unexpected_engine_error_is_no_device_fault(nursery, workdir, monkeypatch):
    daemon = await start(nursery, make_config(workdir))
    monkeypatch.setattr(fakes.FakeSession, "run_round", lambda self: 1 / 0)
    async with await connect(daemon) as c:
        job = (await c.submit(["a"], max_tokens=4))["job"]
        await wait_state(c, job, ("done",))  # an engine bug fails its prompt, not the job (issue 17, defect 2)
        [result] = (await c.result(job))["results"]
        assert result["error"]["code"] == "internal_error" and daemon.queue.quarantine is None
    daemon.request_stop()


def test_startup_warns_when_another_process_has_the_npu_open(workdir, monkeypatch):
    import structlog

    from npud import daemon as daemon_module
    from npud.device import DeviceInfo

    d = Daemon(make_config(workdir), loader=fakes.load_model)
    try:
        d.device = DeviceInfo("npu", "amdxdna device at /dev/accel/accel0", node="/dev/accel/accel0")
        seen = []
        monkeypatch.setattr(daemon_module, "other_holders",
                            lambda node: seen.append(node) or [{"pid": 7, "comm": "flm", "drm_client_ids": ["3"]}])
        monkeypatch.setattr(daemon_module.resource, "getrlimit", lambda which: (8 << 20, 8 << 20))
        with structlog.testing.capture_logs() as logs:
            d.check_other_holders()
        assert seen == ["/dev/accel/accel0"]
        assert [e["limit_bytes"] for e in logs if e["event"] == "npu_memlock_limited"] == [8 << 20]
        [warning] = [e for e in logs if e["event"] == "npu_shared_with_other_process"]
        assert warning["holders"][0]["comm"] == "flm" and warning["log_level"] == "warning"
        assert "NPU also open in pid 7" in d.status_line()
        d.device = DeviceInfo("host", "no NPU")
        d.other_holders = []
        d.check_other_holders()  # no NPU: nothing to look for
        assert seen == ["/dev/accel/accel0"]
    finally:
        d.store.close()
