"""The prefix cache's directory (npud/engine/prefix_cache.py): an entry's file written and deleted, the
index rebuilt from the files at start-up, and the pins file. The files themselves are npud/engine/prefix_store.py's.

The functions work on a PrefixCache's index under its lock (the caller holds it, or is its
constructor)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from npud.engine import prefix_store as store
from npud.engine.cache_entry import reject
from npud.engine.state import PlaneKind, StateSnapshot

log = structlog.get_logger(__name__)

PINS_FILE = "pins.json"


@dataclass(slots=True, eq=False)
class Entry:
    """One cached prefix: its tokens and block keys, its snapshot in memory and/or its file."""

    key: str
    tokens: np.ndarray  # int64 [num_tokens], read-only
    hashes: tuple[bytes, ...]  # chained key of each full block
    recurrent: bool  # serves exactly num_tokens only
    nbytes: int  # snapshot bytes
    snapshot: StateSnapshot | None = None  # None: on disk only
    path: Path | None = None  # None: not written (yet)
    file_bytes: int = 0
    last_used: int = 0
    pins: set[str] = field(default_factory=set)
    scope: str | None = None  # whose entry (GenerateRequest.cache_scope); None: the shared scope

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)



def rebuild(cache) -> None:
    """Index the files of this model in the state dir; drop the bad ones."""
    for tmp in cache.state_dir.glob("*.tmp"):
        store.unlink(tmp)  # an interrupted write
    found, stale = [], []
    for path in cache.state_dir.glob(f"*{store.SUFFIX}"):
        try:
            entry = _index_file(cache, path)
        except store.OtherModel:
            stale.append(path)
            continue
        except (store.BadFile, OSError) as exc:
            reject(path, "prefix", str(exc))
            cache._counts["files_dropped"] += 1
            continue
        found.append((path.stat().st_mtime_ns, entry))
    if stale:
        # snapshots of other numerics (weights, format, backend, kernels): never restored
        for path in stale:
            store.unlink(path)
        cache._counts["files_dropped"] += len(stale)
        log.warning("prefix_cache_stale_dropped", files=len(stale), directory=str(cache.state_dir),
                    reason="their key is not this model's: its weights, weight format, backend or "
                           "engine numerics changed since they were written")
    for _, entry in sorted(found, key=lambda f: f[0]):
        cache._take_share(entry.scope)
        cache._add(entry)
    _load_pins(cache)
    cache._enforce_budgets()

def _index_file(cache, path: Path) -> Entry:
    """An on-disk entry for a file, after every check short of reading its tensors."""
    info = store.read_entry_info(path, fingerprint=cache.fingerprint, block_size=cache.block_size,
                                 template=cache._template)
    tokens = np.asarray(info.tokens, dtype=np.int64)
    tokens.flags.writeable = False
    hashes = cache._chain(tokens, info.scope)
    key = hashes[-1].hex()
    if info.key != key or path.name != f"{key}{store.SUFFIX}":
        raise store.BadFile(f"key {info.key!r} (file {path.name}) is not the hash of its tokens, {key}")
    recurrent = any(p.kind is PlaneKind.RECURRENT for p in cache._template.planes)
    return Entry(key, tokens, tuple(hashes), recurrent, info.nbytes, None, path, info.size, scope=info.scope)

def save_pins(cache) -> None:
    if cache.state_dir is None:
        return
    try:
        store.write_atomic(cache.state_dir / PINS_FILE, [json.dumps(cache._pins, sort_keys=True).encode()])
    except OSError as exc:
        log.warning("prefix_cache_write_failed", path=str(cache.state_dir / PINS_FILE), error=str(exc))

def _load_pins(cache) -> None:
    path = cache.state_dir / PINS_FILE
    if not path.exists():
        return
    try:
        pins = json.loads(path.read_text())
        if not isinstance(pins, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        log.warning("prefix_cache_pins_dropped", path=str(path), reason=str(exc))
        return
    for name, key in pins.items():
        entry = cache._entries.get(key) if isinstance(key, str) else None
        if entry is None:
            log.info("prefix_cache_pin_dropped", name=name, key=key, reason="no such entry on disk")
            continue
        cache._pins[name] = key
        entry.pins.add(name)


def write(cache, entry: Entry) -> bool:
    """Write the entry's file; False (logged) when the disk refuses."""
    path = cache.state_dir / f"{entry.key}{store.SUFFIX}"
    try:
        size = store.write_entry(path, entry.snapshot, fingerprint=cache.fingerprint,
                                 block_size=cache.block_size, key=entry.key, tokens=entry.tokens.tolist(),
                                 scope=entry.scope)
    except OSError as exc:
        log.warning("prefix_cache_write_failed", path=str(path), error=str(exc))
        return False
    entry.path, entry.file_bytes = path, size
    cache._disk_bytes += size
    return True

def delete_file(cache, entry: Entry) -> None:
    if entry.path is not None:
        store.unlink(entry.path)
        cache._disk_bytes -= entry.file_bytes
        entry.path, entry.file_bytes = None, 0
