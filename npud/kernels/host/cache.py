"""Where compiled host kernels live between starts: one cache directory per user or service.

The first of NPUD_CACHE_DIR, systemd's CACHE_DIRECTORY (set by `CacheDirectory=npud`),
$XDG_CACHE_HOME/npud and ~/.cache/npud (a relative XDG_CACHE_HOME is ignored, as the XDG
base directory spec says). The daemon's other caches (npud/packaged.py) take this rule
through npud.engine.loader.cache_dir, so there is one. numba's cache goes into its `numba` subdirectory
unless NUMBA_CACHE_DIR says otherwise: `use_for_numba()` must run before any numba kernel is
decorated (npud/kernels/host/recurrent.py, the only numba module, calls it first), because numba
picks the directory then. numba itself is imported only there: a model without recurrent
layers never loads it (about 0.3 s and 40 MB of a start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


class BuildError(RuntimeError):
    """A C library could not be compiled (no gcc, or it failed); the message says which."""


def compile_library(path: Path, sources: list[Path], cflags: tuple[str, ...], what: str, libs: tuple[str, ...] = ()) -> Path:
    """Compile `sources` into the shared object `path` (named by a digest of what goes into it:
    its stem up to the last "-" is the library's name) unless it is there; returns `path`.
    The object appears whole or not at all (a concurrent start sees one or the other); versions
    of the same library not rebuilt for a day are dropped (not at once: two checkouts of
    different versions sharing the cache would rebuild in turn). `what` names the library in
    errors. Raises BuildError when the compiler is missing or fails, OSError when the
    directory is not writable."""
    if path.exists():
        return path
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BuildError(f"building {what} needs a C compiler: {cc!r} was not found (install gcc)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *cflags, "-o", tmp, *map(str, sources), *libs], capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"{cc} failed to build {what}:\n{res.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    name = path.stem.rsplit("-", 1)[0]
    for stale in path.parent.glob(f"{name}-*{path.suffix}"):
        if stale != path and time.time() - stale.stat().st_mtime > 86400:
            stale.unlink(missing_ok=True)
    return path



def cache_dir() -> Path:
    """The kernel cache directory (not created here)."""
    for var in ("NPUD_CACHE_DIR", "CACHE_DIRECTORY"):
        value = os.environ.get(var, "")
        if value:
            # systemd may list several directories separated by ':'; the first is ours
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "npud"


def numba_cache_dir() -> Path:
    """numba's cache directory, as numba will use it."""
    import numba

    return Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else cache_dir() / "numba"


def use_for_numba() -> None:
    """Point numba's cache at cache_dir()/numba unless NUMBA_CACHE_DIR chose one (imports numba)."""
    import numba

    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = str(cache_dir() / "numba")
