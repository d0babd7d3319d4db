"""Checkpoint weights: safetensors files read by hand, converted tensor by tensor.

numpy has no bfloat16, so headers are parsed here and tensors are mapped as raw bytes;
bf16 stays uint16 bits. Every tensor the model needs is checked (present, shape, dtype)
before anything is converted, so a bad checkpoint fails in milliseconds with a message
naming the tensor, not halfway through a large allocation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import HYBRID_MODEL_TYPES, ModelConfig
from kernels.base import LinearWeight, WeightFormat


class WeightsError(ValueError):
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
# rows converted per step are sized to about this many elements, to bound temporaries
_CHUNK_ELEMENTS = 1 << 20


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


@dataclass(slots=True)
class AttentionWeights:
    q: LinearWeight
    k: LinearWeight | None  # None on a KV-shared layer (gemma4): it reads its owner's rows
    v: LinearWeight | None  # None on a KV-shared layer and where the values are the keys (k_eq_v)
    o: LinearWeight
    q_norm: np.ndarray | None  # float32 [head_dim], qwen3
    k_norm: np.ndarray | None
    v_norm: np.ndarray | None = None  # gemma4: ones [head_dim], an RMS norm without a weight of its own
    gate: LinearWeight | None = None  # qwen3_5: the gate half of q_proj, [num_heads * head_dim, D]


@dataclass(slots=True)
class MlpWeights:
    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight


@dataclass(slots=True)
class LinearAttentionWeights:
    """A gated delta net layer (qwen3_5), geometry in engine.config.LinearSpec."""

    in_qkv: LinearWeight  # [conv_dim, D]
    in_z: LinearWeight  # [value_dim, D], the output gate
    in_b: LinearWeight  # [value heads, D], beta = sigmoid(b)
    in_a: LinearWeight  # [value heads, D], the decay's input
    conv: np.ndarray  # float32 [conv_dim, conv_kernel], depthwise
    dt_bias: np.ndarray  # float32 [value heads]
    a_log: np.ndarray  # float32 [value heads]: decay = exp(-exp(a_log) * softplus(a + dt_bias))
    norm: np.ndarray  # float32 [value_head_dim], the gated RMS norm's weight
    out: LinearWeight  # [D, value_dim]


@dataclass(slots=True)
class LayerWeights:
    input_norm: np.ndarray  # float32 [D]
    attn: AttentionWeights | None  # None on a linear-attention layer
    post_attention_norm: np.ndarray  # float32 [D]; gemma4: the norm of the attention output
    mlp: MlpWeights
    linear_attn: LinearAttentionWeights | None = None
    pre_feedforward_norm: np.ndarray | None = None  # gemma4
    post_feedforward_norm: np.ndarray | None = None  # gemma4
    per_layer_gate: LinearWeight | None = None  # gemma4 PLE: [P, D]
    per_layer_projection: LinearWeight | None = None  # gemma4 PLE: [D, P]
    post_per_layer_norm: np.ndarray | None = None  # gemma4 PLE: [D]
    layer_scalar: np.ndarray | None = None  # gemma4: float32 [1]


@dataclass(slots=True)
class ModelWeights:
    embed: LinearWeight  # [V, D] in the chosen format
    layers: list[LayerWeights]
    final_norm: np.ndarray  # float32 [D]
    lm_head: LinearWeight  # the same object as embed when tied
    fingerprint: str
    embed_per_layer: LinearWeight | None = None  # gemma4 PLE: [per-layer vocab, layers * P]
    per_layer_model_projection: LinearWeight | None = None  # gemma4 PLE: [layers * P, D]
    per_layer_projection_norm: np.ndarray | None = None  # gemma4 PLE: [P]

    @property
    def nbytes(self) -> int:
        """Bytes held by all arrays; a tied lm_head is counted once."""
        seen: set[int] = set()
        total = 0
        for obj in weight_arrays(self):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.nbytes
        return total


def weight_arrays(obj):
    """Every LinearWeight and ndarray held by a weights dataclass (or list of them), depth first."""
    if isinstance(obj, (LinearWeight, np.ndarray)):
        yield obj
    elif isinstance(obj, list):
        for item in obj:
            yield from weight_arrays(item)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from weight_arrays(getattr(obj, f.name))


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


FINGERPRINT_SAMPLES = 64  # data chunks hashed per weight file
FINGERPRINT_CHUNK = 1 << 16


def checkpoint_fingerprint(checkpoint_dir) -> str:
    """Returns a sha256 hex digest over config.json, every weight file's header, its size
    and FINGERPRINT_SAMPLES chunks of its data spread evenly over the file; for a
    single-file checkpoint (a .gguf path), over that file's size and samples.

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


def _expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Returns the HF tensor names the model needs with their shapes."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in cfg.layers:
        p = f"model.layers.{layer.index}."
        q_width = layer.num_heads * layer.head_dim
        for proj, n, k in (("q", q_width, d), ("k", layer.kv_width, d), ("v", layer.kv_width, d),
                           ("o", d, q_width)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (n, k)
            if (cfg.o_bias if proj == "o" else cfg.qkv_bias):
                out[f"{p}self_attn.{proj}_proj.bias"] = (n,)
        if cfg.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = (layer.head_dim,)
            out[f"{p}self_attn.k_norm.weight"] = (layer.head_dim,)
        out[f"{p}input_layernorm.weight"] = (d,)
        out[f"{p}post_attention_layernorm.weight"] = (d,)
        for proj, n, k in (("gate", f, d), ("up", f, d), ("down", d, f)):
            out[f"{p}mlp.{proj}_proj.weight"] = (n, k)
            if cfg.mlp_bias:
                out[f"{p}mlp.{proj}_proj.bias"] = (n,)
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def _check_tensors(refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]], directory: Path) -> None:
    problems = []
    for name, shape in expected.items():
        ref = refs.get(name)
        if ref is None:
            problems.append(f"tensor {name!r} is missing")
        elif ref.shape != shape:
            problems.append(f"tensor {name!r} has shape {list(ref.shape)}, expected {list(shape)}")
        elif ref.dtype not in _LOADABLE:
            problems.append(
                f"tensor {name!r} in {ref.path.name} has dtype {ref.dtype}, which is not supported "
                f"(supported: {sorted(_LOADABLE)})"
            )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError(f"{directory}: " + "; ".join(problems[:5]) + more)


def _as_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    """Widens a block of stored values to float32 (exactly: f16 and bf16 fit in f32)."""
    if dtype == "BF16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return block.astype(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Returns bf16 bits (uint16) of float32 `x`, rounded to nearest even as torch does.

    Every NaN becomes the quiet NaN 0x7FC0 (torch gives 0x7FC0 or 0xFFFF depending on
    its code path); values past the largest bf16 round to infinity, as in torch.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the
    # dropped half is above one half, or equal to it with an odd kept half
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def quantize_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (int8 q [N, K], float32 scale [N]) with w ~= q * scale[:, None].

    Symmetric per output row: scale = max|row| / 127, q = clip(rint(w / scale), -127, 127),
    so each element is off by at most scale / 2. An all-zero row gets scale 1.0 (its q is
    all zeros, so it dequantizes to exact zeros and nothing divides by zero).
    """
    absmax = np.max(np.abs(w), axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    scale = (absmax / np.float32(127.0)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _convert_matrix(ref: TensorRef, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray | None]:
    """Returns (data, scale) of a [N, K] tensor in `fmt`, converting a block of rows at a time."""
    src = ref.array()
    n, k = src.shape
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    if fmt is WeightFormat.FP32:
        out = np.empty((n, k), np.float32)
    elif fmt is WeightFormat.BF16:
        out = np.empty((n, k), np.uint16)
    elif fmt is WeightFormat.INT8:
        out = np.empty((n, k), np.int8)
        scale = np.empty(n, np.float32)
    else:
        raise WeightsError(f"unknown weight format {fmt!r}")
    for r0 in range(0, n, rows):
        block = src[r0:r0 + rows]
        if fmt is WeightFormat.BF16 and ref.dtype == "BF16":
            out[r0:r0 + rows] = block
            continue
        block32 = _as_float32(block, ref.dtype)
        if fmt is WeightFormat.FP32:
            out[r0:r0 + rows] = block32
        elif fmt is WeightFormat.BF16:
            out[r0:r0 + rows] = f32_to_bf16_bits(block32)
        else:
            if not np.all(np.isfinite(block32)):
                bad = r0 + int(np.nonzero(~np.all(np.isfinite(block32), axis=1))[0][0])
                raise WeightsError(
                    f"{ref.path}: tensor {ref.name!r} row {bad} holds NaN or infinity; it cannot be quantized to int8"
                )
            out[r0:r0 + rows], scale[r0:r0 + rows] = quantize_int8_rows(block32)
    return out, (scale if fmt is WeightFormat.INT8 else None)


def _vector(ref: TensorRef) -> np.ndarray:
    return np.ascontiguousarray(_as_float32(ref.array(), ref.dtype), dtype=np.float32)


def load_weights(cfg: ModelConfig, checkpoint_dir, fmt: WeightFormat) -> ModelWeights:
    """Returns the model's weights in `fmt` (norms and biases always float32).

    Every needed tensor is checked for presence, shape and dtype first; then tensors
    are converted one at a time. Raises WeightsError naming the file and tensor.
    """
    if not isinstance(fmt, WeightFormat):
        raise WeightsError(f"fmt must be a WeightFormat, got {fmt!r}")
    directory = Path(checkpoint_dir)
    refs = open_checkpoint(directory)
    if cfg.model_type in HYBRID_MODEL_TYPES:
        from engine.weights_hybrid import expected_hybrid_tensors, load_hybrid_weights

        _check_tensors(refs, expected_hybrid_tensors(cfg), directory)
        return load_hybrid_weights(cfg, refs, fmt, checkpoint_fingerprint(directory))
    _check_tensors(refs, _expected_tensors(cfg), directory)
    fingerprint = checkpoint_fingerprint(directory)

    def linear(prefix: str, has_bias: bool) -> LinearWeight:
        data, scale = _convert_matrix(refs[f"{prefix}.weight"], fmt)
        bias = _vector(refs[f"{prefix}.bias"]) if has_bias else None
        return LinearWeight(fmt=fmt, data=data, scale=scale, bias=bias)

    embed = linear("model.embed_tokens", False)
    layers = []
    for layer in cfg.layers:
        p = f"model.layers.{layer.index}."
        attn = AttentionWeights(
            q=linear(f"{p}self_attn.q_proj", cfg.qkv_bias),
            k=linear(f"{p}self_attn.k_proj", cfg.qkv_bias),
            v=linear(f"{p}self_attn.v_proj", cfg.qkv_bias),
            o=linear(f"{p}self_attn.o_proj", cfg.o_bias),
            q_norm=_vector(refs[f"{p}self_attn.q_norm.weight"]) if cfg.qk_norm else None,
            k_norm=_vector(refs[f"{p}self_attn.k_norm.weight"]) if cfg.qk_norm else None,
        )
        mlp = MlpWeights(
            gate=linear(f"{p}mlp.gate_proj", cfg.mlp_bias),
            up=linear(f"{p}mlp.up_proj", cfg.mlp_bias),
            down=linear(f"{p}mlp.down_proj", cfg.mlp_bias),
        )
        layers.append(LayerWeights(
            input_norm=_vector(refs[f"{p}input_layernorm.weight"]),
            attn=attn,
            post_attention_norm=_vector(refs[f"{p}post_attention_layernorm.weight"]),
            mlp=mlp,
        ))
    lm_head = embed if cfg.tie_word_embeddings else linear("lm_head", False)
    return ModelWeights(embed=embed, layers=layers, final_norm=_vector(refs["model.norm.weight"]),
                        lm_head=lm_head, fingerprint=fingerprint)
