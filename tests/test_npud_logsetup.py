"""npud/logsetup.py: the console renderer honours NO_COLOR (https://no-color.org)."""

from __future__ import annotations

import io

import pytest
import structlog

from npud.config import LoggingConfig
from npud.logsetup import setup_logging

ESC = "\x1b["


def console_line(monkeypatch, no_color: str | None) -> str:
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    stream = io.StringIO()
    try:
        setup_logging(LoggingConfig(format="console"), stream)
        structlog.get_logger("t").warning("ticket_granted", job=3)
    finally:
        structlog.reset_defaults()
    return stream.getvalue()


def test_console_logs_are_coloured_unless_no_color_is_set(monkeypatch):
    assert ESC in console_line(monkeypatch, None)
    assert ESC in console_line(monkeypatch, "")  # set but empty: no-color.org says colours stay
    plain = console_line(monkeypatch, "1")
    assert ESC not in plain
    assert "ticket_granted" in plain and "job=3" in plain and "warning" in plain


@pytest.mark.parametrize("fmt", ["json", "auto"])
def test_no_color_does_not_change_json_lines(monkeypatch, fmt):
    monkeypatch.setenv("NO_COLOR", "1")
    stream = io.StringIO()  # not a TTY: auto is JSON
    try:
        setup_logging(LoggingConfig(format=fmt), stream)
        structlog.get_logger("t").info("job_accepted", job=1)
    finally:
        structlog.reset_defaults()
    assert stream.getvalue().startswith('{"') and '"event": "job_accepted"' in stream.getvalue()


# -- issue 42: a hand-started npud shows one line per request; JSON logs stay JSON ------------------

REF = "3f09c2d17a5be814"


def test_the_console_shows_one_line_per_request(monkeypatch):
    """On a terminal (item 9): a request's end as one line (model, tokens, tok/s, the job's
    reference), milestones and warnings; the per-ticket and per-connection events stay in the
    JSON log. At debug level every event shows."""
    monkeypatch.setenv("NO_COLOR", "1")

    def run(level: str) -> list[str]:
        stream = io.StringIO()
        try:
            setup_logging(LoggingConfig(format="console", level=level), stream)
            log = structlog.get_logger("t")
            log.info("job_accepted", job=7, job_ref=REF, model="gemma-3-270m")
            log.info("ticket_granted", ticket=3, job=7)
            log.info("http_request", method="POST", path="/api/chat", status=200)
            log.info("job_done", job=7, job_ref=REF, model="gemma-3-270m", num_prompts=1, tokens=16,
                     tokens_per_s=42.1, error=None)
            log.info("job_cancelled", job=8, job_ref="0000000000000001", model="pycode-base", num_prompts=4,
                     tokens=3, tokens_per_s=None, error="shutting_down")
            log.warning("guard_errors_unavailable", reason="no /dev/kmsg")
            log.info("daemon_ready", socket="/run/user/0/npud/npud.sock")
        finally:
            structlog.reset_defaults()
        return stream.getvalue().splitlines()

    lines = run("info")
    assert len(lines) == 4, lines
    done, cancelled, warning, ready = lines
    assert done.endswith(f"gemma-3-270m 16 tokens, 42.1 tok/s, job {REF} done") and done[2] == ":"
    assert cancelled.endswith("pycode-base 3 tokens (4 prompts), - tok/s, job 0000000000000001 cancelled "
                              "(shutting_down)")
    assert "guard_errors_unavailable" in warning and "warning" in warning and "daemon_ready" in ready
    assert not any(line.lstrip().startswith("{") for line in lines)
    assert len(run("debug")) == 7


def _daemon(tmp_path, **kw):
    from test_npud_support import DaemonProc, short_tempdir, write_fake_checkpoint

    workdir = short_tempdir()
    write_fake_checkpoint(workdir / "fake", tokens_per_round=2)
    return DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(workdir / "fake")}], fake_engine=True, **kw)


def _http_complete(sock: str) -> str:
    """One completion over the HTTP socket; returns the reply's job reference (npud.job)."""
    import json
    import socket

    body = json.dumps({"prompt": "hello there", "max_tokens": 4}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nConnection: close\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])["npud"]["job"]


@pytest.mark.slow
def test_json_logs_sharing_stderr_stay_json_and_name_the_replys_job(tmp_path):
    """`npud --log-format json 2>&1 | jq` and the journal (item 9): every line is JSON, without
    the plain `npud: listening` line; and an HTTP reply's job reference is in the log lines of its
    job (item 8), so `jq 'select(.job_ref == "...")'` finds them."""
    import json
    import shutil
    import subprocess

    from npud_fixture import stop_daemon

    daemon = _daemon(tmp_path)  # stdout and stderr into one file, JSON (DaemonProc)
    daemon.start()
    try:
        ref = _http_complete(str(daemon.dir / "http.sock"))
        lines = daemon.log_path.read_text().splitlines()
        not_json = [line for line in lines if not line.startswith("{")]
        assert not not_json, not_json[:3]
        events = [json.loads(line) for line in lines]
        mine = [e["event"] for e in events if e.get("job_ref") == ref]
        assert mine == ["job_accepted", "job_done"], mine
        (done,) = [e for e in events if e.get("event") == "job_done"]
        assert done["model"] == "fake" and done["tokens"] == 4 and done["tokens_per_s"] > 0
        if shutil.which("jq"):  # docs/operations.md's recipe shape, on the same lines
            out = subprocess.run(["jq", "-cR", f'fromjson? | select(.job_ref == "{ref}") | .event'],
                                 input=daemon.log_path.read_text(), capture_output=True, text=True, timeout=30)
            assert out.stdout.split() == ['"job_accepted"', '"job_done"'], out.stderr
    finally:
        stop_daemon(daemon)


@pytest.mark.slow
def test_a_hand_started_npud_on_a_terminal_shows_a_line_per_request(tmp_path):
    """npud on a terminal (auto format): `npud: listening on ...`, then one plain line per request
    with the model, tokens, tok/s and the job's reference; no JSON."""
    import os
    import pty
    import select
    import shutil
    import time

    from test_npud_support import REPO, TESTS, wait_for

    daemon = _daemon(tmp_path, logging={"format": "auto", "level": "info"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "NO_COLOR": "1"}
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.execvpe(daemon.argv()[0], daemon.argv(), env)
        finally:
            os._exit(127)
    shown = ""

    def read() -> str:
        nonlocal shown
        while select.select([fd], [], [], 0.05)[0]:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            shown += data.decode("utf-8", "replace").replace("\r\n", "\n")
        return shown

    try:
        wait_for(lambda: "npud: listening on" in read(), 60, what="npud to say where it listens")
        ref = _http_complete(str(daemon.dir / "http.sock"))
        wait_for(lambda: f"job {ref} done" in read(), 60, what="the request's line")
        time.sleep(0.2)
        read()
    finally:
        os.kill(pid, 15)  # SIGTERM, as the other daemons stop
        os.waitpid(pid, 0)
        os.close(fd)
        shutil.rmtree(daemon.dir, ignore_errors=True)
    (line,) = [ln for ln in shown.splitlines() if ref in ln]
    assert line.endswith(f"fake 4 tokens, {line.split(', ')[1]}, job {ref} done") and "tok/s" in line
    assert not [ln for ln in shown.splitlines() if ln.lstrip().startswith("{")]
    assert "ticket_granted" not in shown and "http_request" not in shown  # one line per request, not per event
