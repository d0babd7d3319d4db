"""The compute backend interface: what a forward pass needs from a device.

Every operation takes M rows and must give, for each row, the bits that a one-row call
would give for that row alone (batch invariance). The speculative verifier depends on it:
an accepted draft means "the model would have chosen this token here", not "nearby".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npud.kernels.errors import DeviceFault  # noqa: F401  (part of the backend interface)


def numerics_identity(backend) -> str:
    """What a backend's numbers depend on besides the weights: its name, its design where it
    has one, and the path its activations take. A backend says it through `numerics_id()`;
    one that does not is taken at its word in `Backend` (fp32 activations) under its name."""
    numerics_id = getattr(backend, "numerics_id", None)
    return numerics_id() if callable(numerics_id) else f"{backend.name}/activations=fp32"


# The version of the engine's numerics: a kernel change that changes any bit of any output
# bumps it, so that nothing computed by the old kernels (a persisted prefix-cache snapshot,
# say) is taken for the new ones' result. 1: the numba GEMMs (separate multiply and add);
# 2: the C GEMMs (one FMA per k; int8-q8's integer blocks; bf16-bf16's flushed FMA pairs); 3: the C
# attention (FMA chains, its own exponential, a sixteen-lane softmax denominator); 4: the C GEMM
# for GGML block weights (one FMA per k, where numba multiplied and added); 5: gelu_tanh_mul in C
# (float32 with npud_exp, where numba took tanh in float64). Part of every prefix-cache key
# (npud/engine/fingerprint.py); an op's formula in npud/engine/forward.py counts as a kernel change too.
NUMERICS_VERSION = 5


class WeightFormat(enum.Enum):
    """How a linear layer's weight matrix is held in host memory, and which arithmetic multiplies it.

    A new format (a GGUF block format, say) adds a member here, says in `storage` what a
    loader converts the checkpoint to, and registers its host kernel in npud/kernels/host/formats.py;
    the start-up self-check then covers it.
    """

    FP32 = "fp32"  # float32 [N, K]
    BF16 = "bf16"  # uint16 [N, K] holding bfloat16 bits, widened to fp32 inside the kernel
    INT8 = "int8"  # int8 [N, K] with one fp32 scale per output row (symmetric, per channel)
    # INT8's weights against activations quantized per row in blocks of 32 (one fp32 scale
    # each, as llama.cpp's q8_0): exact integer block sums, a looser parity bound (README)
    INT8_Q8 = "int8-q8"
    # INT8's weights against activations quantized per row in blocks of 32 to 16-bit integers
    # (one fp32 scale each), held as byte pairs for the same integer kernels: 254x finer than q8_0
    # for a second pass of byte products, within 1e-2 of the exact path (README)
    INT8_Q16 = "int8-q16"
    # BF16's weights against activations rounded per row to bf16, pairs of products summed
    # in fp32 (AVX512_BF16's vdpbf16ps where present): a looser parity bound (README)
    BF16_BF16 = "bf16-bf16"

    @property
    def storage(self) -> "WeightFormat":
        """The format whose data a loader produces for this one (INT8_Q8 and INT8_Q16 hold INT8's
        data, BF16_BF16 BF16's)."""
        return {WeightFormat.INT8_Q8: WeightFormat.INT8, WeightFormat.INT8_Q16: WeightFormat.INT8,
                WeightFormat.BF16_BF16: WeightFormat.BF16}.get(self, self)

    @classmethod
    def parse(cls, value: str) -> "WeightFormat":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown weight format {value!r}; expected one of {[f.value for f in cls]}"
            ) from None


@dataclass(slots=True, frozen=True)
class LinearWeight:
    """A linear layer y = x @ W.T (+ bias), W held in `fmt`.

    As loaded, `data` is [N, K] ("rows"). A backend may re-lay it out once at load time
    (`Backend.prepare_linear`); the host backend's layouts are in npud/kernels/host/formats.py
    (column tiles [ceil(N / T), K, T] zero-padded, for instance). Any layout but "rows"
    records the true N and K in `out_features` and `in_features`.
    """

    fmt: WeightFormat
    data: np.ndarray  # rows: [N, K]; otherwise the backend's layout. float32, uint16 (bf16 bits) or int8
    scale: np.ndarray | None = None  # [N] float32, INT8 and INT8_Q8 only
    bias: np.ndarray | None = None  # [N] float32
    layout: str = "rows"
    out_features: int = 0  # derived from `data` for the rows layout
    in_features: int = 0  # derived from `data` for the rows and tiles layouts

    def __post_init__(self) -> None:
        if self.layout == "rows":
            object.__setattr__(self, "out_features", int(self.data.shape[0]))
        elif self.out_features <= 0:
            raise ValueError(f"LinearWeight: layout {self.layout!r} needs out_features")
        if self.layout in ("rows", "tiles") and self.in_features == 0:
            object.__setattr__(self, "in_features", int(self.data.shape[1]))
        elif self.in_features <= 0:
            raise ValueError(f"LinearWeight: layout {self.layout!r} needs in_features")

    @property
    def nbytes(self) -> int:
        n = self.data.nbytes
        if self.scale is not None:
            n += self.scale.nbytes
        if self.bias is not None:
            n += self.bias.nbytes
        return n


@dataclass(slots=True, frozen=True)
class FusedLinear:
    """Linear layers of one input held as one weight, so that one GEMM call computes them all.

    Part i's outputs are columns starts[i] .. starts[i] + parts[i].out_features - 1 of the fused
    call's; each column is computed as in the part's own call, so the bits are the same. The
    parts are the backend's views into `weight` (no second copy): whoever holds a layer's own
    fields (an accountant of weight bytes, another reader) sees them unchanged.
    """

    weight: LinearWeight
    parts: tuple[LinearWeight, ...]
    starts: tuple[int, ...]
    _columns: tuple[slice, ...] = ()  # each part's, derived

    def __post_init__(self) -> None:
        columns = tuple(slice(s, s + p.out_features) for s, p in zip(self.starts, self.parts))
        object.__setattr__(self, "_columns", columns)

    def split(self, y: np.ndarray) -> list[np.ndarray]:
        """y: [M, weight's N], the fused call's output -> each part's columns [M, N_i] (views)."""
        return [y[:, c] for c in self._columns]


# The operations below are optional for a backend: where it has none of its own, the engine
# calls these, which fuse nothing or compose the primitives, so any backend keeps working.


def fuse_linears(backend, parts: Sequence[LinearWeight]) -> FusedLinear | None:
    """`parts` (as loaded, one input) as one weight laid out for `backend`, or None where the
    backend keeps them apart (the default: fusion is the backend's decision)."""
    fuse = getattr(backend, "fuse_linears", None)
    return fuse(parts) if callable(fuse) else None


def add_rms_norm(backend, x: np.ndarray, delta: np.ndarray, weight: np.ndarray,
                 eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The residual add and the RMS norm after it: x, delta [M, D] -> (x + delta, rms_norm(x + delta))."""
    fused = getattr(backend, "add_rms_norm", None)
    if callable(fused):
        return fused(x, delta, weight, eps)
    total = x + delta
    return total, backend.rms_norm(total, weight, eps)


def norm_rope(backend, x: np.ndarray, weight: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
              eps: float) -> np.ndarray:
    """A head norm then RoPE: x [M, H, Dh], weight [Dh] -> rope(rms_norm(x)) [M, H, Dh]."""
    fused = getattr(backend, "norm_rope", None)
    if callable(fused):
        return fused(x, weight, positions, inv_freq, eps)
    return backend.rope(backend.rms_norm(x, weight, eps), positions, inv_freq)


class Backend(Protocol):
    """Row-wise kernels. Shapes are written [rows, features]; all activations are fp32."""

    name: str

    # optional: numerics_id() -> str, the backend's numerics identity (see numerics_identity)
    # optional, with the defaults above: fuse_linears(parts) -> FusedLinear | None;
    # add_rms_norm(x, delta, weight, eps) -> (sum, normed); norm_rope(x, weight, positions, inv_freq, eps).
    # Each must give the bits its default gives.

    def prepare_linear(self, w: LinearWeight) -> LinearWeight:
        """Re-lay out a loaded [N, K] weight for this backend (done once, at load)."""

    def linear(self, x: np.ndarray, w: LinearWeight) -> np.ndarray:
        """x: [M, K] -> [M, N]."""

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x: [M, D] normalised over D, times weight [D] -> [M, D]."""

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """x: [M, H, Dh], positions: [M] -> rotated [M, H, Dh] (half-split layout)."""

    def attention(
        self,
        q: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        positions: np.ndarray,
        window: int,
        scale: float,
    ) -> np.ndarray:
        """Causal attention of M query rows over a cache.

        q: [M, H, Dh]; k_cache, v_cache: [T, KVH, Dh] holding positions 0..T-1;
        positions: [M], row m sees keys 0..positions[m] (the last `window` of them when
        window > 0) -> [M, H, Dh].
        """

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up, elementwise, [M, F] -> [M, F]."""

    def embed(self, table: LinearWeight, tokens: np.ndarray) -> np.ndarray:
        """Rows of the embedding table: tokens [M] -> [M, D] fp32."""

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """[M, V] -> [M] int64, the first index of the maximum in each row."""

    # gemma4 / qwen3_5

    def gelu_tanh_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gelu_tanh(gate) * up, elementwise (torch's gelu(approximate="tanh")), [M, F] -> [M, F]."""

    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """x * sigmoid(gate), elementwise, [M, F] -> [M, F]."""

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        """cap * tanh(x / cap), elementwise, [M, V] -> [M, V]."""

    def l2_norm(self, x: np.ndarray, eps: float) -> np.ndarray:
        """x / sqrt(sum(x^2) + eps) over the last axis, [..., D] -> [..., D]."""

    def causal_conv1d_silu(self, x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Depthwise causal conv then silu, row after row.

        x: [M, C]; state: [C, K-1], the inputs before row 0; weight: [C, K] ->
        (out [M, C], states [M, C, K-1]: the last K-1 inputs after each row).
        """

    def gdn_gates(self, a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """a, b: [M, H] -> (log decay -exp(a_log) * softplus(a + dt_bias), beta sigmoid(b)), each [M, H]."""

    def gated_delta_rule(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray, beta: np.ndarray, state: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The gated delta rule over M rows in order, from `state`.

        q, k: [M, HK, DK]; v: [M, HV, DV]; log_decay, beta: [M, HV]; state: [HV, DK, DV];
        value head h reads key head h // (HV / HK). Per row: S *= exp(log_decay);
        S += k (x) (beta (v - S^T k)); out = S^T q -> (out [M, HV, DV], states [M, HV, DK, DV]:
        the state after each row, so a verify can keep any prefix of the pass).
        """

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """weight * rms_norm(x) * silu(z) per row, [R, D] -> [R, D]."""
