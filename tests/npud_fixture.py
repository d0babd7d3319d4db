"""A real npud process on a tiny random checkpoint, for the client tests (npuctl, the Neovim
plugin). No tests here.

The process is the daemon tests' harness (test_npud_support.DaemonProc: `python -m npud
--config`, host backend, a sensor file at 40 C and a kernel-log file of its own); this adds
the model, the environment of client processes, and a way to be another user. When the
tests run as root, the socket's group is `nogroup` so that a relay running as `nobody` can
connect, which is how the tests see another user's view (`not_found`, `forbidden`).
"""

from __future__ import annotations

import contextlib
import grp
import os
import selectors
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from test_npud_support import DaemonProc, short_tempdir

REPO = Path(__file__).resolve().parent.parent
NOBODY_UID = 65534  # `nobody`, and `nogroup` as its group, on Debian
MODEL = "tiny"
ADMIN_GROUP = "npud-test-no-such-group"
# 4096 positions: long enough that a completion of thousands of tokens runs for seconds,
# which the cancel tests need
MAX_CONTEXT = 4096
# a model with Qwen's fill-in-the-middle tokens and a short context (start_daemon(fim=True))
FIM_MODEL = "tiny-fim"
FIM_CONTEXT = 256

_checkpoint: Path | None = None
_fim_checkpoint: Path | None = None


def tiny_checkpoint(base: Path) -> Path:
    """The qwen3 tiny checkpoint, built once per test session (building imports torch)."""
    global _checkpoint
    if _checkpoint is None or not (_checkpoint / "config.json").is_file():
        from npud.engine.testing.checkpoints import build_tiny_checkpoint

        _checkpoint = build_tiny_checkpoint(base / "tiny-qwen3", "qwen3", max_position_embeddings=MAX_CONTEXT)
    return _checkpoint


def fim_checkpoint(base: Path) -> Path:
    """The qwen3 tiny checkpoint with FIM tokens and FIM_CONTEXT positions, built once per session."""
    global _fim_checkpoint
    if _fim_checkpoint is None or not (_fim_checkpoint / "config.json").is_file():
        from npud.engine.testing.checkpoints import build_tiny_checkpoint

        _fim_checkpoint = build_tiny_checkpoint(base / "tiny-fim", "qwen3", fim="qwen",
                                                max_position_embeddings=FIM_CONTEXT)
    return _fim_checkpoint


def nobody_can_connect() -> bool:
    """Running as root with a `nogroup` group: the tests can act as an unprivileged user."""
    if os.geteuid() != 0:
        return False
    try:
        return grp.getgrgid(NOBODY_UID).gr_name == "nogroup"
    except KeyError:
        return False


def python_env(socket_path: str | None) -> dict[str, str]:
    """The environment of npuctl and nvim processes: this repository importable, no user site."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPUD_")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("COLUMNS", None)
    if socket_path is not None:
        env["NPUD_SOCKET"] = socket_path
    return env


def start_daemon(tmp_base: Path, *, fim: bool = False) -> DaemonProc:
    """A running npud on the tiny checkpoint (the daemon tests' harness, DaemonProc), and with
    `fim` on the FIM one too (model FIM_MODEL); stop it with stop_daemon."""
    checkpoint = tiny_checkpoint(tmp_base)
    models = [{"name": MODEL, "checkpoint_dir": str(checkpoint), "weight_format": "fp32"}]
    if fim:
        models.append({"name": FIM_MODEL, "checkpoint_dir": str(fim_checkpoint(tmp_base)), "weight_format": "fp32"})
    server = {"admin_group": ADMIN_GROUP}  # so only root is an admin
    if nobody_can_connect():
        server["socket_group"] = "nogroup"
    workdir = short_tempdir()  # short (a socket path has at most 107 bytes) and open to `nobody`
    return start_or_clean(DaemonProc(workdir, models, server=server))


def start_or_clean(daemon: DaemonProc) -> DaemonProc:
    """`daemon` started (ready within 90 s), or stopped and its directory removed."""
    try:
        daemon.start(timeout=90.0)
    except BaseException:
        daemon.stop()
        shutil.rmtree(daemon.dir, ignore_errors=True)
        raise
    return daemon


def stop_daemon(daemon: DaemonProc) -> None:
    """SIGTERM (a drain), SIGKILL if that takes too long; then remove its directory."""
    try:
        daemon.terminate(timeout=20.0)
    except subprocess.TimeoutExpired:
        pass
    daemon.stop()
    shutil.rmtree(daemon.dir, ignore_errors=True)


def _relay(listener: socket.socket, target: str) -> None:
    """Accept connections one at a time and copy bytes both ways to a new connection to `target`."""
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(target)
        except OSError:
            client.close()
            upstream.close()
            continue
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        open_ends = 2
        while open_ends:
            for key, _ in sel.select():
                data = key.fileobj.recv(65536)
                if data:
                    key.data.sendall(data)
                    continue
                sel.unregister(key.fileobj)
                open_ends -= 1
                try:
                    key.data.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        sel.close()
        client.close()
        upstream.close()


@contextlib.contextmanager
def relay_as_nobody(target: str, path: str) -> Iterator[str]:
    """A socket at `path` that forwards to `target` from a process running as `nobody`, so
    that npud sees `nobody` (SO_PEERCRED) while the client itself runs as root.

    The relay is a fork of this process without exec: this interpreter may live where
    `nobody` cannot execute it. Needs root.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # bound and listening as root: root's clients can connect to it
    listener.listen(8)
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, relay until killed, never return into pytest
        try:
            os.setgroups([])
            os.setgid(NOBODY_UID)
            os.setuid(NOBODY_UID)
            _relay(listener, target)
        finally:
            os._exit(0)
    listener.close()
    try:
        yield path
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.unlink(path)
