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
k_eq_v, per-layer inputs and layer scalar, and a weight in a layout without a native description.
A prefill chunk runs as one call too: its per-row kernels and a sequence's attention, where the
path splits them over threads (ROWS_PARALLEL_MIN, below the per-op path's threshold, and
native.PARALLEL_MIN_WORK, read at each call), go to the GEMM pool's threads inside the call in the same units (whole rows;
whole rows of whole kv heads), so the bits do not depend on the split, and the pool's workers,
busy from one GEMM to the next, do not fall asleep between them.

A stalled GEMM worker (pool.c, native._call) may read a layer's weights after the call returns:
the call goes through native._call with every weight array of the layer, so they are kept until
no worker reads them. No worker reads the call's scratch after the call: a GEMM job holds its own
copy of the activations, a worker whose chunk was taken back writes nothing, and the call waits for
every per-row or attention unit a worker runs (pool.c's pool_for).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from npud.kernels.base import LayerCall, LinearWeight, StackCall, WeightFormat
from npud.kernels.host import native, pointwise
from npud.kernels.host.formats import PARALLEL_MIN_BYTES, kernel_for

LIN_FLOAT, LIN_Q8, LIN_BD, LIN_QT, LIN_BQ8 = range(5)  # layer.c's LIN_*: which GEMM entry multiplies a weight
ACT = {"silu": 0, "gelu_tanh": 1}

# a per-row kernel's elements from which a layer call splits it over the threads: below
# pointwise.POINTWISE_PARALLEL_MIN (the per-op path's, whose split goes through Python's pool),
# as the GEMM pool's workers, held awake through the call, take a unit in microseconds
ROWS_PARALLEL_MIN = 1 << 16
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

    _fields_ = ([(name, _L) for name in ("isa", "threads", "rows_min", "attn_min", "M", "nseq")]
                + [(name, _P) for name in ("x", "delta", "pos", "cs", "seq", "held", "keys", "values", "x_out",
                                           "delta_out", "work")])


def _bind() -> ctypes.CDLL:
    lib = native.library()
    if lib.npud_decoder_layer.restype is not _L:
        lib.npud_decoder_layer.argtypes = [_P, _P]
        lib.npud_decoder_layer.restype = _L
        lib.npud_decoder_layers.argtypes = [_P, _P, _L]
        lib.npud_decoder_layers.restype = _L
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
    """One layer's layer.c description and the arrays it points into."""

    struct: Layer
    keep: tuple  # every weight array the call reads: kept while a stalled worker may read them
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
    return _Native(s, tuple(keep), {})


class HostLayers:
    """A model's layers as layer.c runs them, and the buffers their calls share (one per model:
    DecoderLayer.state["host"]): the scratch, the outputs a stack's layers pass on to the next,
    the call structs. One round at a time uses them; a round on another thread meanwhile makes its own."""

    def __init__(self):
        self.layers: dict[int, _Native | None] = {}
        self.work = np.empty(0, np.float32)  # the layers' scratch (layer.c's layout)
        self.between = np.empty(0, np.float32)  # [2, 2, M, D]: (x, delta) of a stack's layers, alternately
        self.calls: dict[int, ctypes.Array] = {}  # n -> n Call structs
        self.lock = threading.Lock()
        self._stacks: dict[tuple[int, ...], tuple] = {}  # layer indices -> (struct pointers, weight arrays)
        self._round: tuple = (None,)

    def native(self, backend, layer) -> _Native | None:
        nat = self.layers.get(layer.index, False)
        if nat is False:
            nat = self.layers[layer.index] = native_layer(backend, layer)
        return nat

    def _round_arrays(self, rows) -> tuple:
        """Per round (once): the positions, the sequences' bounds [nseq + 1], each sequence's lowest
        and highest position, and a RoPE table per inv_freq array (pointwise._rope_table's)."""
        if self._round[0] is not rows:
            ends = [0] + [z for _, z in rows.seqs]
            if not rows.seqs or any(a != ends[i] or z < a for i, (a, z) in enumerate(rows.seqs)):
                raise ValueError(f"decoder layers: sequences {rows.seqs} are not rows 0.. in order, each after the last")
            positions = np.ascontiguousarray(rows.positions, dtype=np.int64)
            bounds = np.asarray([a for a, _ in rows.seqs] + [rows.seqs[-1][1]], dtype=np.int64)
            spans = [(int(positions[a:z].min()), int(positions[a:z].max())) if z > a else (0, -1)
                     for a, z in rows.seqs]
            self._round = (rows, positions, bounds, spans, {})
        return self._round[1:]

    def _stack(self, layers, nats) -> tuple:
        key = tuple(layer.index for layer in layers)
        entry = self._stacks.get(key)
        if entry is None:
            pointers = (_P * len(nats))(*[ctypes.addressof(nat.struct) for nat in nats])
            keep = tuple(a for nat in nats for a in nat.keep)
            entry = self._stacks[key] = (pointers, keep)
        return entry

    def run(self, backend, layers: tuple, rows, x: np.ndarray, delta: np.ndarray | None,
            planes: tuple) -> tuple[np.ndarray, np.ndarray] | None:
        """layers (each with its planes) over the round's rows in one native call, x + delta the
        first one's input; returns the last one's (x, delta), or None where layer.py's module
        docstring leaves them to compose_layer."""
        nats = [self.native(backend, layer) for layer in layers]
        if None in nats:
            return None
        first = nats[0].struct
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, d = x.shape[0], first.D
        positions, bounds, spans, tables = self._round_arrays(rows)
        if (x.ndim != 2 or x.shape[1] != d or positions.shape != (m,) or bounds[-1] != m
                or any(nat.struct.D != d for nat in nats) or any(len(p) != len(rows.seqs) for p in planes)):
            raise ValueError(f"decoder layers: x {x.shape}, positions {positions.shape} and planes for "
                             f"{[len(p) for p in planes]} of {len(rows.seqs)} sequences do not fit the layers")
        if delta is not None:
            delta = np.ascontiguousarray(delta, dtype=np.float32)
            if delta.shape != x.shape:
                raise ValueError(f"decoder layers: delta {delta.shape} does not fit x {x.shape}")
        threads = native.threads() if backend.parallel else 1
        for layer, nat, mine in zip(layers, nats, planes):
            s = nat.struct
            kv_shape = (s.KVH, s.Dh)
            for (a, z), plane, (lo, hi) in zip(rows.seqs, mine, spans):
                end = plane.held + z - a
                for arr in (plane.keys, plane.values):
                    if (arr.dtype != np.float32 or not arr.flags.c_contiguous or not arr.flags.writeable
                            or arr.shape[1:] != kv_shape or arr.shape[0] < end or plane.held < 0):
                        raise ValueError(f"decoder layers: layer {layer.index}'s plane {arr.dtype} {arr.shape} "
                                         f"cannot hold rows {plane.held}..{end - 1} of {kv_shape}")
                if lo < 0 or hi >= end:
                    raise ValueError(f"attention: positions must lie in 0..{end - 1} (the keys in the cache)")
        n, nseq = len(layers), len(rows.seqs)
        # per layer: each sequence's keys and values addresses and positions held
        where = np.asarray([[[native._addr(p.keys) for p in mine], [native._addr(p.values) for p in mine],
                             [p.held for p in mine]] for mine in planes], dtype=np.int64)
        need = 0
        for nat in nats:
            floats = nat.scratch.get(m)
            if floats is None:
                floats = nat.scratch[m] = _bind().npud_layer_scratch(ctypes.addressof(nat.struct), m)
            need = max(need, floats)
        out = np.empty((2, m, d), np.float32)  # the last layer's x and delta
        owned = self.lock.acquire(blocking=False)
        try:
            if owned:
                if self.work.shape[0] < need:
                    self.work = np.empty(need, np.float32)
                if n > 1 and self.between.shape[0] < 4 * m * d:
                    self.between = np.empty(4 * m * d, np.float32)
                work, between = self.work, self.between
                calls = self.calls.get(n)
                if calls is None:
                    calls = self.calls[n] = (Call * n)()
            else:  # another thread's round is in the shared buffers
                work, between, calls = np.empty(need, np.float32), np.empty(4 * m * d, np.float32), (Call * n)()
            isa, at, ptrs = native.isa_code(), native._addr(out), native._addr(where)
            step, plane_step = m * d * 4, nseq * 8
            w_at, b_at, x_at = native._addr(work), native._addr(between) if n > 1 else 0, native._addr(x)
            d_at = 0 if delta is None else native._addr(delta)
            for i, (layer, c) in enumerate(zip(layers, calls)):
                inv_freq = layer.inv_freq
                table = tables.get(id(inv_freq))
                if table is None:  # the table the per-op path's RoPE calls use, kept for the round
                    table = tables[id(inv_freq)] = pointwise._rope_table(
                        positions, np.ascontiguousarray(inv_freq, dtype=np.float32))
                c.isa, c.threads, c.M, c.nseq = isa, threads, m, nseq
                # read at each call, so that tests can lower them
                c.rows_min, c.attn_min = ROWS_PARALLEL_MIN, native.PARALLEL_MIN_WORK
                c.pos, c.cs, c.seq, c.work = native._addr(positions), native._addr(table), native._addr(bounds), w_at
                c.keys, c.values, c.held = ptrs + 3 * i * plane_step, ptrs + (3 * i + 1) * plane_step, \
                    ptrs + (3 * i + 2) * plane_step
                c.x, c.delta = x_at, d_at
                if i + 1 < n:  # into one of the two (x, delta) pairs between layers
                    x_at = c.x_out = b_at + (i % 2) * 2 * step
                    d_at = c.delta_out = x_at + step
                else:
                    c.x_out, c.delta_out = at, at + step
            stack = self._stack(layers, nats)
            status = native._call(_bind().npud_decoder_layers, stack[1], stack[0], ctypes.addressof(calls), n)
            _check(status, m)
        finally:
            if owned:
                self.lock.release()
        return out[0], out[1]


def _check(status: int, m: int) -> None:
    if status == -2:
        raise ValueError("decoder layers: a weight's q tiles are of no width the kernels know")
    if status < 0:
        raise MemoryError(f"no memory for a GEMM's or attention's scratch in a layer of {m} rows")


def _layers_of(call) -> HostLayers:
    state = call.layers[0].state if hasattr(call, "layers") else call.layer.state
    layers = state.get("host")
    if layers is None:
        layers = state["host"] = HostLayers()
    return layers


def decoder_layer(backend, call: LayerCall) -> tuple[np.ndarray, np.ndarray] | None:
    """HostBackend.decoder_layer: the layer in one native call, or None where compose_layer runs it."""
    if call.per_layer is not None:
        return None
    return _layers_of(call).run(backend, (call.layer,), call.rows, call.x, call.delta, (call.planes,))


def decoder_stack(backend, call: StackCall) -> tuple[np.ndarray, np.ndarray] | None:
    """HostBackend.decoder_stack: the layers in one native call, or None to run them a layer at a time."""
    if not call.layers:
        return None
    return _layers_of(call).run(backend, call.layers, call.rows, call.x, call.delta, call.planes)
