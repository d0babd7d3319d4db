"""The NPU design table: which precompiled GEMM serves which weight shape.

An NPU GEMM design built with mlir-aie's IRON `whole_array` example bakes M, K and N into
its xclbin and its instruction stream, so a model needs one design per distinct (K, N) of
its linear layers. `design.json` lists them (paths relative to its folder):

    {"version": 1, "device": "npu2",
     "designs": [
       {"K": 1024, "N": 3072, "weight_format": "bf16",
        "xclbin": "gemm_1024x3072.xclbin", "insts": "insts_1024x3072.bin", "kernel": "MLIR_AIE",
        "M": 32, "compiled_K": 1024, "compiled_N": 3072, "n_passes": 1,
        "tile_m": 8, "tile_k": 64, "tile_n": 32, "columns": 4,
        "dtype_in": "bf16", "dtype_out": "f32", "b_col_major": false,
        "bfp16_emulation": true, "insts_format": "binary"}]}

An "int8" design ("weight_format": "int8", "dtype_in": "i8", "dtype_out": "i32",
"bfp16_emulation": false) takes int8 A and B and gives int32 C, the sums of exact integer
products; the rows of A are quantized and C is scaled back beside the device (xrt_device.py,
`quantize_rows` and `dequantize`), which docs/npu.md ("Exactness") writes down beside the host's
int8 arithmetic.

(K, N) is the layer's true shape; the compiled shape may be larger (zero padding). A shape may
have several designs that differ in M only (decode-sized and prefill-sized passes): they share
the weight's layout on the device (compiled K and N, passes, B's order, the arithmetic), and
the backend runs each chunk of a call's rows on the smallest M that holds it. A layer
wider than one pass can be (npud/kernels/xrt_rules.py: the output layer) runs as `n_passes`
passes of compiled_N columns each, over slices of its weight. The tile rules the design
generator asserts and the limits the toolchain's verifier puts on the design's transfers
are checked here, so a table that could not have been compiled, or that was compiled for
other rules, is refused at load, not at the first call. `tools/build_npu_designs.py` writes
this file.

The instruction stream is the binary aiecc writes (`--npu-insts-name`), whatever the file's
name: a transaction header, then the operations. `"insts_format": "hex"` (one word per line)
exists for hand-made test tables only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npud.kernels.xrt_rules import generator_errors, transfer_errors

N_AIE_ROWS = 4  # every whole_array design spreads A's rows over the 4 core rows of a column
MAX_COLUMNS = {"npu1": 4, "npu2": 8}  # Phoenix / Hawk Point: 4 columns; Strix / Krackan: 8

# The bf16 MAC shape (r, s, t) of the matmul micro-kernel: m % r, k % s, n % t must be 0.
# On npu2 the 8x8x8 shape is the one that emulates bf16 with bfp16 (8 values share an
# exponent); without emulation it is 4x8x8.
MICRO_TILES = {("npu1", False): (4, 8, 4), ("npu2", True): (8, 8, 8), ("npu2", False): (4, 8, 8)}

# The int8 MAC shape (r, s, t) and the mm kernel's unrolling around it (mlir-aie's
# aie_kernels/aie2/mm.cc and aie2p/mm.cc, matmul_vectorized_*_i8_i32): aie2 (npu1) runs 4x8x8
# MMULs four times along m and twice along n, aie2p (npu2) 8x8x8 twice along m and n, so m, k, n
# must be multiples of these. The products accumulate in int32 lanes and are stored as they are.
INT8_TILE_MULTIPLES = {"npu1": (16, 8, 16), "npu2": (16, 8, 16)}
# |int8 x int8| <= 128 * 128: a K of at most this many products cannot overflow an int32 accumulator
INT8_MAX_K = (2**31 - 1) // (128 * 128)

SERVED_FORMATS = ("bf16", "int8")  # the designs take bf16 or int8 B; other weight formats run on the host
DTYPES = {"bf16": ("bf16", "f32"), "int8": ("i8", "i32")}  # weight format -> the design's (dtype_in, dtype_out)
ELEMENT_BYTES = {"bf16": 2, "i8": 1}  # of A and B; C's are 4 (f32 or i32)
INSTS_FORMATS = ("binary", "hex")  # hex: one word per line, for hand-made test tables only
# The transaction header aiecc puts first in a stream: word 0 is rows << 24 | generation << 16
# | minor << 8 | major, word 1 memory-tile rows << 8 | columns, word 2 the operation count,
# word 3 the stream's size in bytes. The generation is 3 on npu1 and 4 on npu2.
TXN_GENERATION = {"npu1": 3, "npu2": 4}
TXN_HEADER_WORDS = 4


class DesignError(ValueError):
    """design.json is unreadable, or one of its entries breaks a tile rule; the message says which."""


@dataclass(slots=True, frozen=True)
class GemmDesign:
    """One compiled GEMM: C[M, cN] (f32) = A[M, cK] (bf16) x B (bf16), B as [cN, cK] when b_col_major;
    an int8 design: C (i32) = A (i8) x B (i8)."""

    K: int  # the layer's true in_features
    N: int  # the layer's true out_features
    weight_format: str
    xclbin: Path
    insts: Path
    kernel: str
    M: int  # rows per device pass
    compiled_K: int
    compiled_N: int
    tile_m: int
    tile_k: int
    tile_n: int
    columns: int
    dtype_in: str
    dtype_out: str
    b_col_major: bool
    bfp16_emulation: bool = False
    n_passes: int = 1  # passes of compiled_N columns that make up the layer's N
    insts_format: str = "binary"

    @property
    def key(self) -> tuple[int, int, str]:
        return self.K, self.N, self.weight_format

    @property
    def in_bytes(self) -> int:
        """Bytes of one A or B element (C's are 4)."""
        return ELEMENT_BYTES.get(self.dtype_in, 2)


def tile_rule_errors(device: str, d: GemmDesign) -> list[str]:
    """What in `d` breaks the whole_array design's rules on `device` (empty when nothing does)."""
    errors = []
    if device not in MAX_COLUMNS:
        return [f"device {device!r} is not npu1 or npu2"]
    if d.weight_format not in SERVED_FORMATS:
        errors.append(f"weight format {d.weight_format!r}: the NPU designs serve {list(SERVED_FORMATS)}")
    elif (d.dtype_in, d.dtype_out) != DTYPES[d.weight_format]:
        want = DTYPES[d.weight_format]
        errors.append(f"dtypes {d.dtype_in}->{d.dtype_out}: a {d.weight_format} design takes {want[0]} inputs and "
                      f"gives {want[1]} outputs (a narrower output would round or saturate every sum)")
    if d.bfp16_emulation and device != "npu2":
        errors.append("bfp16 emulation exists on npu2 only")
    if d.bfp16_emulation and d.weight_format == "int8":
        errors.append("bfp16 emulation is a bf16 kernel's; an int8 design multiplies integers")
    if d.weight_format == "int8" and d.compiled_K > INT8_MAX_K:
        errors.append(f"compiled_K = {d.compiled_K}: int8 sums over more than {INT8_MAX_K} products could "
                      "overflow the int32 accumulator")
    if not 1 <= d.columns <= MAX_COLUMNS[device]:
        errors.append(f"columns = {d.columns}: {device} has {MAX_COLUMNS[device]}")
    for name in ("M", "compiled_K", "compiled_N", "tile_m", "tile_k", "tile_n", "K", "N", "n_passes"):
        if getattr(d, name) <= 0:
            errors.append(f"{name} = {getattr(d, name)} must be > 0")
    if d.insts_format not in INSTS_FORMATS:
        errors.append(f"insts_format = {d.insts_format!r}: expected one of {list(INSTS_FORMATS)}")
    if errors:
        return errors
    errors += generator_errors(device, d.tile_m, d.tile_k, d.tile_n, d.columns, d.b_col_major)
    if d.compiled_K < d.K or d.compiled_N * d.n_passes < d.N:
        errors.append(f"compiled K x N = {d.compiled_K} x {d.compiled_N} (x {d.n_passes} passes) is smaller "
                      f"than the layer's {d.K} x {d.N}")
    elif d.compiled_N * (d.n_passes - 1) >= d.N:
        errors.append(f"n_passes = {d.n_passes}: {d.n_passes - 1} passes of {d.compiled_N} already cover N = {d.N}")
    if d.M % (d.tile_m * N_AIE_ROWS):
        errors.append(f"M = {d.M} is not a multiple of tile_m * {N_AIE_ROWS} = {d.tile_m * N_AIE_ROWS}")
    if d.compiled_K % d.tile_k:
        errors.append(f"compiled_K = {d.compiled_K} is not a multiple of tile_k = {d.tile_k}")
    if d.compiled_N % (d.tile_n * d.columns):
        errors.append(f"compiled_N = {d.compiled_N} is not a multiple of tile_n * columns = {d.tile_n * d.columns}")
    if d.weight_format == "int8":
        (r, s, t), kind = INT8_TILE_MULTIPLES[device], "int8 kernel"
    else:
        (r, s, t), kind = MICRO_TILES[(device, d.bfp16_emulation)], "bf16 micro-tile"
    for name, value, mac in (("tile_m", d.tile_m, r), ("tile_k", d.tile_k, s), ("tile_n", d.tile_n, t)):
        if value % mac:
            errors.append(f"{name} = {value} is not a multiple of the {device} {kind}'s {mac} "
                          f"({r}x{s}x{t})")
    if not errors:  # the shape divides into its tiles: the transfers are what the runtime sequence moves
        errors += transfer_errors(d.M, d.compiled_K, d.compiled_N, d.tile_m, d.tile_k, d.tile_n, d.columns,
                                  d.b_col_major, d.in_bytes)
    return errors


@dataclass(slots=True, frozen=True)
class DesignTable:
    device: str  # "npu1" or "npu2"
    designs: dict[tuple[int, int, str], GemmDesign]
    path: Path
    on_host: tuple[str, ...] = ()  # the build's word on each shape it left to the host
    toolchain: dict = field(default_factory=dict)  # what built it (tools/build_npu_designs.py); {} for older tables
    # shape -> its designs by M, smallest first (`designs` holds the first); empty for a table of one M each
    variants: dict = field(default_factory=dict)

    def by_m(self, key: tuple[int, int, str]) -> tuple[GemmDesign, ...]:
        """The shape's designs, smallest M first (just `designs[key]` when it has one M)."""
        return self.variants.get(key) or ((self.designs[key],) if key in self.designs else ())

    def lookup(self, k: int, n: int, weight_format: str) -> tuple[GemmDesign | None, str]:
        """The design for a [N, K] weight in `weight_format`, or None and why not."""
        if weight_format not in SERVED_FORMATS:
            return None, f"weight format {weight_format} runs on the host (the NPU designs take {list(SERVED_FORMATS)})"
        design = self.designs.get((k, n, weight_format))
        if design is None:
            said = next((line for line in self.on_host if line.startswith(f"K={k} N={n} {weight_format}:")), None)
            return None, f"no design for K={k}, N={n}, {weight_format} in {self.path}" + (
                f" ({said})" if said else "")
        return design, "npu"

    def identity(self) -> str:
        """A sha256 over every design's fields and its xclbin's and instruction stream's bytes:
        another build of any design is another identity. Raises OSError."""
        h = hashlib.sha256(self.device.encode())
        for d in (d for key in sorted(self.designs) for d in self.by_m(key)):
            fields = {f: getattr(d, f) for f in d.__slots__ if f not in ("xclbin", "insts")}
            h.update(json.dumps(fields, sort_keys=True).encode())
            for path in (d.xclbin, d.insts):
                data = path.read_bytes()
                h.update(b"%d\0" % len(data))
                h.update(data)
        return h.hexdigest()

    @classmethod
    def load(cls, path: str | Path) -> "DesignTable":
        """Read and validate design.json; raises DesignError naming the entry and the rule."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DesignError(f"cannot read NPU design table {path}: {exc}") from None
        if not isinstance(raw, dict) or raw.get("version") != 1:
            raise DesignError(f"{path}: expected an object with \"version\": 1")
        device = raw.get("device")
        if device not in MAX_COLUMNS:
            raise DesignError(f"{path}: device = {device!r}, expected npu1 (Phoenix, Hawk Point) or npu2 (Strix, Krackan)")
        entries = raw.get("designs")
        if not isinstance(entries, list):
            raise DesignError(f"{path}: \"designs\" must be a list")
        on_host = raw.get("on_host", [])
        if not isinstance(on_host, list) or not all(isinstance(x, str) for x in on_host):
            raise DesignError(f"{path}: \"on_host\" must be a list of strings")
        toolchain = raw.get("toolchain", {})
        if not isinstance(toolchain, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                                      for k, v in toolchain.items()):
            raise DesignError(f"{path}: \"toolchain\" must map names to version strings")
        designs: dict[tuple[int, int, str], GemmDesign] = {}
        variants: dict[tuple[int, int, str], list[GemmDesign]] = {}
        for i, entry in enumerate(entries):
            where = f"{path}: designs[{i}]"
            design = _entry(entry, path.parent, where)
            errors = tile_rule_errors(device, design)
            if errors:
                raise DesignError(f"{where} (K={design.K}, N={design.N}): " + "; ".join(errors))
            for f in ("xclbin", "insts"):
                if not getattr(design, f).is_file():
                    raise DesignError(f"{where}: {f} file {getattr(design, f)} does not exist")
            others = variants.setdefault(design.key, [])
            if others:
                why = same_weight_layout(others[0], design)
                if why is not None or any(o.M == design.M for o in others):
                    raise DesignError(f"{where}: a second design for K={design.K}, N={design.N}, "
                                      f"{design.weight_format}" + (f" with M = {design.M}" if why is None else
                                                                   f" whose {why}"))
            others.append(design)
        for key, ds in variants.items():
            ds.sort(key=lambda d: d.M)
            designs[key] = ds[0]
        return cls(device, designs, path, tuple(on_host), dict(toolchain),
                   {k: tuple(ds) for k, ds in variants.items() if len(ds) > 1})


LAYOUT_FIELDS = ("compiled_K", "compiled_N", "n_passes", "b_col_major", "bfp16_emulation")


def same_weight_layout(a: GemmDesign, b: GemmDesign) -> str | None:
    """None when designs `a` and `b` read one weight upload (they may differ in M, tiles and files),
    else which field differs and how."""
    for name in LAYOUT_FIELDS:
        if getattr(a, name) != getattr(b, name):
            return f"{name} = {getattr(b, name)} differs from the M = {a.M} design's {getattr(a, name)}"
    return None


_INT_FIELDS = ("K", "N", "M", "compiled_K", "compiled_N", "tile_m", "tile_k", "tile_n", "columns")
_OPTIONAL_INTS = {"n_passes": 1}


def _entry(entry: object, base: Path, where: str) -> GemmDesign:
    if not isinstance(entry, dict):
        raise DesignError(f"{where}: expected an object")
    try:
        ints = {}
        for name in _INT_FIELDS:
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise DesignError(f"{where}: {name} = {value!r} is not an integer")
            ints[name] = value
        for name, default in _OPTIONAL_INTS.items():
            value = entry.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DesignError(f"{where}: {name} = {value!r} is not an integer")
            ints[name] = value
        flags = {}
        for name, default in (("b_col_major", None), ("bfp16_emulation", False)):
            value = entry.get(name, default)
            if not isinstance(value, bool):
                raise DesignError(f"{where}: {name} = {value!r} is not true or false")
            flags[name] = value
        texts = {name: entry[name] for name in ("weight_format", "xclbin", "insts", "dtype_in", "dtype_out")}
        texts["kernel"] = entry.get("kernel", "MLIR_AIE")
        texts["insts_format"] = entry.get("insts_format", "binary")
        for name, value in texts.items():
            if not isinstance(value, str) or not value:
                raise DesignError(f"{where}: {name} = {value!r} is not a non-empty string")
    except KeyError as exc:
        raise DesignError(f"{where}: missing field {exc.args[0]}") from None
    return GemmDesign(
        xclbin=base / texts.pop("xclbin"), insts=base / texts.pop("insts"), **texts, **ints, **flags)


def read_insts(path: str | Path, insts_format: str = "binary", device: str | None = None) -> np.ndarray:
    """The instruction stream as uint32 words. "binary" (what aiecc writes, whatever the file's
    name): little-endian words that begin with the transaction header, whose size word must be
    the file's and whose generation must be `device`'s when given; "hex": one hexadecimal word
    per line (hand-made test tables). Raises DesignError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DesignError(f"cannot read instruction file {path}: {exc.strerror}") from None
    if insts_format == "hex":
        return _hex_words(path, data)
    if insts_format != "binary":
        raise DesignError(f"{path}: instruction format {insts_format!r}, expected one of {list(INSTS_FORMATS)}")
    if len(data) % 4 or len(data) < TXN_HEADER_WORDS * 4:
        raise DesignError(f"{path}: {len(data)} bytes is not a binary instruction stream (a 16-byte header "
                          "and whole 32-bit words)")
    words = np.frombuffer(data, dtype="<u4").astype(np.uint32)
    why = txn_header_errors(words, device)
    if why:
        hint = " (it reads as text: aiecc writes binary; a hex table says \"insts_format\": \"hex\")" \
            if _is_hex_text(data) else ""
        raise DesignError(f"{path}: not an NPU instruction stream: {why}{hint}")
    return words


def txn_header_errors(words: np.ndarray, device: str | None = None) -> str | None:
    """What in the stream's transaction header is wrong, or None."""
    rows, generation = int(words[0]) >> 24, (int(words[0]) >> 16) & 0xFF
    if generation not in TXN_GENERATION.values() or not 1 <= rows <= 8:
        return f"header word 0x{int(words[0]):08x} names no NPU generation (3: npu1, 4: npu2) and row count"
    if int(words[3]) != words.size * 4:
        return f"the header says {int(words[3])} bytes, the file has {words.size * 4}"
    if device is not None and generation != TXN_GENERATION[device]:
        return f"compiled for generation {generation}, the table's device {device} is {TXN_GENERATION[device]}"
    return None


def _is_hex_text(data: bytes) -> bool:
    try:
        return all(int(w, 16) >= 0 for w in data.decode("ascii").split())
    except ValueError:
        return False


def _hex_words(path: Path, data: bytes) -> np.ndarray:
    try:
        values = [int(w, 16) for w in data.decode("ascii").split()]
    except (UnicodeDecodeError, ValueError) as exc:
        raise DesignError(f"{path}: not one hexadecimal word per line ({exc})") from None
    if not values or any(v >= 1 << 32 for v in values):
        raise DesignError(f"{path}: no instructions, or a word wider than 32 bits")
    return np.array(values, dtype=np.uint32)


def write_table(path: str | Path, device: str, designs: list[GemmDesign], on_host: list[str] = (),
                toolchain: dict | None = None) -> None:
    """Write design.json for `designs` (their files are named relative to the table's folder),
    with `on_host`: one line per shape the build left to the host and why, and `toolchain`: the
    releases the designs were built with and the XRT, driver and firmware the build saw."""
    path = Path(path)
    rows = []
    for d in sorted(designs, key=lambda d: (d.key, d.M)):
        row = {"K": d.K, "N": d.N, "weight_format": d.weight_format,
               "xclbin": _relative(d.xclbin, path.parent), "insts": _relative(d.insts, path.parent),
               "kernel": d.kernel}
        row.update({name: getattr(d, name) for name in _INT_FIELDS if name not in ("K", "N")})
        row.update(n_passes=d.n_passes, dtype_in=d.dtype_in, dtype_out=d.dtype_out, b_col_major=d.b_col_major,
                   bfp16_emulation=d.bfp16_emulation, insts_format=d.insts_format)
        rows.append(row)
    table = {"version": 1, "device": device, "designs": rows, "on_host": list(on_host),
             "toolchain": dict(toolchain or {})}
    path.write_text(json.dumps(table, indent=1) + "\n")


def _relative(p: Path, base: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(Path(p).resolve())
