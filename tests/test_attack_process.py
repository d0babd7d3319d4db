"""npud under attack, as a process (issue 17): signal storms, kill -9 at random points of a
batch, a disk that fills up. Real daemon processes on the fake engine, real sockets."""

from __future__ import annotations

import os
import shutil
import signal
import time

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
