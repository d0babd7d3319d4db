"""Loading logs progress, and clients waiting on a load see it (issue 27, item 4): a real npud
process loading the bundled base through the real engine, whose load is held half-way through
its weights until the test lets it go, so what a waiting client sees does not depend on timing.

The hold: the daemon runs under a launcher that wraps npud.engine.progress.report; at "weights"
3 of 6 it waits while the file `hold` exists in the daemon's directory. While it waits, the
load is in a known place: `models` says so, `npuctl models` prints it, and a client's stream
has had every report up to there.

Mutants these tests kill (each run by hand, see the branch's report): see the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # openai's HTTP client library

from npud.clients import client as npc  # noqa: E402
from npud.engine.api import LoadProgress  # noqa: E402
from npud.registry import ProgressRelay  # noqa: E402
from npud_fixture import python_env, start_or_clean, stop_daemon  # noqa: E402
from test_npud_support import REPO, DaemonProc, short_tempdir  # noqa: E402

pytestmark = pytest.mark.slow  # a real daemon on a real (small) model

MODELS = REPO / "npud" / "models"
MODEL = "pycode"
HELD_AT = 3  # the layer after which the held load waits (of pycode-base's 6)

LAUNCHER = f"""
import os, sys, time
import npud.engine.progress as progress
import npud.main

real = progress.report
def held(stage, done, total):
    real(stage, done, total)
    if stage == "weights" and done == {HELD_AT}:
        while os.path.exists("hold"):  # the daemon's working directory is its test directory
            time.sleep(0.01)
progress.report = held
sys.exit(npud.main.main())
"""


class HeldDaemon(DaemonProc):
    def argv(self) -> list[str]:
        return [sys.executable, "-c", LAUNCHER, "--config", str(self.config_path)]


@pytest.fixture(scope="module")
def daemon():
    models = [{"name": MODEL, "checkpoint_dir": str(MODELS / "pycode-base"), "weight_format": "fp32"}]
    d = start_or_clean(HeldDaemon(short_tempdir(), models, limits={"max_prompt_tokens": 512, "max_tokens": 64}))
    yield d
    stop_daemon(d)


def wait_held(daemon: DaemonProc) -> dict:
    """The model's `models` entry once its load waits at the hold."""
    deadline = time.monotonic() + 120
    with npc.Client(daemon.socket) as c:
        while time.monotonic() < deadline:
            (entry,) = [m for m in c.models()["models"] if m["name"] == MODEL]
            if entry["loading"] == {"stage": "weights", "done": HELD_AT, "total": 6}:
                return entry
            time.sleep(0.02)
    raise AssertionError(f"the load never reached the hold:\n{daemon.log_tail()}")


def unload(daemon: DaemonProc) -> None:
    with npc.Client(daemon.socket) as c:
        c.models_unload(MODEL)


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_client_waiting_on_the_load_sees_its_progress_before_the_tokens(daemon):
    hold = daemon.dir / "hold"
    hold.touch()

    def complete():
        with npc.Client(daemon.socket) as c:
            return [(ev.name, ev.data) for ev in c.complete("def read(path):\n", model=MODEL, max_tokens=4)]

    thread, out = in_thread(complete)
    entry = wait_held(daemon)
    assert entry["state"] == "loading"
    # npuctl models says how far the load is
    shown = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "models"], capture_output=True, text=True,
                           timeout=60, cwd=REPO, env=python_env(daemon.socket))
    assert shown.returncode == 0, shown.stderr
    assert "loading (weights, 50%)" in shown.stdout
    # a stream that begins now hears that the model is loading and how far it is, at once
    with npc.Client(daemon.socket, timeout=30) as c:  # a stream that is not told waits: the hold is still on
        (job,) = [j["job"] for j in c.jobs(["queued", "running"])["jobs"]]
        stream = iter(c.stream(job))
        try:
            first = [next(stream) for _ in range(3)]
        finally:
            hold.unlink()
    assert [(e.name, e.data) for e in first[1:]] == [
        ("model_loading", {"model": MODEL}),
        ("model_load_progress", {"model": MODEL, "stage": "weights", "done": HELD_AT, "total": 6})]
    thread.join(120)
    (events,) = out
    names = [name for name, _ in events]
    reports = [data for name, data in events if name == "model_load_progress"]
    # every stage, in order, each from 0 to its total, then the model, then the tokens
    assert names.index("model_loading") < names.index("model_load_progress")
    assert max(i for i, n in enumerate(names) if n == "model_load_progress") < names.index("model_loaded")
    assert names.index("model_loaded") < names.index("token")
    stages = list(dict.fromkeys(r["stage"] for r in reports))
    assert stages == ["self_check", "tokenizer", "reading", "weights", "calibration"]
    weights = [r["done"] for r in reports if r["stage"] == "weights"]
    assert weights == sorted(weights) and weights[0] == 0 and weights[-1] == 6
    assert all(r["model"] == MODEL and r["total"] >= 1 for r in reports)
    # the log has it too, at each new stage
    logged = daemon.events("model_load_progress")
    assert {"self_check", "tokenizer", "reading", "weights", "calibration"} <= {e["stage"] for e in logged}
    with npc.Client(daemon.socket) as c:
        (entry,) = [m for m in c.models()["models"] if m["name"] == MODEL]
    assert entry["state"] == "loaded" and entry["loading"] is None


def sse_lines(daemon: DaemonProc, body: dict, out: list) -> None:
    transport = httpx.HTTPTransport(uds=str(daemon.dir / "http.sock"))
    with httpx.Client(transport=transport, base_url="http://npud", timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            out.append(r.status_code)
            out.extend(line for line in r.iter_lines() if line)


def test_an_http_stream_says_the_model_is_loading_in_comments_clients_skip(daemon):
    unload(daemon)
    hold = daemon.dir / "hold"
    hold.touch()
    lines: list = []
    thread = threading.Thread(target=sse_lines, args=(daemon, {"model": MODEL, "prompt": "import os\n",
                                                                "max_tokens": 3, "stream": True}, lines),
                              daemon=True)
    thread.start()
    wait_held(daemon)
    hold.unlink()
    thread.join(120)
    status, *rest = lines
    assert status == 200
    comments = [line for line in rest if line.startswith(":")]
    data = [line for line in rest if line.startswith("data: ")]
    assert rest.index(comments[0]) < rest.index(data[0]) and comments[0] == f': model_loading {{"model":"{MODEL}"}}'
    progress = [json.loads(c.split(" ", 2)[2]) for c in comments if c.startswith(": model_load_progress ")]
    assert {"model": MODEL, "stage": "weights", "done": 6, "total": 6} in progress
    assert any(c.startswith(": model_loaded ") for c in comments)
    assert data[-1] == "data: [DONE]"
    chunks = [json.loads(d[6:]) for d in data[:-1]]
    assert chunks[0]["choices"][0]["text"] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # and OpenAI's client reads such a stream as if the comments were not there
    unload(daemon)
    http_client = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.dir / "http.sock")), timeout=120)
    with openai.OpenAI(base_url="http://npud/v1", api_key="none", http_client=http_client, max_retries=0) as oa:
        pieces = [c.choices[0].text for c in oa.completions.create(model=MODEL, prompt="import os\n", max_tokens=3,
                                                                   stream=True)]
    assert "".join(pieces) == "".join(c["choices"][0]["text"] for c in chunks)


def test_the_relay_logs_and_forwards_each_stage_but_rate_limits_within_one():
    now = [0.0]
    forwarded: list[dict] = []
    relay = ProgressRelay("m", forwarded.append, clock=lambda: now[0])
    relay(LoadProgress("tokenizer", 0, 1))
    relay(LoadProgress("tokenizer", 1, 1))  # a stage's end is always told
    for done in range(10):  # ten layers within 0.09 s: only the first is told, and the last
        now[0] += 0.01
        relay(LoadProgress("weights", done, 10))
    now[0] += 0.3
    relay(LoadProgress("weights", 10, 10))
    relay(LoadProgress("weights", 10, 10))
    assert [(f["stage"], f["done"]) for f in forwarded] == [("tokenizer", 0), ("tokenizer", 1), ("weights", 0),
                                                            ("weights", 10), ("weights", 10)]
    assert relay.last == {"stage": "weights", "done": 10, "total": 10}
    forwarded.clear()
    now[0] += 0.05
    relay(LoadProgress("weights", 10, 11))  # not the end, 0.05 s after the last: held back
    now[0] += 0.2
    relay(LoadProgress("weights", 10, 11))  # 0.25 s after the last told one: told
    assert [f["total"] for f in forwarded] == [11]


def test_a_listener_that_raises_does_not_fail_the_load():
    def broken(report):
        raise RuntimeError("a bug in a listener")

    relay = ProgressRelay("m", broken)
    relay(LoadProgress("weights", 0, 2))  # no exception escapes
    assert relay.last == {"stage": "weights", "done": 0, "total": 2}
