"""What npud does with a cache file that is not what it says it is: one log line, and the file goes.

Every cache npud reads back (packed weights, tokenizer entries, pass-cost calibrations, prefix
snapshots, the digest memo) checks a file against its own manifest and builds its objects
itself; a file that fails is rejected here, so that the next use rebuilds it and a bad entry
costs one rebuild, never a failed load."""

from __future__ import annotations

from pathlib import Path

import structlog

from npud.engine.prefix_store import unlink

log = structlog.get_logger(__name__)


def reject(path: Path, cache: str, reason: str) -> None:
    """Log `cache_entry_rejected` (the cache's name, the path, why) and remove the file."""
    log.warning("cache_entry_rejected", cache=cache, path=str(path), reason=reason)
    unlink(path)
