"""`npuctl chat [MODEL]`: a conversation in the terminal, as `ollama run MODEL` has one.

Each turn is a `complete` of the whole conversation (its messages through the model's chat
template, at interactive priority), streamed as it is generated. Lines are edited with readline
and kept in a history file ($XDG_STATE_HOME/npud/chat_history); `/reset`, `/system`, `/save`,
`/help` and `/bye` steer the session. Ctrl-C during a reply stops that reply (the connection
closes, which cancels its job in the daemon) and the session goes on; at the prompt it says how
to leave. The chat template the daemon rendered with is named once, after the first reply.
Without a terminal on stdin, each line read is one turn and each reply is printed whole.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from npud.clients.client import Client, NpudError
from npud.clients.npuctl_common import EXIT_OK, Failed, UsageError, generation_settings, is_tty

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'  # a line of three quotes starts and ends a message of several lines
HELP = """\
  /system TEXT   set the system message (the conversation keeps its turns); /system alone shows it
  /reset         forget the conversation (the system message stays)
  /save FILE     write the conversation to FILE as JSON ({"model", "chat_template", "messages"})
  /help          this list
  /bye           leave (Ctrl-D too)
  \"\"\"            begin or end a message of several lines
Ctrl-C stops a reply and keeps the session."""


def history_path() -> Path:
    """Where the typed lines are kept: $XDG_STATE_HOME/npud/chat_history (~/.local/state/...)."""
    state = os.environ.get("XDG_STATE_HOME") or ""
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "npud" / "chat_history"


class LineReader:
    """The user's lines: readline (editing, history) on a terminal, plain lines otherwise."""

    def __init__(self, stdin: TextIO, out: TextIO) -> None:
        self.stdin = stdin
        self.out = out
        self.tty = is_tty(stdin) and is_tty(out)
        self.readline = None
        self.path = history_path()
        if self.tty:
            try:
                import readline
            except ImportError:  # a Python built without it: lines still work, without history
                return
            self.readline = readline
            readline.set_history_length(1000)
            try:
                readline.read_history_file(self.path)
            except (FileNotFoundError, PermissionError, OSError):
                pass

    def read(self, prompt: str) -> str:
        """One line without its newline; raises EOFError at the end of input."""
        if self.tty:
            return input(prompt)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def message(self) -> str:
        """The next message: one line, or the lines between two \"\"\" fences."""
        first = self.read(PROMPT)
        if not first.strip().startswith(FENCE):
            return first
        lines = [first.strip()[len(FENCE):]]
        while True:
            line = self.read(CONTINUATION)
            if line.rstrip().endswith(FENCE):
                lines.append(line.rstrip()[:-len(FENCE)])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    def save(self) -> None:
        if self.readline is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.readline.write_history_file(self.path)
        except OSError:  # a read-only home: the session worked, only its history is not kept
            pass


class Chat:
    """One conversation with one model over the daemon's socket."""

    def __init__(self, args: argparse.Namespace, model: str, max_tokens: int, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.model = model
        self.max_tokens = max_tokens
        self.out = out
        self.err = err
        self.system: str | None = args.system
        self.turns: list[dict] = []  # user and assistant messages, in order
        self.template: str | None = None  # named once, after the first reply

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def command(self, line: str) -> bool:
        """Run a /command; returns False when the session ends."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name == "/reset":
            self.turns.clear()
            self.err.write("[conversation cleared]\n")
        elif name == "/system":
            if rest:
                self.system = rest
                self.err.write("[system message set]\n")
            else:
                self.err.write(f"[system message: {self.system!r}]\n" if self.system else "[no system message]\n")
        elif name == "/save":
            if not rest:
                self.err.write("[usage: /save FILE]\n")
            else:
                self.save(Path(rest).expanduser())
        elif name in ("/help", "/?"):
            self.err.write(HELP + "\n")
        else:
            self.err.write(f"[unknown command {name}; /help lists them]\n")
        self.err.flush()
        return True

    def save(self, path: Path) -> None:
        record = {"model": self.model, "chat_template": self.template, "messages": self.messages()}
        try:
            path.write_text(json.dumps(record, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            self.err.write(f"[cannot write {path}: {exc.strerror}]\n")
            return
        self.err.write(f"[saved {len(self.messages())} messages to {path}]\n")

    def turn(self, text: str) -> None:
        """Send the conversation with `text` as the user's turn and stream the reply. Ctrl-C
        stops the reply (what was written stays in the conversation); a daemon error ends the
        turn with its message and forgets the turn."""
        self.turns.append({"role": "user", "content": text})
        settings = {**generation_settings(self.args), "model": self.model, "max_tokens": self.max_tokens}
        pieces: list[str] = []
        started = time.monotonic()
        stopped = False
        client = Client(self.args.socket)
        try:
            stream = client.complete(messages=self.messages(), **settings)
            for ev in stream:
                if ev.name == "model_loading" and not pieces:
                    self.err.write(f"[loading model {ev.data.get('model')}]\n")
                    self.err.flush()
                elif ev.name == "model_loaded":
                    started += float(ev.data.get("load_ms") or 0) / 1000
                elif ev.name == "token" and ev.data.get("text"):
                    pieces.append(ev.data["text"])
                    self.out.write(ev.data["text"])
                    self.out.flush()
            result = stream.result or {}
        except KeyboardInterrupt:  # the reply, not the session: closing the connection cancels its job
            result, stopped = {}, True
        except NpudError as exc:
            self.turns.pop()
            self._end_line(pieces)
            self.err.write(f"error: {exc.message}\n")
            self.err.flush()
            return
        finally:
            client.close()
        self._end_line(pieces)
        self.turns.append({"role": "assistant", "content": "".join(pieces)})
        if stopped:
            self.err.write("[stopped]\n")
        elif self.template is None and (result.get("stats") or {}).get("chat_template"):
            self.template = result["stats"]["chat_template"]
            self.err.write(f"[chat template: {self.template}]\n")
        if self.args.verbose and result:
            n = len(result.get("token_ids") or ())
            elapsed = time.monotonic() - started
            self.err.write(f"[{n} tokens, {result.get('finish_reason')}, {n / elapsed if elapsed > 0 else 0:.1f} "
                           f"tok/s, prompt {result.get('prompt_tokens')} tokens]\n")
        self.err.flush()

    def _end_line(self, pieces: list[str]) -> None:
        if pieces and not pieces[-1].endswith("\n"):
            self.out.write("\n")
        self.out.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    if args.json:
        raise UsageError("npuctl chat is interactive and has no --json; `npuctl complete --json` gives one reply")
    with Client(args.socket) as c:
        hello = c.hello("npuctl chat")
    model = args.chat_model or args.model or hello.get("default_model")
    if model is None:
        raise Failed("npud serves no model")
    if model not in hello.get("models", []):
        raise UsageError(f"no model {model!r}; the daemon serves: {', '.join(hello.get('models', []))}")
    limit = int(hello["limits"]["max_tokens"])
    max_tokens = args.max_tokens if args.max_tokens is not None else limit  # as ollama run: until the model stops
    reader = LineReader(sys.stdin, sys.stdout)
    chat = Chat(args, model, max_tokens, sys.stdout, sys.stderr)
    if reader.tty:
        # Ctrl-C is how a reply is stopped: a chat started with SIGINT ignored (a background job of a
        # non-interactive shell, which Python then leaves ignored) would otherwise lose it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stderr.write(f"[chatting with {model}; /help for commands, /bye or Ctrl-D to leave]\n")
        sys.stderr.flush()
    try:
        while True:
            try:
                text = reader.message()
            except KeyboardInterrupt:  # at the prompt: Ctrl-C does not leave (ollama's way)
                sys.stdout.write("\n")
                sys.stderr.write("[use Ctrl-D or /bye to leave]\n")
                sys.stderr.flush()
                continue
            except EOFError:
                if reader.tty:
                    sys.stdout.write("\n")
                break
            if not text.strip():
                continue
            if text.lstrip().startswith("/") and not text.lstrip().startswith("//"):
                if not chat.command(text):
                    break
                continue
            chat.turn(text)
    finally:
        reader.save()
    return EXIT_OK
