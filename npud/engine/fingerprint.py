"""The key of a model's prefix-cache snapshots: everything their numbers depend on.

A restored snapshot must hold the bits a cold prefill of the same tokens gives. Those bits
depend on the whole content of the checkpoint's weight and config files, the weight format
the host holds them in, the backend (the host kernels, or an NPU GEMM design) with the path
its activations take, the engine's kernels (npud.kernels.base.NUMERICS_VERSION) and the versions
of numpy, numba and llvmlite that run them. `numerics_key`
hashes all of them into one string; npud/engine/prefix_cache.py roots every block hash in it and
writes it into every file, and a snapshot under any other key is never restored.

A whole-file digest reads every byte (sha256, which runs on the SHA extensions of every
Ryzen and of Intel since Ice Lake: about twice blake2b's speed here, bench/fingerprint.py).
So each file's digest is remembered by (path, size, mtime_ns, ctime_ns, inode, device), in
this process and in a JSON memo in the model's cache directory: an unchanged file is not
read again at the next start, and a file whose size, times or inode changed is rehashed.
The ctime catches an edit whose mtime was set back (it cannot be set). A file changed within
`SETTLE_NS` of the hash is not remembered, since an edit in the same timestamp tick would
leave its stat unchanged (git's "racy" case); it is hashed again at the next load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from npud.engine.cache_entry import reject
from npud.engine.prefix_store import write_atomic
from npud.kernels import base as kernels_base
from npud.kernels.base import WeightFormat, numerics_identity

log = structlog.get_logger(__name__)

HASH = "sha256"
MEMO_FILE = "file-digests.json"
MEMO_VERSION = 1
SETTLE_NS = 2_000_000_000  # a file changed this recently is not remembered (FAT's mtime ticks are 2 s)
_CHUNK = 1 << 20

_process_memo: dict[tuple, str] = {}  # stat identity -> digest, shared by every memo of the process
_process_lock = threading.Lock()
_directory_memos: dict[Path, "DigestMemo"] = {}  # cache directory -> its memo (directory_memo)
_directory_memos_lock = threading.Lock()


class FingerprintError(OSError):
    """A checkpoint file cannot be read to be hashed."""


def _identity(path: Path, st: os.stat_result) -> tuple:
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def directory_memo(root: str | Path) -> "DigestMemo":
    """The process's one memo kept in cache directory `root` (its `file-digests.json`): every
    cache that lives in `root` and keys entries by file content reads and saves through it."""
    root = Path(root)
    with _directory_memos_lock:
        if root not in _directory_memos:
            _directory_memos[root] = DigestMemo(root / MEMO_FILE)
        return _directory_memos[root]


class DigestMemo:
    """Whole-file digests remembered by path and stat; persisted at `memo_path` when given.

    A missing or unreadable memo file is an empty memo (logged when it exists but is bad).
    """

    def __init__(self, memo_path: str | Path | None = None):
        self.path = Path(memo_path) if memo_path is not None else None
        self.files_read = 0  # files hashed by this memo, for the load log
        self._used: dict[str, dict] = {}  # path -> record: what the next save keeps
        self._saved: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                if raw.get("version") != MEMO_VERSION or raw.get("hash") != HASH or not isinstance(raw.get("files"), dict):
                    raise ValueError(f"not a version {MEMO_VERSION} {HASH} memo")
                self._saved = raw["files"]
            except (OSError, ValueError, AttributeError) as exc:
                reject(self.path, "digest-memo", str(exc))

    def digest(self, path: str | Path) -> str:
        """The hex digest of the file's whole content, read only when the memo does not know
        this (path, size, mtime, ctime, inode, device). Raises FingerprintError."""
        path = Path(path).resolve()
        try:
            st = path.stat()
        except OSError as exc:
            raise FingerprintError(f"{path}: cannot read: {exc.strerror or exc}") from None
        ident = _identity(path, st)
        record = self._saved.get(str(path))
        with _process_lock:
            known = _process_memo.get(ident)
        if known is None and isinstance(record, dict) and record.get("stat") == list(ident[1:]):
            known = record.get("digest")
            if isinstance(known, str):  # every other memo of this process knows it too
                with _process_lock:
                    _process_memo[ident] = known
        if not isinstance(known, str):
            known, settled = self._hash(path, ident)
            if not settled:
                self._used.pop(str(path), None)
                return known
        self._used[str(path)] = {"stat": list(ident[1:]), "digest": known}
        return known

    def _hash(self, path: Path, before: tuple) -> tuple[str, bool]:
        """(digest, whether it may be remembered): not when the file changed while it was read,
        nor when it changed too recently for its stat to tell the next change apart."""
        started = time.time_ns()
        h = hashlib.new(HASH)
        try:
            with open(path, "rb") as f:
                buf = bytearray(_CHUNK)
                view = memoryview(buf)
                while n := f.readinto(buf):
                    h.update(view[:n])
            after = _identity(path, path.stat())
        except OSError as exc:
            raise FingerprintError(f"{path}: cannot read: {exc.strerror or exc}") from None
        self.files_read += 1
        digest = h.hexdigest()
        settled = before == after and max(after[2], after[3]) < started - SETTLE_NS
        if settled:
            with _process_lock:
                _process_memo[after] = digest
        return digest, settled

    def save(self) -> None:
        """Write the records of the files looked up since this memo was made (older ones,
        of files no longer used, are dropped); a refusal of the disk is logged."""
        if self.path is None:
            return
        files = dict(self._used)
        if files == self._saved:
            return
        body = json.dumps({"version": MEMO_VERSION, "hash": HASH, "files": files}, indent=1, sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, [body.encode()])
        except OSError as exc:
            log.warning("digest_memo_write_failed", path=str(self.path), error=str(exc))
        else:
            self._saved = files


TOOLCHAIN = ("numpy", "numba", "llvmlite")  # their versions move bits: SIMD math, code generation


def toolchain() -> dict[str, str | None]:
    """The installed versions of the packages whose code computes the numbers (None: absent)."""
    out = {}
    for name in TOOLCHAIN:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def numerics_key(files: Sequence[str | Path], memo: DigestMemo, *, weight_format: WeightFormat | str, backend) -> str:
    """Returns the prefix-cache key of a model: a sha256 hex digest over the whole content of
    each of `files` (its config and weight files, in the order given; a .gguf is one file),
    the weight format, the backend's numerics identity (npud.kernels.base.numerics_identity),
    npud.kernels.base.NUMERICS_VERSION and the toolchain's versions. Saves the memo. Raises
    FingerprintError."""
    fmt = weight_format.value if isinstance(weight_format, WeightFormat) else str(weight_format)
    parts = {
        "numerics_version": kernels_base.NUMERICS_VERSION,  # read now: a test (or a reload) may bump it
        "weight_format": fmt,
        "backend": numerics_identity(backend),
        "toolchain": toolchain(),
        # names, not paths: the same files moved elsewhere hold the same numbers
        "files": [[Path(p).name, memo.digest(p)] for p in files],
    }
    memo.save()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
