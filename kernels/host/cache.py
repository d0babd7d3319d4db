"""Where compiled host kernels live between starts: one cache directory per user or service.

The first of NPUD_CACHE_DIR, systemd's CACHE_DIRECTORY (set by `CacheDirectory=npud`),
$XDG_CACHE_HOME/npud and ~/.cache/npud (a relative XDG_CACHE_HOME is ignored, as the XDG
base directory spec says). The daemon's other caches (npud/packaged.py) take this rule
through engine.loader.cache_dir, so there is one. numba's cache goes into its `numba` subdirectory
unless NUMBA_CACHE_DIR says otherwise: `use_for_numba()` must run before any numba kernel is
decorated (kernels/host/recurrent.py, the only numba module, calls it first), because numba
picks the directory then. numba itself is imported only there: a model without recurrent
layers never loads it (about 0.3 s and 40 MB of a start).
"""

from __future__ import annotations

import os
from pathlib import Path



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
