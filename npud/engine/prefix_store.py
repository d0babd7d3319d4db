"""Prefix-cache entries on disk: one safetensors file per entry, written atomically, read with checks.

A file holds one `StateSnapshot`: float32 tensors named `layer.<i>.<array>` (k and v of a
KV plane, the state arrays of a recurrent plane; a KV-shared plane has none), and under
`__metadata__["npud_prefix"]` a JSON object: format, model fingerprint, block size, key,
positions, token ids, each plane's kind, layer, positions and geometry, and a digest of
the tensor bytes. Nothing read here reaches a model state before every one of those has
been checked against the model (npud/engine/prefix_cache.py checks the key against the tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from npud.engine.state import ModelState, PlaneKind, PlaneSnapshot, StateSnapshot

log = structlog.get_logger(__name__)

FORMAT_VERSION = 2  # 2: "scope" (whose entry); files of 1 had none and are dropped, whatever their key
META_KEY = "npud_prefix"
SUFFIX = ".safetensors"
META_FIELDS = ("format", "fingerprint", "block_size", "key", "scope", "positions", "tokens", "planes", "digest")
_MAX_HEADER_BYTES = 16 * 1024 * 1024


class BadFile(Exception):
    """A file that must not be loaded (truncated, corrupt, incomplete, wrong geometry)."""


class OtherModel(Exception):
    """A well-formed file under another key (another model, or the same one computed with
    other numerics): never to be loaded."""


@dataclass(slots=True, frozen=True)
class EntryInfo:
    """What a file's header says, once checked against the model."""

    key: str
    tokens: list[int]
    scope: str | None  # the entry's cache scope (npud.engine.api.GenerateRequest.cache_scope)
    nbytes: int  # bytes of the snapshot's arrays
    size: int  # bytes of the file


def write_entry(path: Path, snap: StateSnapshot, *, fingerprint: str, block_size: int, key: str,
                tokens: list[int], scope: str | None = None) -> int:
    """Write `snap` to `path` atomically (tmp + fsync + rename + fsync of the directory).

    Returns the file size; raises OSError.
    """
    tensors = {f"layer.{p.layer}.{name}": a for p in snap.planes for name, a in p.arrays.items()}
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "block_size": block_size,
        "key": key,
        "scope": scope,
        "positions": snap.positions,
        "tokens": tokens,
        "planes": [
            {"layer": p.layer, "kind": p.kind.value, "positions": p.positions, "geometry": p.geometry}
            for p in snap.planes
        ],
        "digest": _digest(tensors),
    }
    header, offset, names = {}, 0, sorted(tensors)
    for name in names:
        n = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {META_KEY: json.dumps(meta)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    parts = [struct.pack("<Q", len(raw)), raw]
    parts += [_bytes_of(tensors[n]) for n in names]
    write_atomic(path, parts)
    return 8 + len(raw) + offset


def read_entry_info(path: Path, *, fingerprint: str, block_size: int, template: ModelState) -> EntryInfo:
    """Check a file's header against the model without reading its tensors.

    Raises OtherModel for another fingerprint, BadFile for anything that must be dropped,
    OSError when the file cannot be read.
    """
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        tensors, meta, _ = _read_header(f, size)
    if meta["fingerprint"] != fingerprint:
        raise OtherModel(f"model fingerprint {str(meta['fingerprint'])[:16]}... is not this model's")
    if meta["format"] != FORMAT_VERSION or meta["block_size"] != block_size:
        raise BadFile(f"format {meta['format']!r} / block size {meta['block_size']!r} is not "
                      f"{FORMAT_VERSION} / {block_size}")
    positions, tokens = meta["positions"], meta["tokens"]
    if (type(positions) is not int or not isinstance(tokens, list) or positions != len(tokens)
            or not all(type(t) is int and t >= 0 for t in tokens) or positions <= 0 or positions % block_size):
        raise BadFile(f"{positions!r} positions and {len(tokens) if isinstance(tokens, list) else tokens!r} "
                      "token ids are not one prefix on a block boundary")
    planes = template.planes
    if not isinstance(meta["planes"], list) or len(meta["planes"]) != len(planes):
        raise BadFile(f"geometry: the file has {len(meta['planes'])} planes, the model {len(planes)}")
    want: dict[str, tuple[int, ...]] = {}
    for plane, p in zip(planes, meta["planes"]):
        kind, layer, geometry, held = _plane_meta(p)
        if (kind, layer, geometry) != (plane.kind, plane.layer, plane.geometry):
            raise BadFile(f"geometry: the file has {kind.value} layer {layer} {geometry}, the model "
                          f"{plane.kind.value} layer {plane.layer} {plane.geometry}")
        if held != (0 if kind is PlaneKind.SHARED else positions):
            raise BadFile(f"layer {layer} holds {held!r} positions in an entry of {positions}")
        for name, shape in plane.array_shapes(positions).items():
            want[f"layer.{layer}.{name}"] = shape
    got = {name: shape for name, (shape, _, _) in tensors.items()}
    if got != want:
        raise BadFile(f"geometry: tensors {sorted(got.items())} are not the model's {sorted(want.items())}")
    if not isinstance(meta["key"], str):
        raise BadFile(f"key {meta['key']!r} is not a string")
    if meta["scope"] is not None and not isinstance(meta["scope"], str):
        raise BadFile(f"scope {meta['scope']!r} is not a string or null")
    nbytes = sum(4 * int(np.prod(s)) for s in want.values())
    return EntryInfo(meta["key"], tokens, meta["scope"], nbytes, size)


def read_entry_snapshot(path: Path, *, fingerprint: str, tokens: list[int]) -> StateSnapshot:
    """Read the snapshot of a file indexed by `read_entry_info`, checking its digest.

    The caller still checks it against the model's planes (ModelState.check_snapshot).
    Raises BadFile or OSError.
    """
    with path.open("rb") as f:
        tensors, meta, data_start = _read_header(f, os.fstat(f.fileno()).st_size)
        arrays = {}
        for name, (shape, begin, end) in tensors.items():
            a = np.empty(shape, np.float32)
            f.seek(data_start + begin)
            if f.readinto(a.reshape(-1).view(np.uint8)) != end - begin:
                raise BadFile(f"truncated while reading tensor {name!r}")
            arrays[name] = a
    if _digest(arrays) != meta["digest"]:
        raise BadFile("the tensor bytes do not match the digest in the metadata")
    if meta["tokens"] != tokens or meta["fingerprint"] != fingerprint:
        raise BadFile("the file no longer holds the entry it was indexed as")
    planes = []
    for p in meta["planes"]:
        kind, layer, geometry, held = _plane_meta(p)
        prefix = f"layer.{layer}."
        own = {n[len(prefix):]: a for n, a in arrays.items() if n.startswith(prefix)}
        planes.append(PlaneSnapshot(kind, layer, held, geometry, own))
    return StateSnapshot(meta["positions"], tuple(planes))


def write_atomic(path: Path, parts) -> None:
    """Write `parts` (bytes-like) to `path` so that a crash leaves the old file or the new one.
    The file is the writer's alone (0600, whatever the umask): caches and snapshots hold
    weights, prompts' states and tokenizers that no other user needs to read."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def unlink(path: Path) -> None:
    """Remove a file; a missing file is fine, a refusal is logged."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("prefix_cache_unlink_failed", path=str(path), error=str(exc))


def _plane_meta(p) -> tuple[PlaneKind, int, tuple, int]:
    try:
        kind, layer, held = PlaneKind(p["kind"]), p["layer"], p["positions"]
        geometry = _geometry(p["geometry"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadFile(f"plane metadata {p!r} is incomplete: {exc!r}") from None
    if type(layer) is not int or type(held) is not int:
        raise BadFile(f"plane metadata {p!r}: layer and positions must be ints")
    return kind, layer, geometry, held


def _geometry(raw) -> tuple:
    """A plane's geometry from JSON, [[name, int | [int, ...]], ...], in PlaneSnapshot's tuple form."""
    if not isinstance(raw, list):
        raise ValueError(f"geometry {raw!r} is not a list")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"geometry item {item!r} is not [name, value]")
        name, value = item
        out.append((name, tuple(value) if isinstance(value, list) else value))
    return tuple(out)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype="<f4").reshape(-1).view(np.uint8)


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(arrays):
        h.update(b"%s\0%s\0" % (name.encode(), repr(tuple(arrays[name].shape)).encode()))
        h.update(_bytes_of(arrays[name]))
    return h.hexdigest()


def _read_header(f, size: int) -> tuple[dict[str, tuple[tuple[int, ...], int, int]], dict, int]:
    """(tensors: name -> (shape, begin, end), our metadata, data start); raises BadFile."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise BadFile(f"truncated: {size} bytes")
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER_BYTES or 8 + length > size:
        raise BadFile(f"header length {length} does not fit in {size} bytes (truncated, or not safetensors)")
    try:
        header = json.loads(f.read(length).decode("utf-8"))
        meta = json.loads(header.pop("__metadata__")[META_KEY])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadFile(f"header or metadata is not readable: {exc!r}") from None
    missing = [k for k in META_FIELDS if k not in meta] if isinstance(meta, dict) else list(META_FIELDS)
    if missing:
        raise BadFile(f"metadata lacks {missing}")
    tensors, spans = {}, []
    for name, t in header.items():
        try:
            dtype, shape, (begin, end) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise BadFile(f"tensor {name!r}: bad entry {t!r}: {exc!r}") from None
        if (dtype != "F32" or not all(type(d) is int and d >= 0 for d in shape)
                or type(begin) is not int or type(end) is not int or end - begin != 4 * int(np.prod(shape))):
            raise BadFile(f"tensor {name!r}: {dtype} {shape} at {begin}..{end} is not a float32 tensor")
        tensors[name] = (shape, begin, end)
        spans.append((begin, end))
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise BadFile(f"tensor data has a gap or an overlap at byte {begin}")
        covered = end
    data_start = 8 + length
    if data_start + covered != size:
        raise BadFile(f"the file has {size} bytes, its header describes {data_start + covered} (truncated or padded)")
    return tensors, meta, data_start
