"""structlog set-up: JSON lines on stdout for journald, a readable console on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from npud.config import LoggingConfig


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
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer()]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
