"""structlog set-up: JSON lines on stdout for journald and pipes, a short console on a TTY.

The console format is for a person watching a hand-started npud, as Ollama's is: one line per
request when its job ends (time, model, tokens, tok/s, the job's reference, how it ended),
the daemon's own milestones (listening, a model loaded, stopping), and every warning and error
in full. At --log-level debug it shows every event. JSON lines (`--log-format json`, and `auto`
when stdout is no terminal, as under systemd) carry every event with all its fields.

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


# the events that end a request: the console's one line each
REQUEST_ENDS = {"job_done": "done", "job_failed": "failed", "job_cancelled": "cancelled"}
# the daemon's milestones the console shows at info level (the rest is in the JSON log)
MILESTONES = frozenset({"daemon_ready", "http_listening", "model_loaded", "model_unloaded", "store_recovered",
                        "signal_received", "shutdown_started", "daemon_stopped", "config_reloaded"})


def request_line(event_dict: dict) -> str:
    """A finished job as one console line: `HH:MM:SS MODEL N tokens R tok/s job REF STATE`."""
    clock = str(event_dict.get("timestamp", ""))[11:19]
    rate = event_dict.get("tokens_per_s")
    state = REQUEST_ENDS[event_dict["event"]]
    error = event_dict.get("error")
    prompts = event_dict.get("num_prompts") or 1
    return (f"{clock} {event_dict.get('model')} {event_dict.get('tokens')} tokens"
            f"{'' if prompts == 1 else f' ({prompts} prompts)'}, {'-' if rate is None else rate} tok/s, "
            f"job {event_dict.get('job_ref')} {state}{f' ({error})' if error else ''}")


class ConsoleLines:
    """The console format's renderer: a request's end as request_line, anything else as
    structlog's console renderer shows it."""

    def __init__(self, colors: bool) -> None:
        self.console = structlog.dev.ConsoleRenderer(colors=colors)

    def __call__(self, logger: Any, method_name: str, event_dict: dict) -> str:
        if event_dict.get("event") in REQUEST_ENDS:
            return request_line(event_dict)
        return self.console(logger, method_name, event_dict)


def console_filter(logger: Any, method_name: str, event_dict: dict) -> dict:
    """Keep what a person watching needs at info level: request ends, milestones, warnings and errors."""
    if event_dict.get("event") in REQUEST_ENDS or event_dict.get("event") in MILESTONES:
        return event_dict
    if str(event_dict.get("level")) in ("warning", "warn", "error", "critical", "exception"):
        return event_dict
    raise structlog.DropEvent


def logs_are_json(cfg: LoggingConfig, stream: TextIO | None = None) -> bool:
    """Whether the log lines are JSON: --log-format json, or auto on a stream that is no terminal."""
    stream = stream if stream is not None else sys.stdout
    return cfg.format == "json" or (cfg.format == "auto" and not stream.isatty())


def plain_lines_fit(cfg: LoggingConfig) -> bool:
    """Whether npud's own plain lines on stderr (`npud: listening on ...`) stay apart from JSON
    log lines: not when stderr is the journal, nor when it is the very file or pipe stdout's
    JSON goes to (`2>&1 | jq`), where a line that is not JSON would break a reader of the log."""
    if is_journal_stream(sys.stderr):
        return False
    if not logs_are_json(cfg):
        return True
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return True
    return (out.st_dev, out.st_ino) != (err.st_dev, err.st_ino)


def setup_logging(cfg: LoggingConfig, stream: TextIO | None = None) -> None:
    """Configure structlog for the daemon; may be called again (SIGHUP) to change the level."""
    stream = stream if stream is not None else sys.stdout
    as_json = logs_are_json(cfg, stream)
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
        renderer = [ConsoleLines(colors=not os.environ.get("NO_COLOR"))]
        if cfg.level != "debug":
            renderer.insert(0, console_filter)
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
