"""The daemon's configuration: every field validated, errors name the field, --check-config."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npud.config import DaemonConfigError, diff_for_reload, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent


def test_defaults_are_valid_and_frozen():
    cfg = parse_config({})
    assert cfg.server.socket_mode == 0o660 and cfg.models == () and cfg.default_model_name is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.socket_path = "/x"


@pytest.mark.parametrize("raw, field", [
    ({"server": {"socket_mode": 0o666}}, "server.socket_mode"),
    ({"server": {"socket_path": "/" + "x" * 120}}, "server.socket_path"),
    ({"server": {"max_connections": 0}}, "server.max_connections"),
    ({"server": {"max_conections": 5}}, "server.max_conections"),
    ({"limits": {"max_tokens": "3"}}, "limits.max_tokens"),
    ({"limits": {"max_line_bytes": 10}}, "limits.max_line_bytes"),
    ({"limits": {"max_prompt_tokens": True}}, "limits.max_prompt_tokens"),
    ({"store": {"retention_days": -1}}, "store.retention_days"),
    ({"store": {"prefix_cache_users": -1}}, "store.prefix_cache_users"),
    ({"store": {"prefix_cache_users": 65}}, "store.prefix_cache_users"),
    ({"scheduler": {"quantum_tokens": 0}}, "scheduler.quantum_tokens"),
    ({"thermal": {"resume_below_c": 96.0}}, "thermal.resume_below_c"),
    ({"thermal": {"abort_above_c": 90.0}}, "thermal.abort_above_c"),
    ({"thermal": {"paths": "/sys/x"}}, "thermal.paths"),
    ({"errors": {"patterns": ["amdxdna ("]}}, "errors.patterns[0]"),
    ({"errors": {"pre_hang_patterns": ["("]}}, "errors.pre_hang_patterns[0]"),
    ({"logging": {"level": "loud"}}, "logging.level"),
    ({"engine": {"module": "npud.engine.session"}}, "engine"),  # gone: models come from npud.engine.loader.load_model
    ({"models": [{"name": "a"}]}, "models[0].checkpoint_dir"),
    ({"models": [{"name": "bad name", "checkpoint_dir": "x"}]}, "models.name"),
    ({"models": [{"name": "a", "checkpoint_dir": "x", "weight_format": "fp8"}]}, "models[a].weight_format"),
    ({"models": [{"name": "a", "checkpoint_dir": "x"}, {"name": "a", "checkpoint_dir": "y"}]}, "models.name"),
    ({"models": [{"name": "a", "checkpoint_dir": "x"}], "default_model": "b"}, "default_model"),
    ({"modles": []}, "modles"),
    # TOML has nan and inf: an idle timeout of nan reset every connection, a drain timeout of nan made
    # SIGTERM exit 1 (issue 17, defect 7)
    ({"server": {"idle_timeout_s": float("nan")}}, "server.idle_timeout_s"),
    ({"server": {"drain_timeout_s": float("nan")}}, "server.drain_timeout_s"),
    ({"server": {"line_timeout_s": float("inf")}}, "server.line_timeout_s"),
    ({"server": {"idle_timeout_s": -1.0}}, "server.idle_timeout_s"),
    ({"thermal": {"hold_above_c": float("nan")}}, "thermal.hold_above_c"),
    ({"scheduler": {"quantum_ms": float("-inf")}}, "scheduler.quantum_ms"),
    ({"server": {"max_connections_per_uid": 0}}, "server.max_connections_per_uid"),
    ({"server": {"max_connections": 4, "admin_reserved_connections": 4}}, "server.admin_reserved_connections"),
])
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(DaemonConfigError) as info:
        parse_config(raw)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field)


def test_relative_model_paths_are_taken_from_the_config_file(tmp_path):
    (tmp_path / "npud.toml").write_text('[[models]]\nname = "m"\ncheckpoint_dir = "ckpt"\ndraft_dir = "d"\n')
    cfg = load_config(tmp_path / "npud.toml")
    assert cfg.models[0].checkpoint_dir == str(tmp_path / "ckpt")
    assert cfg.models[0].draft_dir == str(tmp_path / "d")
    assert cfg.default_model_name == "m"


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(DaemonConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[server\n")
    with pytest.raises(DaemonConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_reload_keeps_what_cannot_change():
    old = parse_config({"server": {"socket_path": "/run/a.sock"}, "limits": {"max_tokens": 10}})
    new = parse_config({"server": {"socket_path": "/run/b.sock"}, "limits": {"max_tokens": 20},
                        "store": {"state_dir": "/elsewhere"}})
    merged, ignored = diff_for_reload(old, new)
    assert merged.server.socket_path == "/run/a.sock" and merged.store.state_dir == old.store.state_dir
    assert merged.limits.max_tokens == 20
    assert ignored == ["server.socket_path", "store.state_dir"]


def _npud(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "npud", *args], capture_output=True, text=True, env=env, timeout=60)


def test_check_config_command(tmp_path):
    good = tmp_path / "good.toml"  # the bundled model: --check-config reads its config, tokenizer and weights
    good.write_text(f'[[models]]\nname = "m"\ncheckpoint_dir = "{REPO / "npud" / "models" / "pycode-base"}"\n')
    done = _npud("--check-config", "--config", str(good))
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[thermal]\nhold_above_c = "hot"\n')
    done = _npud("--check-config", "--config", str(bad))
    assert done.returncode == 2 and "thermal.hold_above_c" in done.stderr
    missing = tmp_path / "missing.toml"
    missing.write_text('[[models]]\nname = "m"\ncheckpoint_dir = "nowhere"\n')
    done = _npud("--check-config", "--config", str(missing))
    assert done.returncode == 2 and "models[m].checkpoint_dir" in done.stderr and "does not exist" in done.stderr
    assert "not a directory" not in done.stderr


def test_check_config_says_what_is_wrong_with_the_file(tmp_path):
    for text in ("", "# only a comment\n\n"):  # a file that sets nothing is an error, with a hint
        empty = tmp_path / "empty.toml"
        empty.write_text(text)
        done = _npud("--check-config", "--config", str(empty))
        assert done.returncode == 2 and "the file sets nothing" in done.stderr and "systemd/npud.toml" in done.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text('[server]\nsocket_path = "/tmp/x.sock"\n[[models]\n')
    done = _npud("--check-config", "--config", str(broken))
    assert done.returncode == 2 and "not valid TOML" in done.stderr and "line 3, column" in done.stderr
    assert "create it" not in done.stderr  # the file is there: no "create the file" hint
    done = _npud("--check-config", "--config", str(tmp_path / "absent.toml"))
    assert done.returncode == 2 and "create it" in done.stderr


def test_a_second_daemon_on_the_same_socket_refuses_to_start(tmp_path):
    import socket

    path = str(tmp_path / "s.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket_path = "{path}"\n[store]\nstate_dir = "{tmp_path / "state"}"\n'
                   '[thermal]\nenabled = false\n[errors]\nenabled = false\n')
    try:
        done = _npud("--config", str(cfg))
    finally:
        live.close()
    assert done.returncode == 1 and "already listening" in done.stderr


def test_logs_are_json_lines_when_not_a_tty_and_filtered_by_level():
    import io
    import json

    import structlog

    from npud.config import LoggingConfig
    from npud.logsetup import setup_logging

    try:
        out = io.StringIO()  # not a TTY
        setup_logging(LoggingConfig(level="info", format="auto"), stream=out)
        with structlog.contextvars.bound_contextvars(conn=7):
            structlog.get_logger("npud.test").info("ticket_granted", ticket=3)
        structlog.get_logger("npud.test").debug("too_detailed")
        [line] = out.getvalue().splitlines()
        record = json.loads(line)
        assert record["event"] == "ticket_granted" and record["ticket"] == 3 and record["conn"] == 7
        assert record["level"] == "info" and record["timestamp"].endswith("Z")
    finally:
        structlog.reset_defaults()


def test_device_backend_is_validated():
    from npud.config import DeviceConfig

    assert DeviceConfig().backend == "auto"
    with pytest.raises(DaemonConfigError, match="device.backend"):
        DeviceConfig(backend="gpu")


# -- [http]: the HTTP front end's sockets ------------------------------------------------------


def test_http_listens_beside_the_main_socket_by_default():
    cfg = parse_config({"server": {"socket_path": "/run/x/npud.sock"}})
    assert cfg.http.enabled and cfg.http.tcp_address == ""
    assert cfg.http.unix_path(cfg.server) == "/run/x/http.sock"
    assert parse_config({"http": {"socket_path": "/tmp/h.sock"}}).http.unix_path(cfg.server) == "/tmp/h.sock"


@pytest.mark.parametrize("http, field, words", [
    ({"tcp_address": "0.0.0.0:8080", "tcp_owner_uid": 1000}, "http.tcp_address", "not a loopback address"),
    ({"tcp_address": "192.168.1.5:8080", "tcp_owner_uid": 1000, "allow_remote": True}, "http.allow_remote",
     "needs http.bearer_token"),
    # a loopback address too: the docs promise the token with allow_remote (issue 26)
    ({"tcp_address": "127.0.0.1:8080", "tcp_owner_uid": 1000, "allow_remote": True}, "http.allow_remote",
     "needs http.bearer_token"),
    ({"tcp_address": "127.0.0.1:8080"}, "http.tcp_owner_uid", "is required"),
    ({"tcp_address": "localhost:8080", "tcp_owner_uid": 1000}, "http.tcp_address", "HOST:PORT"),
    ({"tcp_address": "127.0.0.1", "tcp_owner_uid": 1000}, "http.tcp_address", "HOST:PORT"),
    ({"tcp_address": "127.0.0.1:70000", "tcp_owner_uid": 1000}, "http.tcp_address", "HOST:PORT"),
    ({"bearer_token": "short"}, "http.bearer_token", "at least 16"),
    ({"tcp_owner_uid": -1}, "http.tcp_owner_uid", "a uid"),
    ({"tcp_owner_uid": "1000"}, "http.tcp_owner_uid", "an integer"),
    ({"socket_path": "/run/npud/npud.sock"}, "http.socket_path", "must differ"),
    ({"port": 8080}, "http.port", "unknown field"),
])
def test_bad_http_settings_name_the_field(http, field, words):
    with pytest.raises(DaemonConfigError) as info:
        parse_config({"http": http})
    assert info.value.field == field and words in str(info.value)
    assert "short" not in str(info.value) or field != "http.bearer_token"  # a token is never echoed


@pytest.mark.parametrize("http", [
    {"tcp_address": "127.0.0.1:8080", "tcp_owner_uid": 1000},
    {"tcp_address": "[::1]:0", "tcp_owner_uid": 0},
    {"tcp_address": "127.0.0.2:8080", "tcp_owner_uid": 1000, "bearer_token": "x" * 16},
    {"tcp_address": "192.168.1.5:8080", "tcp_owner_uid": 1000, "allow_remote": True, "bearer_token": "y" * 32},
    {"enabled": False, "socket_path": "/run/npud/npud.sock"},
])
def test_good_http_settings(http):
    assert parse_config({"http": http}).http.tcp_address == http.get("tcp_address", "")


def test_reload_keeps_the_http_listeners():
    old = parse_config({"http": {"tcp_address": "127.0.0.1:8080", "tcp_owner_uid": 1000}})
    new = parse_config({"http": {"tcp_address": "127.0.0.1:9090", "tcp_owner_uid": 1001, "socket_path": "/tmp/h.sock",
                                 "bearer_token": "z" * 16}})
    merged, ignored = diff_for_reload(old, new)
    assert merged.http.tcp_address == "127.0.0.1:8080" and merged.http.socket_path == ""
    assert merged.http.tcp_owner_uid == 1001 and merged.http.bearer_token == "z" * 16  # these apply at once
    assert set(ignored) == {"http.tcp_address", "http.socket_path"}
