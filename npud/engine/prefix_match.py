"""What the prefix cache hands back: a lookup's match, a cached prefill, its counters, its
error; and common_prefix, which the cache and the draft-model head both measure with."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from npud.engine.api import EngineError
from npud.engine.state import StateSnapshot


class PrefixCacheError(EngineError):
    """A cache operation the caller got wrong (unknown key, bad arguments)."""


class MatchSource(enum.Enum):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt: restore `snapshot`, then prefill the rest."""

    key: str
    num_cached_tokens: int  # == snapshot.positions, always < len(prompt)
    snapshot: StateSnapshot  # arrays are read-only; restoring copies them
    source: MatchSource
    entry_tokens: int  # length of the entry it came from: no new entry is needed up to there


@dataclass(slots=True, frozen=True)
class PrefixCacheStats:
    hits: int
    misses: int
    tokens_reused: int
    bytes_held: int  # snapshot bytes in memory
    disk_bytes: int  # bytes of this model's files in the state dir
    entries: int  # indexed entries, in memory or on disk
    entries_in_memory: int
    evictions: int  # entries removed by a budget (memory without a state dir, disk with one)
    spills: int  # entries moved from memory to disk only by the memory budget
    superseded: int  # entries dropped because a longer KV-only entry serves all their prefixes
    files_dropped: int  # files found bad and deleted
    shares_reclaimed: int  # owner scopes whose budget share a scope new to the cache took (max_scopes)


@dataclass(slots=True, frozen=True)
class CachedPrefill:
    """What `PrefixCache.prefill` did: the match it restored (None: a miss, or no lookup), the
    logits of the last row it prefilled (None: nothing prefilled), and the insert it deferred
    (call it after the first token is out; None: nothing deferred)."""

    match: PrefixMatch | None
    logits: np.ndarray | None
    insert: Callable[[], str | None] | None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b (sequences or 1-D arrays of ints) have in common."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
