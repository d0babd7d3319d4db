"""The compute backend interface: what a forward pass needs from a device.

Every operation takes M rows and must give, for each row, the bits that a one-row call
would give for that row alone (batch invariance). The speculative verifier depends on it:
an accepted draft means "the model would have chosen this token here", not "nearby".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
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


def quantize_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Returns (int8 q [N, K], float32 scale [N]) with w ~= q * scale[:, None]: WeightFormat.INT8's rows.

    Here, not in npud.engine.weights, because the NPU's start-up check (npud.kernels.xrt_check) makes
    the rows an int8 model loads, and kernels do not import the engine.

    Symmetric per output row: scale = max|row| / 127, q = clip(rint(w / scale), -127, 127),
    so each element is off by at most scale / 2. An all-zero row gets scale 1.0 (its q is
    all zeros, so it dequantizes to exact zeros and nothing divides by zero).
    """
    absmax = np.max(np.abs(w), axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    scale = (absmax / np.float32(127.0)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


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


# ------------------------------------------------------------------ a decoder layer in one call
#
# The shapes below are backend-neutral: the host backend runs a LayerCall as one native call
# (npud/kernels/host/layer.py), the NPU as one command (issue 41), and any backend without
# `decoder_layer` runs compose_layer, the primitives' composition (what the engine ran before).


@dataclass(slots=True, frozen=True)
class DecoderLayer:
    """One decoder layer of a model as a backend runs it: its weights and the numbers of its spec.

    Made once per model (npud.engine.model.Model.decoder_layers) and shared by every call of
    every round; backend-neutral (no backend's layout is assumed beyond the LinearWeights' own).
    `state` is one dict per model, shared by all its layers: what a backend builds once for this
    model and keeps as long as the model (the host: each layer's native description and the
    scratch its calls run in); nothing else reads or writes it.
    """

    weights: object  # the engine's LayerWeights (npud/engine/weights/layout.py), read by field name
    index: int  # the layer's position in the model
    kind: str  # "full_attention", "sliding_attention" or "linear_attention" (a GDN layer: no LayerCall)
    num_heads: int  # H, query heads
    num_kv_heads: int  # KVH, key/value heads; H is a multiple of it
    head_dim: int  # Dh
    window: int  # 0: a row sees every position up to its own; W > 0: the last W of them, its own included
    scale: float  # attention score scale (head_dim ** -0.5, or the model's)
    eps: float  # every RMS norm's epsilon
    activation: str  # the MLP's gate activation: "silu" or "gelu_tanh"
    kv_owner: int  # == index where the layer owns its KV plane; else the earlier layer whose plane it reads
    sandwich_norms: bool  # gemma3/4: the attention and MLP outputs are normed before they join the residual
    inv_freq: np.ndarray  # [rotary Dh / 2] float32, this layer's RoPE frequencies (pairs (i, i + Dh_rot / 2))
    state: dict = field(default_factory=dict, compare=False, repr=False)  # per model, a backend's own

    @property
    def owns_kv(self) -> bool:
        return self.kv_owner == self.index


@dataclass(slots=True, frozen=True)
class RoundRows:
    """The rows of one round (one or more sequences' passes packed): made once per round.

    Each sequence's rows are contiguous and in order; `seqs` covers 0..M-1 in order.
    """

    positions: np.ndarray  # [M] int64, each row's position in its own sequence
    seqs: tuple[tuple[int, int], ...]  # per sequence: its rows [start, stop) of the M

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


@dataclass(slots=True, frozen=True)
class PlaneRows:
    """One sequence's KV plane of one layer as a layer call sees it: the plane's own arrays, with
    room for this pass's rows already reserved by the engine (nothing is copied to make it)."""

    keys: np.ndarray  # [capacity, KVH, Dh] float32, C-contiguous; capacity >= held + the sequence's rows
    values: np.ndarray  # [capacity, KVH, Dh] float32, C-contiguous
    held: int  # positions held before this pass (== the sequence's first position in it): rows 0..held-1


@dataclass(slots=True, frozen=True)
class LayerCall:
    """One attention layer over every row of a round: x + delta in, (x, delta) out.

    Per sequence s of rows.seqs (rows [a, b), n = b - a), planes[s] is the plane the layer
    reads: its own, or where it is KV-shared its kv_owner's. A layer that owns its KV writes
    the pass's k and v rows at planes[s] rows held..held+n-1 (the engine then counts them as
    held); a KV-shared layer finds them there, written by its owner earlier in the same pass.
    Row r attends over plane rows 0..positions[r] (the last `window` of them when window > 0).
    """

    layer: DecoderLayer
    rows: RoundRows
    x: np.ndarray  # [M, D] float32, the residual stream
    delta: np.ndarray | None  # [M, D] float32 added to x before the input norm (the last layer's MLP output), or None
    planes: tuple[PlaneRows, ...]  # per sequence of rows.seqs
    per_layer: np.ndarray | None = None  # [M, P] float32, gemma4's per-layer inputs for this layer (PLE), or None


def decoder_layer(backend, call: LayerCall) -> tuple[np.ndarray, np.ndarray | None]:
    """One attention layer: norm, projections, RoPE, the KV rows written, attention over each
    sequence's plane, output projection, residual, norm, MLP. Returns (x, delta), the layer's
    output being x + delta (delta None: x), delta for the next norm to add. A backend's own
    `decoder_layer(call)` may return None for a layer it does not run as one; then, and for a
    backend without one, the primitives' composition runs (compose_layer). Same bits either way."""
    fused = getattr(backend, "decoder_layer", None)
    if callable(fused):
        out = fused(call)
        if out is not None:
            return out
    return compose_layer(backend, call)


@dataclass(slots=True, frozen=True)
class StackCall:
    """Consecutive attention layers over every row of a round, each one's output the next one's
    input: a whole step's layers where nothing comes between them (no GDN layer, no per-layer
    inputs, no tap the engine reads). Backend-neutral, as LayerCall.

    planes[i] is layers[i]'s LayerCall.planes. The engine counts a layer's written KV rows as held
    only after the call, so a KV-shared layer reads its owner's rows from the arrays (rows
    held..held+n-1, written earlier in the same call), never from the planes' lengths.
    """

    layers: tuple[DecoderLayer, ...]
    rows: RoundRows
    x: np.ndarray  # [M, D] float32, the first layer's residual stream
    delta: np.ndarray | None  # [M, D] float32 pending on x, or None
    planes: tuple[tuple[PlaneRows, ...], ...]  # per layer, per sequence of rows.seqs


def decoder_stack(backend, call: StackCall) -> tuple[np.ndarray, np.ndarray | None]:
    """The layers of `call` in order, as decoder_layer each; returns the last one's (x, delta). A
    backend's own `decoder_stack(call)` runs them all in one call (None: it does not, and each
    layer goes to decoder_layer). Same bits either way."""
    fused = getattr(backend, "decoder_stack", None)
    if callable(fused):
        out = fused(call)
        if out is not None:
            return out
    x, delta = call.x, call.delta
    for layer, planes in zip(call.layers, call.planes):
        x, delta = decoder_layer(backend, LayerCall(layer, call.rows, x, delta, planes))
    return x, delta


def compose_layer(backend, call: LayerCall) -> tuple[np.ndarray, np.ndarray | None]:
    """decoder_layer from the primitives (and the optional fused ops above): a call each."""
    b, layer = backend, call.layer
    lw = layer.weights
    if call.delta is None:
        x, h = call.x, b.rms_norm(call.x, lw.input_norm, layer.eps)
    else:
        x, h = add_rms_norm(b, call.x, call.delta, lw.input_norm, layer.eps)
    return layer_tail(b, layer, x, _compose_attention(b, call, h), call.per_layer)


def layer_tail(backend, layer: DecoderLayer, x: np.ndarray, mixed: np.ndarray,
               per_layer: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """A layer after its token mixing (attention, or a GDN layer's): x [M, D] the residual, mixed
    [M, D] the mixer's output -> (x, delta) as decoder_layer. The MLP's output is left as delta for
    the next norm to add where nothing comes between (add_rms_norm: the add and the norm in one)."""
    b, lw, eps = backend, layer.weights, layer.eps
    if layer.sandwich_norms:
        # gemma3/4: the attention and MLP outputs are normed before they join the residual
        x = x + b.rms_norm(mixed, lw.post_attention_norm, eps)
        h = b.rms_norm(x, lw.pre_feedforward_norm, eps)
        x = x + b.rms_norm(_mlp(b, layer, h), lw.post_feedforward_norm, eps)
    else:
        x, h = add_rms_norm(b, x, mixed, lw.post_attention_norm, eps)
        if per_layer is None and lw.layer_scalar is None:
            return x, _mlp(b, layer, h)
        x = x + _mlp(b, layer, h)
    if per_layer is not None:
        gated = _act_mul(b, layer, b.linear(x, lw.per_layer_gate), per_layer)
        x = x + b.rms_norm(b.linear(gated, lw.per_layer_projection), lw.post_per_layer_norm, eps)
    if lw.layer_scalar is not None:
        x = x * lw.layer_scalar[0]
    return x, None


def _act_mul(backend, layer: DecoderLayer, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    if layer.activation == "silu":
        return backend.silu_mul(gate, up)
    return backend.gelu_tanh_mul(gate, up)


def _mlp(backend, layer: DecoderLayer, h: np.ndarray) -> np.ndarray:
    b, mw = backend, layer.weights.mlp
    if mw.gate_up is not None:  # one GEMM call; the activation reads the halves where they lie
        gate, up = mw.gate_up.split(b.linear(h, mw.gate_up.weight))
    else:
        gate, up = b.linear(h, mw.gate), b.linear(h, mw.up)
    return b.linear(_act_mul(b, layer, gate, up), mw.down)


def _norm_rope(backend, x: np.ndarray, norm: np.ndarray | None, call: LayerCall) -> np.ndarray:
    if norm is None:
        return backend.rope(x, call.rows.positions, call.layer.inv_freq)
    return norm_rope(backend, x, norm, call.rows.positions, call.layer.inv_freq, call.layer.eps)


def _compose_attention(backend, call: LayerCall, h: np.ndarray) -> np.ndarray:
    b, layer = backend, call.layer
    aw = layer.weights.attn
    m, heads, kv_heads, dh = h.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    if aw.qkv is not None:  # one GEMM call for q, k, v (and the output gate), then column views
        q, k, v, *gate = aw.qkv.split(b.linear(h, aw.qkv.weight))
    else:
        q, k, v, gate = b.linear(h, aw.q), None, None, ()
    q = _norm_rope(b, q.reshape(m, heads, dh), aw.q_norm, call)
    if layer.owns_kv:
        if k is None:
            k = b.linear(h, aw.k)
            # k_eq_v: the values are the raw key projection, before the key's norm and RoPE
            v = k if aw.v is None else b.linear(h, aw.v)
        k = k.reshape(m, kv_heads, dh)
        v = v.reshape(m, kv_heads, dh)
        if aw.v_norm is not None:
            v = b.rms_norm(v, aw.v_norm, layer.eps)
        k = _norm_rope(b, k, aw.k_norm, call)
        for (a, z), plane in zip(call.rows.seqs, call.planes):
            plane.keys[plane.held : plane.held + z - a] = k[a:z]
            plane.values[plane.held : plane.held + z - a] = v[a:z]
    # each sequence attends over its own plane; a KV-shared layer reads the rows its owner wrote
    outs = []
    for (a, z), plane in zip(call.rows.seqs, call.planes):
        end = plane.held + z - a
        outs.append(b.attention(q[a:z], plane.keys[:end], plane.values[:end], call.rows.positions[a:z],
                                layer.window, layer.scale))
    out = (outs[0] if len(outs) == 1 else np.concatenate(outs)).reshape(m, heads * dh)
    if aw.gate is not None:  # qwen3_5's output gate
        out = b.sigmoid_mul(out, gate[0] if gate else b.linear(h, aw.gate))
    return b.linear(out, aw.o)


class Backend(Protocol):
    """Row-wise kernels. Shapes are written [rows, features]; all activations are fp32."""

    name: str

    # optional: numerics_id() -> str, the backend's numerics identity (see numerics_identity)
    # optional, with the defaults above: fuse_linears(parts) -> FusedLinear | None;
    # add_rms_norm(x, delta, weight, eps) -> (sum, normed); norm_rope(x, weight, positions, inv_freq, eps);
    # decoder_layer(call: LayerCall) -> (x, delta), or None for a layer it leaves to compose_layer;
    # decoder_stack(call: StackCall) -> (x, delta), or None to run the layers one decoder_layer each.
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
