"""The npuctl(1) man page, written from the same argparse parser as `--help` and the shell
completion (tools/gen_manpage.py writes docs/man/npuctl.1; a test checks it is current).

One page: the synopsis and global options, then a subsection per command with its usage,
description, options and epilog (examples, input format), then exit status and environment
from the epilog every command shares.
"""

from __future__ import annotations

import argparse
import re

from npud.clients.shell_completion import Command, takes_value, walk


def _text(s: str) -> str:
    """Plain text for roff: backslashes escaped, no line starting with a control character."""
    s = s.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in s.split("\n"))


def _option(action: argparse.Action) -> str:
    value = f" \\fI{_text(action.metavar or action.dest.upper())}\\fR" if takes_value(action) else ""
    if action.choices and takes_value(action):
        value = " \\fI{" + _text(",".join(str(c) for c in action.choices)) + "}\\fR"
    return ", ".join(f"\\fB{_text(s)}\\fR" for s in action.option_strings) + value


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    return _text(" ".join(text.split()))


def _options(actions: list[argparse.Action]) -> list[str]:
    out = []
    for action in actions:
        out += [".TP", _option(action), _help(action)]
    return out


def _paragraphs(text: str) -> list[str]:
    """A description: filled text, one paragraph per blank-line-separated block."""
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        out += [".PP", _text(" ".join(block.split()))]
    return out


def _preformatted(text: str) -> list[str]:
    """An epilog as written (examples and formats keep their layout)."""
    return [".PP", ".nf", _text(text.rstrip("\n")), ".fi"]


def _usage(parser: argparse.ArgumentParser) -> str:
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    return _text(usage)


def render(parser: argparse.ArgumentParser, version: str, shared_epilog: str) -> str:
    """The page as roff (man macros). `shared_epilog` is the text every command's epilog ends
    with (exit codes, environment): printed once, as EXIT STATUS, not under every command."""
    root = walk(parser)
    prog = parser.prog
    out = [f'.TH {prog.upper()} 1 "" "{prog} {version}" "User Commands"', ".SH NAME",
           f"{prog} \\- {_text(root.parser.description.split(':')[0].rstrip('.'))}",
           ".SH SYNOPSIS", _usage(parser), ".SH DESCRIPTION", *_paragraphs(root.parser.description),
           ".SH OPTIONS", *_options(root.options), ".SH COMMANDS"]
    for cmd in root.all()[1:]:
        out += _command(cmd, shared_epilog)
    out += [".SH EXIT STATUS AND ENVIRONMENT", *_preformatted(shared_epilog),
            ".SH SEE ALSO", "npud(8); docs/clients.md and docs/protocol.md in the npud sources"]
    return "\n".join(out) + "\n"


def _command(cmd: Command, shared_epilog: str) -> list[str]:
    out = [f'.SS "{" ".join(cmd.path)}"', _usage(cmd.parser)]
    if cmd.parser.description:
        out += _paragraphs(cmd.parser.description)
    if cmd.positionals:
        out += [".PP", "Arguments:", *_options_positional(cmd.positionals)]
    if cmd.options:
        out += [".PP", "Options:", *_options(cmd.options)]
    epilog = (cmd.parser.epilog or "").replace(shared_epilog, "").strip("\n")
    if epilog:
        out += _preformatted(epilog)
    return out


def _options_positional(actions: list[argparse.Action]) -> list[str]:
    out = []
    for action in actions:
        name = action.metavar or action.dest
        if action.choices:
            name += " {" + ",".join(str(c) for c in action.choices) + "}"
        out += [".TP", f"\\fI{_text(name)}\\fR", _help(action) or "\\&"]
    return out
