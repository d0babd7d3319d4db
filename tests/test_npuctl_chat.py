"""`npuctl chat` in a real terminal: the command runs on a pseudo-terminal (its controlling
terminal, so Ctrl-C is the line discipline's SIGINT, as a person's keyboard sends it) against a
real daemon process on the fake engine, whose replies are a pure function of the conversation
(test_npud_support.expected_text), so each reply can be predicted from the messages sent.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from npud_fixture import python_env, stop_daemon
from test_npud_support import DaemonProc, expected_text, short_tempdir, wait_for, write_fake_checkpoint

pytestmark = pytest.mark.slow  # a daemon process and terminals

TEMPLATE = "builtin:fake"


@pytest.fixture(scope="module")
def daemon():
    workdir = short_tempdir()
    # one token a round, 20 ms a round: a reply of the default length (limits.max_tokens) runs for
    # seconds, long enough for Ctrl-C to find it running
    write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=0.02, chat_template=TEMPLATE)
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(workdir / "fake")}], fake_engine=True,
                   limits={"max_tokens": 1500})
    d.start()
    yield d
    stop_daemon(d)


class Terminal:
    """A process on a pseudo-terminal: type into it, read what it shows."""

    def __init__(self, argv: list[str], env: dict[str, str], sigint=signal.SIG_DFL) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal and stdin, stdout, stderr
            try:
                signal.signal(signal.SIGINT, sigint)  # as its parent left it (SIG_IGN: a background job's)
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.shown = ""  # everything the terminal showed so far
        self.mark = 0  # where the next expect() starts looking

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the process ended (EIO on Linux)
            return False
        if not data:
            return False
        self.shown += data.decode("utf-8", "replace").replace("\r\n", "\n")
        return True

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Wait for `pattern` (a regex) to show after the last match; returns the match."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            m = regex.search(self.shown, self.mark)
            if m is not None:
                self.mark = m.end()
                return m
            if time.monotonic() > deadline or not self._read(min(0.2, max(0.0, deadline - time.monotonic()))):
                m = regex.search(self.shown, self.mark)
                if m is not None:
                    self.mark = m.end()
                    return m
                raise AssertionError(f"{pattern!r} did not show; the terminal showed:\n{self.shown[-3000:]}")

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"npuctl chat did not end; it showed:\n{self.shown[-2000:]}")


def chat(daemon: DaemonProc, home: Path, *args: str, sigint=signal.SIG_DFL) -> Terminal:
    env = {**python_env(daemon.socket), "HOME": str(home), "XDG_STATE_HOME": str(home / "state"), "TERM": "xterm",
           "NO_COLOR": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent)])}
    env.pop("INPUTRC", None)
    return Terminal([sys.executable, "-m", "npud.clients.npuctl", "chat", *args], env, sigint)


def transcript(*messages: tuple[str, str]) -> str:
    """The fake engine's prompt text of a conversation (test_npud_support.prompt_text)."""
    return "\n".join(f"{role}: {content}" for role, content in messages)


def test_a_conversation_with_system_reset_save_and_history(daemon, tmp_path):
    term = chat(daemon, tmp_path, "fake", "--max-tokens", "5")
    term.expect(r"\[chatting with fake; /help")
    term.expect(">>> ")
    term.send("hello\r")
    first = expected_text(transcript(("user", "hello")), 5)
    term.expect(re.escape(first.strip()) + r"\n")
    term.expect(re.escape(f"[chat template: {TEMPLATE}]"))
    term.expect(">>> ")
    term.send("/system Be brief.\r")
    term.expect(r"\[system message set\]")
    term.send("again\r")
    second = expected_text(transcript(("system", "Be brief."), ("user", "hello"), ("assistant", first),
                                      ("user", "again")), 5)
    term.expect(re.escape(second.strip()) + r"\n")
    term.expect(">>> ")
    term.send("/reset\r")
    term.expect(r"\[conversation cleared\]")
    term.send('"""\rline one\rline two"""\r')  # a message of two lines
    third = expected_text(transcript(("system", "Be brief."), ("user", "line one\nline two")), 5)
    term.expect(re.escape(third.strip()) + r"\n")
    saved = tmp_path / "conversation.json"
    term.send(f"/save {saved}\r")
    term.expect(r"\[saved 3 messages")
    term.send("/bye\r")
    assert term.wait() == 0
    assert term.shown.count("[chat template:") == 1  # named once
    record = json.loads(saved.read_text())
    assert record == {"model": "fake", "chat_template": TEMPLATE, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "line one\nline two"},
        {"role": "assistant", "content": third}]}
    history = (tmp_path / "state" / "npud" / "chat_history").read_text()
    assert "hello" in history and "again" in history

    # readline's history: Ctrl-P brings back the last line of the last session, /bye, which leaves
    again = chat(daemon, tmp_path, "fake", "--max-tokens", "5")
    again.expect(">>> ")
    again.send("\x10")
    again.expect("/bye")
    again.send("\r")
    assert again.wait() == 0
    assert not re.search(r" w\d+", again.shown)  # nothing was sent to the model


@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored-by-parent"])
def test_ctrl_c_stops_the_reply_and_the_session_goes_on(daemon, tmp_path, sigint):
    """Also when npuctl chat starts with SIGINT ignored, as a background job of a non-interactive
    shell does (Python leaves an ignored SIGINT ignored: the reply ran to its end, seen in CI)."""
    with daemon.client() as c:
        before = {j["job"] for j in c.jobs(limit=1000)["jobs"]}
    term = chat(daemon, tmp_path, "fake", sigint=sigint)  # no --max-tokens: the reply runs up to limits.max_tokens (1500)
    term.expect(">>> ")
    term.send("tell me everything\r")
    term.expect(r" w\d+ w\d+ w\d+")  # the reply is streaming
    term.send("\x03")  # Ctrl-C
    term.expect(r"\[stopped\]")
    term.expect(">>> ")
    with daemon.client() as c:
        [job] = [j for j in c.jobs(limit=1000)["jobs"] if j["job"] not in before]
        state = wait_for(lambda: (s := c.status(job["job"])["state"]) in ("cancelled", "done") and s, 30,
                         what="the stopped reply's job to end")
        assert state == "cancelled" and c.status(job["job"])["tokens"] < 1500
    term.send("\x03")  # at the prompt: the session stays
    term.expect(r"\[use Ctrl-D or /bye to leave\]")
    saved = tmp_path / "stopped.json"
    term.send(f"/save {saved}\r")
    term.expect(r"\[saved 2 messages")
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0] == {"role": "user", "content": "tell me everything"}
    partial = messages[1]["content"]  # what was shown stays in the conversation
    assert partial and expected_text(transcript(("user", "tell me everything")), 1500).startswith(partial)
    term.send("/bye\r")
    assert term.wait() == 0


def test_an_unknown_model_names_the_served_ones(daemon, tmp_path):
    term = chat(daemon, tmp_path, "llama3.2")
    term.expect(r"error: no model 'llama3.2'; the daemon serves: fake")
    assert term.wait() == 2


def test_without_a_terminal_each_line_is_a_message(daemon):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "chat", "--max-tokens", "3"],
                          input="hi\nthere\n", capture_output=True, text=True, timeout=120,
                          env=python_env(daemon.socket))
    assert done.returncode == 0, done.stderr
    first = expected_text(transcript(("user", "hi")), 3)
    second = expected_text(transcript(("user", "hi"), ("assistant", first), ("user", "there")), 3)
    assert done.stdout == first + "\n" + second + "\n"
