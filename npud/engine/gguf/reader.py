"""A GGUF file's metadata and tensor table, parsed here; tensor data memory-mapped.

Why not `gguf.GGUFReader`: it builds numpy views for every element of every array, which
takes seconds for a 262144-entry vocabulary (13 s for gemma-3-270m here), and
`npud --check-config` reads every model's metadata. The format is small (little-endian:
magic, version, counts, typed key/value pairs, tensor infos, aligned data); the tests
check this parser against ggml-org's reader field by field and tensor by tensor.

Tensor shapes are given row-major, [rows, columns] (GGUF lists dimensions fastest first).
Nothing is converted here; npud/engine/gguf/weights.py decides what each tensor becomes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from npud.engine.weights import WeightsError

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, weights per block, bytes per block); sizes of the types a file may hold
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# value type id -> struct format of a scalar (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges")


def is_gguf(path) -> bool:
    """True when `path` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(slots=True, frozen=True)
class GgufTensor:
    """One tensor of a GGUF file, located but not converted."""

    name: str
    type_name: str  # ggml's type name: "F32", "Q4_K", ...
    ggml_type: int
    shape: tuple[int, ...]  # row-major: [rows, columns] for a matrix
    data: np.ndarray | None  # uint8 bytes of the tensor (a view of the mapped file); None for an unknown type

    def raw_rows(self) -> np.ndarray:
        """The tensor's bytes as [rows, bytes per row] uint8 (a view)."""
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return self.data.reshape(rows, -1)

    def array(self) -> np.ndarray:
        """F32 / F16 tensors as a typed view of their shape."""
        dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[self.type_name]
        return self.data.view(dtype).reshape(self.shape)


@dataclass(slots=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]
    file_bytes: int
    mapping: np.memmap | None = None  # the whole file, mapped read-only

    def release(self, data: np.ndarray) -> None:
        """Let this process's resident pages of `data` (a view of the mapping) go: the weights
        copied out of it are not read from the file again, and a mapped page counts in the
        process's peak RSS as much as a copied one. The kernel's page cache keeps them; a
        later read faults them back in. Pages only partly inside `data` are let go too
        (harmless for the same reason)."""
        m = self.mapping
        mm = getattr(m, "_mmap", None)
        if mm is None or data.size == 0 or not hasattr(mm, "madvise"):
            return
        start = data.ctypes.data - m.ctypes.data
        if not 0 <= start <= start + data.nbytes <= m.nbytes:
            return
        lo = start - start % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, start + data.nbytes - lo)
        except (OSError, ValueError):
            pass

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def arch_field(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Reads little-endian values from the mapped file; running past the end is a WeightsError."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise WeightsError(f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {len(self.mv)})")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise WeightsError(f"{self.path}: a GGUF string at byte {self.pos - n} is not UTF-8") from None

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings without decoding them."""
        pos, end, buf = self.pos, len(self.mv), self.mv
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > end or (count and pos == self.pos):
            raise WeightsError(f"{self.path}: truncated GGUF header (needs byte {pos}, file has {end})")
        self.pos = pos

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize
                arr = np.frombuffer(self.take(count * size), dtype=_NUMPY[etype])
                return arr.astype(bool) if etype == 7 else arr.tolist()
            if etype == 8:
                return [self.string() for _ in range(count)]
            if etype == 9:
                raise WeightsError(f"{self.path}: metadata {key!r}: arrays of arrays are not supported")
            raise WeightsError(f"{self.path}: metadata {key!r}: unknown array element type {etype}")
        raise WeightsError(f"{self.path}: metadata {key!r}: unknown value type {vtype}")


def open_gguf(path, *, vocabulary: bool = True) -> GgufFile:
    """Returns the metadata and tensor table of a GGUF file (tensor data stays mapped).

    vocabulary=False leaves the tokenizer's arrays (tokens, scores, types, merges: 262,144
    and more entries each in a gemma file) out of the metadata, stepped over unread: loading the weights
    does not need them, and the tokenizer comes from its own cache
    (npud/engine/gguf/tokenizer_cache.py). Raises WeightsError for a missing, unreadable, truncated or malformed file, or tensors
    that overlap or run past its end.
    """
    p = Path(path)
    try:
        buf = np.memmap(p, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise WeightsError(f"{p}: no such GGUF file") from None
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{p}: cannot map: {exc}") from None
    c = _Cursor(buf, p)
    if bytes(c.take(4)) != GGUF_MAGIC:
        raise WeightsError(f"{p}: not a GGUF file (no GGUF magic)")
    version = c.scalar("<I")
    if version not in _VERSIONS:
        raise WeightsError(f"{p}: GGUF version {version} is not supported (expected one of {_VERSIONS})")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        vtype = c.scalar("<I")
        if not vocabulary and key in _TOKENIZER_ARRAYS and vtype == 9:
            at = c.pos
            etype, count = c.scalar("<I"), c.scalar("<Q")
            if etype == 8:
                c.skip_strings(count)
                continue
            if etype in _NUMPY:
                c.take(count * np.dtype(_NUMPY[etype]).itemsize)
                continue
            c.pos = at
        metadata[key] = c.value(vtype, key)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if n_dims > 8:
            raise WeightsError(f"{p}: tensor {name!r} has {n_dims} dimensions")
        dims = [c.scalar("<Q") for _ in range(n_dims)]
        infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise WeightsError(f"{p}: general.alignment = {alignment!r}: must be a power of two")
    data_start = -(-c.pos // alignment) * alignment
    tensors: dict[str, GgufTensor] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise WeightsError(f"{p}: tensor {name!r} appears twice")
        shape = tuple(int(d) for d in reversed(dims))
        known = GGML_TYPES.get(ggml_type)
        type_name = known[0] if known else f"type {ggml_type}"
        data = None
        if known is not None:
            count = int(np.prod(shape)) if shape else 1
            weights, size = known[1], known[2]
            if dims and dims[0] % weights:
                raise WeightsError(f"{p}: tensor {name!r}: rows of {dims[0]} are not whole {type_name} blocks")
            start = data_start + offset
            end = start + count // weights * size
            if offset % alignment or end > len(buf):
                raise WeightsError(f"{p}: tensor {name!r} ({type_name} {list(shape)}) does not fit in the file")
            data = buf[start:end]
        tensors[name] = GgufTensor(name=name, type_name=type_name, ggml_type=ggml_type, shape=shape, data=data)
    return GgufFile(path=p, metadata=metadata, tensors=tensors, file_bytes=len(buf), mapping=buf)
