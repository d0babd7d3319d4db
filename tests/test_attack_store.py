"""npud under attack through its store (issue 17): a disk that fills up in the middle of a job.
The in-process daemon on the fake engine where the failure is injected into the store (so
it strikes exactly at a result write); a daemon process on a small tmpfs where one can be
mounted."""

from __future__ import annotations

import shutil

import pytest
import trio

import test_npud_support as fakes
from npud.clients.client import AsyncClient, Overloaded
from npud import jobs as jobs_module
from npud.store import Store, StoreCode, StoreError
from test_npud_support import make_config, start


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


class DiskFull:
    """Makes every store write fail as a full disk does once `results_left` more results have
    been written, until `full` is cleared."""

    def __init__(self, monkeypatch, results_left: int) -> None:
        self.full = False
        self.results_left = results_left
        for name in ("add_result", "set_job_state", "insert_job"):
            monkeypatch.setattr(Store, name, self._wrap(name, getattr(Store, name)))

    def _wrap(self, name, real):
        def write(store, *args, **kwargs):
            if name == "add_result" and not self.full:
                self.full = self.results_left == 0
                self.results_left -= 1
            if self.full:
                raise StoreError(StoreCode.FULL, f"the job store {store.path} is full (no space left)")
            return real(store, *args, **kwargs)
        return write


async def test_a_failed_result_write_ends_the_job_where_clients_see_it(nursery, workdir, monkeypatch):
    # before: the job failed in memory but its row stayed `running`, so `status` (read from the
    # store once the job had left memory) said "running" for ever and a poller waited for ever
    monkeypatch.setattr(jobs_module, "STORE_RETRY_S", 0.05, raising=False)
    disk = DiskFull(monkeypatch, results_left=1)  # the second prompt's result meets a full disk
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 1, "round_sleep_s": 0.005}))
    async with await AsyncClient.connect(daemon.cfg.server.socket_path) as c:
        job = (await c.submit(["a", "b", "c"], max_tokens=20))["job"]
        with trio.fail_after(20):
            final = {"status": await c.stream(job, tokens=False).wait()}
        status = final["status"]  # the waiting client was answered
        assert status["state"] == "failed" and status["error"]["code"] == "store_full"
        assert "/" not in status["error"]["message"]  # no path reaches the client
        status = await c.status(job)
        assert status["state"] == "failed" and status["store_error"]["code"] == "store_full"
        stats = await c.stats()
        assert stats["store"]["writable"] is False and stats["store"]["unsaved_jobs"] == 1
        assert daemon.store.job(job)["state"] == "running"  # the store is behind, and says so
        disk.full = False
        with trio.fail_after(20):
            while daemon.store.job(job)["state"] != "failed":  # the retry catches up
                await trio.sleep(0.01)
        assert daemon.store.job(job)["error"]["code"] == "store_full"
        assert (await c.stats())["store"] == {"writable": True, "error": None, "unsaved_jobs": 0}
        status = await c.status(job)
        assert status["state"] == "failed" and "store_error" not in status
    daemon.request_stop()


async def test_queued_prompt_bytes_are_bounded_per_user(nursery, workdir):
    # before: only the number of jobs was bounded; 64 jobs of ~1 MB each were accepted at once
    daemon = await start(nursery, make_config(workdir, limits={"max_queued_bytes_per_user": 3000}))
    daemon.queue.set_thermal(hold=True, abort=False)  # keep jobs queued
    async with await AsyncClient.connect(daemon.cfg.server.socket_path) as c:
        first = (await c.submit(["x" * 1000, "y" * 1000]))["job"]
        await c.submit(["\u00e9" * 400])  # 800 bytes in UTF-8
        with pytest.raises(Overloaded, match="limits.max_queued_bytes_per_user = 3000"):
            await c.submit(["z" * 201])
        await c.cancel(first)  # what a job no longer holds is free again
        await c.submit(["z" * 2000])
        assert (await c.hello())["limits"]["max_queued_bytes_per_user"] == 3000
    daemon.request_stop()
