"""What the npuctl commands share: their error types, output helpers and generation options."""

from __future__ import annotations

import argparse
import json
import pwd
import sys
from typing import Any, TextIO

from npud.clients.client import Client

EXIT_OK = 0
EXIT_DAEMON = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad arguments or input: exit code 2."""


class Interrupted(Exception):
    """Ctrl-C, with what it left behind: exit code 130."""


class Failed(Exception):
    """Something the user waited for failed although every request succeeded: exit code 1."""


# -- output helpers ----------------------------------------------------------------------------


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def emit_json(value: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(value, indent=2 if is_tty(out) else None, ensure_ascii=False) + "\n")


def user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def connect(args: argparse.Namespace) -> Client:
    return Client(args.socket)


def open_output(path: str | None) -> TextIO:
    if path is None or path == "-":
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None


# -- generation settings shared by submit and complete ---------------------------------------------

def generation_settings(args: argparse.Namespace) -> dict:
    """The submit/complete params the command line sets (absent ones are the daemon's defaults)."""
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                                  ("top_p", args.top_p), ("seed", args.seed)) if v is not None}
    spec = {k: v for k, v in (("method", args.spec), ("k", args.spec_k)) if v is not None}
    settings: dict = {"model": args.model, "max_tokens": args.max_tokens}
    if sampling:
        settings["sampling"] = sampling
    if spec:
        settings["spec"] = spec
    if args.stop:
        settings["stop"] = args.stop
    if args.no_prefix_cache:
        settings["use_prefix_cache"] = False
    return {k: v for k, v in settings.items() if v is not None}
