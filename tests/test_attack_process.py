"""npud under attack, as a process (issue 17): signal storms, kill -9 at random points of a
batch, a disk that fills up. Real daemon processes on the fake engine, real sockets."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_npud_support import DaemonProc, short_tempdir, wait_for, write_fake_checkpoint

pytestmark = pytest.mark.slow  # daemon processes: tens of seconds in all


@pytest.fixture
def fake_daemon():
    made: list[DaemonProc] = []

    def make(round_sleep_s: float = 0.0, **sections) -> DaemonProc:
        workdir = short_tempdir()
        checkpoint = write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=round_sleep_s)
        made.append(DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True,
                               **sections))
        return made[-1]

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


def test_a_storm_of_stop_signals_only_hurries_the_drain(fake_daemon):
    # before: a stop signal that arrived after the signal receiver closed killed the process
    # before the store was closed and `daemon_stopped` logged
    d = fake_daemon(round_sleep_s=0.05).start()
    with d.client() as c:
        job = c.submit(["a b c"], max_tokens=4000)["job"]
        wait_for(lambda: c.status(job)["state"] == "running", what="the job to run")
    d.proc.send_signal(signal.SIGTERM)
    sent = 1
    while d.proc.poll() is None and sent < 5000:  # until it has exited, whatever state it is in
        d.proc.send_signal((signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)[sent % 3])
        sent += 1
        time.sleep(0.002)
    assert d.proc.wait(30) == 0, d.log_tail()
    events = [e["event"] for e in d.logs()]
    assert events[-1] == "daemon_stopped" and "shutdown_started" in events
    hurried = [e for e in d.logs() if e.get("action") == "hurry"]
    assert hurried, "the second stop signal hurried the drain"
    d.start()  # the job was requeued, not lost
    with d.client() as c:
        assert c.status(job)["state"] in ("queued", "running")
        c.cancel(job)


def test_other_catchable_signals_do_not_end_the_daemon(fake_daemon):
    # before: SIGUSR1 (and SIGUSR2, SIGALRM, SIGPWR, ...) ended the process with no drain
    d = fake_daemon().start()
    for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGPWR, signal.SIGVTALRM, signal.SIGRTMIN):
        d.proc.send_signal(signum)
    wait_for(lambda: d.events("daemon_status"), what="SIGUSR1's status line in the log")
    assert d.alive()
    with d.client() as c:
        assert c.hello()["protocol"] == 1
    assert d.terminate() == 0 and d.logs()[-1]["event"] == "daemon_stopped"


def test_kill9_at_random_points_of_batches_loses_and_repeats_no_acknowledged_prompt(fake_daemon):
    from test_npud_support import expected_text

    rng = random.Random(9)
    d = fake_daemon(round_sleep_s=0.003).start()
    acked: dict[int, list[str]] = {}
    for cycle in range(6):
        with d.client() as c:
            for _ in range(rng.randrange(1, 3)):
                prompts = [f"p{cycle} {i} {rng.randrange(1000)}" for i in range(rng.randrange(3, 9))]
                acked[c.submit(prompts, max_tokens=20)["job"]] = prompts  # acknowledged: must run exactly once
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in a round, a commit, a grant or idle
        d.kill9()
        d.start()
    with d.client() as c:
        for job, prompts in acked.items():
            wait_for(lambda: c.status(job)["state"] == "done", 60, what=f"job {job} to finish")
            results = c.result(job)["results"]
            assert [r["prompt"] for r in results] == list(range(len(prompts))), job  # each once, none lost
            assert [r["text"] for r in results] == [expected_text(p, 20) for p in prompts], job
        assert len(c.jobs(limit=1000)["jobs"]) == len(acked)  # and no job made twice


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of `size` at `path`; None when done, else why it cannot be."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount(8) to mount a small tmpfs"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.strip()}"


def test_a_full_disk_refuses_work_clearly_and_every_acknowledged_job_ends_where_clients_see_it(fake_daemon):
    from npud.clients.client import NpudError
    from test_npud_support import expected_text

    d = fake_daemon(round_sleep_s=0.001)
    state = d.dir / "state"
    state.mkdir()
    why = _mount_tmpfs(state, "3m")
    if why is not None:
        pytest.skip(why)
    try:
        d.start()
        filler = state / "filler"
        with d.client() as c:
            c.complete("warm up", max_tokens=2).wait()  # the store's first pages exist
            free = shutil.disk_usage(state).free
            filler.write_bytes(b"\0" * max(0, free - 96 * 1024))  # leave the store a little room
            acked, refused = {}, []
            for i in range(200):  # until the disk is full
                prompts = [f"job {i} prompt {k} " + "x" * 3000 for k in range(4)]
                try:
                    acked[c.submit(prompts, max_tokens=40)["job"]] = prompts
                except NpudError as exc:
                    refused.append(exc.code)
                    if len(refused) >= 3:
                        break
            assert refused and set(refused) <= {"store_full", "store_error"}, refused
            assert c.hello()["protocol"] == 1  # the daemon carries on
            # every acknowledged job ends, and its status says how, even while the disk is full
            for job in acked:
                wait_for(lambda: c.status(job)["state"] in ("done", "failed"), 60, what=f"job {job} to end")
            failed = [j for j in acked if c.status(j)["state"] == "failed"]
            for job in failed:
                assert c.status(job)["error"]["code"] in ("store_full", "store_error")
            filler.unlink()  # room again
            wait_for(lambda: c.stats()["store"]["unsaved_jobs"] == 0, 60, what="the store to catch up")
            for job, prompts in acked.items():
                status = c.status(job)
                assert "store_error" not in status and status["state"] in ("done", "failed")
                results = c.result(job)["results"]
                assert len({r["prompt"] for r in results}) == len(results)  # none twice
                for r in results:
                    assert r["text"] == expected_text(prompts[r["prompt"]], 40)
                if status["state"] == "done":
                    assert len(results) == len(prompts)
            job = c.submit(["after"], max_tokens=3)["job"]
            wait_for(lambda: c.status(job)["state"] == "done", 30, what="a job after the disk has room")
    finally:
        d.stop()
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
