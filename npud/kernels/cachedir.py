"""npud's cache directory: where it is, and whether npud may trust what it finds there.

Where: the first of NPUD_CACHE_DIR, systemd's CACHE_DIRECTORY (set by `CacheDirectory=npud`; of
several, the first), $XDG_CACHE_HOME/npud and ~/.cache/npud (a relative XDG_CACHE_HOME is
ignored, as the XDG base directory spec says). Every cache of npud lives under it: the compiled
libraries (npud/kernels/host/cache.py), the self-check's passes, GGUF tokenizers, packed
weights, speculation calibrations, packaged models and numba's cache.

Trust: some of what npud loads from there is code (the compiled libraries are dlopened, numba's
cache holds pickles), so whoever can write there can run code as npud, as root when npud runs
as root. So the directory and everything under it must be npud's own: owned by the user npud
runs as (root's own when that is root: a directory of another uid is refused even then) and
writable by nobody else. The socket's fallback directory (npud/userdirs.py) follows the same
rule, closed to reading as well. The tree is checked once per process, when the cache is
first asked for (one lstat an entry). A cache that fails is not used at all: cache_dir() is then
a directory of this process alone (0700, in $TMPDIR, removed at exit), the libraries are
compiled there and nothing is kept between starts; `cache_dir_refused` is logged once, naming
the path and why, and cache_state() says so for `npuctl device`.

Modes: a per-user cache (any but systemd's) is made 0700 with its subdirectories, and the
files npud's own modules write in it are 0600. Under systemd the directory is the unit's
(CacheDirectoryMode=), never chmodded, and what npud makes in it follows the unit's UMask=;
a unit that leaves it writable to group or others is refused like any other.

Standard library only at import (the daemon reaches this module through npud.engine.loader).
"""

from __future__ import annotations

import atexit
import enum
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

# what npud's modules make under the cache: made here, with the cache's directory mode, so that
# each writer's own mkdir(exist_ok=True) finds them made
SUBDIRS = ("packed", "tokenizers", "pass-costs", "models", "numba")
NOT_OTHERS_WRITABLE = 0o022  # the cache: nobody but the owner may write
NOT_OTHERS_AT_ALL = 0o077  # the socket's directory: nobody but the owner may even enter


class CacheMode(enum.Enum):
    USER = "user"  # NPUD_CACHE_DIR, $XDG_CACHE_HOME/npud or ~/.cache/npud: npud makes it, 0700
    SERVICE = "service"  # systemd's CACHE_DIRECTORY: the unit made it and says its mode


@dataclass(slots=True, frozen=True)
class CacheState:
    configured: Path  # the directory the rule above names
    path: Path  # the directory in use: `configured` (its real path), or this process's private one
    mode: CacheMode
    refused: str | None  # why `configured` is not used, naming the path at fault; None: it is used

    @property
    def trusted(self) -> bool:
        return self.refused is None

    def to_wire(self) -> dict:
        return {"dir": str(self.configured), "trusted": self.trusted, "reason": self.refused}


def configured_cache_dir() -> Path:
    """The cache directory the environment names (not made, not checked)."""
    for var in ("NPUD_CACHE_DIR", "CACHE_DIRECTORY"):
        value = os.environ.get(var, "")
        if value:
            # systemd may list several directories separated by ':'; the first is ours
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "npud"


def cache_mode() -> CacheMode:
    """SERVICE when the directory is systemd's CACHE_DIRECTORY, else USER."""
    if not os.environ.get("NPUD_CACHE_DIR") and os.environ.get("CACHE_DIRECTORY"):
        return CacheMode.SERVICE
    return CacheMode.USER


def dir_mode() -> int:
    """The mode npud makes its cache's directories with (the umask applies on top)."""
    return 0o700 if cache_mode() is CacheMode.USER else 0o777


def owner_problem(st: os.stat_result, forbidden: int = NOT_OTHERS_WRITABLE) -> str | None:
    """Why a file or directory with status `st` is not this user's own (None when it is): it
    must belong to this process's user and have none of the `forbidden` mode bits."""
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & forbidden:
        must = oct(0o777 & ~forbidden if stat.S_ISDIR(st.st_mode) else 0o666 & ~forbidden).replace("0o", "0")
        return f"has mode {oct(mode)} (it must be at most {must})"
    return None


def unsafe_reason(directory: Path, forbidden: int = NOT_OTHERS_WRITABLE) -> str | None:
    """Why `directory` is not this user's own directory (None when it is): it must be a real
    directory (not a symbolic link), owned by this process's user, with none of the
    `forbidden` mode bits (NOT_OTHERS_WRITABLE for the cache, NOT_OTHERS_AT_ALL for the socket's)."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return owner_problem(st, forbidden)


def untrusted_entry(root: Path) -> str | None:
    """The first path of the tree at `root` (root included) that is not this user's own, with
    why ("<path> belongs to uid 1001"); None when every directory and file is. Symbolic links
    and special files are refused: npud makes none in its cache."""
    why = unsafe_reason(root)
    if why is not None:
        return f"{root} {why}"
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except FileNotFoundError:  # removed meanwhile (another npud evicting)
            continue
        except OSError as exc:
            return f"{directory} cannot be read ({exc.strerror})"
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                return f"{entry.path} cannot be read ({exc.strerror})"
            if stat.S_ISLNK(st.st_mode):
                return f"{entry.path} is a symbolic link (npud makes none in its cache)"
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return f"{entry.path} is not a file or a directory"
            why = owner_problem(st)
            if why is not None:
                return f"{entry.path} {why}"
            if stat.S_ISDIR(st.st_mode):
                pending.append(Path(entry.path))
    return None


def check_tree(root: Path, *, subdirs: tuple[str, ...] = ()) -> str | None:
    """Make `root` (and `subdirs` in it) where missing, with the cache's directory mode, then
    why the tree cannot be trusted (untrusted_entry); None when it can. A root that cannot be
    made is refused too: whoever can make it later could fill it."""
    mode = dir_mode()
    try:
        root.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        return f"{root} cannot be made ({exc.strerror or exc})"
    real = Path(os.path.realpath(root))
    why = unsafe_reason(real)
    if why is not None:  # not even a subdirectory is made in a directory that is not ours
        return f"{real} {why}"
    for name in subdirs:
        try:
            (real / name).mkdir(mode=mode, exist_ok=True)
        except OSError:  # a read-only cache: each writer logs its own failure
            pass
    return untrusted_entry(real)


_lock = threading.RLock()
_states: dict[tuple[str, CacheMode], CacheState] = {}
_private: Path | None = None


def cache_state() -> CacheState:
    """The cache directory in use and whether the configured one passed its check (once per
    process and configured directory; a refusal is logged then)."""
    configured, mode = configured_cache_dir(), cache_mode()
    key = (str(configured), mode)
    with _lock:
        state = _states.get(key)
        if state is None:
            refused = check_tree(configured, subdirs=SUBDIRS)
            if refused is None:
                state = CacheState(configured, Path(os.path.realpath(configured)), mode, None)
            else:
                state = CacheState(configured, private_dir(), mode, refused)
                _log().warning("cache_dir_refused", dir=str(configured), reason=refused, instead=str(state.path))
            _states[key] = state
        return state


def cache_dir() -> Path:
    """The cache directory to use: the configured one (made when missing) once it passed the
    trust check, else this process's private directory."""
    return cache_state().path


def private_dir() -> Path:
    """A directory of this process alone (0700, made by mkdtemp in $TMPDIR), made on first use
    and removed when the process exits."""
    global _private
    with _lock:
        if _private is None:
            _private = Path(tempfile.mkdtemp(prefix="npud-cache-"))
            atexit.register(_remove_private, _private, os.getpid())
        return _private


def _remove_private(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not from a forked child that inherited the hook
        shutil.rmtree(path, ignore_errors=True)


def _log():
    import structlog  # the daemon's logger; not at import (standard library only there)

    return structlog.get_logger(__name__)
