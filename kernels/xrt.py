"""The NPU backend: GEMMs on an AMD Ryzen AI NPU through XRT (pyxrt), the rest on the host.

The NPU runs one precompiled GEMM design (an xclbin plus its instruction stream, built
with the AIE toolchain outside this project) described by a `design.json`:

    {"xclbin": "gemm.xclbin", "insts": "insts.bin", "kernel": "MLIR_AIE",
     "tile_m": 16, "tile_k": 64, "tile_n": 64, "max_k": 8192, "max_n": 155648}

The design computes C[tile_m, N] = A[tile_m, K] (bf16) x B[K, N] (bf16) with fp32
accumulation, in a fixed order per output element. Every call is padded to exactly
`tile_m` rows, so a row's result is computed by the same program whatever M is: that is
what makes this backend batch-invariant (a verify of 8 rows costs the same device pass
as one row). The start-up self-check (kernels.host.check_batch_invariance) is run on this
backend too before it is used.

Weights are uploaded once at load (`prepare_linear`) into device buffers, transposed and
padded to the design's tiles; norms, RoPE, attention and the rest run on the host kernels.
pyxrt ships with XRT and is not on the package index: it is imported when the backend is
built, and its absence is reported by `probe()`, never raised at import time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.base import LinearWeight, WeightFormat


class XrtUnavailable(ValueError):
    """The NPU path cannot run here; the message says what is missing (a configuration
    error from the daemon's point of view: the model was asked for a backend it cannot have)."""


@dataclass(slots=True, frozen=True)
class GemmDesign:
    xclbin: Path
    insts: Path
    kernel: str
    tile_m: int
    tile_k: int
    tile_n: int
    max_k: int
    max_n: int

    @classmethod
    def load(cls, design_json: str | Path) -> "GemmDesign":
        """Read design.json; paths in it are relative to its folder. Raises XrtUnavailable."""
        path = Path(design_json)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise XrtUnavailable(f"cannot read NPU GEMM design {path}: {e}") from e
        try:
            design = cls(
                xclbin=path.parent / raw["xclbin"],
                insts=path.parent / raw["insts"],
                kernel=str(raw.get("kernel", "MLIR_AIE")),
                tile_m=int(raw["tile_m"]),
                tile_k=int(raw["tile_k"]),
                tile_n=int(raw["tile_n"]),
                max_k=int(raw["max_k"]),
                max_n=int(raw["max_n"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise XrtUnavailable(f"{path}: missing or bad field {e}") from e
        for f in ("xclbin", "insts"):
            if not getattr(design, f).is_file():
                raise XrtUnavailable(f"{path}: {f} file {getattr(design, f)} does not exist")
        return design

    def identity(self) -> str:
        """A sha256 over the xclbin's and the instruction stream's bytes and the tile fields:
        another build of the design is another identity. Raises OSError."""
        h = hashlib.sha256()
        for path in (self.xclbin, self.insts):
            data = path.read_bytes()
            h.update(b"%d\0" % len(data))
            h.update(data)
        h.update(json.dumps([self.kernel, self.tile_m, self.tile_k, self.tile_n, self.max_k, self.max_n]).encode())
        return h.hexdigest()


def probe(accel_dir: str | Path = "/dev/accel") -> tuple[bool, str]:
    """Whether an amdxdna NPU and the XRT binding are usable here, and why (not)."""
    nodes = sorted(Path(accel_dir).glob("accel*")) if Path(accel_dir).is_dir() else []
    if not nodes:
        return False, f"no NPU device node under {accel_dir}"
    try:
        import pyxrt  # noqa: F401
    except ImportError as e:
        return False, f"{nodes[0]} exists but the XRT Python binding (pyxrt) is not importable: {e}"
    return True, f"{nodes[0]} with pyxrt"


def _pad_to(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN kept a NaN)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


class XrtBackend:
    """GEMMs on the NPU (one padded tile_m-row pass per call), everything else on `host`."""

    name = "xrt"

    def __init__(self, design: GemmDesign, host, device_index: int = 0):
        try:
            import pyxrt
        except ImportError as e:
            raise XrtUnavailable(f"the XRT Python binding (pyxrt) is not importable: {e}") from e
        self._xrt = pyxrt
        self.design = design
        self.host = host
        self.device = pyxrt.device(device_index)
        xclbin = pyxrt.xclbin(str(design.xclbin))
        self.device.register_xclbin(xclbin)
        self.context = pyxrt.hw_context(self.device, xclbin.get_uuid())
        self.kernel = pyxrt.kernel(self.context, design.kernel)
        insts = np.fromfile(design.insts, dtype=np.uint32)
        self._insts_len = int(insts.size)
        self._bo_insts = self._bo(insts.nbytes, pyxrt.bo.cacheable, 1)
        self._bo_insts.write(insts.view(np.uint8), 0)
        self._sync_to(self._bo_insts)
        self._weights: dict[int, tuple] = {}  # id(data) -> (bo, Kp, Np)
        self._a = None  # activation buffer, grown to the largest K seen
        self._c = None

    def numerics_id(self) -> str:
        """The design's identity (its program files and tiles) and the activation path: an
        explicit method, since __getattr__ would answer with the host's."""
        return f"xrt/design={self.design.identity()}/activations=bf16/accumulate=fp32"

    def _bo(self, nbytes: int, flags, arg: int):
        return self._xrt.bo(self.device, int(nbytes), flags, self.kernel.group_id(arg))

    def _sync_to(self, bo) -> None:
        bo.sync(self._xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        """Upload W^T [Kp, Np] as bf16 into a device buffer; the host keeps a tiled copy for embeddings."""
        d = self.design
        if w.layout != "rows":
            raise ValueError(f"xrt backend prepares weights from the rows layout, got {w.layout!r}")
        n, k = w.data.shape
        if k > d.max_k or n > d.max_n:
            raise ValueError(f"weight [{n}, {k}] exceeds the NPU design's limits [{d.max_n}, {d.max_k}]")
        if w.fmt is WeightFormat.BF16:
            dense = (w.data.astype(np.uint32) << 16).view(np.float32)
        elif w.fmt.storage is WeightFormat.INT8:
            dense = w.data.astype(np.float32) * w.scale[:, None]
        else:
            dense = w.data
        kp, np_ = _pad_to(k, d.tile_k), _pad_to(n, d.tile_n)
        bt = np.zeros((kp, np_), np.uint16)
        bt[:k, :n] = _bf16_bits(dense).T
        bo = self._bo(bt.nbytes, self._xrt.bo.host_only, 4)
        bo.write(bt.view(np.uint8).ravel(), 0)
        self._sync_to(bo)
        host_copy = self.host.prepare_linear(w)
        self._weights[id(host_copy.data)] = (bo, kp, np_)
        return host_copy

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        # x: [M, K] -> [M, N]; each tile_m-row chunk is one device pass over W
        entry = self._weights.get(id(w.data))
        if entry is None:
            raise ValueError("weight was not prepared by this xrt backend")
        bo_b, kp, np_ = entry
        d = self.design
        m, k = x.shape
        out = np.empty((m, w.out_features), np.float32)
        self._ensure_io(kp, np_)
        for r0 in range(0, m, d.tile_m):
            rows = x[r0 : r0 + d.tile_m]
            a = np.zeros((d.tile_m, kp), np.uint16)
            a[: rows.shape[0], :k] = _bf16_bits(rows)
            self._a.write(a.view(np.uint8).ravel(), 0)
            self._sync_to(self._a)
            run = self.kernel(3, self._bo_insts, self._insts_len, self._a, bo_b, self._c, d.tile_m, kp, np_)
            run.wait()
            self._c.sync(self._xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
            c = np.frombuffer(self._c.read(d.tile_m * np_ * 4, 0), np.float32).reshape(d.tile_m, np_)
            out[r0 : r0 + rows.shape[0]] = c[: rows.shape[0], : w.out_features]
        if w.bias is not None:
            out += w.bias
        return out

    def _ensure_io(self, kp: int, np_: int) -> None:
        d = self.design
        a_bytes, c_bytes = d.tile_m * kp * 2, d.tile_m * np_ * 4
        if self._a is None or self._a.size() < a_bytes:
            self._a = self._bo(a_bytes, self._xrt.bo.host_only, 3)
        if self._c is None or self._c.size() < c_bytes:
            self._c = self._bo(c_bytes, self._xrt.bo.host_only, 5)

    def __getattr__(self, attr):
        # rms_norm, rope, attention, silu_mul, embed, argmax: the host kernels
        return getattr(self.host, attr)
