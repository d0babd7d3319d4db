"""A first run without a config file (issue 16): `npud --model PATH` as an ordinary user with
the XDG paths, clients finding that socket, NPUD_CONFIG, ~ and $VAR in config paths, Hugging
Face repo ids from the local cache, --check-config reading every model, preload, and the
`model_loading` progress of a cold start.

Mutants these tests kill (each run by hand, see the branch's report): the client trying the
user socket before the system one; NPUD_SOCKET after the system socket; no ownership or mode
check on /tmp/npud-<uid> (daemon and client); XDG paths taken when relative; $VAR left
unexpanded; ~ not expanded; expansion skipped for tuple paths; a repo id tried before an
existing directory of that name; refs/main ignored.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from npud.clients import client as npc
from npud.clients.termout import Progress
from npud import main as npud_main
from npud import userdirs
from npud.config import DaemonConfigError, parse_config
from npud_fixture import python_env
from test_npud_support import load_model as fakes_load_model
from test_npud_support import REPO, DaemonProc, make_config, short_tempdir, start, write_fake_checkpoint

PYCODE = REPO / "npud" / "models" / "pycode-base"


@pytest.fixture
def workdir():
    d = short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- the per-user paths -----------------------------------------------------------------------------

def test_user_paths_follow_xdg_and_ignore_relative_values(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert userdirs.socket_path() == tmp_path / "run" / "npud" / "npud.sock"
    assert userdirs.state_dir() == tmp_path / "state" / "npud"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # the XDG spec: relative values are invalid
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert userdirs.state_dir() == tmp_path / "home" / ".local" / "state" / "npud"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert userdirs.state_dir() == tmp_path / "home" / ".local" / "state" / "npud"


def test_without_xdg_runtime_dir_the_socket_goes_in_a_private_directory(monkeypatch, tmp_path):
    fallback = tmp_path / f"npud-{os.getuid()}"
    monkeypatch.setattr(userdirs, "fallback_runtime_dir", lambda: fallback)
    monkeypatch.setattr(npc, "USER_FALLBACK_DIR", str(tmp_path / "npud-{uid}"))
    for value in (None, "relative"):
        if value is None:
            monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        else:
            monkeypatch.setenv("XDG_RUNTIME_DIR", value)
        assert userdirs.socket_path() == fallback / "npud.sock"
        assert (fallback.stat().st_mode & 0o777) == 0o700
        assert npc.user_socket_path() == str(fallback / "npud.sock")
    # a directory others can enter, a link, or another user's: neither side uses it
    fallback.chmod(0o755)
    with pytest.raises(userdirs.UserDirError, match="has mode 0o755"):
        userdirs.socket_path()
    assert npc.user_socket_path() is None
    fallback.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(fallback, 12345, -1)
        with pytest.raises(userdirs.UserDirError, match="belongs to uid 12345"):
            userdirs.socket_path()
        assert npc.user_socket_path() is None
        os.chown(fallback, os.getuid(), -1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    fallback.rmdir()
    fallback.symlink_to(elsewhere)
    with pytest.raises(userdirs.UserDirError, match="is not a directory") as info:
        userdirs.socket_path()
    assert "XDG_RUNTIME_DIR" in str(info.value) and "--socket" in str(info.value)
    assert npc.user_socket_path() is None


def test_clients_look_for_the_socket_in_order(monkeypatch, tmp_path):
    system = tmp_path / "system.sock"
    user = tmp_path / "run" / "npud" / "npud.sock"
    monkeypatch.setattr(npc, "DEFAULT_SOCKET", str(system))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("NPUD_SOCKET", raising=False)
    assert npc.user_socket_path() == str(userdirs.socket_path())  # the daemon's rule and the client's agree
    assert npc.default_socket_path() == str(system)  # neither exists: the system path, to say so
    user.parent.mkdir(parents=True)
    user.touch()
    assert npc.default_socket_path() == str(user)  # no system socket: the user's
    system.touch()
    assert npc.default_socket_path() == str(system)  # a system socket first
    monkeypatch.setenv("NPUD_SOCKET", str(tmp_path / "env.sock"))
    assert npc.default_socket_path() == str(tmp_path / "env.sock")  # $NPUD_SOCKET before both
    with pytest.raises(npc.NotRunning, match="flag.sock"):  # --socket before all
        npc.Client(str(tmp_path / "flag.sock"))


# -- the configuration file ------------------------------------------------------------------------

def test_npud_config_names_the_file_and_config_beats_it(monkeypatch, tmp_path, capsys):
    conf = tmp_path / "from-env.toml"
    conf.write_text(f'[[models]]\nname = "m"\ncheckpoint_dir = "{PYCODE}"\n')
    monkeypatch.setenv("NPUD_CONFIG", str(conf))
    assert npud_main.main(["--check-config"]) == 0
    assert capsys.readouterr().out.startswith(f"{conf}: OK (1 model(s)")
    # --model with a file: one model more, the file's socket (not a per-user daemon)
    assert npud_main.main(["--check-config", "--model", str(PYCODE)]) == 0
    # started by hand, root too: the per-user socket (npud_main.per_user; issue 42)
    assert capsys.readouterr().out.startswith(f"{conf}: OK (2 model(s), socket {userdirs.socket_path()}")
    other = tmp_path / "flag.toml"
    other.write_text("[thermal]\nenabled = false\n")
    assert npud_main.main(["--check-config", "--config", str(other)]) == 0
    assert capsys.readouterr().out.startswith(f"{other}: OK (0 model(s)")
    monkeypatch.setenv("NPUD_CONFIG", str(tmp_path / "missing.toml"))
    assert npud_main.main(["--check-config"]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_a_per_user_daemon_gives_its_user_the_whole_prefix_cache():
    # one user: no other to share the budget with (a system daemon splits it, docs/operations.md)
    assert npud_main.user_config("/tmp/x.sock", "/tmp/x").store.prefix_cache_users == 0
    assert parse_config({}).store.prefix_cache_users == 7


def test_no_config_and_no_model_says_both_ways(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("NPUD_CONFIG", raising=False)
    monkeypatch.setattr(npud_main, "DEFAULT_CONFIG_PATH", tmp_path / "npud.toml")
    assert npud_main.main([]) == 2
    err = capsys.readouterr().err
    assert f"no configuration file ({tmp_path / 'npud.toml'} does not exist)" in err
    assert "npud --model PATH" in err and "npud --config FILE" in err and "NPUD_CONFIG" in err
    assert npud_main.main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "--model" in (err := capsys.readouterr().err) and "no such file or directory" in err


def test_paths_in_the_config_expand_home_and_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NPUD_TEST_DIR", str(tmp_path / "var"))
    cfg = parse_config({
        "server": {"socket_path": "$NPUD_TEST_DIR/s.sock", "admin_group": "$NOT_A_PATH"},
        "store": {"state_dir": "~/state"},
        "thermal": {"paths": ["${NPUD_TEST_DIR}/t*", "~/temp"]},
        "metrics": {"textfile_path": "${NPUD_TEST_DIR}/npud.prom"},
        "models": [{"name": "m", "checkpoint_dir": "~/ckpt", "draft_dir": "$NPUD_TEST_DIR/draft"}],
    }, base_dir=tmp_path / "etc")
    assert cfg.server.socket_path == f"{tmp_path}/var/s.sock"
    assert cfg.server.admin_group == "$NOT_A_PATH"  # a group name, not a path: left alone
    assert cfg.store.state_dir == f"{tmp_path}/home/state"
    assert cfg.thermal.paths == (f"{tmp_path}/var/t*", f"{tmp_path}/home/temp")
    assert cfg.metrics.textfile_path == f"{tmp_path}/var/npud.prom"
    assert cfg.models[0].checkpoint_dir == f"{tmp_path}/home/ckpt"  # expanded, so not under base_dir
    assert cfg.models[0].draft_dir == f"{tmp_path}/var/draft"
    assert parse_config({"models": [{"name": "m", "checkpoint_dir": "rel"}]},
                        base_dir=tmp_path).models[0].checkpoint_dir == f"{tmp_path}/rel"
    monkeypatch.delenv("NPUD_TEST_UNSET", raising=False)
    with pytest.raises(DaemonConfigError, match="the environment variable NPUD_TEST_UNSET is not set") as info:
        parse_config({"store": {"state_dir": "${NPUD_TEST_UNSET}/npud"}})
    assert info.value.field == "store.state_dir"


# -- Hugging Face repo ids ---------------------------------------------------------------------------

def fake_hf_cache(hub: Path, repo_id: str, revisions: dict[str, Path], main: str | None) -> None:
    """The hub cache's layout as huggingface_hub writes it: models--org--name/{blobs, refs,
    snapshots/<commit>/<file> -> ../../blobs/<hash>}, with refs/main naming `main`."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for commit, source in revisions.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in source.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)


def test_a_repo_id_is_the_snapshot_refs_main_names(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    hub = tmp_path / "hub"
    old, new = "a" * 40, "b" * 40
    fake_hf_cache(hub, "npud-test/pycode", {old: PYCODE, new: PYCODE}, main=old)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    raw = {"models": [{"name": "m", "checkpoint_dir": "npud-test/pycode"}]}
    snapshot = hub / "models--npud-test--pycode" / "snapshots" / old
    assert parse_config(raw, base_dir=tmp_path).models[0].checkpoint_dir == str(snapshot)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert parse_config(raw, base_dir=tmp_path).models[0].checkpoint_dir == str(snapshot)
    # a directory of that name beside the config is a path, not a repo
    (tmp_path / "npud-test" / "pycode").mkdir(parents=True)
    assert parse_config(raw, base_dir=tmp_path).models[0].checkpoint_dir == str(tmp_path / "npud-test" / "pycode")


def test_npud_model_takes_a_cached_repo_id(monkeypatch, tmp_path, capsys):
    pytest.importorskip("huggingface_hub")
    fake_hf_cache(tmp_path / "hub", "npud-test/pycode", {"c" * 40: PYCODE}, main="c" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("NPUD_CONFIG", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert npud_main.main(["--check-config", "--model", "npud-test/pycode"]) == 0
    out = capsys.readouterr().out
    assert f"socket {tmp_path}/run/npud/npud.sock" in out and f"state {tmp_path}/state/npud" in out
    entry = npud_main.model_entry("npud-test/pycode")
    assert entry.name == "pycode" and entry.preload
    assert entry.checkpoint_dir == str(tmp_path / "hub" / "models--npud-test--pycode" / "snapshots" / ("c" * 40))


def test_a_repo_missing_from_the_cache_is_named_with_the_cache(monkeypatch, tmp_path, capsys):
    pytest.importorskip("huggingface_hub")
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    raw = {"models": [{"name": "m", "checkpoint_dir": "npud-test/absent"}]}
    with pytest.raises(DaemonConfigError) as info:  # no cache at all
        parse_config(raw, base_dir=tmp_path)
    assert "npud-test/absent" in str(info.value) and str(hub) in str(info.value)
    fake_hf_cache(hub, "npud-test/other", {"d" * 40: PYCODE}, main="d" * 40)
    with pytest.raises(DaemonConfigError) as info:  # a cache without that repo
        parse_config(raw, base_dir=tmp_path)
    message = str(info.value)
    assert info.value.field == "models[m].checkpoint_dir"
    assert f"no snapshot of npud-test/absent in the Hugging Face cache {hub}" in message
    assert "never downloads" in message
    assert npud_main.main(["--check-config", "--model", "npud-test/absent"]) == 2
    assert "no snapshot of npud-test/absent" in capsys.readouterr().err


# -- --check-config reads every model ----------------------------------------------------------------

def test_check_config_fails_on_a_model_that_would_not_load(tmp_path, capsys):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(PYCODE, tmp_path / name))

    bad_type = copy("bad-type")
    config = json.loads((bad_type / "config.json").read_text())
    (bad_type / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    (copy("no-tokenizer") / "tokenizer.json").unlink()
    truncated = copy("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:4])
    conf = tmp_path / "npud.toml"
    conf.write_text("".join(f'[[models]]\nname = "{n}"\ncheckpoint_dir = "{n}"\n'
                            for n in ("good", "bad-type", "no-tokenizer", "truncated")))
    copy("good")
    assert npud_main.main(["--check-config", "--config", str(conf)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and not any("models[good]" in line for line in lines)
    assert lines[0].startswith("npud: error: models[bad-type].checkpoint_dir: ") and "no-such-architecture" in lines[0]
    assert lines[1].startswith("npud: error: models[no-tokenizer].checkpoint_dir: ") and "tokenizer.json" in lines[1]
    assert lines[2].startswith("npud: error: models[truncated].checkpoint_dir: ") and "model.safetensors" in lines[2]


# -- preload and the cold start ------------------------------------------------------------------------

async def test_preload_loads_at_start_and_a_broken_one_is_only_logged(nursery, workdir):
    write_fake_checkpoint(workdir / "lazy")
    (workdir / "broken").mkdir()
    (workdir / "broken" / "fake.json").write_text("{ not json")
    cfg = make_config(workdir, models=[
        {"name": "broken", "checkpoint_dir": str(workdir / "broken"), "preload": True},
        {"name": "fake", "checkpoint_dir": str(workdir / "fake"), "preload": True},
        {"name": "lazy", "checkpoint_dir": str(workdir / "lazy")}])
    daemon = await start(nursery, cfg)
    with trio.fail_after(20):
        while daemon.registry.resident("fake") is None:
            await trio.sleep(0.01)
    assert daemon.registry.resident("lazy") is None and daemon.registry.resident("broken") is None
    async with await npc.AsyncClient.connect(cfg.server.socket_path) as c:
        events = []
        async for ev in (s := c.complete("a", model="fake", max_tokens=2)):  # no load to wait for
            events.append(ev.name)
        assert "model_loading" not in events and s.result["finish_reason"] == "length"
    daemon.request_stop()


async def test_a_cold_start_says_loading_model_before_the_tokens(nursery, workdir):
    cfg = make_config(workdir, knobs={"tokens_per_round": 1, "load_sleep_s": 0.3})
    daemon = await start(nursery, cfg)
    async with await npc.AsyncClient.connect(cfg.server.socket_path) as c:
        events = [(ev.name, ev.data) async for ev in c.complete("a", max_tokens=2)]
        names = [name for name, _ in events]
        assert names.index("model_loading") < names.index("model_loaded") < names.index("token")
        assert events[names.index("model_loading")][1] == {"model": "fake"}
        assert events[names.index("model_loaded")][1]["load_ms"] >= 300
        again = [ev.name async for ev in c.complete("b", max_tokens=2)]
        assert "model_loading" not in again and "model_loaded" not in again  # it stayed loaded
        # a stream that begins while the load is under way hears of it first
        daemon.registry.unload("fake")
        job = (await c.submit(["c"], max_tokens=2))["job"]
        with trio.fail_after(20):
            while daemon.jobs.active[job].loading_model is None:
                await trio.sleep(0.005)
        streamed = [ev.name async for ev in c.stream(job)]
        assert streamed[:2] == ["progress", "model_loading"] and "model_loaded" in streamed
    daemon.request_stop()


def test_tokens_per_second_leave_the_load_out():
    now = [0.0]
    p = Progress(1, clock=lambda: now[0])
    p.on_tokens(1, 0, 20)
    now[0] = 10.0
    assert p.tokens_per_s() == 2.0
    p.load_s = 8.0  # what model_loaded said
    assert p.tokens_per_s() == 10.0


def test_npuctl_submit_wait_says_loading_model(workdir):
    slow = write_fake_checkpoint(workdir / "slow", tokens_per_round=1, load_sleep_s=2.0)
    daemon = DaemonProc(workdir, [{"name": "slow", "checkpoint_dir": str(slow)}], fake_engine=True)
    try:
        daemon.start()
        run = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "submit", "--wait", "--max-tokens", "3", "-"],
                             input='{"prompt": "a"}\n', capture_output=True, text=True, timeout=60, cwd=REPO,
                             env=python_env(daemon.socket))
        assert run.returncode == 0, run.stderr
        assert run.stderr.splitlines()[0] == "loading model slow"
        assert run.stderr.splitlines()[1].startswith("prompt 1/1 done (line 1, job 1, length); ")
    finally:
        daemon.terminate()
        daemon.stop()


# (the first run for real, as an ordinary user from the README's own commands: tests/test_readme_first_run.py)


async def test_a_reload_keeps_the_models_of_the_command_line(nursery, workdir):
    cfg = make_config(workdir)  # the fake model in workdir/fake
    conf = workdir / "npud.toml"
    conf.write_text(f'[server]\nsocket_path = "{cfg.server.socket_path}"\n[store]\nstate_dir = "{workdir}/state"\n'
                    f'[thermal]\nenabled = false\n[errors]\nsource = "{workdir}/kmsg"\n'
                    f'[[models]]\nname = "configured"\ncheckpoint_dir = "{workdir}/fake"\n')
    extra = write_fake_checkpoint(workdir / "extra")
    args = npud_main._parser().parse_args(["--config", str(conf), "--model", str(extra)])
    overrides = npud_main._overrides(args, (npud_main.model_entry(str(extra)),))
    from npud.config import load_config
    from npud.daemon import Daemon

    daemon = await nursery.start(Daemon(overrides(load_config(conf)), config_path=conf, overrides=overrides,
                                        loader=fakes_load_model).run)
    assert daemon.registry.names == ("extra", "configured")
    await daemon.reload()  # SIGHUP reads the file again; --model is not in it
    assert daemon.registry.names == ("extra", "configured")
    daemon.request_stop()
