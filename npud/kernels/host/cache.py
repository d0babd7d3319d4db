"""Compiled libraries kept between starts, and numba's cache, in npud's cache directory.

The directory, and whether it may be trusted, is npud/kernels/cachedir.py's (cache_dir() is
re-exported here for the modules that import it from here). numba's cache goes into its `numba`
subdirectory unless NUMBA_CACHE_DIR names another that passes the same check: `use_for_numba()`
must run before any numba kernel is decorated (npud/kernels/host/recurrent.py, the only numba
module, calls it first), because numba picks the directory then. numba itself is imported only
there: a model without recurrent layers never loads it (about 0.3 s and 40 MB of a start).

A compiled library is dlopened, so its bytes are checked before: compile_library() records
the sha256 and size of what it built in a manifest beside it (`<library>.json`, written
atomically before the library is renamed into place), and a library whose bytes do not match
its manifest (truncated, emptied, changed, or with no manifest) is logged once
(`cache_entry_rejected`, its path and why), removed and built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from npud.kernels.cachedir import cache_dir, check_tree, private_dir  # noqa: F401  (cache_dir, private_dir: re-exported)

MANIFEST_FORMAT = "npud-compiled-library"


class BuildError(RuntimeError):
    """A C library could not be compiled (no gcc, or it failed); the message says which."""


@dataclass(slots=True, frozen=True)
class Library:
    path: Path
    sha256: str  # of the bytes at `path`, as checked against (or written to) its manifest
    built: bool  # compiled by this call


def manifest_path(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def library_sha256(path: Path) -> tuple[str | None, str | None]:
    """(sha256, None) when the library at `path` holds the bytes its manifest recorded at build,
    (None, why not) when it does not, (None, None) when there is no library."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, "is not a regular file"
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except FileNotFoundError:
        return None, "no manifest"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest ({exc.__class__.__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT \
            or manifest.get("library") != path.name:
        return None, "the manifest is not this library's"
    want_bytes, want_sha = manifest.get("bytes"), manifest.get("sha256")
    if st.st_size != want_bytes:
        return None, f"{st.st_size} bytes, the manifest says {want_bytes}"
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    if digest != want_sha:
        return None, "its sha256 is not the manifest's"
    return digest, None


def _write_manifest(path: Path, built: Path) -> str:
    """Record `built`'s sha256 and size as the manifest of library `path` (atomically); returns the sha256."""
    with open(built, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    body = json.dumps({"format": MANIFEST_FORMAT, "library": path.name, "bytes": os.path.getsize(built),
                       "sha256": digest}, sort_keys=True)
    target = manifest_path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return digest


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    manifest_path(path).unlink(missing_ok=True)


def compile_library(path: Path, sources: list[Path], cflags: tuple[str, ...], what: str,
                    libs: tuple[str, ...] = ()) -> Library:
    """The shared object `path` (named by a digest of what goes into it: its stem up to the
    last "-" is the library's name), checked against its manifest, or compiled from `sources`
    when it is missing or fails the check (then logged as `cache_entry_rejected` and removed first).
    The object and its manifest appear whole or not at all (a concurrent start sees one or the
    other); versions of the same library not rebuilt for a day are dropped (not at once: two
    checkouts of different versions sharing the cache would rebuild in turn). `what` names the
    library in errors. Raises BuildError when the compiler is missing or fails, OSError when
    the directory is not writable."""
    digest, why = library_sha256(path)
    if digest is not None:
        return Library(path, digest, built=False)
    if why is not None:
        _log().warning("cache_entry_rejected", cache="library", path=str(path), reason=why)
        _remove(path)
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BuildError(f"building {what} needs a C compiler: {cc!r} was not found (install gcc)")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # an explicit directory (the cache's is made)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *cflags, "-o", tmp, *map(str, sources), *libs], capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"{cc} failed to build {what}:\n{res.stderr[-2000:]}")
        os.chmod(tmp, 0o600)  # the linker adds execute bits; dlopen needs none
        digest = _write_manifest(path, Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    name = path.stem.rsplit("-", 1)[0]
    for stale in path.parent.glob(f"{name}-*{path.suffix}"):
        if stale != path and time.time() - stale.stat().st_mtime > 86400:
            _remove(stale)
    return Library(path, digest, built=True)


def numba_cache_dir() -> Path:
    """numba's cache directory, as numba will use it."""
    import numba

    return Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else cache_dir() / "numba"


def use_for_numba() -> None:
    """Point numba's cache at cache_dir()/numba unless NUMBA_CACHE_DIR chose one that passes the
    cache's check (imports numba). A NUMBA_CACHE_DIR inside a refused cache, or one that fails
    the check itself, is replaced (logged as `cache_dir_refused`): numba's index files are pickles."""
    import numba

    from npud.kernels.cachedir import cache_state, configured_cache_dir

    chosen = numba.config.CACHE_DIR
    if chosen:
        state = cache_state()
        real = Path(os.path.realpath(chosen))
        inside = real.is_relative_to(os.path.realpath(configured_cache_dir()))
        why = state.refused if inside else check_tree(Path(chosen))
        if why is None:
            return
        _log().warning("cache_dir_refused", dir=chosen, reason=why, instead=str(cache_dir() / "numba"))
    numba.config.CACHE_DIR = str(cache_dir() / "numba")


def _log():
    import structlog  # not at import: standard library only there

    return structlog.get_logger(__name__)
