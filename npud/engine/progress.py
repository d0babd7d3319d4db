"""Load progress: the stages of a load told to whoever asked (npud.engine.api.LoadProgress).

npud.engine.loader.load_model installs the caller's callback for the thread that loads; the code
that loads calls `report(stage, done, total)` wherever it knows how far it is, without a
callback parameter threaded through every function. Standard library only. A report with no
callback installed (a load outside npud.engine.loader, a test) costs one attribute lookup.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from npud.engine.api import LoadProgress, LoadProgressCallback

_local = threading.local()


@contextlib.contextmanager
def reporting(callback: LoadProgressCallback | None) -> Iterator[None]:
    """Send this thread's reports to `callback` (None: to no one) until the block ends."""
    saved = getattr(_local, "callback", None), getattr(_local, "prefix", ""), getattr(_local, "last", None)
    _local.callback, _local.prefix, _local.last = callback, "", None
    try:
        yield
    finally:
        _local.callback, _local.prefix, _local.last = saved


@contextlib.contextmanager
def part(name: str) -> Iterator[None]:
    """Inside the block, a stage is reported as "<name> <stage>" (a draft's own weights)."""
    saved = getattr(_local, "prefix", "")
    _local.prefix = f"{saved}{name} "
    try:
        yield
    finally:
        _local.prefix = saved


def report(stage: str, done: int, total: int) -> None:
    """`done` of `total` of `stage` (npud.engine.api.LOAD_STAGES) are done; the same report twice
    in a row is told once."""
    callback = getattr(_local, "callback", None)
    if callback is not None:
        event = LoadProgress(stage=_local.prefix + stage, done=done, total=total)
        if event != _local.last:
            _local.last = event
            callback(event)
