"""Where a per-user npud keeps its socket and its state: the XDG base directories.

`npud --model PATH` with no configuration file runs as whoever started it, so its socket
cannot go in /run/npud and its store cannot go in /var/lib/npud. The socket goes in
$XDG_RUNTIME_DIR/npud (a directory only this user can enter, which systemd-logind makes at
login) and the store in $XDG_STATE_HOME/npud (default ~/.local/state/npud). Without
$XDG_RUNTIME_DIR (a cron job, `su` without a login session) the socket goes in /tmp/npud-<uid>,
made 0700 and refused when it already exists but is not a directory of this user that only
they can enter: in a directory others can write, whoever made it first could otherwise pose
as the daemon. npud/clients/client.py finds the socket by the same rule (and the same check).
"""

from __future__ import annotations

import os
from pathlib import Path

from npud.engine.loader import directory_unsafe_reason

SOCKET_NAME = "npud.sock"


class UserDirError(RuntimeError):
    """No directory for the socket or the store can be used safely; the message says why."""


def _xdg(name: str) -> str | None:
    """An XDG variable's value; the spec says a relative path there is invalid and ignored."""
    value = os.environ.get(name, "")
    return value if os.path.isabs(value) else None


def fallback_runtime_dir() -> Path:
    return Path(f"/tmp/npud-{os.getuid()}")


def socket_path() -> Path:
    """The per-user socket, $XDG_RUNTIME_DIR/npud/npud.sock, else /tmp/npud-<uid>/npud.sock
    (made here, 0700, when missing). Raises UserDirError when the fallback exists and is not safe."""
    runtime = _xdg("XDG_RUNTIME_DIR")
    if runtime is not None:
        return Path(runtime) / "npud" / SOCKET_NAME
    directory = fallback_runtime_dir()
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserDirError(f"XDG_RUNTIME_DIR is not set and {directory} cannot be made ({exc.strerror}); "
                           "set XDG_RUNTIME_DIR or pass --socket PATH") from None
    why = unsafe_reason(directory)
    if why is not None:
        raise UserDirError(f"XDG_RUNTIME_DIR is not set and {directory} {why}, so another user could pose as "
                           "npud there; remove it, set XDG_RUNTIME_DIR, or pass --socket PATH")
    return directory / SOCKET_NAME


def unsafe_reason(directory: Path) -> str | None:
    """Why `directory` cannot hold this user's socket (None when it can): it must be a real
    directory (not a symbolic link), owned by this user, closed to group and others. The rule
    of npud's cache directory (npud/kernels/cachedir.py), which only asks that nobody else may
    write there, with the socket's stricter mode."""
    return directory_unsafe_reason(directory, closed_to_others=True)


def state_dir() -> Path:
    """$XDG_STATE_HOME/npud, else ~/.local/state/npud (made by the store when it opens)."""
    state = _xdg("XDG_STATE_HOME")
    if state is not None:
        return Path(state) / "npud"
    try:
        home = Path.home()  # $HOME, else the passwd entry
    except RuntimeError:
        raise UserDirError("neither XDG_STATE_HOME nor HOME is set; pass --state-dir DIR") from None
    return home / ".local" / "state" / "npud"
