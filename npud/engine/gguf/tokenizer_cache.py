"""The tokenizer a GGUF file describes, built once and kept between starts in the kernel cache.

Building it takes seconds (gemma-3-270m: 262,144 tokens, 514,906 merges implied by the
vocabulary, found in Python); a start that reads it back reads arrays. An entry is one file,
`<cache_dir()>/tokenizers/<sha256 of the GGUF>.json`: a header line (JSON: the format, the
builder's version, which backend the payload is for, the GGUF's digest, the payload's length
and sha256, and the settings npud/engine/gguf/tokenizer.py's gguf_tokenizer_parts gives beside
the backend) and then the payload. For a SentencePiece vocabulary (backend "native") the
payload is npud/engine/gguf/tokenizer.py's encode_native: the spellings as one UTF-8 blob with
int32 offsets and the merges as int32 (left, right, merged) rows, which
npud/engine/tokenizer_native.py's C tokenizer uses in place (gemma-3-270m: 9 MB, read and tabled
in tens of milliseconds). For a byte-level BPE (backend "tokenizers", the header also names
the library's version) it is the recipe (encode_recipe: the vocabulary as a JSON list and
the merges as pairs of ids) that the `tokenizers` object is assembled from, by the same code a
build uses; the library's own JSON was not used, since reading it back took gemma-3-270m 1.4 s
of CPU and 410 MB of transient memory against 0.9 s and about 200 MB for the recipe.

Keyed by the file's whole content: its digest comes from npud/engine/fingerprint.py's DigestMemo,
persisted here (`file-digests.json`), so an unchanged file is not read again at the next
start, and the prefix cache's key reads the same process-wide memo instead of hashing the
file a second time. An entry is written atomically (a crash leaves the old one or none); an
entry that is truncated, altered, written for another file, by another builder or library
version, or that the library refuses, is ignored, rebuilt and replaced. At most
`MAX_ENTRIES` entries are kept, the least recently used go first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from pathlib import Path

import structlog

from npud.engine.cache_entry import reject
from npud.engine.fingerprint import MEMO_FILE, FingerprintError, directory_memo
from npud.engine.gguf.tokenizer import (BUILDER_VERSION, assemble_backend, decode_native, decode_recipe, finish_backend,
                                   gguf_tokenizer_parts, native_backend, tokenizer_from_parts)
from npud.engine.prefix_store import unlink, write_atomic
from npud.engine.tokenizer import Tokenizer, TokenizerError

log = structlog.get_logger(__name__)

FORMAT = "npud-gguf-tokenizer"
SUBDIR = "tokenizers"
MAX_ENTRIES = 16


def default_root() -> Path:
    """Where entries live: the `tokenizers` directory of the kernel cache (npud/kernels/host/cache.py)."""
    from npud.kernels.host.cache import cache_dir

    return cache_dir() / SUBDIR


def _library() -> str:
    return importlib.metadata.version("tokenizers")


def load_gguf_tokenizer(path, root: str | Path | None = None) -> tuple[Tokenizer, str]:
    """The engine Tokenizer of the GGUF file at `path` and how it was had: "hit" (read from the
    cache), "miss" (built and stored) or "rebuilt" (an entry was there but unusable, and was
    replaced). `root`: the cache directory (default_root() when None). A cache that cannot be
    read or written costs only the build (logged). Raises TokenizerError for a file that is
    not a GGUF or has no usable tokenizer."""
    started = time.perf_counter()
    tokenizer, status = _load(path, root)
    log.info("gguf_tokenizer_loaded", status=status, seconds=round(time.perf_counter() - started, 3))
    return tokenizer, status


def _load(path, root) -> tuple[Tokenizer, str]:
    from npud.engine.gguf import open_gguf
    from npud.engine.weights import WeightsError

    path = Path(path)
    root = Path(root) if root is not None else default_root()
    memo = directory_memo(root)
    try:
        digest = memo.digest(path)
    except FingerprintError as exc:
        raise TokenizerError(str(exc)) from None
    memo.save()
    entry = root / f"{digest}.json"
    status = "miss"
    if entry.exists():
        tokenizer, why = _read(entry, digest, str(path))
        if tokenizer is not None:
            _touch(entry)
            return tokenizer, "hit"
        reject(entry, "tokenizer", why)
        status = "rebuilt"
    try:
        g = open_gguf(path)
    except WeightsError as exc:
        raise TokenizerError(str(exc)) from None
    backend, payload, settings = gguf_tokenizer_parts(g)
    del g  # the file's metadata (every token as a Python string) is not kept
    tokenizer = tokenizer_from_parts(backend, settings, str(path))
    _write(root, entry, digest, payload, settings)
    return tokenizer, status


def _header(digest: str, payload: bytes, settings: dict) -> dict:
    header = {"format": FORMAT, "builder": BUILDER_VERSION, "backend": settings["backend"], "file_sha256": digest,
              "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest(), "settings": settings}
    if settings["backend"] == "tokenizers":
        header["tokenizers"] = _library()  # the library reads the payload; another version may read it otherwise
    return header


def _read(entry: Path, digest: str, source: str) -> tuple[Tokenizer | None, str]:
    """(the entry's tokenizer, "") or (None, why it cannot be used)."""
    try:
        raw = entry.read_bytes()
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    end = raw.find(b"\n")
    line, payload = raw[:max(end, 0)], memoryview(raw)[end + 1:]  # the payload is not copied
    try:
        header = json.loads(line) if end >= 0 else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None, "not a tokenizer cache entry"
    checks = [("builder", BUILDER_VERSION), ("file_sha256", digest)]
    if header.get("backend") == "tokenizers":
        checks.append(("tokenizers", _library()))
    elif header.get("backend") != "native":
        return None, f"backend is {header.get('backend')!r}"
    for key, want in checks:
        if header.get(key) != want:
            return None, f"{key} is {header.get(key)!r}, not {want!r}"
    if header.get("payload_bytes") != len(payload) or header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        return None, "the payload does not match its digest"
    settings = header.get("settings")
    try:
        if header["backend"] == "native":
            backend = native_backend(decode_native(payload))
        else:
            from npud.engine.tokenizer_backend import TokenizersBackend

            backend = TokenizersBackend(assemble_backend(decode_recipe(payload)))
        finish_backend(backend, settings)
        return tokenizer_from_parts(backend, settings, source), ""
    except Exception as exc:  # a header that passed its digest but not the library or the engine: rebuild
        return None, f"unusable: {type(exc).__name__}"


def _write(root: Path, entry: Path, digest: str, payload: bytes, settings: dict) -> None:
    header = json.dumps(_header(digest, payload, settings), sort_keys=True).encode("utf-8")
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, [header, b"\n", payload])
    except OSError as exc:
        log.warning("tokenizer_cache_write_failed", entry=str(entry), error=exc.strerror or str(exc))
        return
    _evict(root, keep=entry)


def _touch(entry: Path) -> None:
    try:
        os.utime(entry)  # the eviction order: least recently used first
    except OSError:
        pass


def _evict(root: Path, keep: Path) -> None:
    try:
        entries = [(p.stat().st_mtime_ns, p) for p in root.glob("*.json") if p.name != MEMO_FILE and p != keep]
    except OSError:
        return
    entries.sort()
    for _, p in entries[: max(0, len(entries) + 1 - MAX_ENTRIES)]:
        unlink(p)
