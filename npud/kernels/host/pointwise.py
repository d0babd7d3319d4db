"""The per-row kernels of the host library (pointwise.c says how each output is computed): RMS norm,
RoPE, SiLU- and GELU(tanh)-and-multiply, and the fused forms a decoder layer calls instead of two of them (the
residual add with the RMS norm after it; a head's RMS norm with its RoPE), which give the bits of
the composed calls and save one ctypes call and one pass over the rows each.

A decode step's call goes straight to the library; a prefill-sized one is split by whole rows over
attention's pool (native.on_threads), so no row's bits depend on the split. norm_rope and silu_mul
read rows lying any stride apart, so the column blocks of a fused projection's output (q, k; gate,
up) are read where they are, without a copy.
"""

from __future__ import annotations

import ctypes

import numpy as np

from npud.kernels.host import native
from npud.kernels.host.native import _addr, _weight_ptr

POINTWISE_PARALLEL_MIN = 1 << 18  # elements of a per-row call below which a second thread costs more than it saves
_rope_tables: dict[int, tuple] = {}  # id(inv_freq) -> (inv_freq, positions' bytes, their cosines and sines)
_bound: ctypes.CDLL | None = None

_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double


def _lib() -> ctypes.CDLL:
    """The library, with this module's functions' argument types declared (once)."""
    global _bound
    if _bound is None:
        lib = native.library()
        for name, args in (
            ("npud_rms_norm", [_I, _P, _L, _P, _D, _P, _L, _L]),
            ("npud_add_rms_norm", [_I, _P, _P, _L, _P, _D, _P, _P, _L, _L]),
            ("npud_rope_table", [_P, _P, _L, _P, _L, _L]),
            ("npud_rope", [_I, _P, _L, _L, _L, _P, _P, _L, _L]),
            ("npud_norm_rope", [_I, _P, _L, _L, _L, _P, _D, _L, _P, _P, _L, _L]),
            ("npud_silu_mul", [_I, _P, _L, _P, _L, _L, _P, _L, _L]),
            ("npud_gelu_tanh_mul", [_I, _P, _L, _P, _L, _L, _P, _L, _L]),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        _bound = lib
    return _bound


def _rows(fn, m: int, elements: int, parallel: bool, *args) -> None:
    """fn(*args, r0, r1) over rows 0..m-1: in one call, or (with `parallel` and enough elements) in
    blocks of whole rows that the caller and the pool's threads take from one queue; a row's bits
    depend on neither the block nor the thread."""
    n_threads = native.threads() if parallel and elements >= POINTWISE_PARALLEL_MIN else 1
    if n_threads == 1 or m < 2:  # a decode step's call: no more Python than the call itself
        fn(*args, 0, m)
        return
    blocks = min(m, 4 * n_threads)  # more blocks than threads: a thread on a busy core leaves its share
    native.on_threads(n_threads, [(m * b // blocks, m * (b + 1) // blocks) for b in range(blocks)],
                      lambda unit: fn(*args, *unit))


def row_stride(x: np.ndarray) -> int | None:
    """Floats between the rows of a float32 array whose rows are each contiguous (the column
    block of a wider matrix, say), or None when they are not."""
    shape, strides = x.shape, x.strides
    width = x.size // shape[0] if shape[0] else 0
    if x.flags.c_contiguous:  # a decode step's column block (one row) is
        return width
    inner = 4
    for i in range(x.ndim - 1, 0, -1):
        if shape[i] > 1 and strides[i] != inner:
            return None
        inner *= shape[i]
    return strides[0] // 4 if strides[0] >= inner and strides[0] % 4 == 0 else None


def _first(a: np.ndarray) -> int:
    """The address of a's first element where a's rows lie apart but each is contiguous: its first
    row's (numpy's a.ctypes.data, the way _addr takes for such an array, costs five times more)."""
    return _addr(a if a.flags.c_contiguous else a[0])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, parallel: bool) -> np.ndarray:
    """x [M, D] f32, weight [D] f32 -> [M, D] f32."""
    m, d = x.shape
    out = np.empty_like(x)
    _rows((_bound or _lib()).npud_rms_norm, m, x.size, parallel, native.isa_code(), _addr(x), d,
          _weight_ptr(weight), eps, _addr(out))
    return out


def add_rms_norm(x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float,
                 parallel: bool) -> tuple[np.ndarray, np.ndarray]:
    """x, delta [M, D] f32, weight [D] f32 -> (x + delta, rms_norm(x + delta)), each [M, D] f32."""
    m, d = x.shape
    both = np.empty((2, m, d), np.float32)  # one allocation and one address for the two outputs
    at = _addr(both)
    _rows((_bound or _lib()).npud_add_rms_norm, m, x.size, parallel, native.isa_code(), _addr(x), _addr(delta), d,
          _weight_ptr(weight), eps, at, at + x.nbytes)
    return both[0], both[1]


def _rope_table(positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """[M, 2 * half] cosines then sines of the rows' angles, computed once for every layer (and q
    and k) of a forward that passes these positions and this inv_freq array."""
    key = positions.tobytes()  # a bytes comparison: np.array_equal costs microseconds a call
    entry = _rope_tables.get(id(inv_freq))
    if entry is not None and entry[0] is inv_freq and entry[1] == key:
        return entry[2]
    m, half = positions.shape[0], inv_freq.shape[0]
    table = np.empty((m, 2 * half), np.float32)
    (_bound or _lib()).npud_rope_table(_addr(positions), _addr(inv_freq), half, _addr(table), 0, m)
    if len(_rope_tables) >= 8:  # models alive in this process rarely have more than two rotary tables
        _rope_tables.clear()
    _rope_tables[id(inv_freq)] = (inv_freq, key, table)  # holding inv_freq keeps its id
    return table


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, parallel: bool) -> np.ndarray:
    """x [M, H, Dh] f32, positions [M] int64, inv_freq [half] f32 (2 half <= Dh) -> [M, H, Dh] f32:
    pairs (i, i + half) rotated."""
    m, h, dh = x.shape
    half = inv_freq.shape[0]
    table = _rope_table(positions, inv_freq)
    out = np.empty_like(x)
    _rows((_bound or _lib()).npud_rope, m, x.size, parallel, native.isa_code(), _addr(x), h, dh, half,
          _addr(table), _addr(out))
    return out


def norm_rope(x: np.ndarray, ld: int, weight: np.ndarray, eps: float, positions: np.ndarray,
              inv_freq: np.ndarray, parallel: bool) -> np.ndarray:
    """x [M, H, Dh] f32 with contiguous rows `ld` floats apart, weight [Dh] f32, positions [M]
    int64, inv_freq [half] f32 -> rope(rms_norm(x) per head) [M, H, Dh] f32 (contiguous)."""
    m, h, dh = x.shape
    half = inv_freq.shape[0]
    table = _rope_table(positions, inv_freq)
    out = np.empty((m, h, dh), np.float32)
    _rows((_bound or _lib()).npud_norm_rope, m, out.size, parallel, native.isa_code(), _first(x), ld, h, dh,
          _weight_ptr(weight), eps, half, _addr(table), _addr(out))
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray, parallel: bool, ld_gate: int | None = None,
             ld_up: int | None = None) -> np.ndarray:
    """gate, up [M, F] f32 with contiguous rows ld_gate and ld_up floats apart (default F)
    -> silu(gate) * up [M, F] f32 (contiguous)."""
    return _act_mul((_bound or _lib()).npud_silu_mul, gate, up, parallel, ld_gate, ld_up)


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray, parallel: bool, ld_gate: int | None = None,
                  ld_up: int | None = None) -> np.ndarray:
    """As silu_mul, with gelu_tanh (torch's gelu(approximate="tanh")) in place of silu."""
    return _act_mul((_bound or _lib()).npud_gelu_tanh_mul, gate, up, parallel, ld_gate, ld_up)


def _act_mul(fn, gate: np.ndarray, up: np.ndarray, parallel: bool, ld_gate: int | None,
             ld_up: int | None) -> np.ndarray:
    m, f = gate.shape
    out = np.empty((m, f), np.float32)
    _rows(fn, m, out.size, parallel, native.isa_code(), _first(gate), f if ld_gate is None else ld_gate,
          _first(up), f if ld_up is None else ld_up, f, _addr(out))
    return out
