"""`npuctl submit --wait` across a restart of npud (issue 42, item 1): the job is kept in the
store and runs on from the prompts without a result, so the wait goes on and ends with every
result, never with the unfinished prompts written out as cancelled.

A real daemon process on the fake engine (one token a round, 40 ms a round, one sequence at a
time), stopped with SIGTERM (its drain ends every follower of an unfinished job) and started
again on the same store while npuctl waits.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from npud_fixture import python_env, stop_daemon
from test_npud_support import DaemonProc, expected_text, short_tempdir, wait_for, write_fake_checkpoint

pytestmark = pytest.mark.slow  # a daemon process, stopped and started

PROMPTS = [f"prompt number {i}" for i in range(16)]
MAX_TOKENS = 6


def test_submit_wait_follows_the_job_through_a_restart(tmp_path):
    workdir = short_tempdir()
    write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=0.04)
    daemon = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(workdir / "fake"), "preload": True}],
                        fake_engine=True, batching={"max_batch": 1})
    daemon.start()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.txt"
    try:
        with open(err, "wb") as err_file:
            waiter = subprocess.Popen([sys.executable, "-m", "npud.clients.npuctl", "submit", str(src), "--wait",
                                       "--max-tokens", str(MAX_TOKENS), "-o", str(out)],
                                      env=python_env(daemon.socket), stderr=err_file)
        wait_for(lambda: "prompt 3/16 done" in err.read_text(), 60, what="three prompts to finish")
        assert daemon.terminate() == 0  # SIGTERM: the running prompt's round ends, the job stays queued
        assert waiter.poll() is None, err.read_text()  # still waiting: the job is not over
        daemon.start()
        assert waiter.wait(120) == 0, err.read_text()
    finally:
        if waiter.poll() is None:
            waiter.kill()
        stop_daemon(daemon)
    said = err.read_text()
    assert "npud stopped; job(s) 1 are kept in its store" in said and "npud is back" in said
    assert said.rstrip().splitlines()[-1].startswith("done: 16/16 prompts")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(16))
    assert not [r for r in records if "error" in r], [r for r in records if "error" in r][:2]
    assert [r["text"] for r in records] == [expected_text(p, MAX_TOKENS) for p in PROMPTS]
    assert "cancelled" not in out.read_text()
