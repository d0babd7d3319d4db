"""structlog set-up: JSON lines on stdout for journald, a readable console on a TTY.

Under systemd, stdout is a journald stream ($JOURNAL_STREAM names it). Each JSON line is then
prefixed with its syslog priority (`<3>{...}`), which journald strips into PRIORITY= (the
unit's SyslogLevelPrefix=, on by default), so `journalctl -u npud -p warning` works and
MESSAGE is the JSON object alone.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any, TextIO

import structlog

from npud.config import LoggingConfig

# syslog priorities of structlog's level names (add_log_level names exception() "error")
SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2}


def is_journal_stream(stream: TextIO) -> bool:
    """Whether `stream` is the journald stream that $JOURNAL_STREAM ("device:inode") names."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (device, inode)


class PriorityPrefixed:
    """A renderer wrapped so that each line starts with `<priority>` for journald."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer

    def __call__(self, logger: Any, method_name: str, event_dict: dict) -> str:
        priority = SYSLOG_PRIORITY.get(str(event_dict.get("level", "info")), 6)
        return f"<{priority}>{self.renderer(logger, method_name, event_dict)}"


def setup_logging(cfg: LoggingConfig, stream: TextIO | None = None) -> None:
    """Configure structlog for the daemon; may be called again (SIGHUP) to change the level."""
    stream = stream if stream is not None else sys.stdout
    as_json = cfg.format == "json" or (cfg.format == "auto" and not stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if as_json:
        json_renderer: Any = structlog.processors.JSONRenderer()
        if is_journal_stream(stream):
            json_renderer = PriorityPrefixed(json_renderer)
        renderer = [structlog.processors.format_exc_info, json_renderer]
    else:
        # https://no-color.org: a NO_COLOR that is set and not empty turns colours off
        renderer = [structlog.dev.ConsoleRenderer(colors=not os.environ.get("NO_COLOR"))]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
