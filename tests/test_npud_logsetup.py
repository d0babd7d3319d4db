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
