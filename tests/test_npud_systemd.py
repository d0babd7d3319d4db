"""systemd/ and npud's side of the systemd protocols, for real where the tools exist:
`systemd-analyze verify` and `security` on the installed units, sysusers and tmpfiles applied
to a scratch root, the example configuration read by npud's own loader, socket activation
under `systemd-socket-activate`, sd_notify received on a datagram socket, and the JSON log
lines on stdout.

Without Debian's systemd package the tool-based tests skip, saying so; .ci/run installs it
(`apt-get install -y systemd`).

Mutants these tests kill: npud unlinking (or not taking) the socket it was passed; no
STOPPING=1; the journald priority prefix on a stream that is not the journal; a setting of the
example without its comment; the hardening section dropped from the unit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import structlog

from npud.clients.client import NotFound
from npud import config as config_module
from npud.config import LoggingConfig, load_config
from npud.logsetup import setup_logging
from npud.systemd import listen_fds, sd_notify, watchdog_interval
from test_npud_support import (REPO, TESTS, DaemonProc, expected_text, short_tempdir, wait_for,
                               write_fake_checkpoint)

SYSTEMD = REPO / "systemd"
INSTALL = REPO / "tools" / "install-systemd.sh"
APT_HINT = "install Debian's systemd package: apt-get install -y systemd"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed ({APT_HINT})")
    return path


def npud_executable() -> str:
    """The installed npud entry point, for ExecStart= (systemd-analyze checks that it exists)."""
    path = shutil.which("npud", path=str(Path(sys.executable).parent)) or shutil.which("npud")
    if path is None:
        pytest.skip("no npud executable to put in ExecStart= (pip install -e . makes one)")
    return path


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The units as tools/install-systemd.sh puts them in place, under a scratch root."""
    root = tmp_path_factory.mktemp("root")
    run = subprocess.run(["bash", str(INSTALL), "--root", str(root), "--npud", npud_executable()],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return root


# -- reading unit files ----------------------------------------------------------------------------

def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}}; a key may repeat (DeviceAllow=), as systemd allows."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def sysusers_names(path: Path) -> tuple[set[str], set[str]]:
    """(users, groups) that a sysusers.d file declares ('u' makes a group of the same name)."""
    users, groups = set(), set()
    for line in path.read_text().splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if fields[0] == "u":
            users.add(fields[1])
            groups.add(fields[1])
        elif fields[0] == "g":
            groups.add(fields[1])
    return users, groups


# -- systemd-analyze ----------------------------------------------------------------------------

def verify_problems(*units: Path) -> list[str]:
    """What `systemd-analyze verify` says about our units: an exit status or any line naming them."""
    run = subprocess.run([need("systemd-analyze"), "verify", *map(str, units)], capture_output=True, text=True,
                         timeout=120)
    problems = [line for line in (run.stdout + run.stderr).splitlines() if "npud" in line]
    if run.returncode != 0:
        problems.append(f"exit status {run.returncode}: {run.stderr.strip()}")
    return problems


def test_the_installed_units_pass_systemd_analyze_verify(installed, tmp_path):
    units = installed / "etc" / "systemd" / "system"
    assert verify_problems(units / "npud.service", units / "npud.socket") == []
    # the check sees a mistake when there is one: a misspelt key is only a warning to systemd
    broken = tmp_path / "npud.service"
    broken.write_text((units / "npud.service").read_text().replace("ProtectHome=", "ProtectHomes="))
    assert any("ProtectHomes" in p for p in verify_problems(broken, units / "npud.socket"))


def test_the_tcp_drop_in_verifies_and_opens_loopback_only(installed, tmp_path):
    """systemd/npud.service.d/tcp.conf (docs/operations.md): the unit with it passes `verify`,
    which reads it (a misspelt key in it is reported), and it leaves npud loopback only."""
    drop_in = SYSTEMD / "npud.service.d" / "tcp.conf"
    units = tmp_path / "units"
    (units / "npud.service.d").mkdir(parents=True)
    for name in ("npud.service", "npud.socket"):
        shutil.copy(installed / "etc" / "systemd" / "system" / name, units / name)
    shutil.copy(drop_in, units / "npud.service.d" / "tcp.conf")
    assert verify_problems(units / "npud.service", units / "npud.socket") == []
    (units / "npud.service.d" / "tcp.conf").write_text(drop_in.read_text().replace("IPAddressAllow=", "IPAddressAlow="))
    assert any("IPAddressAlow" in p for p in verify_problems(units / "npud.service", units / "npud.socket"))
    unit, extra = unit_settings(units / "npud.service")["Service"], unit_settings(drop_in)["Service"]
    assert unit["PrivateNetwork"] == ["yes"] and unit["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert extra["PrivateNetwork"] == ["no"]
    assert extra["RestrictAddressFamilies"] == ["", "AF_UNIX AF_INET AF_INET6"]  # reset, then the new list
    assert unit["IPAddressDeny"] == ["any"] and "IPAddressDeny" not in extra and extra["IPAddressAllow"] == ["localhost"]


def test_the_user_unit_passes_systemd_analyze_verify_and_uses_the_user_paths(tmp_path):
    """systemd/user/npud.service, checked by `systemd-analyze --user verify` (which needs a
    runtime directory for the user manager it models) with ExecStart= naming a real npud."""
    unit = tmp_path / "npud.service"
    text = (SYSTEMD / "user" / "npud.service").read_text()
    assert "\nExecStart=%h/.local/bin/npud " in text
    unit.write_text(text.replace("ExecStart=%h/.local/bin/npud ", f"ExecStart={npud_executable()} "))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)

    def problems(path: Path) -> list[str]:
        run = subprocess.run([need("systemd-analyze"), "--user", "verify", str(path)], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
        found = [line for line in (run.stdout + run.stderr).splitlines() if "npud" in line]
        return found + ([f"exit status {run.returncode}: {run.stderr.strip()}"] if run.returncode else [])

    assert problems(unit) == []
    broken = tmp_path / "broken" / "npud.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    assert any("NoNewPrivilege" in p for p in problems(broken))
    service = unit_settings(SYSTEMD / "user" / "npud.service")["Service"]
    # the socket and store where `npud --model` puts them (npud/userdirs.py): %t is
    # $XDG_RUNTIME_DIR and %S is $XDG_STATE_HOME (~/.local/state) in a user manager
    assert service["ExecStart"][0].endswith(" --config %E/npud/npud.toml --socket %t/npud/npud.sock "
                                            "--state-dir %S/npud")
    assert service["RuntimeDirectory"] == ["npud"] == service["StateDirectory"]
    assert service["RuntimeDirectoryMode"] == ["0700"] and service["Type"] == ["notify"]
    assert "User" not in service and "AmbientCapabilities" not in service  # a user manager grants neither
    assert service["LimitMEMLOCK"] == ["infinity"]  # NPU buffers are pinned, as in the system unit


def test_the_service_is_hardened(installed, tmp_path):
    analyze = need("systemd-analyze")
    service = installed / "etc" / "systemd" / "system" / "npud.service"

    def exposure_ok(path: Path) -> bool:
        # --threshold is on systemd's 0..100 scale: 15 is "1.5" on the 0..10 scale it prints
        run = subprocess.run([analyze, "security", "--offline=yes", "--threshold=15", str(path)],
                             capture_output=True, text=True, timeout=120)
        if "--offline" in run.stderr and "unrecognized" in run.stderr:
            pytest.skip("this systemd-analyze has no offline security review (systemd >= 250 has)")
        return run.returncode == 0

    assert exposure_ok(service)
    text = service.read_text()
    weaker = tmp_path / "npud.service"
    weaker.write_text(text[:text.index("# -- hardening")] + text[text.index("[Install]"):])
    assert not exposure_ok(weaker)


def test_sysusers_and_tmpfiles_apply_to_a_fresh_root(tmp_path):
    sysusers, tmpfiles = need("systemd-sysusers"), need("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    run = subprocess.run([sysusers, f"--root={tmp_path}", str(SYSTEMD / "npud.sysusers")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    group = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert {"npud", "npu", "npud-admin", "render"} <= set(group)
    name, _, uid, gid, _, home, shell = passwd["npud"]
    assert group["npud"][2] == gid and home == "/var/lib/npud" and shell.endswith("nologin")
    run = subprocess.run([tmpfiles, f"--root={tmp_path}", "--create", str(SYSTEMD / "npud.tmpfiles")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    st = (tmp_path / "run" / "npud").stat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755
    assert (st.st_uid, st.st_gid) == (int(uid), int(gid))  # npud's, as the root's passwd says


def test_units_sysusers_and_example_config_agree():
    service = unit_settings(SYSTEMD / "npud.service")["Service"]
    sock = unit_settings(SYSTEMD / "npud.socket")["Socket"]
    cfg = load_config(SYSTEMD / "npud.toml")
    users, groups = sysusers_names(SYSTEMD / "npud.sysusers")

    assert sock["ListenStream"] == [cfg.server.socket_path]
    assert sock["SocketGroup"] == [cfg.server.socket_group] and int(sock["SocketMode"][0], 8) == cfg.server.socket_mode
    assert service["User"][0] in users and service["Group"][0] in groups
    assert set(service["SupplementaryGroups"][0].split()) | {cfg.server.socket_group, cfg.server.admin_group} <= groups
    assert service["StateDirectory"] == ["npud"] and cfg.store.state_dir == "/var/lib/npud"
    assert service["RuntimeDirectory"] == ["npud"] and os.path.dirname(cfg.server.socket_path) == "/run/npud"
    assert service["ConfigurationDirectory"] == ["npud"]
    assert service["ExecStart"][0].endswith(" --config /etc/npud/npud.toml")
    assert "d /run/npud 0755 npud npud -" in (SYSTEMD / "npud.tmpfiles").read_text()
    assert int(service["TimeoutStopSec"][0].rstrip("s")) > 2 * cfg.server.drain_timeout_s
    # readiness, restart, and the hardening the error guard and the device still work under
    assert service["Type"] == ["notify"] and service["Restart"] == ["on-failure"]
    assert service["AmbientCapabilities"] == ["CAP_SYSLOG"] == service["CapabilityBoundingSet"]
    assert service["ProtectKernelLogs"] == ["no"] and "/dev/kmsg r" in service["DeviceAllow"]
    assert "char-accel rw" in service["DeviceAllow"] and service["DevicePolicy"] == ["closed"]
    assert service["LimitMEMLOCK"] == ["infinity"]  # NPU buffers are pinned memory (xdna-driver README)
    for key, want in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                      ("PrivateTmp", "yes"), ("PrivateDevices", None), ("MemoryDenyWriteExecute", None)):
        assert service.get(key, [None]) == [want], key


# -- the example configuration ---------------------------------------------------------------

# settings whose example value is not the default, on purpose (the header of npud.toml says so)
EXAMPLE_NOT_DEFAULT = {"server.socket_group", "http.tcp_owner_uid"}


def test_the_example_config_loads_and_shows_every_setting():
    raw = tomllib.loads((SYSTEMD / "npud.toml").read_text())
    cfg = load_config(SYSTEMD / "npud.toml")  # npud's own loader: every value valid
    assert cfg.default_model == raw["default_model"] and cfg.models
    for section, cls in config_module._SECTIONS.items():
        assert section in raw, section
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}"
            assert f.name in raw[section], f"the example has no {name}"
            if name not in EXAMPLE_NOT_DEFAULT:
                assert getattr(getattr(cfg, section), f.name) == getattr(cls(), f.name), f"{name} is not the default"
    assert {f.name for f in dataclasses.fields(config_module.DaemonConfig)} == set(config_module._SECTIONS) | {
        "models", "default_model"}
    fields = {f.name for f in dataclasses.fields(config_module.ModelEntry)}
    for entry in raw["models"]:
        assert set(entry) <= fields
    # every model setting is shown by some entry (a Gemma 4 assistant and a Qwen3 draft model
    # cannot sit in one)
    assert set().union(*raw["models"]) == fields


def test_every_setting_in_the_example_is_commented():
    lines = (SYSTEMD / "npud.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+ = ", line):
            inline = line.split("=", 1)[1].partition("#")[2].strip()
            above = lines[i - 1].lstrip("#").strip() if i > 0 and lines[i - 1].startswith("#") else ""
            documented = bool(inline or above)
            assert documented, f"line {i + 1} has no comment: {line}"


# -- the protocols, in this process ------------------------------------------------------------

def test_sd_notify_sends_one_datagram_to_an_abstract_socket(monkeypatch):
    name = f"npud-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify("READY=1", "STATUS=serving") is True
        assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sd_notify("READY=1") is False
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd_notify("READY=1") is False


def test_watchdog_interval_is_half_the_timeout_for_this_process_only(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    with pytest.raises(RuntimeError, match="WATCHDOG_USEC"):
        watchdog_interval()


def test_listen_fds_takes_only_what_was_passed_to_this_process(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_FDNAMES", "npud.socket")
    assert listen_fds() == []
    assert not {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} & set(os.environ)  # nothing later takes them
    assert listen_fds() == []
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "0")
    assert listen_fds() == []
    monkeypatch.setenv("LISTEN_PID", "me")
    monkeypatch.setenv("LISTEN_FDS", "1")
    with pytest.raises(RuntimeError, match="LISTEN_PID"):
        listen_fds()


def test_log_lines_carry_the_journald_priority_only_on_the_journal_stream(monkeypatch, tmp_path):
    path = tmp_path / "stdout"
    log = structlog.get_logger("test")
    try:
        with open(path, "w") as stream:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
            setup_logging(LoggingConfig(format="json"), stream)
            log.info("plain_line", job=1)
            st = os.fstat(stream.fileno())
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
            setup_logging(LoggingConfig(format="json"), stream)
            log.info("journal_line", job=2)
            log.error("journal_error")
            log.debug("filtered_out")
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")  # another stream
            setup_logging(LoggingConfig(format="json"), stream)
            log.warning("plain_again")
    finally:
        structlog.reset_defaults()
    lines = path.read_text().splitlines()
    assert len(lines) == 4  # the debug line is below the level
    assert lines[0].startswith('{"') and lines[3].startswith('{"')
    assert lines[1].startswith("<6>{") and lines[2].startswith("<3>{")
    assert json.loads(lines[1][3:])["event"] == "journal_line" and json.loads(lines[2][3:])["level"] == "error"
    assert [json.loads(lines[i])["event"] for i in (0, 3)] == ["plain_line", "plain_again"]


# -- real daemon processes on the fake engine ------------------------------------------------------

def fake_daemon(**sections) -> DaemonProc:
    workdir = short_tempdir()
    models = [{"name": "fake", "checkpoint_dir": str(write_fake_checkpoint(workdir / "fake", tokens_per_round=2))},
              {"name": "slow", "checkpoint_dir": str(write_fake_checkpoint(workdir / "slow", tokens_per_round=1,
                                                                           round_sleep_s=0.02))}]
    return DaemonProc(workdir, models, fake_engine=True, **sections)


@pytest.fixture
def daemons():
    made: list[DaemonProc] = []

    def make(**sections) -> DaemonProc:
        made.append(fake_daemon(**sections))
        return made[-1]

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


class NotifyReceiver:
    """A datagram socket in the role of systemd's notify socket, read by a thread (the kernel
    queues only a few datagrams; a sender to a full queue would wait)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def all(self) -> list[dict[str, str]]:
        with self._lock:
            return [m for _, m in self.messages]

    def first(self, predicate, what: str, timeout: float = 30.0, after: int = 0) -> int:
        """Index of the first message at or after `after` that satisfies predicate."""
        def found():
            return next((i + 1 for i, m in enumerate(self.all()) if i >= after and predicate(m)), None)
        return wait_for(found, timeout, what=what) - 1

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def test_sd_notify_ready_status_watchdog_reload_and_stopping(daemons):
    d = daemons()
    receiver = NotifyReceiver(d.dir / "notify")
    try:
        d.start(env={"NOTIFY_SOCKET": receiver.path, "WATCHDOG_USEC": "200000"})
        ready = receiver.first(lambda m: m.get("READY") == "1", "READY=1")
        messages = receiver.all()
        assert messages[0] == {"STATUS": "recovering queued jobs from the store"}  # before READY=1
        status = messages[ready]["STATUS"]
        assert re.fullmatch(r"serving, GEMMs on host \(no \S+/accel\* node: no NPU, or the amdxdna driver is not "
                            r"loaded\); idle; queue 0 interactive, 0 batch; thermal ok 40C; 0 amdxdna error\(s\)",
                            status), status
        # WATCHDOG_USEC=0.2 s: a ping every 0.1 s
        start = len(receiver.all())
        time.sleep(1.0)
        pings = sum(1 for m in receiver.all()[start:] if m == {"WATCHDOG": "1"})
        assert 4 <= pings <= 15, pings

        with d.client() as c:
            # 250 rounds of 20 ms: the error is counted while the prompt runs, and the fault is
            # found when it finishes (its result is not committed) and the device quarantined
            job = c.submit(["long"], model="slow", max_tokens=250)["job"]
            receiver.first(lambda m: f"of job {job} holds the device" in m.get("STATUS", ""), "STATUS with the holder")
            d.add_kmsg(d.kmsg_error)
            receiver.first(lambda m: "QUARANTINED" in m.get("STATUS", "") and "1 amdxdna error(s)" in m["STATUS"],
                           "STATUS with the quarantine")
            c.device_clear()
            c.cancel(job)

        before = len(receiver.all())
        d.hup()
        reloading = receiver.first(lambda m: m.get("RELOADING") == "1", "RELOADING=1", after=before)
        assert int(receiver.all()[reloading]["MONOTONIC_USEC"]) > 0
        receiver.first(lambda m: m.get("READY") == "1", "READY=1 after the reload", after=reloading)

        before = len(receiver.all())
        assert d.terminate() == 0
        stopping = receiver.first(lambda m: m.get("STOPPING") == "1", "STOPPING=1", after=before)
        assert receiver.all()[stopping]["STATUS"].startswith("stopping")
    finally:
        receiver.close()


def test_socket_activation_serves_jobs_on_the_passed_socket(daemons):
    tool = need("systemd-socket-activate")
    d = daemons()
    log = open(d.log_path, "ab")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    # systemd-socket-activate hands the child a clean environment: -E passes what it needs
    d.proc = subprocess.Popen([tool, "-l", d.socket, "-E", f"PYTHONPATH={REPO}{os.pathsep}{TESTS}",
                               *d.argv()],
                              stdout=log, stderr=subprocess.STDOUT, cwd=str(d.dir), env=env)
    log.close()
    wait_for(lambda: os.path.exists(d.socket), 30, what="systemd-socket-activate to listen")
    mode = os.stat(d.socket).st_mode
    time.sleep(0.5)
    assert d.events("daemon_starting") == []  # nothing runs until a client connects
    with d.client() as c:  # this connection starts npud, which accepts it on the passed socket
        job = c.submit(["one two", "three"], max_tokens=5)["job"]
        wait_for(lambda: c.status(job)["state"] == "done", 60, what="the job")
        texts = [r["text"] for r in c.result(job)["results"]]
    assert texts == [expected_text("one two", 5), expected_text("three", 5)]
    [inherited] = d.events("socket_inherited")
    assert inherited["path"] == d.socket and d.events("socket_listening") == []
    assert d.events("daemon_ready")[0]["socket_activated"] is True
    assert d.terminate() == 0
    # the socket is the activator's: npud neither changed nor removed it
    assert os.path.exists(d.socket) and os.stat(d.socket).st_mode == mode


def test_a_passed_socket_that_is_not_a_stream_is_refused_clearly(daemons):
    tool = need("systemd-socket-activate")
    d = daemons()
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    proc = subprocess.Popen([tool, "--datagram", "-l", d.socket, "-E", f"PYTHONPATH={REPO}{os.pathsep}{TESTS}",
                             *d.argv()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(d.dir), env=env)
    try:
        wait_for(lambda: os.path.exists(d.socket), 30, what="systemd-socket-activate to listen")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"hello", d.socket)  # a datagram starts the service
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1
    assert "not a listening Unix stream socket (family AF_UNIX, type SOCK_DGRAM" in stderr


ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
EVENT_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def test_every_log_line_on_stdout_is_json_with_its_ids(daemons):
    d = daemons(logging={"level": "debug", "format": "json"})
    d.start(stderr_path=d.dir / "stderr")
    with d.client() as c:
        c.hello("test")
        job = c.submit(["a b", "c"], max_tokens=3)["job"]
        wait_for(lambda: c.status(job)["state"] == "done", 60, what="the job")
        interactive = c.complete("d e", max_tokens=2).wait()["job"]
        with pytest.raises(NotFound):
            c.status(10**6)
        tickets = {t["ticket"]: t["job"] for t in c.tickets()["tickets"]}
    assert d.terminate() == 0
    lines = [line for line in d.log_path.read_text().splitlines() if line.strip()]
    assert len(lines) > 10
    events = []
    for line in lines:
        entry = json.loads(line)  # every line, not only those that look like JSON
        assert isinstance(entry, dict), line
        assert ISO_UTC.match(entry["timestamp"]), line
        datetime.datetime.fromisoformat(entry["timestamp"])
        assert entry["level"] in ("debug", "info", "warning", "error", "critical"), line
        assert EVENT_NAME.match(entry["event"]), line
        events.append(entry)
    names = [e["event"] for e in events]
    for name in ("daemon_starting", "daemon_ready", "connection_opened", "client_hello", "job_accepted",
                 "ticket_queued", "ticket_granted", "ticket_released", "job_done", "connection_closed",
                 "shutdown_started", "daemon_stopped"):
        assert name in names, name
    for e in events:
        if e["event"] in ("ticket_queued", "ticket_granted", "ticket_released"):
            assert tickets[e["ticket"]] == e["job"], e  # the bound ids are the ticket's and its job's
        if e["event"] in ("job_accepted", "job_done", "model_loaded"):
            assert e["job"] in (job, interactive), e
        if e["event"] in ("connection_opened", "connection_closed", "client_hello", "job_accepted"):
            assert isinstance(e["conn"], int), e
        if e["event"] == "ticket_queued":
            assert isinstance(e["conn"], int), e  # queued by a request: its connection is bound too
    assert {e["job"] for e in events if e["event"] == "job_done"} == {job, interactive}
