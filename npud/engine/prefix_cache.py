"""Prefix cache: model states of prompt prefixes, found by chained block hashes.

A prompt is cut into blocks of `block_size` tokens; block i is keyed by
H(key of block i - 1, its token ids), so one key names a whole prefix. Only full blocks
are keyed, and a hit is trusted only after the token ids themselves compare equal.

An entry is a `StateSnapshot` of the model after its tokens. A snapshot of KV planes only
serves any shorter prefix too (`StateSnapshot.prefix(n)` cuts each plane at its own
width); one with a recurrent plane holds its state at exactly one position and serves
that length only.

`PrefixCache.prefill(forward, prompt)` is the one caller protocol (look up, restore, prefill
the rest, offer the state at the last block boundary), so that a restored prompt is
bit-identical to a cold one. Its insert may wait until the first token has been sent
(`defer_insert`: the state is still at the boundary until the next step), which keeps the
snapshot copy out of the time to first token.

Memory is bounded by `max_bytes` (LRU). With `max_scopes`, the budgets are split into one
share per owner scope (and one for the shared scope), and the LRU runs within a scope: one
owner's inserts never push out another's entries, so no owner's cache hits (or time to first
token) tell of another's activity. An owner scope takes a share at its first insert and keeps
it; only when all `max_scopes` shares are held does a scope new to the cache take the share of
the scope used least recently (dropping that scope's entries). With a `state_dir`, an entry pushed out of memory
is written to disk (a spill, npud/engine/prefix_store.py) and read back on a hit; `flush()`
writes the entries that are only in memory (call it when idle and before exit); the disk
is bounded by `max_disk_bytes` (LRU; an entry evicted from disk is gone). Pinned entries
are never evicted, and pins are kept in `pins.json`. At start-up the index is rebuilt (npud/engine/prefix_dir.py) from
the directory: a truncated, corrupt or incomplete file, or one of another geometry, is
deleted with a log line, and so are the files under another key (npud/engine/fingerprint.py:
the model's weights, weight format, backend or engine numerics changed), with one log line
for all of them: a snapshot is only ever restored into the numerics that computed it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from pathlib import Path

import numpy as np
import structlog

from npud.engine import prefix_dir, prefix_store as store
from npud.engine.cache_entry import reject
from npud.engine.prefix_dir import Entry
from npud.engine.forward import drive
from npud.engine.packed import Pass
from npud.engine.prefix_match import (
    CachedPrefill,
    MatchSource,
    PrefixCacheError,
    PrefixCacheStats,
    PrefixMatch,
    common_prefix,
)
from npud.engine.state import ModelState, PlaneKind, PlaneSnapshot, StateError, StateSnapshot

log = structlog.get_logger(__name__)

class PrefixCache:
    """Snapshots of prompt prefixes for one model; every public method holds a lock."""

    def __init__(
        self,
        fingerprint: str,
        state: ModelState,
        state_dir: str | Path | None = None,
        max_bytes: int = 1 << 30,
        max_disk_bytes: int = 8 << 30,
        block_size: int = 32,
        max_scopes: int = 0,
    ):
        """`state` is a (fresh) `ModelState` of the model: entries must fit its planes.
        `fingerprint` keys every entry: for a served model, npud/engine/fingerprint.py's
        numerics_key (weights, format, backend, engine numerics), so that no snapshot is
        restored into numerics other than those that computed it.

        Raises PrefixCacheError for a bad argument; with `state_dir`, creates it and
        rebuilds the index from the files in it. `max_scopes` > 0 splits `max_bytes` and
        `max_disk_bytes` into max_scopes + 1 equal shares (see the module docstring); 0 keeps
        one budget for every entry (a cache of one user's prompts).
        """
        if not isinstance(fingerprint, str) or not fingerprint:
            raise PrefixCacheError(f"fingerprint must be a non-empty string, got {fingerprint!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise PrefixCacheError(f"block_size must be an int >= 1, got {block_size!r}")
        for name, value in (("max_bytes", max_bytes), ("max_disk_bytes", max_disk_bytes), ("max_scopes", max_scopes)):
            if not isinstance(value, int) or value < 0:
                raise PrefixCacheError(f"{name} must be an int >= 0, got {value!r}")
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.max_disk_bytes = max_disk_bytes
        self.max_scopes = max_scopes
        self._template = state
        self._recurrent = any(p.kind is PlaneKind.RECURRENT for p in state.planes)
        self._root = hashlib.blake2b(
            b"npud-prefix\0%s\0%d" % (fingerprint.encode(), block_size), digest_size=16
        ).digest()
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._blocks: dict[bytes, set[str]] = {}  # block key -> entries that can serve it
        self._pins: dict[str, str] = {}
        self._shares: OrderedDict[str, None] = OrderedDict()  # owner scopes holding a share, LRU first
        self._tick = 0
        self._counts = dict.fromkeys(("hits", "misses", "tokens_reused", "evictions", "spills",
                                      "superseded", "files_dropped", "shares_reclaimed"), 0)
        self._bytes_held = 0
        self._disk_bytes = 0
        self.state_dir = Path(state_dir) if state_dir is not None else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            prefix_dir.rebuild(self)

    # ------------------------------------------------------------------ lookup and insert

    def insert_boundary(self, num_tokens: int) -> int:
        """Where the caller should snapshot a prompt of `num_tokens`: a multiple of block_size.

        The longest full-block boundary <= num_tokens, or < num_tokens when the model has a
        recurrent plane (such an entry serves only its exact length, and a repeat of the
        prompt must leave a token to prefill). 0 means: nothing to insert.
        """
        b = self.block_size
        return ((num_tokens - 1) // b) * b if self._recurrent and num_tokens > 0 else (num_tokens // b) * b

    def lookup(self, tokens: Sequence[int], scope: str | None = None) -> PrefixMatch | None:
        """Returns the longest cached prefix of `tokens` shorter than the whole prompt, or None.

        Only entries of `scope` are found, and the pinned entries of the shared scope (None);
        a lookup in the shared scope finds all of its entries. At least one token is always
        left to prefill: the first sampled token needs the last prompt row's logits, which a
        snapshot does not hold.
        """
        tokens = _as_tokens(tokens)
        with self._lock:
            if scope in self._shares:
                self._shares.move_to_end(scope)
            limit = len(tokens) - 1
            # (the chain of block keys, the scope its entries must have, pinned ones only)
            chains = [(self._chain(tokens, scope), scope, False)]
            if scope is not None:
                chains.append((self._chain(tokens, None), None, True))
            for depth_blocks in range(len(chains[0][0]), 0, -1):
                depth = depth_blocks * self.block_size
                found = []
                candidates = [(self._entries[key], want, pinned_only) for hashes, want, pinned_only in chains
                              for key in self._blocks.get(hashes[depth_blocks - 1], ())]
                for e, want, pinned_only in candidates:
                    if e.scope != want or (pinned_only and not e.pins):
                        continue  # another owner's entry, or a shared one no operator pinned
                    if not np.array_equal(e.tokens[:depth], tokens[:depth]):
                        continue  # a hash is not trusted alone
                    if e.recurrent:
                        served = depth if e.num_tokens == depth and depth <= limit else 0
                    else:
                        served = min(depth + common_prefix(e.tokens[depth:limit], tokens[depth:limit]), limit)
                    if served > 0:
                        found.append((served, e.last_used, e))
                for served, _, e in sorted(found, key=lambda f: (f[0], f[1]), reverse=True):
                    source = MatchSource.MEMORY if e.snapshot is not None else MatchSource.DISK
                    snap = self._snapshot_of(e)
                    if snap is None:
                        continue  # its file was bad and is gone
                    self._counts["hits"] += 1
                    self._counts["tokens_reused"] += served
                    if served != snap.positions:
                        snap = snap.prefix(served)
                    self._enforce_budgets()
                    return PrefixMatch(e.key, served, snap, source, e.num_tokens)
            self._counts["misses"] += 1
            return None

    def prefill(
        self, forward, prompt: Sequence[int], *, rest: bool = True, restore: bool = True, defer_insert: bool = False,
        scope: str | None = None,
    ) -> CachedPrefill:
        """prefill_passes with the passes run on `forward` alone (see there)."""
        return drive(forward, self.prefill_passes(forward, prompt, rest=rest, restore=restore,
                                                  defer_insert=defer_insert, scope=scope))

    def prefill_passes(
        self, forward, prompt: Sequence[int], *, rest: bool = True, restore: bool = True, defer_insert: bool = False,
        scope: str | None = None,
    ) -> Generator[Pass, np.ndarray, CachedPrefill]:
        """The caller protocol: restore the longest cached prefix of `prompt` into `forward`,
        prefill to the last block boundary, offer that state to the cache, prefill the rest.

        `forward` is a fresh npud.engine.forward.Forward; its prefill chunks are yielded as passes
        (npud.engine.packed.Pass) for a driver to run (npud/engine/batch.py), which sends their logits back. With `rest=False` the prompt's last token is left
        to the caller's decode loop, which also runs whatever follows the boundary (the
        session does this). With `restore=False` nothing is looked up, but the state is still
        offered. With `defer_insert`, an insert at the very end of the prompt is returned as
        `CachedPrefill.insert` instead of run (the state stays there until the next step).
        Lookups and inserts are in `scope` (see lookup).

        Returns the match (None on a miss or without restore), the logits of the last
        prefilled row (None when nothing was prefilled; with `rest` always set, as a lookup
        leaves a token) and the deferred insert. Raises PrefixCacheError for bad tokens and
        StateError when a snapshot does not fit `forward`'s state.
        """
        end = len(prompt) if rest else len(prompt) - 1
        if end <= 0:
            return CachedPrefill(None, None, None)
        match = self.lookup(prompt, scope) if restore else None  # at most len(prompt) - 1 tokens
        if match is not None:
            forward.state.restore(match.snapshot)
        boundary = self.insert_boundary(end)
        logits, insert = None, None
        if forward.positions_held < boundary:
            logits = (yield from forward.prefill_passes(prompt[forward.positions_held : boundary]))[0]
            if defer_insert and boundary == len(prompt):
                insert = lambda: self.insert(prompt, forward.state.snapshot(), scope)  # noqa: E731
            else:
                self.insert(prompt[:boundary], forward.state.snapshot(), scope)
        if rest and forward.positions_held < end:
            logits = (yield from forward.prefill_passes(prompt[forward.positions_held : end]))[0]
        return CachedPrefill(match, logits, insert)

    def insert(self, tokens: Sequence[int], snapshot: StateSnapshot, scope: str | None = None) -> str | None:
        """Cache `snapshot`, the state after `tokens[:snapshot.positions]`, in `scope` (its
        block keys are chained from a root salted with the scope); returns its key.

        The entry is keyed at the longest full-block boundary <= snapshot.positions; a
        KV-only snapshot past it is cut there (copied), while a snapshot with a recurrent
        plane must sit on a boundary (use `insert_boundary`). Returns None when the
        snapshot holds less than one block. The cache takes the snapshot's arrays (and
        makes them read-only): do not write to them afterwards. Raises StateError when the
        snapshot does not fit this model's planes, PrefixCacheError when tokens are too few.
        """
        tokens = _as_tokens(tokens)
        if snapshot.positions > len(tokens):
            raise PrefixCacheError(f"snapshot holds {snapshot.positions} positions but only {len(tokens)} tokens given")
        recurrent = any(p.kind is PlaneKind.RECURRENT for p in snapshot.planes)
        boundary = (snapshot.positions // self.block_size) * self.block_size
        if boundary == 0:
            return None
        if recurrent and boundary != snapshot.positions:
            raise StateError(
                f"a snapshot with a recurrent plane holds position {snapshot.positions} only; "
                f"snapshot at a multiple of {self.block_size} (insert_boundary)"
            )
        self._template.check_snapshot(snapshot)
        with self._lock:
            tokens = tokens[:boundary].copy()
            tokens.flags.writeable = False
            hashes = self._chain(tokens, scope)
            key = hashes[-1].hex()
            old = self._entries.get(key)
            if old is not None:
                if np.array_equal(old.tokens, tokens):
                    self._touch(old)
                    return key
                log.warning("prefix_cache_key_collision", key=key)
                return None
            if boundary != snapshot.positions:
                snapshot = _owned(snapshot.prefix(boundary))
            _freeze(snapshot)
            entry = Entry(key, tokens, tuple(hashes), recurrent, snapshot.nbytes, snapshot, scope=scope)
            self._take_share(scope)
            self._add(entry)
            if not recurrent:
                self._drop_superseded(entry)
            self._enforce_budgets()
            return key if key in self._entries else None

    # ------------------------------------------------------------------ pins and drops

    def pin(self, name: str, key: str) -> None:
        """Pin entry `key` under `name` (moving the name if it pinned another); raises PrefixCacheError.

        With a state dir the entry is written at once, so the pin outlives the process.
        """
        if not isinstance(name, str) or not name:
            raise PrefixCacheError(f"pin name must be a non-empty string, got {name!r}")
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise PrefixCacheError(f"no cached entry {key!r}")
            if self.state_dir is not None and entry.path is None and entry.snapshot is not None:
                prefix_dir.write(self, entry)
            self._unpin(name)
            self._pins[name] = key
            entry.pins.add(name)
            prefix_dir.save_pins(self)

    def unpin(self, name: str) -> bool:
        """Remove pin `name`; returns whether it existed. The entry becomes evictable."""
        with self._lock:
            existed = self._unpin(name)
            if existed:
                prefix_dir.save_pins(self)
                self._enforce_budgets()
            return existed

    def pins(self) -> dict[str, str]:
        with self._lock:
            return dict(self._pins)

    def drop(self, key: str) -> bool:
        """Remove entry `key` from memory and disk, pins included; returns whether it existed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            had_pins = bool(entry.pins)
            self._remove(entry)
            if had_pins:
                prefix_dir.save_pins(self)
            return True

    # ------------------------------------------------------------------ disk

    def flush(self) -> int:
        """Write every in-memory entry that has no file yet; returns how many were written."""
        if self.state_dir is None:
            return 0
        with self._lock:
            written = 0
            for entry in list(self._entries.values()):
                if entry.path is None and entry.snapshot is not None and prefix_dir.write(self, entry):
                    written += 1
            self._enforce_budgets()
            return written

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                bytes_held=self._bytes_held,
                disk_bytes=self._disk_bytes,
                entries=len(self._entries),
                entries_in_memory=sum(e.snapshot is not None for e in self._entries.values()),
                **self._counts,
            )

    # ------------------------------------------------------------------ internals

    def _chain(self, tokens: np.ndarray, scope: str | None) -> list[bytes]:
        """The chained key of every full block of `tokens` in `scope`: the chain starts at the
        cache's root, salted with the scope unless it is the shared one."""
        b = self.block_size
        out, parent = [], self._root
        if scope is not None:
            parent = hashlib.blake2b(parent + b"scope\0" + scope.encode(), digest_size=16).digest()
        for start in range(0, len(tokens) - b + 1, b):
            parent = hashlib.blake2b(parent + tokens[start : start + b].astype("<i8").tobytes(), digest_size=16).digest()
            out.append(parent)
        return out

    def _touch(self, entry: Entry) -> None:
        self._tick += 1
        entry.last_used = self._tick
        self._entries.move_to_end(entry.key)

    def _add(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._touch(entry)
        for h in entry.hashes[-1:] if entry.recurrent else entry.hashes:
            self._blocks.setdefault(h, set()).add(entry.key)
        if entry.snapshot is not None:
            self._bytes_held += entry.nbytes
        self._disk_bytes += entry.file_bytes

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        for h in entry.hashes:
            keys = self._blocks.get(h)
            if keys is not None:
                keys.discard(entry.key)
                if not keys:
                    del self._blocks[h]
        for name in entry.pins:
            self._pins.pop(name, None)
        entry.pins.clear()
        self._release(entry)
        prefix_dir.delete_file(self, entry)

    def _release(self, entry: Entry) -> None:
        if entry.snapshot is not None:
            entry.snapshot = None
            self._bytes_held -= entry.nbytes

    def _unpin(self, name: str) -> bool:
        key = self._pins.pop(name, None)
        if key is None:
            return False
        self._entries[key].pins.discard(name)
        return True

    def _drop_superseded(self, entry: Entry) -> None:
        # a shorter unpinned KV-only entry on this entry's path serves nothing this one can't
        for depth_blocks, h in enumerate(entry.hashes[:-1], start=1):
            for key in list(self._blocks.get(h, ())):
                other = self._entries[key]
                if (not other.recurrent and not other.pins and other.num_tokens == depth_blocks * self.block_size
                        and np.array_equal(other.tokens, entry.tokens[: other.num_tokens])):
                    self._remove(other)
                    self._counts["superseded"] += 1

    def _take_share(self, scope: str | None) -> None:
        """Give owner scope `scope` its share of the budgets (taking the one of the scope used
        least recently when all are held); the shared scope always has its own."""
        if scope is None or not self.max_scopes:
            return
        if scope in self._shares:
            self._shares.move_to_end(scope)
            return
        if len(self._shares) >= self.max_scopes:
            loser, _ = self._shares.popitem(last=False)
            for entry in [e for e in self._entries.values() if e.scope == loser and not e.pins]:
                self._remove(entry)
            self._counts["shares_reclaimed"] += 1
            log.info("prefix_cache_share_reclaimed", shares=self.max_scopes)
        self._shares[scope] = None

    def _enforce_budgets(self) -> None:
        """Spill or evict least recently used entries until each budget holds: the whole
        cache's, or with max_scopes each scope's share."""
        if not self.max_scopes:
            self._enforce(list(self._entries.values()), self.max_bytes, self.max_disk_bytes)
            return
        groups: dict[str | None, list[Entry]] = {}
        for entry in self._entries.values():  # least recently used first
            groups.setdefault(entry.scope, []).append(entry)
        shares = self.max_scopes + 1
        for entries in groups.values():
            self._enforce(entries, self.max_bytes // shares, self.max_disk_bytes // shares)

    def _enforce(self, entries: list[Entry], max_bytes: int, max_disk_bytes: int) -> None:
        # least recently used first; the entry just used or inserted is the newest
        held = sum(e.nbytes for e in entries if e.snapshot is not None)
        for entry in entries:
            if held <= max_bytes:
                break
            if entry.snapshot is None or entry.pins:
                continue
            held -= entry.nbytes
            if self.state_dir is not None and (entry.path is not None or prefix_dir.write(self, entry)):
                self._release(entry)
                self._counts["spills"] += 1
            else:
                self._remove(entry)
                self._counts["evictions"] += 1
        entries = [e for e in entries if self._entries.get(e.key) is e]
        disk = sum(e.file_bytes for e in entries)
        for entry in entries:
            if disk <= max_disk_bytes:
                break
            if entry.path is not None and not entry.pins:
                disk -= entry.file_bytes
                self._remove(entry)
                self._counts["evictions"] += 1

    def _snapshot_of(self, entry: Entry) -> StateSnapshot | None:
        """The entry's snapshot, read from disk when needed; None (entry dropped) if its file is bad."""
        self._touch(entry)
        if entry.snapshot is not None:
            return entry.snapshot
        try:
            snap = store.read_entry_snapshot(entry.path, fingerprint=self.fingerprint, tokens=entry.tokens.tolist())
            self._template.check_snapshot(snap)
        except (store.BadFile, StateError, OSError) as exc:
            reject(entry.path, "prefix", str(exc))
            self._counts["files_dropped"] += 1
            pinned = bool(entry.pins)
            self._remove(entry)
            if pinned:
                prefix_dir.save_pins(self)
            return None
        _freeze(snap)
        entry.snapshot = snap
        self._bytes_held += entry.nbytes
        return snap

# ---------------------------------------------------------------------- helpers


def _as_tokens(tokens: Sequence[int]) -> np.ndarray:
    a = np.asarray(tokens, dtype=np.int64)
    if a.ndim != 1:
        raise PrefixCacheError(f"tokens must be a 1-D sequence of ints, got shape {a.shape}")
    return a


def _owned(snap: StateSnapshot) -> StateSnapshot:
    """A snapshot whose arrays are its own (a prefix's views would keep the long arrays alive)."""
    planes = tuple(PlaneSnapshot(p.kind, p.layer, p.positions, p.geometry, {k: a.copy() for k, a in p.arrays.items()})
                   for p in snap.planes)
    return StateSnapshot(snap.positions, planes)


def _freeze(snap: StateSnapshot) -> None:
    for p in snap.planes:
        for a in p.arrays.values():
            a.flags.writeable = False
