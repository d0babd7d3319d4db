"""A per-user daemon (issue 27): `npud --config FILE` as a user keeps a socket and store left at
the system defaults in the XDG directories; the user who runs npud administers it; a model that
does not load at start is said in npud's own output, listed with its error (in words: no path, no exception text), and when nothing is
left to serve npud exits non-zero.

Mutants these tests kill (run by hand, see the branch's report): per_user keeping root on the system paths, or applied
under systemd's StateDirectory; an explicit socket_path replaced; is_admin without the daemon's
own uid; the exit when only some models fail; the load error kept after the entry changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys


import pytest
import trio

from npud.clients import client as npc
from npud import main as npud_main
from npud import server as server_module
from npud.config import ModelEntry, parse_config
from npud.registry import ModelRegistry
from test_npud_support import load_model as fakes_load_model
from npud_fixture import python_env
from test_npud_support import REPO, TESTS, make_config, short_tempdir, start, write_fake_checkpoint

httpx = pytest.importorskip("httpx2")  # openai's HTTP client library


def test_a_users_config_keeps_default_paths_in_the_xdg_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    defaults = parse_config({"models": [{"name": "m", "checkpoint_dir": str(tmp_path)}]})
    explicit = parse_config({"server": {"socket_path": str(tmp_path / "mine.sock")}})
    monkeypatch.setattr(npud_main.os, "geteuid", lambda: 1000)
    cfg = npud_main.per_user(defaults)
    assert cfg.server.socket_path == str(tmp_path / "run" / "npud" / "npud.sock")
    assert cfg.store.state_dir == str(tmp_path / "state" / "npud")
    assert cfg.http.unix_path(cfg.server) == str(tmp_path / "run" / "npud" / "http.sock")
    assert npud_main.per_user(explicit).server.socket_path == str(tmp_path / "mine.sock")  # the file's stays
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/npud")  # the system unit, as User=npud
    assert npud_main.per_user(defaults) == defaults
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setattr(npud_main.os, "geteuid", lambda: 0)  # root by hand is a user like any other
    assert npud_main.per_user(defaults).server.socket_path == str(tmp_path / "run" / "npud" / "npud.sock")


def test_npud_config_by_hand_as_root_keeps_off_the_system_paths(tmp_path):
    """Issue 42, item 3: `npud --config FILE` started by hand, as root too, with the example
    file's system paths in it, listens and stores in the XDG directories; only systemd's
    service (RUNTIME_DIRECTORY / STATE_DIRECTORY) gets /run/npud and /var/lib/npud."""
    config = tmp_path / "npud.toml"
    config.write_text('[server]\nsocket_path = "/run/npud/npud.sock"\n[store]\nstate_dir = "/var/lib/npud"\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {**python_env(None), "XDG_RUNTIME_DIR": str(run_dir), "XDG_STATE_HOME": str(tmp_path / "state")}
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "NPUD_CONFIG"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "npud", "--config", str(config), "--check-config"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"socket {run_dir}/npud/npud.sock, state {tmp_path}/state/npud" in done.stdout, done.stdout
    done = subprocess.run([sys.executable, "-m", "npud", "--config", str(config), "--check-config"],
                          env={**env, "RUNTIME_DIRECTORY": "/run/npud", "STATE_DIRECTORY": "/var/lib/npud"},
                          capture_output=True, text=True, timeout=120)
    assert "socket /run/npud/npud.sock, state /var/lib/npud" in done.stdout, done.stdout  # the system service


def test_the_user_running_npud_is_its_admin(monkeypatch):
    monkeypatch.setattr(server_module.os, "getuid", lambda: 4321)
    assert server_module.is_admin(4321, 4321, "npud-test-no-such-group")
    assert not server_module.is_admin(4322, 4322, "npud-test-no-such-group")
    assert server_module.is_admin(0, 0, "npud-test-no-such-group")


def test_a_load_error_is_listed_in_words_and_forgotten_when_the_entry_changes(tmp_path):
    broken = tmp_path / "secret-dir" / "broken"
    broken.mkdir(parents=True)
    (broken / "fake.json").write_text("{ not json")
    entry = ModelEntry(name="b", checkpoint_dir=str(broken))
    registry = ModelRegistry((entry,), max_resident_bytes=10**6, loader=fakes_load_model)
    with pytest.raises(Exception) as info:
        registry.get("b")
    [described] = registry.describe()
    assert described["load_error"] == "its files do not load"  # a ModelError: no path, no exception text
    assert "secret-dir" not in str(info.value) and "not JSON" not in str(info.value)
    assert "fake.json: not JSON" in registry.load_details["b"]  # npud's own output has it all
    (broken / "fake.json").write_text("{}")
    registry.get("b")
    assert registry.describe()[0]["load_error"] is None  # loaded now
    (broken / "fake.json").write_text("{ not json")
    registry.unload("b")
    with pytest.raises(Exception):
        registry.get("b")
    registry.reconfigure((ModelEntry(name="b", checkpoint_dir=str(tmp_path)),), 10**6, keep=())
    assert registry.describe()[0]["load_error"] is None  # another entry: the old error no longer says anything
    assert "b" not in registry.load_details


def test_load_errors_in_words_by_kind():
    from npud.engine.api import ConfigError, ModelError
    from npud.registry import load_error
    from npud.engine.tokenizer import TokenizerError  # the engine's subclasses, matched by name (npud imports only npud.engine.api)
    assert load_error(ConfigError("/x/config.json: model_type 'x'")) == "its config.json is not one npud can run"
    assert load_error(TokenizerError("/x/tokenizer.json: bad")) == "its tokenizer does not load"
    assert load_error(FileNotFoundError(2, "No such file", "/x/model.safetensors")) == "a file of it is missing"
    assert load_error(ModelError("/x: no")) == "its files do not load"


def test_npud_model_that_does_not_load_says_so_and_exits_non_zero(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fake.json").write_text("{ not json")
    conf = tmp_path / "npud.toml"
    conf.write_text(f'[thermal]\nenabled = false\n[errors]\nsource = "{tmp_path / "kmsg"}"\n')
    argv = ["--config", str(conf), "--model", str(broken), "--socket", str(tmp_path / "s.sock"),
            "--state-dir", str(tmp_path / "state"), "--log-format", "json"]
    script = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_npud_support import load_model; "
              f"from npud.main import main; sys.exit(main({argv!r}, loader=load_model))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=python_env(None))
    assert done.returncode == npud_main.EXIT_START_FAILED, done.stderr
    assert f"npud: error: model 'broken' ({broken}) does not load: ModelError: {broken}/fake.json: not JSON" in done.stderr
    assert done.stderr.rstrip().endswith("nothing to serve; stopped")


async def test_with_several_models_the_rest_are_served_and_the_broken_one_listed(nursery, tmp_path):
    workdir = short_tempdir()
    write_fake_checkpoint(workdir / "fake")
    (workdir / "broken").mkdir()
    (workdir / "broken" / "fake.json").write_text("{ not json")
    cfg = make_config(workdir, models=[
        {"name": "broken", "checkpoint_dir": str(workdir / "broken"), "preload": True},
        {"name": "fake", "checkpoint_dir": str(workdir / "fake"), "preload": True}])
    daemon = await start(nursery, cfg)
    with trio.fail_after(20):
        while daemon.registry.resident("fake") is None or "broken" not in daemon.registry.load_errors:
            await trio.sleep(0.01)
    assert not daemon.start_failed
    async with await npc.AsyncClient.connect(cfg.server.socket_path) as c:
        models = {m["name"]: m for m in (await c.models())["models"]}
        assert models["broken"]["load_error"] == "its files do not load"
        assert models["fake"]["load_error"] is None and models["fake"]["resident"]
    http_sock = cfg.http.unix_path(cfg.server)

    def v1_models():
        with httpx.Client(transport=httpx.HTTPTransport(uds=http_sock), base_url="http://npud") as h:
            return h.get("/v1/models").json()

    data = {m["id"]: m["npud"] for m in (await trio.to_thread.run_sync(v1_models))["data"]}
    assert data["broken"]["load_error"] == "its files do not load" and str(workdir) not in json.dumps(data)
    daemon.request_stop()
    shutil.rmtree(workdir, ignore_errors=True)
