#!/usr/bin/env python3
"""Build the NPU GEMM designs a checkpoint needs, and the design table npud reads.

    tools/build_npu_designs.py CHECKPOINT [CHECKPOINT ...] [--dflash DIR] --device npu2 --out DIR
    tools/build_npu_designs.py CHECKPOINT --list

Lists the distinct (K, N, weight format) of the checkpoints' linear layers (a base, its
draft, its DFlash drafter: give them all), plans one mlir-aie IRON `whole_array` GEMM per
bf16 or int8 shape (--weight-format int8: i8 A and B, i32 C, the int8 MACs npu1 and npu2 run
fastest; --int8-rows rows a pass, 64 by default: the int8 kernel's tile_m is a multiple of 16)
with the npu1 (Phoenix, Hawk Point) or npu2 (Strix, Krackan) tiling, builds each
with the example's Makefile (IRON -> MLIR -> aiecc.py with Peano -> xclbin + the binary
instruction stream) and writes DIR/design.json.

A layer wider than one pass can move (the output layer: npud/kernels/xrt_rules.py) is planned as
several passes of one design; layers whose padded shapes are equal share one build. Every
design is a kernel of its own (MLIR_AIE_<j>, its own instruction stream) in one xclbin,
model.xclbin, linked with aiecc's --xclbin-input: npud opens one hardware context for all the
checkpoints' shapes (a base, its draft, its drafter), where one xclbin per shape took six or
more and thrashed npu1's six (--xclbin-per-shape builds them apart, as before). A shape the rules refuse, or whose build fails, stays on the
host: the tool says why, builds the others, and always writes design.json (with what did
build, and `"on_host"` listing the rest and why). Other weight formats (int8-q8, int8-q16, the
GGUF blocks, fp32) run on the host too.

Each shape is built for several M (rows per pass; --rows, by default the smallest the tiles
allow on the device, 16 or 32, for decode steps and 128 for prefill): npud runs each chunk of a
call's rows on the smallest M that holds it. The designs of one shape share the weight's layout
on the device (compiled K and N, passes), so an M whose layout would differ is left out, said.

npu2 designs default to bfp16 emulation, as mlir-aie's stock npu2 build compiles the mm
kernel (--no-bfp16-emulation for a checkout built without it); the start-up check applies
the matching tolerance (docs/npu.md, "Exactness").

Building needs what is not on the package index: the mlir-aie and llvm-aie (Peano) wheels,
and an mlir-aie source checkout for the example (docs/npu.md says how). Without them the
tool says what is missing and exits 3; --list needs none of them.

The toolchain is pinned: the designs are built with mlir-aie release MLIR_AIE_RELEASE (its
wheel, and a checkout of the same tag, whose whole_array Makefile takes the targets this tool
names) and the llvm-aie (Peano) wheel LLVM_AIE_WHEEL that release was tested with. A wheel of
another release is refused (exit 4) unless --unpinned says to build with it anyway. design.json
records what built it ("toolchain": the mlir-aie and llvm-aie versions and the checkout's
commit, and the XRT, amdxdna driver and NPU firmware versions this machine shows). When not one
design builds, the tool says why for every shape and exits 5 (no empty table that would leave
everything on the host without a word).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.xrt_design import (DTYPES, ELEMENT_BYTES, N_AIE_ROWS, SERVED_FORMATS, GemmDesign, tile_rule_errors,
                                     write_table)
from npud.kernels.xrt_rules import split_n
from npud.kernels.xrt_design import MICRO_TILES, same_weight_layout  # the M sizes of one shape

EXAMPLE = "programming_examples/basic/matrix_multiplication/whole_array"
EXIT_MISSING = 3
EXIT_UNPINNED = 4  # an mlir-aie wheel of another release than MLIR_AIE_RELEASE (without --unpinned)
EXIT_NOTHING_BUILT = 5  # not one design built: a line per shape says why

# The release the designs are built with: its wheel (`pip install mlir_aie -f <its release
# assets>`) and a checkout of its tag for the example's Makefile, whose makefile-common lets the
# caller name the targets (xclbin_target ?=, insts_target ?=) and picks npu2 from NPU2=1. Later
# releases rework the example's build rules; another release is refused unless --unpinned.
MLIR_AIE_RELEASE = "v1.0"
LLVM_AIE_WHEEL = "19.0.0.2025041501+b2a279c1"  # the llvm-aie (Peano) nightly paired with it
# what the tool passes to make, as the example's makefile-common must take it
MAKEFILE_OVERRIDES = ("xclbin_target", "insts_target")


@dataclasses.dataclass(slots=True, frozen=True)
class Shape:
    K: int
    N: int
    weight_format: str
    layers: tuple[str, ...]  # where it occurs, e.g. "layers[0].q_proj"


def gemm_shapes(checkpoint_dirs: list[str | Path], weight_format: str = "bf16",
                dflash_dirs: list[str | Path] = ()) -> list[Shape]:
    """The distinct GEMM shapes of the checkpoints' (and DFlash drafters') linear layers, sorted by (K, N).

    The embedding table is a GEMM only as the LM head (tied). Raises the engine's
    ConfigError / WeightsError for a checkpoint that does not load."""
    from npud.engine.config import load_config
    from npud.engine.dflash import load_dflash_config, load_dflash_weights
    from npud.engine.weights import load_weights

    fmt = WeightFormat.parse(weight_format)
    found: dict[tuple[int, int, str], list[str]] = {}

    def add(weights, prefix: str, head) -> None:
        for name, w in _linears(weights, prefix):
            if w is head:
                name = f"{prefix}.lm_head"  # tied or not, the head is the GEMM
            elif name.endswith(".embed"):
                continue  # an untied embedding table is a lookup, not a GEMM
            n, k = w.data.shape
            found.setdefault((int(k), int(n), w.fmt.value), []).append(name)

    for ckpt in checkpoint_dirs:
        weights = load_weights(load_config(ckpt), ckpt, fmt)
        add(weights, Path(ckpt).name, weights.lm_head)
    for d in dflash_dirs:  # the drafter reads the base's embedding and LM head
        add(load_dflash_weights(load_dflash_config(d), d, fmt), Path(d).name, None)
    return [Shape(k, n, f, tuple(names)) for (k, n, f), names in sorted(found.items())]


def _linears(obj, prefix: str):
    seen: set[int] = set()

    def walk(o, path):
        if isinstance(o, LinearWeight):
            if id(o) not in seen:
                seen.add(id(o))
                yield path, o
        elif isinstance(o, list):
            for i, item in enumerate(o):
                yield from walk(item, f"{path}[{i}]")
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                yield from walk(getattr(o, f.name), f"{path}.{f.name}")

    yield from walk(obj, prefix)


@dataclasses.dataclass(slots=True, frozen=True)
class Tiling:
    device: str  # npu1 or npu2
    rows: int = 32  # M: rows per device pass (a decode step uses 1, a verify k + 1)
    tile_k: int = 64
    tile_n: int = 32
    columns: int = 4
    b_col_major: bool = False  # True: B is the weight as loaded, [N, K]; whole_array then wants 32-multiples
    bfp16_emulation: bool | None = None  # npu2's 8x8x8 bf16 MACs through bfp16; None: as the stock build (npu2 on)
    one_xclbin: bool = True  # every design a kernel of model.xclbin (one hardware context), else one xclbin each
    more_rows: tuple[int, ...] = ()  # M of further designs of every shape (the same weight layout as `rows`')
    int8_rows: int = 64  # M of an int8 design: the int8 kernels unroll m to multiples of 16 (tile_m = M / 4)

    def __post_init__(self) -> None:
        if self.bfp16_emulation is None:
            object.__setattr__(self, "bfp16_emulation", self.device == "npu2")

    @property
    def tile_m(self) -> int:
        return self.rows // N_AIE_ROWS


LINKED_XCLBIN = "model.xclbin"


def plan(shape: Shape, tiling: Tiling, out_dir: Path, kernel: str = "MLIR_AIE") -> GemmDesign:
    """The design for `shape` under `tiling` (K and N padded up to the tiles, N split into
    passes where one pass cannot move it); raises ValueError with the broken rules when the
    tiling cannot build it. Shapes with the same padded shape get the same files."""
    t = tiling
    int8 = shape.weight_format == "int8"
    rows = t.int8_rows if int8 else t.rows
    dtype_in, dtype_out = DTYPES.get(shape.weight_format, DTYPES["bf16"])
    ck = -(-shape.K // t.tile_k) * t.tile_k
    split = split_n(shape.N, rows, ck, rows // N_AIE_ROWS, t.tile_k, t.tile_n, t.columns, t.b_col_major,
                    in_bytes=ELEMENT_BYTES[dtype_in])
    passes, cn = split if split is not None else (1, -(-shape.N // (t.tile_n * t.columns)) * (t.tile_n * t.columns))
    stem = f"{rows}x{ck}x{cn}" + ("_i8" if int8 else "")
    xclbin = out_dir / (LINKED_XCLBIN if t.one_xclbin else f"gemm_{stem}.xclbin")
    design = GemmDesign(K=shape.K, N=shape.N, weight_format=shape.weight_format,
                        xclbin=xclbin, insts=out_dir / f"insts_{stem}.bin",
                        kernel=kernel, M=rows, compiled_K=ck, compiled_N=cn, tile_m=rows // N_AIE_ROWS,
                        tile_k=t.tile_k, tile_n=t.tile_n, columns=t.columns, dtype_in=dtype_in, dtype_out=dtype_out,
                        b_col_major=t.b_col_major, bfp16_emulation=t.bfp16_emulation and not int8, n_passes=passes)
    errors = tile_rule_errors(t.device, design)
    if errors:
        raise ValueError(f"K={shape.K} N={shape.N}: " + "; ".join(errors))
    return design


def missing_toolchain(mlir_aie_src: str | None) -> list[str]:
    """What building needs and this machine lacks (empty: ready)."""
    missing = []
    if importlib.util.find_spec("aie") is None:
        missing.append("the mlir-aie Python wheel (module 'aie'): pip install mlir_aie from its GitHub releases")
    if shutil.which("aiecc.py") is None and shutil.which("aiecc") is None:
        missing.append("aiecc.py on PATH (installed by the mlir-aie wheel)")
    peano = os.environ.get("PEANO_INSTALL_DIR")
    if not peano or not (Path(peano) / "bin" / "clang++").exists():
        missing.append("PEANO_INSTALL_DIR naming the llvm-aie (Peano) install with bin/clang++: "
                       "pip install llvm-aie from its GitHub releases")
    if not mlir_aie_src or not (Path(mlir_aie_src) / EXAMPLE / "Makefile").is_file():
        missing.append(f"an mlir-aie source checkout with {EXAMPLE}/Makefile (--mlir-aie-src or MLIR_AIE_SRC)")
    if shutil.which("make") is None:
        missing.append("make")
    return missing


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _first_line(cmd: list[str]) -> str | None:
    """The first non-empty line `cmd` prints, or None when it does not run."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line.strip() for line in (run.stdout + run.stderr).splitlines() if line.strip()), None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def toolchain_seen(mlir_aie_src: str | None, sysfs: Path = Path("/sys")) -> dict[str, str | None]:
    """What this build runs with, for design.json: the pinned release, the mlir-aie and llvm-aie
    wheels' versions, the checkout's commit, and the XRT, amdxdna driver and NPU firmware versions
    this machine shows (None where it shows none: the build machine need not be the NPU's)."""
    checkout = None
    if mlir_aie_src and (Path(mlir_aie_src) / ".git").exists():
        checkout = _first_line(["git", "-C", str(mlir_aie_src), "describe", "--tags", "--always", "--dirty"])
    return {
        "mlir_aie_release": MLIR_AIE_RELEASE,
        "mlir_aie": _version("mlir_aie") or _version("mlir-aie"),
        "llvm_aie": _version("llvm-aie") or _version("llvm_aie"),
        "mlir_aie_checkout": checkout,
        "xrt": _first_line(["xrt-smi", "--version"]),
        "amdxdna_driver": _read(sysfs / "module" / "amdxdna" / "version"),
        "npu_firmware": _read(sysfs / "class" / "accel" / "accel0" / "device" / "fw_version"),
    }


def _release(version: str) -> tuple[int, ...]:
    """"v1.0", "1.0" and "1.0.0" name one release."""
    parts = [int(p) for p in version.lstrip("v").split("+")[0].split(".") if p.isdigit()]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def pin_errors(seen: dict, mlir_aie_src: str | None) -> list[str]:
    """How the toolchain found differs from the pinned one (empty: it is the pinned one)."""
    errors = []
    wheel = seen.get("mlir_aie")
    if wheel is not None and _release(wheel) != _release(MLIR_AIE_RELEASE):
        errors.append(f"the mlir-aie wheel is {wheel}, the designs are built with release {MLIR_AIE_RELEASE} "
                      f"(pip install mlir_aie -f <the {MLIR_AIE_RELEASE} release's assets>)")
    common = Path(mlir_aie_src or ".") / EXAMPLE / ".." / "makefile-common"
    text = _read(common.resolve()) if mlir_aie_src else None
    if text is not None:
        taken = [v for v in MAKEFILE_OVERRIDES if f"{v}?=" in text.replace(" ", "")]
        if len(taken) != len(MAKEFILE_OVERRIDES):
            errors.append(f"{common.resolve()} does not take {', '.join(MAKEFILE_OVERRIDES)} from the command line "
                          f"(another release's build rules): check out {MLIR_AIE_RELEASE} "
                          f"(git -C {mlir_aie_src} checkout {MLIR_AIE_RELEASE})")
    return errors


def build_with_iron(design: GemmDesign, tiling: Tiling, mlir_aie_src: Path, work: Path,
                    link: bool = False) -> None:
    """Build one design with the whole_array example's Makefile; copies its xclbin and its
    instruction stream (binary, as aiecc writes it whatever the name) to the design's paths.
    With the tiling's one_xclbin, the Makefile makes the design's MLIR and micro-kernel only, and
    aiecc compiles it as kernel `design.kernel` of the shared xclbin (`link`: one is there
    already, to extend). Raises subprocess.CalledProcessError when the build fails."""
    stem = f"npud_{design.M}x{design.compiled_K}x{design.compiled_N}_{design.dtype_in}"
    variables = {
        "M": design.M, "K": design.compiled_K, "N": design.compiled_N, "m": design.tile_m, "k": design.tile_k,
        "n": design.tile_n, "n_aie_cols": design.columns, "b_col_maj": int(design.b_col_major),
        # int8: i8 A and B into the int32 accumulators, stored as they are (i32 C): npud scales them back
        "dtype_in": design.dtype_in, "dtype_out": design.dtype_out,
        "devicename": "npu2" if tiling.device == "npu2" else "npu",
        "xclbin_target": f"build/{stem}.xclbin", "insts_target": f"build/{stem}_insts.bin",
    }
    if tiling.device == "npu2":
        variables["NPU2"] = 1
    # bfp16 emulation is a compile flag of the mm micro-kernel (AIE_API_EMULATE_BFLOAT16_MMUL_WITH_BFP16)
    # set by mlir-aie's own npu2 build flags, not by this tool: the tiling declares what the checkout
    # does (on for npu2 unless --no-bfp16-emulation), so the table carries the 8x8x8 micro-tile rule
    # and the start-up check the bfp16 tolerance
    src = Path(mlir_aie_src) / EXAMPLE
    work.mkdir(parents=True, exist_ok=True)
    for made in _shape_targets(design):  # a bf16 and an int8 design of one shape share these names: make
        (src / made).unlink(missing_ok=True)  # would take the other dtype's as up to date
    if tiling.one_xclbin:
        _build_linked(design, variables, src, link)
        return
    cmd = ["make", "-C", str(src), f"build/{stem}.xclbin", *(f"{k}={v}" for k, v in variables.items())]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    shutil.copyfile(src / "build" / f"{stem}.xclbin", design.xclbin)
    shutil.copyfile(src / "build" / f"{stem}_insts.bin", design.insts)


def _shape_targets(d: GemmDesign) -> tuple[str, str]:
    """The Makefile's MLIR and micro-kernel targets of `d`, named by shape and not by dtype."""
    suffix = f"{d.M}x{d.compiled_K}x{d.compiled_N}_{d.tile_m}x{d.tile_k}x{d.tile_n}_{d.columns}c"
    return f"build/aie_{suffix}.mlir", f"build/mm_{d.tile_m}x{d.tile_k}x{d.tile_n}.o"


def _build_linked(design: GemmDesign, variables: dict, src: Path, link: bool) -> None:
    """The Makefile's MLIR and micro-kernel targets for `design`, then aiecc as the Makefile runs
    it (Peano, the basic-sequential allocator) plus the flags that make the design kernel
    `design.kernel` of the shared xclbin: --xclbin-kernel-name / -instance-name / -kernel-id, and
    --xclbin-input to add it to the xclbin the earlier designs made."""
    d = design
    mlir, micro = _shape_targets(d)
    make = ["make", "-C", str(src), mlir, micro, *(f"{k}={v}" for k, v in variables.items()
                                                   if k not in ("xclbin_target", "insts_target"))]
    print("+", " ".join(make), flush=True)
    subprocess.run(make, check=True)
    index = int(d.kernel.rsplit("_", 1)[1])
    target = d.xclbin.with_name(d.xclbin.stem + ".next.xclbin")
    aiecc = ["aiecc.py", "--alloc-scheme=basic-sequential", "--aie-generate-xclbin", "--no-compile-host",
             f"--xclbin-name={target.resolve()}", f"--xclbin-kernel-name={d.kernel}",
             f"--xclbin-instance-name=MLIRAIE{index}", f"--xclbin-kernel-id=0x{0x901 + index:x}",
             *([f"--xclbin-input={d.xclbin.resolve()}"] if link else []),
             "--no-xchesscc", "--no-xbridge", "--peano", os.environ.get("PEANO_INSTALL_DIR", ""),
             "--aie-generate-npu-insts", f"--npu-insts-name={d.insts.resolve()}", mlir.removeprefix("build/")]
    print("+ (cd", src / "build", "&&", " ".join(aiecc) + ")", flush=True)
    subprocess.run(aiecc, check=True, cwd=src / "build")
    os.replace(target, d.xclbin)


PREFILL_ROWS = 128  # the larger M a shape gets by default: a prefill's chunks


def default_rows(device: str, bfp16_emulation: bool | None = None) -> list[int]:
    """The smallest M the device's micro-tile allows (4 core rows of one micro-tile's rows each: a
    decode step's pass), then PREFILL_ROWS."""
    emulated = device == "npu2" if bfp16_emulation is None else bfp16_emulation
    smallest = N_AIE_ROWS * MICRO_TILES[(device, emulated and device == "npu2")][0]
    return [smallest, PREFILL_ROWS] if smallest < PREFILL_ROWS else [smallest]


def _rows_list(text: str) -> list[int]:
    try:
        rows = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected M values separated by commas, e.g. 16,128") from None
    if not rows or rows[0] <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every M must be a positive number of rows")
    return rows


def build_table(shapes: list[Shape], tiling: Tiling, out_dir: Path,
                build: Callable[[GemmDesign], None], toolchain: dict | None = None) -> tuple[Path, list[str], int]:
    """Plan and build a design for every served shape it can, then write out_dir/design.json.

    Returns (the table's path, one line per shape left to the host and why, the designs
    built). A shape the rules refuse or whose build raises is one of those; the table is
    written whatever built, with `toolchain` (what built it), so npud learns where each shape
    runs; main() fails when nothing built."""
    out_dir.mkdir(parents=True, exist_ok=True)
    designs, on_host, built = [], [], {}
    kernels: dict[tuple, str] = {}  # padded shape -> its kernel in the shared xclbin
    linked = False  # the shared xclbin holds a kernel already: the next one extends it
    for shape in shapes:
        where = f"K={shape.K} N={shape.N} {shape.weight_format}"
        if shape.weight_format not in SERVED_FORMATS:
            on_host.append(f"{where}: runs on the host (the NPU designs take {list(SERVED_FORMATS)})")
            continue
        try:
            design = plan(shape, tiling, out_dir)
        except ValueError as exc:
            on_host.append(f"{where}: the toolchain would refuse it ({exc})")
            continue
        padded = (design.M, design.compiled_K, design.compiled_N, design.dtype_in)  # a bf16 and an int8: two builds
        if tiling.one_xclbin:
            kernel = kernels.setdefault(padded, f"MLIR_AIE_{len(kernels)}")
            design = dataclasses.replace(design, kernel=kernel)
        if padded not in built:  # shapes with one padded shape share one build
            try:
                build(design, linked) if tiling.one_xclbin else build(design)
                built[padded] = None
                linked = True
            except Exception as exc:  # a failed make, a missing output: this shape only
                built[padded] = f"{type(exc).__name__}: {exc}"
        if built[padded] is not None:
            on_host.append(f"{where}: the build failed ({built[padded]})")
            continue
        designs.append(design)
        for rows in tiling.more_rows:  # the same shape for more rows a pass, where the layout allows
            said = f"{where} (M = {rows}): left out"
            try:
                more = plan(shape, dataclasses.replace(tiling, rows=rows, more_rows=()), out_dir)
            except ValueError as exc:
                on_host.append(f"{said}: the toolchain would refuse it ({exc})")
                continue
            if more.M == design.M:  # an int8 shape: its designs have the int8 kernels' M alone
                continue
            why = same_weight_layout(design, more)
            if why is not None:
                on_host.append(f"{said}: its {why}")
                continue
            padded = (more.M, more.compiled_K, more.compiled_N, more.dtype_in)
            if tiling.one_xclbin:
                more = dataclasses.replace(more, kernel=kernels.setdefault(padded, f"MLIR_AIE_{len(kernels)}"))
            if padded not in built:
                try:
                    build(more, linked) if tiling.one_xclbin else build(more)
                    built[padded] = None
                    linked = True
                except Exception as exc:
                    built[padded] = f"{type(exc).__name__}: {exc}"
            if built[padded] is not None:
                on_host.append(f"{said}: the build failed ({built[padded]})")
                continue
            designs.append(more)
    path = out_dir / "design.json"
    write_table(path, tiling.device, designs, on_host=on_host, toolchain=toolchain)
    return path, on_host, len(designs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories (the base, its draft model)")
    p.add_argument("--dflash", action="append", default=[], metavar="DIR", help="a DFlash drafter of the base")
    p.add_argument("--weight-format", default="bf16", help="as in the model's config (default bf16)")
    p.add_argument("--list", action="store_true", help="list the GEMM shapes and exit")
    p.add_argument("--device", choices=["npu1", "npu2"], help="npu1: Ryzen AI 7040/8040; npu2: Ryzen AI 300")
    p.add_argument("--out", type=Path, help="folder for the xclbins, instruction files and design.json")
    p.add_argument("--rows", type=_rows_list, default=None,
                   help="M, rows per device pass, one design of each per shape (e.g. 16,128; each a multiple of "
                        "4 x the micro-tile's rows); default: the smallest the device's tiles allow, and 128")
    p.add_argument("--int8-rows", type=int, default=64,
                   help="M of the int8 designs (--weight-format int8): the int8 kernels take tile_m = M / 4 in 16s")
    p.add_argument("--tile-k", type=int, default=64)
    p.add_argument("--tile-n", type=int, default=32)
    p.add_argument("--columns", type=int, default=4)
    p.add_argument("--b-col-major", action="store_true", help="B as the weight is stored, [N, K]")
    p.add_argument("--xclbin-per-shape", action="store_true",
                   help="one xclbin (and hardware context) per shape instead of every design in model.xclbin")
    p.add_argument("--bfp16-emulation", action=argparse.BooleanOptionalAction, default=None,
                   help="npu2: the checkout's mm kernel emulates bf16 MACs with bfp16 (8x8x8 micro-tiles); "
                        "default: on for npu2, as mlir-aie's stock npu2 build")
    p.add_argument("--mlir-aie-src", default=os.environ.get("MLIR_AIE_SRC"))
    p.add_argument("--unpinned", action="store_true",
                   help=f"build with an mlir-aie other than release {MLIR_AIE_RELEASE} (design.json records which)")
    args = p.parse_args(argv)
    shapes = gemm_shapes(args.checkpoints, args.weight_format, args.dflash)
    for s in shapes:
        print(f"K={s.K:6d} N={s.N:7d} {s.weight_format:5s} x{len(s.layers):<3d} {s.layers[0]}")
    if args.list:
        return 0
    if args.device is None or args.out is None:
        p.error("--device and --out are needed to build (or --list)")
    rows = args.rows or default_rows(args.device, args.bfp16_emulation)
    tiling = Tiling(args.device, rows[0], args.tile_k, args.tile_n, args.columns, args.b_col_major,
                    args.bfp16_emulation, one_xclbin=not args.xclbin_per_shape, more_rows=tuple(rows[1:]),
                    int8_rows=args.int8_rows)
    for shape in shapes:  # every plan first: what stays on the host is said before an hour of compiling
        if shape.weight_format in SERVED_FORMATS:
            try:
                plan(shape, tiling, args.out)
            except ValueError as exc:
                print(f"stays on the host: {exc}", file=sys.stderr)
    missing = missing_toolchain(args.mlir_aie_src)
    if missing:
        print("cannot build the NPU designs here; missing:", file=sys.stderr)
        for m in missing:
            print(f"  - {m}", file=sys.stderr)
        print("docs/npu.md, 'Building the designs', says how to install them.", file=sys.stderr)
        return EXIT_MISSING
    seen = toolchain_seen(args.mlir_aie_src)
    unpinned = pin_errors(seen, args.mlir_aie_src)
    if unpinned and not args.unpinned:
        print(f"not the pinned toolchain (mlir-aie {MLIR_AIE_RELEASE}, llvm-aie {LLVM_AIE_WHEEL}):", file=sys.stderr)
        for line in unpinned:
            print(f"  - {line}", file=sys.stderr)
        print("install the pinned release (docs/npu.md, 'Building the designs'), or pass --unpinned", file=sys.stderr)
        return EXIT_UNPINNED
    if unpinned:
        seen["unpinned"] = "; ".join(unpinned)
    return finish(*build_table(shapes, tiling, args.out,
                               lambda d, link=False: build_with_iron(d, tiling, Path(args.mlir_aie_src),
                                                                     args.out / "work", link),
                               toolchain=seen), served=[s for s in shapes if s.weight_format in SERVED_FORMATS])


def finish(path: Path, on_host: list[str], built: int, served: list[Shape]) -> int:
    """Say what was built and what stays on the host; the exit status: 0 when a design built or
    nothing could use one, EXIT_NOTHING_BUILT (with a line per shape) when none of `served` did."""
    if served and not built:
        print(f"no NPU design built for any of the {len(served)} shapes; {path} lists none:", file=sys.stderr)
        for line in on_host:
            print(f"  {line}", file=sys.stderr)
        return EXIT_NOTHING_BUILT
    for line in on_host:
        print(line)
    print(f"wrote {path} ({built} designs); set device.xrt_design = \"{path.resolve()}\" in npud.toml")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
