"""The host backend's decoder_layer: an attention layer over every row of a round in one native call.

layer.c runs the layer (norm, q/k/v, head norm and RoPE, the KV rows into each sequence's plane,
attention per sequence, o, residual and norm, gate/up, activation, down) by calling, step by step,
the kernels HostBackend's per-op calls reach, with the same arguments, so every bit is the
per-op path's (npud.kernels.base.compose_layer); the GIL is released for the whole layer, and
the call's buffers are the model's (allocated when a model first runs a round of that many rows,
kept as long as the model).

Which layers run as one call: those of llama, mistral, qwen2 / qwen3 and gemma3 (plain attention, q/k
head norms or none, sliding windows, KV-shared layers reading their owner's plane, gemma3's four
norms), in any weight format the host serves (describe_linear; GGUF blocks: the ggml backend's
native_linear). Left to compose_layer: a GDN layer or qwen3_5's output gate, gemma4's v_norm,
k_eq_v, per-layer inputs and layer scalar, a weight in a layout without a native description,
and a round whose per-row kernels the per-op path would split over threads (prefill chunks of a
wide model: M x max(D, H Dh, F) >= pointwise.POINTWISE_PARALLEL_MIN). Where a sequence's
attention is large enough for threads (HostBackend.attention's rule), the layer runs as two calls
around native.attention on the pool (the bits do not depend on the split either way).

A stalled GEMM worker (pool.c, native._call) may read a layer's weights after the call returns:
the call goes through native._call with every weight array of the layer, so they are kept until
no worker reads them. No worker reads the call's scratch: a GEMM job holds its own copy of the
activations, and a worker whose chunk was taken back writes nothing.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from npud.kernels.base import LayerCall, LinearWeight, WeightFormat
from npud.kernels.host import native, pointwise
from npud.kernels.host.formats import PARALLEL_MIN_BYTES, kernel_for
from npud.kernels.host.native import PARALLEL_MIN_WORK

LIN_FLOAT, LIN_Q8, LIN_BD, LIN_QT, LIN_BQ8 = range(5)  # layer.c's LIN_*: which GEMM entry multiplies a weight
ACT = {"silu": 0, "gelu_tanh": 1}
STAGE_ALL, STAGE_BEFORE_ATTENTION, STAGE_AFTER_ATTENTION = range(3)

_L, _D, _P = ctypes.c_long, ctypes.c_double, ctypes.c_void_p
_FLOAT_CODES = {WeightFormat.FP32: native.FMT_F32, WeightFormat.BF16: native.FMT_BF16, WeightFormat.INT8: native.FMT_I8}


class Linear(ctypes.Structure):
    """layer.c's npud_linear_t."""

    _fields_ = [(name, _L) for name in ("kind", "fmt", "parallel", "K", "Kp", "ntiles", "N", "group", "parts", "fac16",
                                        "qbits", "zero")] + [(name, _P) for name in ("w", "fac", "scale", "bias")]


LINEARS = ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down")


class Layer(ctypes.Structure):
    """layer.c's npud_layer_t."""

    _fields_ = ([(name, _L) for name in ("D", "H", "KVH", "Dh", "half", "F", "window")]
                + [("scale", _D), ("eps", _D)]
                + [(name, _L) for name in ("act", "owns_kv", "sandwich", "qkv_fused", "q_col", "k_col", "v_col",
                                           "gate_up_fused", "up_col")]
                + [(name, _P) for name in ("in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm",
                                           "k_norm")]
                + [(name, Linear) for name in LINEARS])


class Call(ctypes.Structure):
    """layer.c's npud_call_t."""

    _fields_ = ([(name, _L) for name in ("isa", "threads", "stage", "M", "nseq")]
                + [(name, _P) for name in ("x", "delta", "pos", "cs", "seq", "held", "keys", "values", "x_out",
                                           "delta_out", "work")])


def _bind() -> ctypes.CDLL:
    lib = native.library()
    if lib.npud_decoder_layer.restype is not _L:
        lib.npud_decoder_layer.argtypes = [_P, _P]
        lib.npud_decoder_layer.restype = _L
        lib.npud_layer_scratch.argtypes = [_P, _L]
        lib.npud_layer_scratch.restype = _L
    return lib


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def describe_linear(w: LinearWeight) -> tuple[Linear, tuple] | None:
    """The host formats' weights (prepared) as layer.c's Linear: the entry and the arguments their
    per-op call passes (formats.py's kernels, native.py's wrappers), and the arrays it reads; None
    for a weight in another layout."""
    try:
        layout = kernel_for(w.fmt).layout
    except ValueError:
        return None
    if w.layout != layout:
        return None
    tiles, k = w.data.shape[0], w.in_features
    lin = Linear(K=k, Kp=k, ntiles=tiles, N=w.out_features, parallel=int(w.data.nbytes >= PARALLEL_MIN_BYTES),
                 w=_ptr(w.data), scale=_ptr(w.scale), bias=_ptr(w.bias))
    if layout == "tiles":  # native.gemm
        lin.kind, lin.fmt = LIN_FLOAT, _FLOAT_CODES[w.fmt]
    elif layout == "q8-tiles":  # native.linear_q8
        lin.kind, lin.Kp = LIN_Q8, w.data.shape[1] * 4
        lin.fmt = native.FMT_Q16 if w.fmt is WeightFormat.INT8_Q16 else native.FMT_Q8
    elif layout == "bf16-pairs":  # native.linear_bf16_dot: no scale
        lin.kind, lin.Kp, lin.scale = LIN_BD, w.data.shape[1] * 2, None
    else:
        return None
    return lin, (w.data, w.scale, w.bias)


def _vector(a: np.ndarray | None, n: int) -> np.ndarray | None:
    """A norm's weight as the per-op path hands it to the kernel (float32, contiguous), or None
    where it is absent or not [n]."""
    if a is None or a.shape != (n,):
        return None
    return np.ascontiguousarray(a, dtype=np.float32)


@dataclass(slots=True)
class _Native:
    """One layer's layer.c description, the arrays it points into, and its widest per-row call."""

    struct: Layer
    keep: tuple  # every weight array the call reads: kept while a stalled worker may read them
    widest: int  # the most floats a row of one per-row kernel call covers (max(D, H Dh, F))
    scratch: dict  # M -> floats of work a call needs


def native_layer(backend, layer) -> _Native | None:
    """`layer` (a DecoderLayer) as layer.c runs it, or None where it is left to compose_layer."""
    lw = layer.weights
    aw, mw = lw.attn, lw.mlp
    if (layer.kind == "linear_attention" or aw is None or aw.gate is not None or aw.v_norm is not None
            or lw.per_layer_gate is not None or lw.layer_scalar is not None or layer.activation not in ACT):
        return None
    if layer.owns_kv and (aw.k is None or aw.v is None):  # k_eq_v
        return None
    d, heads, kv_heads, dh = lw.input_norm.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    inv_freq = np.ascontiguousarray(layer.inv_freq, dtype=np.float32)
    if inv_freq.ndim != 1 or 2 * inv_freq.shape[0] > dh:
        return None
    s = Layer(D=d, H=heads, KVH=kv_heads, Dh=dh, half=inv_freq.shape[0], window=layer.window, scale=layer.scale,
              eps=layer.eps, act=ACT[layer.activation], owns_kv=int(layer.owns_kv), sandwich=int(layer.sandwich_norms))
    keep: list = []
    norms = {"in_norm": (lw.input_norm, d), "post_attn_norm": (lw.post_attention_norm, d)}
    if layer.sandwich_norms:
        norms.update(pre_ff_norm=(lw.pre_feedforward_norm, d), post_ff_norm=(lw.post_feedforward_norm, d))
    for name, (a, n) in norms.items():
        v = _vector(a, n)
        if v is None:
            return None
        keep.append(v)
        setattr(s, name, v.ctypes.data)
    for name, a in (("q_norm", aw.q_norm), ("k_norm", aw.k_norm)):
        if a is not None:
            v = _vector(a, dh)
            if v is None:
                return None
            keep.append(v)
            setattr(s, name, v.ctypes.data)

    def put(name: str, w: LinearWeight | None, n: int, k: int) -> bool:
        described = None if w is None else backend.native_linear(w)
        if described is None or w.in_features != k or (n and w.out_features != n):
            return False
        setattr(s, name, described[0])
        keep.extend(a for a in described[1] if a is not None)
        return True

    q_width, kv_width = heads * dh, kv_heads * dh
    if aw.qkv is not None:
        if len(aw.qkv.parts) != 3 or [p.out_features for p in aw.qkv.parts] != [q_width, kv_width, kv_width]:
            return None
        s.qkv_fused = 1
        s.q_col, s.k_col, s.v_col = aw.qkv.starts
        if not put("qkv", aw.qkv.weight, 0, d):
            return None
    elif not put("q", aw.q, q_width, d) or (layer.owns_kv and not (put("k", aw.k, kv_width, d)
                                                                   and put("v", aw.v, kv_width, d))):
        return None
    f = mw.gate.out_features
    s.F = f
    if mw.gate_up is not None:
        if [p.out_features for p in mw.gate_up.parts] != [f, f]:
            return None
        s.gate_up_fused, s.up_col = 1, mw.gate_up.starts[1]
        if not put("gate_up", mw.gate_up.weight, 0, d):
            return None
    elif not (put("gate", mw.gate, f, d) and put("up", mw.up, f, d)):
        return None
    if not (put("o", aw.o, d, q_width) and put("down", mw.down, d, f)):
        return None
    return _Native(s, tuple(keep), max(d, q_width, f), {})


class HostLayers:
    """A model's layers as layer.c runs them, and the buffers their calls share (one per model:
    DecoderLayer.state["host"])."""

    def __init__(self):
        self.layers: dict[int, _Native | None] = {}
        self.work = np.empty(0, np.float32)
        self.call = Call()
        self.lock = threading.Lock()  # one round at a time in the shared buffers; another gets its own
        self._round: tuple = (None, None, None)  # (rows, seq bounds, each sequence's position span)

    def _round_arrays(self, rows) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """rows.seqs as [nseq + 1] bounds, and each sequence's lowest and highest position (once a round)."""
        if self._round[0] is not rows:
            bounds = np.asarray([a for a, _ in rows.seqs] + [rows.seqs[-1][1]], dtype=np.int64)
            spans = [(int(rows.positions[a:z].min()), int(rows.positions[a:z].max())) if z > a else (0, -1)
                     for a, z in rows.seqs]
            self._round = (rows, bounds, spans)
        return self._round[1], self._round[2]

    def run(self, backend, call: LayerCall) -> tuple[np.ndarray, np.ndarray] | None:
        layer = call.layer
        nat = self.layers.get(layer.index, False)
        if nat is False:
            nat = self.layers[layer.index] = native_layer(backend, layer)
        if nat is None or call.per_layer is not None:
            return None
        s, rows = nat.struct, call.rows
        x = np.ascontiguousarray(call.x, dtype=np.float32)
        m = x.shape[0]
        if x.ndim != 2 or x.shape[1] != s.D or rows.positions.shape != (m,) or len(call.planes) != len(rows.seqs):
            raise ValueError(f"decoder_layer: x {call.x.shape}, positions {rows.positions.shape} and "
                             f"{len(call.planes)} planes for {len(rows.seqs)} sequences do not fit layer {layer.index}")
        delta = None if call.delta is None else np.ascontiguousarray(call.delta, dtype=np.float32)
        if delta is not None and delta.shape != x.shape:
            raise ValueError(f"decoder_layer: delta {delta.shape} does not fit x {x.shape}")
        threads = native.threads() if backend.parallel else 1
        if threads > 1 and m > 1 and m * nat.widest >= pointwise.POINTWISE_PARALLEL_MIN:
            return None  # the per-row kernels would take threads (a prefill chunk of a wide model)
        bounds, spans = self._round_arrays(rows)
        if bounds[-1] != m:
            raise ValueError(f"decoder_layer: the sequences cover rows 0..{bounds[-1] - 1} of {m}")
        kv_shape = (s.KVH, s.Dh)
        staged = False
        for (a, z), plane, (lo, hi) in zip(rows.seqs, call.planes, spans):
            end = plane.held + z - a
            for arr in (plane.keys, plane.values):
                if arr.dtype != np.float32 or not arr.flags.c_contiguous or arr.shape[1:] != kv_shape or arr.shape[0] < end:
                    raise ValueError(f"decoder_layer: layer {layer.index}'s plane {arr.dtype} {arr.shape} cannot hold "
                                     f"{end} rows of {kv_shape}")
            if lo < 0 or hi >= end:
                raise ValueError(f"attention: positions must lie in 0..{end - 1} (the keys in the cache)")
            staged = staged or (threads > 1 and (z - a) * s.H * end * s.Dh >= PARALLEL_MIN_WORK)
        positions = np.ascontiguousarray(rows.positions, dtype=np.int64)
        inv_freq = np.ascontiguousarray(layer.inv_freq, dtype=np.float32)
        cs = pointwise._rope_table(positions, inv_freq)  # the table the per-op path's RoPE calls use
        need = nat.scratch.get(m)
        if need is None:
            need = nat.scratch[m] = _bind().npud_layer_scratch(ctypes.addressof(s), m)
        x_out = np.empty((m, s.D), np.float32)
        delta_out = np.empty((m, s.D), np.float32)
        held = np.asarray([p.held for p in call.planes], dtype=np.int64)
        keys = np.asarray([p.keys.ctypes.data for p in call.planes], dtype=np.uint64)
        values = np.asarray([p.values.ctypes.data for p in call.planes], dtype=np.uint64)
        mine = self.lock.acquire(blocking=False)
        try:
            if mine:
                if self.work.shape[0] < need:
                    self.work = np.empty(need, np.float32)
                work, c = self.work, self.call
            else:  # another thread's round is in the shared buffers
                work, c = np.empty(need, np.float32), Call()
            c.isa, c.threads, c.M, c.nseq = native.isa_code(), threads, m, len(call.planes)
            c.x, c.delta, c.pos, c.cs = x.ctypes.data, _ptr(delta), positions.ctypes.data, cs.ctypes.data
            c.seq, c.held, c.keys, c.values = bounds.ctypes.data, held.ctypes.data, keys.ctypes.data, values.ctypes.data
            c.x_out, c.delta_out, c.work = x_out.ctypes.data, delta_out.ctypes.data, work.ctypes.data
            if not staged:
                c.stage = STAGE_ALL
                self._native(nat, c)
            else:
                self._staged(nat, c, call, work, positions)
        finally:
            if mine:
                self.lock.release()
        return x_out, delta_out

    @staticmethod
    def _native(nat: _Native, c: Call) -> None:
        status = native._call(_bind().npud_decoder_layer, nat.keep, ctypes.addressof(nat.struct), ctypes.addressof(c))
        if status == -2:
            raise ValueError("decoder_layer: a weight's q tiles are of no width the kernels know")
        if status < 0:
            raise MemoryError(f"no memory for a GEMM's or attention's scratch in a layer of {c.M} rows")

    def _staged(self, nat: _Native, c: Call, call: LayerCall, work: np.ndarray, positions: np.ndarray) -> None:
        """The layer as two calls around attention on the pool's threads (native.attention, with
        HostBackend.attention's rule for when it takes threads), reading and writing the q and
        attention buffers at the start of work."""
        s, m = nat.struct, c.M
        size = m * s.H * s.Dh
        q = work[:size].reshape(m, s.H, s.Dh)
        attn = work[-(-size // 16) * 16 :][:size].reshape(m, s.H, s.Dh)
        c.stage = STAGE_BEFORE_ATTENTION
        self._native(nat, c)
        for (a, z), plane in zip(call.rows.seqs, call.planes):
            end = plane.held + z - a
            big = (z - a) * s.H * end * s.Dh >= PARALLEL_MIN_WORK
            attn[a:z] = native.attention(q[a:z], plane.keys[:end], plane.values[:end], positions[a:z],
                                         int(s.window), float(s.scale), big)
        c.stage = STAGE_AFTER_ATTENTION
        self._native(nat, c)


def decoder_layer(backend, call: LayerCall) -> tuple[np.ndarray, np.ndarray] | None:
    """HostBackend.decoder_layer: the layer in one native call, or None where compose_layer runs it."""
    state = call.layer.state
    layers = state.get("host")
    if layers is None:
        layers = state["host"] = HostLayers()
    return layers.run(backend, call)
