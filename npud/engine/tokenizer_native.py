"""The tokenizer of a GGUF SentencePiece vocabulary (tokenizer.ggml.model = llama) in C
(npud/engine/tokenizer_native.c says what it reproduces of the `tokenizers` backend that
npud/engine/gguf/tokenizer.py's assemble_backend builds), called through ctypes.

Why not `tokenizers` for these files: building its BPE from gemma-3-270m's 262,144 tokens and
514,906 merges held the GIL about a second at every start and kept ~70 MiB; here a start
reads the arrays npud/engine/gguf/tokenizer_cache.py keeps (the spellings as one UTF-8 blob and
offsets, the merges as (left, right, merged) id rows in rank order) and builds hash tables
over them in C: tens of milliseconds, and the arrays plus the tables are the whole vocabulary
in memory. ctypes releases the GIL for every call, so a long prompt is encoded while the
daemon's other threads run.

The library is compiled with gcc once per machine into the kernel cache (npud/kernels/host/cache.py),
named by a digest of its source and flags, and checked against the manifest written at build
before it is loaded, as the host kernels are (npud/kernels/host/native.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import threading
import weakref
from pathlib import Path

import numpy as np

from npud.engine.tokenizer import TokenizerError

SOURCE = Path(__file__).with_name("tokenizer_native.c")
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c11")

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library_path(directory: Path | None = None) -> Path:
    """Where the shared object for this source and these flags lives."""
    from npud.kernels.host.cache import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + platform.machine().encode())
    return (directory or cache_dir()) / f"npud_tokenizer-{digest.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Compile the library into the cache directory unless a library that matches its manifest
    is there; returns its path. Raises TokenizerError when gcc is missing or fails, OSError when
    the directory is not writable."""
    from npud.kernels.host.cache import BuildError, compile_library

    try:
        return compile_library(library_path(directory), [SOURCE], CFLAGS, "the GGUF tokenizer").path
    except BuildError as exc:
        raise TokenizerError(str(exc)) from None


def library() -> ctypes.CDLL:
    """The loaded library (built on first use, checked against its manifest before)."""
    from npud.kernels.host.cache import private_dir

    global _lib
    with _lock:
        if _lib is None:
            try:
                path = build()
            except OSError:  # an unwritable cache directory: build into this process's own
                path = build(private_dir())
            lib = ctypes.CDLL(str(path))
            lib.spm_new.argtypes = [_I, _P, _P, _I, _P, _I, _P, _I, ctypes.c_int]
            lib.spm_new.restype = _P
            lib.spm_free.argtypes = [_P]
            lib.spm_free.restype = None
            lib.spm_encode_bound.argtypes = [_L]
            lib.spm_encode_bound.restype = _L
            lib.spm_encode.argtypes = [_P, ctypes.c_char_p, _L, ctypes.c_int, _I, _P]
            lib.spm_encode.restype = _L
            lib.spm_token_to_id.argtypes = [_P, ctypes.c_char_p, _L]
            lib.spm_token_to_id.restype = _I
            lib.spm_ids_of.argtypes = [_P, _P, _L, _P]
            lib.spm_ids_of.restype = None
            lib.spm_known.argtypes = [_P, _P]
            lib.spm_known.restype = None
            lib.spm_decode_bound.argtypes = [_P, _P, _L]
            lib.spm_decode_bound.restype = _L
            lib.spm_decode.argtypes = [_P, _P, _L, _P]
            lib.spm_decode.restype = _L
            _lib = lib
        return _lib


class NativeBackend:
    """A SentencePiece BPE over arrays (npud/engine/gguf/tokenizer.py's native_arrays): the backend
    interface npud/engine/tokenizer.py's Tokenizer uses (npud/engine/tokenizer_backend.py describes it).

    `offsets`: int32 [n + 1] into `blob` (the spellings, UTF-8); `merges`: int32 [m, 3] (left,
    right, merged id; rank = row); `control`, `user`: token indices of the added tokens (special
    and not); `unk`: the unknown token's index or None; `gemma`: no leading "▁" on the text and
    none dropped when decoding. The arrays are used in place and must not change."""

    byte_level = False

    def __init__(self, offsets: np.ndarray, blob, merges: np.ndarray, control, user, unk: int | None,
                 gemma: bool) -> None:
        self._lib = lib = library()
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int32)
        self._blob = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob
        self._merges = np.ascontiguousarray(merges, dtype=np.int32).reshape(-1, 3)
        self._control, self._user = list(control), list(user)
        added = np.array(self._control + self._user, dtype=np.int32)
        self._gemma = bool(gemma)
        n = len(self._offsets) - 1
        handle = lib.spm_new(n, self._offsets.ctypes.data, self._blob.ctypes.data, len(self._merges),
                             self._merges.ctypes.data, len(added), added.ctypes.data,
                             -1 if unk is None else unk, int(self._gemma))
        if not handle:
            raise MemoryError("the GGUF tokenizer's tables")
        self._handle = handle
        weakref.finalize(self, lib.spm_free, handle)
        self.n_tokens = n
        known = np.empty(n, dtype=np.uint8)
        lib.spm_known(handle, known.ctypes.data)
        self._known = known.view(bool)
        self.vocab_size = int(self._known.sum())  # distinct spellings, as the library counts them
        self._bos = -1

    def add_bos(self, content: str | None) -> None:
        """Put the token `content` in front of encode(..., add_special_tokens=True) (None: nothing).
        Raises TokenizerError when no token is spelled so."""
        bos = -1 if content is None else self.token_to_id(content)
        if bos is None:
            raise TokenizerError(f"the BOS token {content!r} is not in the vocabulary")
        self._bos = bos

    def _encode(self, text: str, split_added: bool, bos: int) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"text is not valid Unicode (a lone surrogate at character {exc.start})") from None
        out = np.empty(self._lib.spm_encode_bound(len(raw)), dtype=np.int32)
        count = self._lib.spm_encode(self._handle, raw, len(raw), int(split_added), bos, out.ctypes.data)
        if count < 0:
            raise MemoryError("encoding a text")
        return out[:count].tolist()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`, the added tokens written in it as their ids."""
        return self._encode(text, True, self._bos if add_special_tokens else -1)

    def encode_plain(self, text: str) -> list[int]:
        """The ids of `text` with no added tokens (their spellings as the characters they are made of)."""
        return self._encode(text, False, -1)

    def decode(self, ids) -> str:
        """The text of `ids`; raises ValueError for an id outside [0, n_tokens)."""
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        if not arr.size:
            return ""
        if arr.min() < 0 or arr.max() >= self.n_tokens:
            raise ValueError(f"token ids must be in [0, {self.n_tokens})")
        bound = self._lib.spm_decode_bound(self._handle, arr.ctypes.data, len(arr))
        out = np.empty(bound, dtype=np.uint8)
        n = self._lib.spm_decode(self._handle, arr.ctypes.data, len(arr), out.ctypes.data)
        return out[:n].tobytes().decode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        """The spelling of `token_id`, or None when it has none (another id has its spelling)."""
        if not 0 <= token_id < self.n_tokens or not self._known[token_id]:
            return None
        return self._blob[self._offsets[token_id]:self._offsets[token_id + 1]].tobytes().decode("utf-8")

    def token_to_id(self, content: str) -> int | None:
        """The id whose spelling is `content` (the last of a repeated spelling), or None."""
        raw = content.encode("utf-8", "surrogatepass")
        token_id = self._lib.spm_token_to_id(self._handle, raw, len(raw))
        return None if token_id < 0 else token_id

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        """{id: (spelling, special)} of the tokens cut out of text whole (empty spellings are not)."""
        indices = np.array(self._control + self._user, dtype=np.int32)
        ids = np.empty(len(indices), dtype=np.int32)
        self._lib.spm_ids_of(self._handle, indices.ctypes.data, len(indices), ids.ctypes.data)
        blob, n_control = self._blob.tobytes(), len(self._control)
        starts, ends = self._offsets[indices].tolist(), self._offsets[indices + 1].tolist()
        out: dict[int, tuple[str, bool]] = {}
        for k, (start, end, token_id) in enumerate(zip(starts, ends, ids.tolist())):
            if end > start:
                out[token_id] = (blob[start:end].decode("utf-8"), k < n_control)
        return out

    def known_ids(self) -> np.ndarray:
        """The ids that decode to their spelling (int64)."""
        return np.flatnonzero(self._known)
