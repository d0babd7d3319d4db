"""A GGUF model's prepared weights, kept between starts in the kernel cache and mapped whole.

Packing a GGUF file's block matrices into the host kernels' tiles (npud/kernels/ggml/gemm.py) and
fusing each layer's projections takes gemma-3-270m about a second of CPU and a transient of
some 60 MiB above the packed weights. A start with an entry maps the packed arrays instead
(read-only, faulted in at once: the page cache's pages, no copy and no temporaries; gemma's
306 MB in some 50 ms where reading them into fresh memory took 0.3-1.3 s) and never touches
the GGUF file's tensor pages (only its header, for the config).

An entry is one file, `<cache_dir()>/packed/<key>.npw`: a header line (JSON: the format, the
key, per buffer its kind, size and a 64-bit word sum, each array as (buffer, byte offset,
dtype, shape, strides), and the weights tree as data, npud/engine/weights/tree.py's nodes),
then the buffers, each on a 4 KiB boundary. Nothing in an entry is code: the reader builds
the weights dataclasses itself from a closed list of kinds and checks every field's type. Arrays that were views of one buffer
(each part of a fused projection, a tied head) are views of one buffer again: no array is
held twice. A buffer of the huge-page arena (npud/kernels/host/resident.py, "gguf-q8") is read
back into that arena (the kernels stream the same kind of memory as after a build), every
other one is mapped (the exact float path's tiles stream as fast from mapped pages:
measured on gemma's 160 MiB output layer). An entry that is evicted or replaced while a
daemon maps it is unlinked, never rewritten, so the mapping keeps its old pages.

The key is a sha256 over the GGUF file's whole content (npud/engine/fingerprint.py's DigestMemo,
persisted beside the tokenizers' entries: an unchanged file is not read again), the layout,
the backend's class and numerics identity, numpy's version, PACK_VERSION and the source of
the modules that decide the packing, so a change to any of them makes a new entry. An entry
that is truncated, whose word sums do not match (a torn or zeroed page), or whose tree is not
a weights tree (npud/engine/weights/tree.py) is rejected (`cache_entry_rejected`), removed and
rebuilt. The sums catch damage, not tampering; tampering needs the cache directory, which
npud uses only when it owns it (docs/operations.md, "Who may write the cache"). At most
MAX_ENTRIES entries and MAX_BYTES are kept, the least recently used go first (the newest
stays whatever its size).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np
import structlog

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    from numpy import byte_bounds

from npud.engine.cache_entry import reject
from npud.engine.fingerprint import FingerprintError, directory_memo
from npud.engine.prefix_store import unlink, write_atomic
from npud.engine.weights import tree as weights_tree

log = structlog.get_logger(__name__)

FORMAT = "npud-packed-weights"
# bump when what an entry holds changes in a way the sources below do not show (2: the exact
# path's q tiles packed in 4 / 5 bits and its factor tiles in float16 where exact; 3: the tree
# as data, npud/engine/weights/tree.py, instead of a pickle)
PACK_VERSION = 3
SUBDIR = "packed"
SUFFIX = ".npw"
MAX_ENTRIES = 32
MAX_BYTES = 2 << 30  # entries are about the size of their model's packed weights (gemma-3-270m: 292-352 MiB)
ALIGN = 4096
MAX_HEADER = 64 << 20  # the header line's bound (gemma-3-270m's: 87 KB; it grows with the layer count)
_ROOT = Path(__file__).resolve().parents[3]  # the checkout (or site-packages) that holds npud/
# the modules whose code decides the arrays an entry holds
SOURCES = ("npud/engine/gguf/packed_cache.py", "npud/engine/gguf/load.py", "npud/engine/model.py", "npud/engine/gguf/weights.py",
           "npud/engine/weights/layout.py", "npud/engine/weights/__init__.py", "npud/kernels/base.py",
           "npud/kernels/ggml/gemm.py", "npud/kernels/ggml/blocks.py", "npud/kernels/ggml/nibbles.py", "npud/kernels/ggml/backend.py", "npud/kernels/host/backend.py",
           "npud/kernels/host/formats.py", "npud/kernels/host/resident.py", "npud/engine/weights/tree.py")


def default_root() -> Path:
    from npud.kernels.host.cache import cache_dir

    return cache_dir() / SUBDIR


def cacheable(backend) -> bool:
    """Whether `backend`'s prepared weights are plain arrays this cache can keep: the host
    backends' (an NPU backend's hold device state, and are built each start)."""
    from npud.kernels.host.backend import HostBackend

    return isinstance(backend, HostBackend)


def entry_key(path, layout: str, backend, root: Path) -> str:
    """The key of `path`'s packed weights in `layout` for `backend`. Raises FingerprintError."""
    from npud.kernels.base import numerics_identity

    memo = directory_memo(root)
    digest = memo.digest(path)
    memo.save()
    h = hashlib.sha256(json.dumps({"format": FORMAT, "version": PACK_VERSION, "file_sha256": digest,
                                   "layout": layout, "backend": f"{type(backend).__module__}.{type(backend).__qualname__}",
                                   "numerics": numerics_identity(backend), "numpy": np.__version__},
                                  sort_keys=True).encode())
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (_ROOT / name).read_bytes())
    return h.hexdigest()


# -- writing ------------------------------------------------------------------------------


def _owner(a: np.ndarray) -> tuple[str, object]:
    """(kind, owner) of the memory `a` is part of: ("array", the ndarray that owns it), ("arena",
    the huge-page mapping it lies in), or ("array", a itself) over any other memory (a mapped file's)."""
    from npud.kernels.host.resident import is_arena

    owner = a
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    if isinstance(owner, memoryview):  # np.frombuffer's base: the exporter is behind it
        owner = owner.obj
    if isinstance(owner, np.ndarray):
        return "array", owner
    if is_arena(owner):
        return "arena", owner
    if not a.flags.c_contiguous:
        raise TypeError("a non-contiguous array over memory npud did not allocate")
    return "array", a


def _layout(arrays: list[np.ndarray]) -> tuple[list[tuple[str, np.ndarray]], list[list]]:
    """The buffers to write, (kind, bytes), and each array as [buffer, offset, dtype, shape,
    strides]. An owner's whole memory is one buffer; an arena mapping gives one buffer per run
    of live bytes (the arrays in it merged where they overlap or touch), so memory that no
    array uses any more (a projection's own tiles before fusion) is neither written nor read."""
    groups: dict[int, tuple[str, object, list[int]]] = {}
    for i, a in enumerate(arrays):
        kind, owner = _owner(a)
        groups.setdefault(id(owner), (kind, owner, []))[2].append(i)
    buffers, table = [], [None] * len(arrays)
    for kind, owner, members in groups.values():
        if kind == "array":
            whole = owner.reshape(-1).view(np.uint8) if owner.flags.c_contiguous else None
            if whole is None:
                raise TypeError("an array that owns memory it does not hold contiguously")
            runs = [(owner.ctypes.data, owner.ctypes.data + owner.nbytes, members)]
        else:
            runs = []
            for i in sorted(members, key=lambda i: byte_bounds(arrays[i])[0]):
                low, high = byte_bounds(arrays[i])
                if runs and low <= runs[-1][1]:
                    runs[-1] = (runs[-1][0], max(runs[-1][1], high), runs[-1][2] + [i])
                else:
                    runs.append((low, high, [i]))
            mapped = np.frombuffer(owner, np.uint8)
        for low, high, idx in runs:
            if kind == "array":
                data = whole
            else:
                start = low - mapped.ctypes.data
                data = mapped[start : start + (high - low)]
            for i in idx:
                a = arrays[i]
                table[i] = [len(buffers), a.ctypes.data - low, a.dtype.str, list(a.shape), list(a.strides)]
            buffers.append((kind, data))
    return buffers, table


def _word_sum(raw: np.ndarray) -> int:
    """The wrapping sum of the buffer as little-endian uint64 words (zero-padded to a word)."""
    whole = raw[: raw.size - raw.size % 8].view("<u8")
    tail = int.from_bytes(bytes(raw[raw.size - raw.size % 8:]).ljust(8, b"\0"), "little")
    return (int(whole.sum(dtype=np.uint64)) + tail) % (1 << 64)


def store(weights, key: str, root: Path | None = None) -> None:
    """Write `weights` (a prepared weights tree) as the entry `key`; a refusal of the disk is logged."""
    root = Path(root) if root is not None else default_root()
    try:
        doc, arrays = weights_tree.encode(weights)
        buffers, table = _layout(arrays)
    except (TypeError, ValueError) as exc:  # a tree this module cannot keep: built each start
        log.warning("packed_weights_not_stored", reason=str(exc))
        return
    views = [data for _, data in buffers]
    header = {"format": FORMAT, "key": key, "tree": doc, "arrays": table,
              "buffers": [{"kind": kind, "bytes": int(v.size), "sum": _word_sum(v)} for (kind, _), v in zip(buffers, views)]}
    head = json.dumps(header, sort_keys=True, allow_nan=False).encode() + b"\n"
    parts, at = [head], len(head)
    for v in views:
        pad = -at % ALIGN
        parts += [b"\0" * pad, memoryview(v)]
        at += pad + v.size
    entry = root / f"{key}{SUFFIX}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, parts)
    except OSError as exc:
        log.warning("packed_weights_write_failed", entry=str(entry), error=exc.strerror or str(exc))
        return
    _evict(root, keep=entry)


# -- reading ------------------------------------------------------------------------------


def load(key: str, root: Path | None = None):
    """The ModelWeights of entry `key`, or None when there is none or it is unusable (then the
    entry is rejected: logged once and removed, so the caller's build replaces it)."""
    root = Path(root) if root is not None else default_root()
    entry = root / f"{key}{SUFFIX}"
    try:
        f = open(entry, "rb", buffering=0)
    except FileNotFoundError:
        return None
    except OSError as exc:
        reject(entry, "packed", f"cannot open: {exc.strerror or exc}")
        return None
    try:
        with f:
            weights, why = _read(f, key)
    except OSError as exc:
        weights, why = None, f"cannot read: {exc.strerror or exc}"
    except (KeyError, TypeError, ValueError, IndexError, OverflowError):  # a header of the right key but not of this shape
        weights, why = None, "a malformed header"
    if weights is None:
        reject(entry, "packed", why)
        return None
    try:
        os.utime(entry)  # the eviction order: least recently used first
    except OSError:
        pass
    return weights


def _read(f, key: str):
    """(weights, "") or (None, why the entry cannot be used)."""
    first = _header_line(f.fileno())
    if first is None:
        return None, "no header line"
    try:
        header = json.loads(first)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "not a packed weights entry"
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
        return None, "not this model's packed weights entry"
    at = len(first)
    size = os.fstat(f.fileno()).st_size
    buffers = []
    for b in header["buffers"]:
        if type(b["bytes"]) is not int or b["bytes"] < 0 or b["kind"] not in ("array", "arena"):
            return None, "a malformed header"
        at += -at % ALIGN
        if at + b["bytes"] > size:
            return None, "truncated"
        buf = _map(f, at, b["bytes"]) if b["kind"] != "arena" else _copy(f, at, b["bytes"])
        if buf is None:
            return None, "truncated"
        if _word_sum(buf) != b["sum"]:
            return None, "a buffer does not match its sum"
        buffers.append(buf)
        at += b["bytes"]
    try:
        arrays = [_array(buffers, *spec) for spec in header["arrays"]]
        return weights_tree.decode(header["tree"], arrays), ""
    except weights_tree.TreeError as exc:
        return None, f"not a weights tree: {exc}"


def _array(buffers: list[np.ndarray], buffer: int, offset: int, dtype: str, shape: list, strides: list) -> np.ndarray:
    """One array of an entry's table over its buffer. Raises TreeError for an index, a dtype or
    an extent the buffer does not have (numpy checks the extent against the buffer's size)."""
    if type(buffer) is not int or not 0 <= buffer < len(buffers):
        raise weights_tree.TreeError(f"buffer {buffer!r} is not in the entry")
    kind = np.dtype(dtype)
    if kind.kind not in weights_tree.DTYPE_KINDS or kind.hasobject:
        raise weights_tree.TreeError(f"an array of {dtype!r}")
    try:
        return np.ndarray(tuple(shape), kind, buffer=buffers[buffer], offset=offset, strides=tuple(strides))
    except (TypeError, ValueError) as exc:
        raise weights_tree.TreeError(f"an array outside its buffer: {exc}") from None


def _header_line(fd: int) -> bytes | None:
    """The entry's first line, newline included, read in blocks (a line of an unbuffered file
    is read a byte a call); None when there is no newline in the first MAX_HEADER bytes."""
    blocks, at = [], 0
    while at < MAX_HEADER:
        block = os.pread(fd, 1 << 16, at)
        end = block.find(b"\n")
        if end >= 0:
            return b"".join(blocks) + block[:end + 1]
        if not block:
            return None
        blocks.append(block)
        at += len(block)
    return None


def _map(f, at: int, size: int) -> np.ndarray:
    """The entry's bytes [at, at + size) mapped read-only and faulted in now (one call, no
    copy): the page cache's own pages, shared by every process that serves the model.
    Entries are replaced by rename, never rewritten in place, so a mapping cannot change
    under the kernels; a write through one of its arrays raises (they are read-only)."""
    if size == 0:
        return np.empty(0, np.uint8)
    m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                  prot=mmap.PROT_READ, offset=at)
    return np.frombuffer(m, np.uint8)


def _copy(f, at: int, size: int) -> np.ndarray | None:
    """The entry's bytes [at, at + size) read into a new buffer of the huge-page arena."""
    from npud.kernels.host.resident import resident_empty

    f.seek(at)
    buf = resident_empty(size)
    view = memoryview(buf)
    done = 0
    while done < size:
        n = f.readinto(view[done:])
        if not n:
            return None
        done += n
    return buf


def _evict(root: Path, keep: Path) -> None:
    try:
        entries = sorted(((st.st_mtime_ns, st.st_size, p) for p in root.glob(f"*{SUFFIX}") if p != keep
                          for st in (p.stat(),)), reverse=True)  # newest first
        total = keep.stat().st_size
    except OSError:
        return
    kept = 1
    for _, size, p in entries:
        if kept + 1 > MAX_ENTRIES or total + size > MAX_BYTES:
            unlink(p)
        else:
            kept, total = kept + 1, total + size


__all__ = ["FingerprintError", "default_root", "entry_key", "load", "store"]
