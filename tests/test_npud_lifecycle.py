"""Model lifecycle against a real npud on the bundled model: `npuctl load` / `unload` seen in
`npuctl models` and in the daemon's RSS, the idle keep-alive (the entry's and a request's),
and the per-model context_length and threads settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npud_fixture import (ADMIN_GROUP, REPO, nobody_can_connect, python_env, relay_as_nobody,  # noqa: E402
                          start_or_clean, stop_daemon)
from test_npud_support import DaemonProc, short_tempdir, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # a real daemon on a real (small) model

MODELS = REPO / "npud" / "models"
BASE = str(MODELS / "pycode-base")
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def daemon():
    models = [
        {"name": "pycode", "checkpoint_dir": BASE, "draft_dir": str(MODELS / "pycode-draft"), "weight_format": "fp32"},
        # idle for a second, then unloaded
        {"name": "short", "checkpoint_dir": BASE, "weight_format": "fp32", "keep_alive_s": 1.0},
        # 40 positions (clamped below the checkpoint's), one host thread
        {"name": "small", "checkpoint_dir": BASE, "weight_format": "fp32", "context_length": 40, "threads": 1},
        {"name": "huge", "checkpoint_dir": BASE, "weight_format": "fp32", "context_length": 10 ** 9},
        {"name": "broken", "checkpoint_dir": str(MODELS / "README.md"), "weight_format": "fp32"},
    ]
    server = {"admin_group": ADMIN_GROUP}
    if nobody_can_connect():
        server["socket_group"] = "nogroup"
    d = start_or_clean(DaemonProc(short_tempdir(), models, server=server, limits={"max_prompt_tokens": 512}))
    yield d
    stop_daemon(d)


def npuctl(daemon, *args: str, socket_path: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npud.clients.npuctl", *args], cwd=REPO, capture_output=True, text=True,
                          env=python_env(socket_path or daemon.socket), timeout=120)


def models(daemon) -> dict[str, dict]:
    run = npuctl(daemon, "models", "--json")
    assert run.returncode == 0, run.stderr
    return {m["name"]: m for m in json.loads(run.stdout)["models"]}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_load_and_unload_show_in_models_and_in_rss(daemon):
    assert models(daemon)["pycode"]["state"] == "unloaded"
    before = rss_bytes(daemon.proc.pid)
    run = npuctl(daemon, "load", "pycode")
    assert run.returncode == 0 and run.stdout.startswith("pycode loaded in "), run.stderr
    m = models(daemon)["pycode"]
    # fp32 weights of the base and its draft: (5,771,264 + 2,622,976) parameters x 4 bytes
    assert m["state"] == "loaded" and m["memory_bytes"] >= 4 * (5_771_264 + 2_622_976)
    assert m["keep_alive_s"] is None and m["idle_unload_in_s"] is None  # stays until evicted or unloaded
    loaded = rss_bytes(daemon.proc.pid)
    assert loaded - before >= m["memory_bytes"] // 2
    assert npuctl(daemon, "load", "pycode").stdout.startswith("pycode was already loaded")
    run = npuctl(daemon, "unload", "pycode")
    assert run.returncode == 0 and run.stdout == "pycode unloaded\n", run.stderr
    assert models(daemon)["pycode"]["state"] == "unloaded"
    assert loaded - rss_bytes(daemon.proc.pid) >= m["memory_bytes"] // 2
    assert npuctl(daemon, "unload", "pycode").stdout == "pycode was not loaded\n"


def test_a_model_that_does_not_load_is_failed(daemon):
    run = npuctl(daemon, "load", "broken")
    assert run.returncode != 0 and "does not load" in run.stderr and str(MODELS) not in run.stderr
    assert models(daemon)["broken"]["state"] == "failed"
    assert npuctl(daemon, "load", "nope").returncode != 0


def test_the_entrys_keep_alive_unloads_an_idle_model(daemon):
    with daemon.client() as c:
        done = c.complete(prompt=PROMPT, model="short", max_tokens=2).wait()
    assert done["token_ids"]
    wait_for(lambda: models(daemon)["short"]["state"] == "unloaded", 30, what="the idle model to be unloaded")
    assert any(e.get("event") == "model_unloaded" and e.get("model") == "short" and e.get("reason") == "idle"
               for e in daemon.logs())


def test_a_requests_keep_alive_replaces_the_models(daemon):
    with daemon.client() as c:
        c.complete(prompt=PROMPT, model="pycode", max_tokens=2, keep_alive="1h").wait()
        m = models(daemon)["pycode"]
        assert m["state"] == "loaded" and m["keep_alive_s"] == 3600 and 3500 < m["idle_unload_in_s"] <= 3600
        c.complete(prompt=PROMPT, model="pycode", max_tokens=2, keep_alive=0).wait()  # Ollama's "unload now"
    wait_for(lambda: models(daemon)["pycode"]["state"] == "unloaded", 30, what="keep_alive 0 to unload")
    run = npuctl(daemon, "load", "pycode", "--keep-alive", "-1")  # back to "until evicted"
    assert run.returncode == 0 and models(daemon)["pycode"]["keep_alive_s"] is None
    with daemon.client() as c:
        for bad in ("soon", "5x", True, [1]):
            with pytest.raises(Exception, match="params.keep_alive"):
                c.complete(prompt=PROMPT, max_tokens=1, keep_alive=bad).wait()


def test_context_length_is_clamped_to_the_checkpoint_and_threads_are_the_models(daemon):
    with daemon.client() as c:
        ref = c.complete(prompt=PROMPT, model="pycode", max_tokens=6).wait()
        small = c.complete(prompt=PROMPT, model="small", max_tokens=6).wait()
        assert small["text"] == ref["text"]  # one thread: the same bits
        with pytest.raises(Exception, match="prompt_too_long|context"):
            c.complete(prompt=PROMPT * 20, model="small", max_tokens=2).wait()
        c.complete(prompt=PROMPT, model="huge", max_tokens=1).wait()
    ms = models(daemon)
    assert ms["small"]["context_length"] == 40 and ms["small"]["describe"]["threads"] == 1
    assert ms["huge"]["context_length"] == ms["pycode"]["context_length"] < 10 ** 9
    assert ms["pycode"]["describe"]["threads"] is None


@pytest.mark.skipif(not nobody_can_connect(), reason="needs root and a `nogroup` group to act as another user")
def test_unload_is_for_admins_and_load_for_everyone(daemon):
    with relay_as_nobody(daemon.socket, str(daemon.dir / "nobody.sock")) as path:
        run = npuctl(daemon, "unload", "pycode", socket_path=path)
        assert run.returncode == 1 and run.stderr == "error: models.unload needs root or the admin group\n"
        assert npuctl(daemon, "load", "short", socket_path=path).returncode == 0


def test_a_model_in_use_is_neither_unloaded_nor_idle(daemon):
    import time

    assert npuctl(daemon, "load", "short").returncode == 0
    daemon.set_temp(95.0)  # held for heat: the job stays queued, and its model is in use all along
    try:
        with daemon.client() as c:
            wait_for(lambda: c.device_status()["thermal"]["state"] == "hold", what="thermal hold")
            job = c.submit([PROMPT], model="short", max_tokens=4)["job"]
            run = npuctl(daemon, "unload", "short")
            assert run.returncode == 1 and "in use" in run.stderr
            time.sleep(2.5)  # past the model's one-second keep-alive: a queued job is not idleness
            assert c.status(job)["state"] == "queued" and models(daemon)["short"]["state"] == "loaded"
            c.cancel(job)
    finally:
        daemon.set_temp(40.0)
    wait_for(lambda: models(daemon)["short"]["state"] == "unloaded", 30, what="the idle model to go")


def test_a_load_in_progress_shows_as_loading():
    """The fake engine (a load that takes a while) shows the state between unloaded and loaded."""
    from test_npud_support import write_fake_checkpoint

    workdir = short_tempdir()
    checkpoint = write_fake_checkpoint(workdir / "fake", load_sleep_s=1.5)
    d = start_or_clean(DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True))
    try:
        loading = subprocess.Popen([sys.executable, "-m", "npud.clients.npuctl", "load", "fake"], cwd=REPO,
                                   env=python_env(d.socket), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen = set()
        wait_for(lambda: seen.add(models(d)["fake"]["state"]) or "loading" in seen, 30, what="the loading state")
        assert loading.wait(30) == 0
        assert models(d)["fake"]["state"] == "loaded" and seen <= {"unloaded", "loading"}
    finally:
        stop_daemon(d)
