"""Safetensors checkpoints read by hand: headers, tensor references, shard sets, fingerprints.

numpy has no bfloat16, so headers are parsed here and tensors are mapped as raw bytes;
bf16 stays uint16 bits.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npud.engine.api import ModelError


class WeightsError(ModelError):
    """A checkpoint file is missing, malformed, or lacks a tensor the model needs."""


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# element sizes of every dtype the safetensors format defines; only three can be loaded
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}
_LOADABLE = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# the reference implementation refuses headers above 100 MB; a larger length means junk
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class TensorRef:
    """One tensor of a safetensors file, located but not read."""

    name: str
    path: Path
    dtype: str  # safetensors dtype string: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    buffer: np.memmap  # the whole file, uint8, read-only
    start: int  # absolute byte offset in the file
    end: int

    def array(self) -> np.ndarray:
        """Returns a read-only view of the tensor (BF16 as uint16 bits); raises WeightsError for other dtypes."""
        dtype = _LOADABLE.get(self.dtype)
        if dtype is None:
            raise WeightsError(
                f"{self.path}: tensor {self.name!r} has dtype {self.dtype}, which is not supported "
                f"(supported: {sorted(_LOADABLE)})"
            )
        return self.buffer[self.start:self.end].view(dtype).reshape(self.shape)



def _read_header_bytes(path: Path) -> tuple[bytes, int]:
    """Returns (the 8-byte length + JSON header bytes, file size); raises WeightsError."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightsError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES or 8 + length > size:
                raise WeightsError(
                    f"{path}: not a safetensors file or truncated: header length {length} "
                    f"does not fit in the file's {size} bytes"
                )
            header = f.read(length)
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WeightsError(f"{path}: is a directory, not a safetensors file") from None
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(header) != length:
        raise WeightsError(f"{path}: truncated while reading the {length}-byte header")
    return prefix + header, size


def read_safetensors_header(path) -> tuple[dict, int]:
    """Returns (tensor entries without __metadata__, byte offset where tensor data starts).

    Validates the 8-byte little-endian length, the JSON object, and for every tensor its
    dtype, shape and data_offsets (consistent with each other, inside the file, not
    overlapping). Raises WeightsError naming the file (and tensor).
    """
    path = Path(path)
    raw, size = _read_header_bytes(path)
    data_start = len(raw)
    try:
        header = json.loads(raw[8:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: not a safetensors file: the header is not JSON") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file: the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise WeightsError(f"{path}: __metadata__ must be an object, got {metadata!r}")

    data_size = size - data_start
    spans = []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise WeightsError(f"{where}: entry must be an object, got {entry!r}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _ITEMSIZE:
            raise WeightsError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise WeightsError(f"{where}: shape must be a list of ints >= 0, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise WeightsError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
        begin, end = offsets
        expected = math.prod(shape) * _ITEMSIZE[dtype]
        if not 0 <= begin <= end or end - begin != expected:
            raise WeightsError(
                f"{where}: data_offsets {offsets} do not hold {dtype} {shape} ({expected} bytes)"
            )
        if end > data_size:
            raise WeightsError(
                f"{where}: truncated file: data ends at byte {data_start + end} but the file has {size} bytes"
            )
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise WeightsError(f"{path}: tensors {name_a!r} and {name_b!r} overlap")
    return header, data_start


def _map_file(path: Path) -> np.memmap:
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: cannot map: {exc}") from None


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Returns (weight files, index weight_map or None); raises WeightsError."""
    index_path = directory / INDEX_FILE
    single = directory / SINGLE_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsError(f"{index_path}: cannot read the shard index: {exc}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightsError(f"{index_path}: weight_map must be a non-empty object")
        names = set()
        for tensor, filename in weight_map.items():
            # a shard must be a plain file beside the index, never a path elsewhere
            if not isinstance(filename, str) or Path(filename).name != filename or filename in ("", ".", ".."):
                raise WeightsError(f"{index_path}: tensor {tensor!r} names an invalid shard {filename!r}")
            names.add(filename)
        files = [directory / name for name in sorted(names)]
        for path in files:
            if not path.is_file():
                raise WeightsError(f"{path}: shard named in {index_path.name} does not exist")
        return files, weight_map
    if single.exists():  # a directory by that name is reported by the header reader
        return [single], None
    if not directory.is_dir():
        raise WeightsError(f"{directory}: no such checkpoint directory")
    raise WeightsError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def open_checkpoint(checkpoint_dir) -> dict[str, TensorRef]:
    """Returns every tensor of the checkpoint by name, memory-mapped, nothing read yet.

    Handles model.safetensors or a shard set described by model.safetensors.index.json.
    Raises WeightsError for a missing or malformed file, a tensor in two shards, or an
    index entry its shard does not hold.
    """
    directory = Path(checkpoint_dir)
    files, weight_map = _weight_files(directory)
    refs: dict[str, TensorRef] = {}
    for path in files:
        header, data_start = read_safetensors_header(path)
        buffer = _map_file(path)
        for name, entry in header.items():
            if name in refs:
                raise WeightsError(f"{path}: tensor {name!r} is also in {refs[name].path}")
            begin, end = entry["data_offsets"]
            refs[name] = TensorRef(name=name, path=path, dtype=entry["dtype"], shape=tuple(entry["shape"]),
                                   buffer=buffer, start=data_start + begin, end=data_start + end)
    if weight_map is not None:
        for name, filename in weight_map.items():
            ref = refs.get(name)
            if ref is None or ref.path.name != filename:
                raise WeightsError(f"{directory / filename}: does not hold tensor {name!r} named in {INDEX_FILE}")
    return refs


def checkpoint_files(checkpoint_dir) -> list[Path]:
    """Returns the files a checkpoint's numbers come from: config.json, the shard index when
    there is one, and every weight file (what npud/engine/fingerprint.py hashes whole); a
    checkpoint that is one file (a .gguf) is its own list. Raises WeightsError when the
    weight files cannot be found."""
    directory = Path(checkpoint_dir)
    if directory.is_file():
        return [directory]
    files, _ = _weight_files(directory)
    index = [directory / INDEX_FILE] if (directory / INDEX_FILE).is_file() else []
    return [directory / "config.json", *index, *files]


FINGERPRINT_SAMPLES = 64  # data chunks hashed per weight file
FINGERPRINT_CHUNK = 1 << 16


def checkpoint_fingerprint(checkpoint_dir) -> str:
    """Returns a sha256 hex digest over config.json, every weight file's header, its size
    and FINGERPRINT_SAMPLES chunks of its data spread evenly over the file (for a single-file
    checkpoint, a .gguf path, over that file's size and samples): the identity of a checkpoint
    (a DFlash draft's training.json records its base's). The prefix cache is keyed by
    npud/engine/fingerprint.py's whole-content key instead.

    Retrained weights of the same shapes change it (every chunk of a retrained file
    differs), which keeps a persisted prefix cache or a drafter from being used with a
    base it was not made for; it reads at most 4 MiB a file. It is not a full content
    hash: a deliberate edit between the sampled chunks would go unnoticed. Raises WeightsError.
    """
    directory = Path(checkpoint_dir)
    digest = hashlib.sha256()
    if directory.is_file():
        # a single-file checkpoint (GGUF): config, tokenizer and weights are all in its bytes
        digest.update(b"single-file\0")
        _hash_samples(digest, directory)
        return digest.hexdigest()
    config_path = directory / "config.json"
    try:
        config_bytes = config_path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"{config_path}: cannot read: {exc.strerror or exc}") from None
    # lengths and names delimit the parts, so no two different inputs hash the same bytes
    digest.update(b"config.json\0%d\0" % len(config_bytes))
    digest.update(config_bytes)
    files, _ = _weight_files(directory)
    for path in files:
        header, _ = _read_header_bytes(path)
        digest.update(b"%s\0%d\0" % (path.name.encode(), len(header)))
        digest.update(header)
        _hash_samples(digest, path)
    return digest.hexdigest()


def _hash_samples(digest, path: Path) -> None:
    try:
        size = path.stat().st_size
        digest.update(b"size\0%d\0" % size)
        with open(path, "rb") as f:
            step = max(FINGERPRINT_CHUNK, size // FINGERPRINT_SAMPLES)
            for offset in range(0, size, step):
                f.seek(offset)
                digest.update(f.read(FINGERPRINT_CHUNK))
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read: {exc.strerror or exc}") from None

