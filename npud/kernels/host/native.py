"""The host GEMM and attention kernels: a small C library, compiled once per machine with gcc, called
through ctypes.

Why C rather than numba: the contract needs exact control of each output element's chain of
operations (an explicit FMA per k, in k order, never reassociated), and speed needs control
of the registers (a block of rows x 64 columns held in zmm registers for the whole k loop,
each weight vector widened once per k for all rows; on the q8 path the int32 block sums),
of prefetch, and of VNNI's vpdpbusd and AVX512_BF16's vdpbf16ps.
Intrinsics give all of that directly; and a shared object compiled once and kept in the
cache directory costs nothing at start-up, where numba recompiled the closure kernels at
every start (issue 19). The library picks its path at run time from cpuid: AVX-512 (+VNNI, +BF16),
AVX2+FMA (the generic C built for it), or the generic C that every x86-64 runs. Every path
computes the same chain per element (the generic one with fmaf), so they give the same bits,
which tests/test_kernels.py checks. gemm.c says how each element is computed.

Threads: a persistent pool inside the library (workers spin briefly, then sleep). A call's
output tiles go in small chunks that every thread, the caller included, takes from one
counter; the caller takes back the chunks of a worker that stalls (on a shared machine its
core may be busy with someone else) instead of waiting a scheduler time slice for it. A
chunk is whole tiles, k is never split, so the bits do not depend on who computed what.
A worker the scheduler woke on the caller's CPU (where it could only take turns with the
caller) moves to the other CPUs. A worker whose chunk was taken back may go on reading the
weights after the call returns, so `_call` keeps the arrays of such calls alive until the
library says no worker reads them. ctypes releases the GIL for the call.

Attention (attention.c says how each output is computed) runs in the same library: one kernel
for a decode step, a verify and a prefill chunk, so their rows agree by construction. Its threads
are a persistent Python pool calling the nogil function on whole kv heads or whole rows (not
pool.c, which divides GEMM tiles).

The per-row kernels (RMS norm, RoPE, SiLU-and-multiply and their fused forms: pointwise.c says
how) are in the library too; their wrappers are in pointwise.py, which shares attention's pool.

Build: on first use, or ahead of time with `python -m npud.kernels.host` (tools/test.sh and
tools/demo.sh do so after installing). The shared object is named by a digest of the sources
and flags, in cache_dir(); a build writes a temporary file and renames it, so concurrent
starts are safe. Before it is loaded its bytes are checked against the manifest written at
build (npud/kernels/host/cache.py), and rebuilt when they do not match.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import structlog

from npud.kernels.host.cache import (BuildError, Library, cache_dir, compile_library,  # noqa: F401  (BuildError: native.BuildError)
                                     private_dir)

log = structlog.get_logger(__name__)

TILE = 64  # output columns per weight tile (gemm.c's TILE)
QB = 32  # activation quantization block (gemm.c's QB)
ISA_NAMES = ("generic", "avx2", "avx512", "avx512-vnni", "avx512-bf16")  # each has the ones before it
FMT_F32, FMT_BF16, FMT_I8, FMT_Q8 = 0, 1, 2, 3
FMT_Q16 = 7  # int8-q16: the q8 kernels on 16-bit activation blocks held as byte pairs (gemm.h)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemm.c", "q8pairs.c", "bf16dot.c", "blockgemm.c", "blockq8.c", "pool.c", "attention.c",
                             "pointwise.c", "layer.c"))
# the library's name covers them too: gemm.h (what the GEMM sources share), vexp.h (the exponential
# attention.c and pointwise.c share), entries.h (the entries layer.c calls, checked against their definitions)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("gemm.h", "vexp.h", "entries.h"))
# -ffp-contract=off: the only FMAs are the explicit ones; no -ffast-math: no reassociation
CFLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-std=gnu11")

_lock = threading.Lock()
_call_lock = threading.Lock()  # a call and the bookkeeping of what a stalled worker still reads
_held: list = []  # arrays of finished calls a stalled worker may still read (pool.c)
_lib: ctypes.CDLL | None = None
_lib_sha256 = ""  # of the loaded library's bytes: the self-check's pass is stored under it
_threads = 0
_isa_in_use = ""

_P = ctypes.c_void_p
_L = ctypes.c_long
_I = ctypes.c_int


def library_path(directory: Path | None = None) -> Path:
    """Where the shared object for this source and these flags lives."""
    sources = b"".join(src.name.encode() + src.read_bytes() for src in SOURCES + HEADERS)
    digest = hashlib.sha256(sources + " ".join(CFLAGS).encode() + platform.machine().encode())
    return (directory or cache_dir()) / f"npud_gemm-{digest.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Compile SOURCES into the cache directory unless a library that matches its manifest is
    there; returns the shared object's path.

    Raises BuildError when gcc is missing or fails, OSError when the directory is not writable.
    """
    return _build(directory).path


def _build(directory: Path | None) -> Library:
    built = compile_library(library_path(directory), list(SOURCES), CFLAGS, "the host kernels", libs=("-lm",))
    if built.built:
        log.info("host_kernels_built", path=str(built.path))
    return built


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use, checked against its manifest before)."""
    global _lib, _isa_in_use, _lib_sha256
    with _lock:
        if _lib is None:
            try:
                built = _build(None)
            except OSError as e:  # an unwritable cache directory: build into this process's own
                log.warning("kernel_cache_unwritable", dir=str(cache_dir()), error=str(e))
                built = _build(private_dir())
            lib = ctypes.CDLL(str(built.path))
            lib.npud_isa_best.restype = _I
            lib.npud_set_isa.argtypes = [_I]
            lib.npud_set_isa.restype = _I
            lib.npud_gemm.argtypes = [_I, _P, _L, _L, _P, _L, _L, _P, _P, _P, _I]
            lib.npud_gemm.restype = _L
            lib.npud_linear_q8.argtypes = [_I, _P, _L, _L, _L, _P, _L, _L, _P, _P, _P, _I]
            lib.npud_linear_q8.restype = _L
            lib.npud_linear_bd.argtypes = [_P, _L, _L, _L, _P, _L, _L, _P, _P, _P, _I]
            lib.npud_linear_bd.restype = _L
            lib.npud_linear_qtiles.argtypes = [_P, _L, _L, _P, _P, _L, _L, _I, _I, _I, _L, _L, _P, _P, _I]
            lib.npud_linear_qtiles.restype = _L
            lib.npud_linear_bq8.argtypes = [_P, _L, _L, _P, _P, _L, _L, _I, _I, _I, _L, _L, _P, _P, _I]
            lib.npud_linear_bq8.restype = _L
            if hasattr(lib, "npud_bq8_stream_min"):  # (bench/kernels_ab.py loads older revisions' kernels too)
                lib.npud_bq8_stream_min.argtypes = [_L]
                lib.npud_bq8_stream_min.restype = _L
            lib.npud_gather_qtiles.argtypes = [_P, _P, _L, _L, _L, _I, _I, _I, _P, _L, _P]
            lib.npud_gather_qtiles.restype = None
            lib.npud_round_bf16.argtypes = [_P, _L, _L, _L, _P]
            lib.npud_round_bf16.restype = None
            lib.npud_bf16dot_hardware.argtypes = [_I]
            lib.npud_bf16dot_hardware.restype = _I
            lib.npud_pool_held.restype = _L
            lib.npud_pool_stats.argtypes = [_P]
            lib.npud_pool_stats.restype = None
            lib.npud_pool_for_stats.argtypes = [_P]
            lib.npud_pool_for_stats.restype = None
            lib.npud_pool_stall.argtypes = [_L]
            lib.npud_pool_stall.restype = None
            lib.npud_gemm_clock.argtypes = [_P]
            lib.npud_gemm_clock.restype = None
            lib.npud_quantize_q8.argtypes = [_P, _L, _L, _L, _P, _P, _P]
            lib.npud_quantize_q8.restype = None
            lib.npud_quantize_q8_pairs.argtypes = [_P, _L, _L, _L, _P, _P, _P]
            lib.npud_quantize_q8_pairs.restype = None
            lib.npud_embed.argtypes = [_I, _P, _L, _L, _P, _L, _P, _P]
            lib.npud_embed.restype = None
            lib.npud_attention.argtypes = [_I, _P, _L, _L, _L, _P, _P, _L, _L, _P, _L, ctypes.c_float, _P,
                                           _L, _L, _L, _L]
            lib.npud_attention.restype = _L
            lib.npud_attention_exp.argtypes = [_I, _P, _L, _P]
            lib.npud_attention_exp.restype = None
            wanted = os.environ.get("NPUD_HOST_ISA", "")  # tests and benchmarks: force a slower path
            _isa_in_use = ISA_NAMES[lib.npud_set_isa(ISA_NAMES.index(wanted) if wanted in ISA_NAMES else -1)]
            _lib_sha256 = built.sha256
            _lib = lib
        return _lib


def library_sha256() -> str:
    """The sha256 of the loaded library's bytes (loaded on first use)."""
    library()
    return _lib_sha256


def best_isa() -> str:
    """The fastest path this CPU can run."""
    return ISA_NAMES[library().npud_isa_best()]


def set_isa(name: str | None) -> str:
    """Use path `name` (None: the best; a path the CPU lacks falls back to the best); returns the one in use."""
    global _isa_in_use
    if name is not None and name not in ISA_NAMES:
        raise ValueError(f"unknown kernel path {name!r}; expected one of {ISA_NAMES}")
    _isa_in_use = ISA_NAMES[library().npud_set_isa(-1 if name is None else ISA_NAMES.index(name))]
    return _isa_in_use


def isa() -> str:
    """The path in use."""
    library()
    return _isa_in_use


def isa_code() -> int:
    """The path in use as the library's ISA_* number (what the per-call kernels take)."""
    return ISA_NAMES.index(_isa_in_use if _lib is not None else isa())


def threads() -> int:
    """Threads a GEMM splits its output columns across (NPUD_HOST_THREADS, else the CPUs this process may use)."""
    global _threads
    if _threads == 0:
        env = os.environ.get("NPUD_HOST_THREADS", "")
        _threads = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return _threads


def set_threads(n: int) -> None:
    """Use n threads from the next call on, 0 for the default (NPUD_HOST_THREADS, else the
    CPUs this process may use); the bits do not depend on it."""
    global _threads
    if n < 0:
        raise ValueError(f"threads must be >= 0, got {n}")
    _threads = n


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


_byte_at = ctypes.c_char.from_buffer
_address_of = ctypes.addressof


def _addr(a: np.ndarray) -> int:
    """The data address of a C-contiguous array: a third of the cost of a.ctypes.data (which
    builds a ctypes helper object), paid on each activation and output of every per-layer call.
    The buffer protocol hands out the same address; an array it refuses (read-only, empty, or
    not C-contiguous) takes numpy's way."""
    try:
        return _address_of(_byte_at(a))
    except (TypeError, ValueError):
        return a.ctypes.data


_addresses: dict[int, int] = {}  # id(weight array) -> its data address, while the array lives


def _weight_ptr(a: np.ndarray | None) -> int | None:
    """The data address of a weight array (weights, scales, biases live as long as the model),
    remembered until the array is freed: numpy's a.ctypes.data costs over a microsecond, and a
    one-row GEMM of a small layer pays it for three arrays."""
    if a is None:
        return None
    key = id(a)
    address = _addresses.get(key)
    if address is None:
        address = _addresses[key] = a.ctypes.data
        weakref.finalize(a, _addresses.pop, key, None)  # before the id can name another array
    return address


def _call(fn, arrays: tuple, *args) -> int:
    """fn(*args) under the call lock; keeps `arrays` alive while a stalled worker may read them."""
    with _call_lock:
        held = fn(*args)
        if held > 0:
            _held.append(arrays)
        elif held == 0:
            _held.clear()  # no worker reads any finished call's arrays now
        return held


POOL_TRACE = ("calls", "joined", "wake_ns", "slept", "caller_chunks", "call_ns", "own_ns", "wait_ns")


def _pool_counters() -> tuple[int, ...]:
    stats = (ctypes.c_long * (4 + len(POOL_TRACE)))()
    library().npud_pool_stats(stats)
    return tuple(stats)


def pool_stats() -> tuple[int, int, int, int]:
    """So far: (chunks the pool's workers delivered, chunks the caller took back from a stalled
    worker, times a worker moved off the caller's CPU, chunks of the calls that went to the pool)."""
    return _pool_counters()[:4]


def pool_trace() -> dict[str, int]:
    """So far, over the calls that went to the pool (pool.c's trace): `calls`; `joined`, those a
    worker saw while the caller still ran, and `wake_ns`, their nanoseconds from the call's start
    to that; `slept`, the workers' wakes from sleep rather than a spin; `caller_chunks`, the chunks
    the caller computed, and `worker_chunks`, those the workers delivered; the caller's nanoseconds
    in whole calls (`call_ns`), in its own chunks (`own_ns`) and waiting for or taking back the
    chunks workers held (`wait_ns`)."""
    counters = _pool_counters()
    return dict(zip(POOL_TRACE, counters[4:]), worker_chunks=counters[0])


def pool_for_stats() -> tuple[int, int, int]:
    """So far: (a layer call's per-row and attention splits that went to the pool (pool.c's pool_for),
    their units, the units the pool's workers ran)."""
    counts = (ctypes.c_long * 3)()
    library().npud_pool_for_stats(counts)
    return counts[0], counts[1], counts[2]


def gemm_clock() -> tuple[int, int]:
    """So far: (GEMM calls, their nanoseconds, each from its entry's start to its return), in this
    process, whether Python or a layer call (layer.c) made them: a profile's GEMM time."""
    clock = (ctypes.c_long * 2)()
    library().npud_gemm_clock(clock)
    return clock[0], clock[1]


def stall_workers(microseconds: int) -> None:
    """Tests: make every worker sleep this long on each chunk it takes (0: stop), as a descheduled one."""
    library().npud_pool_stall(microseconds)


def held_calls() -> int:
    """Finished calls whose weights a stalled worker may still read (their arrays are kept until then)."""
    with _call_lock:
        held = library().npud_pool_held()
        if held == 0:
            _held.clear()
        return held


def gemm(fmt: int, x: np.ndarray, w: np.ndarray, n: int, scale: np.ndarray | None, bias: np.ndarray | None,
         parallel: bool) -> np.ndarray:
    """x: [M, K] f32, w: tiles [T, K, TILE] -> [M, T * TILE] f32 (columns >= n are padding).

    Raises MemoryError when the transposed copy of x cannot be allocated."""
    m, k = x.shape
    tiles = w.shape[0]
    out = np.empty((m, tiles * TILE), np.float32)
    if _call((_lib or library()).npud_gemm, (w, scale, bias), fmt, _addr(x), m, k, _weight_ptr(w), tiles, n,
             _weight_ptr(scale), _weight_ptr(bias), _addr(out), threads() if parallel else 1) < 0:
        raise MemoryError(f"no memory for a transposed copy of a [{m}, {k}] activation")
    return out


def linear_q8(x: np.ndarray, w: np.ndarray, n: int, scale: np.ndarray, bias: np.ndarray | None,
              parallel: bool, pairs: bool = False) -> np.ndarray:
    """x: [M, K] f32 quantized per row in blocks of QB (quantize_q8, or quantize_q8_pairs when `pairs`:
    int8-q16), w: [T, Kp / 4, TILE, 4] uint8 (int8 + 128)
    -> [M, T * TILE] f32. Raises MemoryError when the row buffer cannot be allocated."""
    m, k = x.shape
    tiles, kp = w.shape[0], w.shape[1] * 4
    out = np.empty((m, tiles * TILE), np.float32)
    if _call((_lib or library()).npud_linear_q8, (w, scale, bias), FMT_Q16 if pairs else FMT_Q8, _addr(x), m, k, kp,
             _weight_ptr(w), tiles, n, _weight_ptr(scale), _weight_ptr(bias), _addr(out),
             threads() if parallel else 1) < 0:
        raise MemoryError(f"no memory for the q8 rows of a [{m}, {kp}] activation")
    return out


def quantize_q8(x: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q8 blocks linear_q8 makes of x [M, K] f32 (zero-padded to kp): int8 [M, kp], per-block
    scales d and integer sums [M, kp / QB] (on the path in use; every path gives the same)."""
    m, k = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    xq = np.empty((m, kp), np.int8)
    xs = np.empty((m, kp // QB), np.float32)
    xsum = np.empty((m, kp // QB), np.int32)
    library().npud_quantize_q8(x.ctypes.data, m, k, kp, xq.ctypes.data, xs.ctypes.data, xsum.ctypes.data)
    return xq, xs, xsum


def quantize_q8_pairs(x: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows linear_q8 makes of x [M, K] f32 (zero-padded to kp; q8pairs.c): int8 [M, 2 kp]
    (each block's hi bytes, then its lo bytes: Q = 254 hi + lo), per-block scales d and sums of
    Q [M, kp / QB] (on the path in use; every path gives the same)."""
    m, k = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    xq = np.empty((m, 2 * kp), np.int8)
    xs = np.empty((m, kp // QB), np.float32)
    xsum = np.empty((m, kp // QB), np.int32)
    library().npud_quantize_q8_pairs(x.ctypes.data, m, k, kp, xq.ctypes.data, xs.ctypes.data, xsum.ctypes.data)
    return xq, xs, xsum


def linear_bf16_dot(x: np.ndarray, w: np.ndarray, n: int, bias: np.ndarray | None, parallel: bool) -> np.ndarray:
    """x: [M, K] f32 rounded per row to bf16, w: [T, Kp / 2, TILE] uint32 bf16 k-pairs
    -> [M, T * TILE] f32. Raises MemoryError when the row buffer cannot be allocated."""
    m, k = x.shape
    tiles, kp = w.shape[0], w.shape[1] * 2
    out = np.empty((m, tiles * TILE), np.float32)
    if _call((_lib or library()).npud_linear_bd, (w, bias), _addr(x), m, k, kp, _weight_ptr(w), tiles, n, None,
             _weight_ptr(bias), _addr(out), threads() if parallel else 1) < 0:
        raise MemoryError(f"no memory for the bf16 rows of a [{m}, {kp}] activation")
    return out


QT_ROW_BITS = {64: 8, 32: 4, 40: 5}  # blockgemm.c: bytes of a q tile's k row -> bits a weight


def linear_qtiles(x: np.ndarray, q: np.ndarray, f: np.ndarray, n: int, bias: np.ndarray | None,
                  parallel: bool, zero: int = 0) -> np.ndarray:
    """x: [M, K] f32, GGML block weights as q tiles [T, K, TILE] int8, or packed [T, K, 32 | 40]
    uint8 (q + zero in 4 / 5 bits: npud/kernels/ggml/nibbles.py), and factor tiles [T, K / g, P, TILE]
    f32 or f16 (blockgemm.c) -> [M, T * TILE] f32. Raises MemoryError as gemm, ValueError for q
    tiles of another row width."""
    m, k = x.shape
    tiles = q.shape[0]
    out = np.empty((m, tiles * TILE), np.float32)
    qbits = QT_ROW_BITS.get(q.shape[2], 0)
    status = _call((_lib or library()).npud_linear_qtiles, (q, f, bias), _addr(x), m, k, _weight_ptr(q),
                   _weight_ptr(f), k // f.shape[1], f.shape[2], int(f.dtype == np.float16), qbits, zero, tiles, n,
                   _weight_ptr(bias), _addr(out), threads() if parallel else 1)
    if status == -2:
        raise ValueError(f"q tiles of {q.shape[2]} bytes a k row: expected one of {sorted(QT_ROW_BITS)}")
    if status < 0:
        raise MemoryError(f"no memory for a transposed copy of a [{m}, {k}] activation")
    return out


def linear_bq8(x: np.ndarray, q: np.ndarray, f: np.ndarray, n: int, bias: np.ndarray | None,
               parallel: bool, zero: int = 128) -> np.ndarray:
    """x: [M, K] f32 quantized per row in q8 blocks, GGML block weights as q tiles [T, K / 4, TILE, 4]
    uint8 (q + 128) or packed [T, K / 32, 1024 | 1280] (q + zero: npud/kernels/ggml/nibbles.py) and factor tiles [T, K / g, P, TILE] f32, or f16 for P = 1 and g = 32
    (blockq8.c) -> [M, T * TILE] f32. Raises MemoryError when the row buffer cannot be allocated,
    ValueError for f16 factors of another shape."""
    m, k = x.shape
    tiles = q.shape[0]
    out = np.empty((m, tiles * TILE), np.float32)
    half = f.dtype == np.float16
    qbits = 8 if q.ndim == 4 else {1024: 4, 1280: 5}.get(q.shape[2], 0)  # packed Q4_0 / Q5_0 tiles
    status = _call((_lib or library()).npud_linear_bq8, (q, f, bias), _addr(x), m, k, _weight_ptr(q), _weight_ptr(f),
                   k // f.shape[1], f.shape[2], int(half), qbits, zero, tiles, n, _weight_ptr(bias), _addr(out),
                   threads() if parallel else 1)
    if status == -2:
        raise ValueError(f"float16 factor tiles need one factor per 32 weights (packed q tiles: groups of 32, "
                         f"float16 factors for one a group), not factors {f.shape[1:3]} {f.dtype} with q tiles {q.shape[1:]}")
    if status < 0:
        raise MemoryError(f"no memory for the q8 rows of a [{m}, {k}] activation")
    return out


def bq8_stream_min(nbytes: int | None = None) -> int:
    """The q-byte size from which linear_bq8 runs several row blocks interleaved per weight group
    (blockq8.c's bq_vnni_multi, VNNI path) rather than in k chunks; sets it when nbytes is given
    (tests: 0 takes that path for every weight). Returns the value before. The bits are the same."""
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"a size in bytes, not {nbytes}")
    return int(library().npud_bq8_stream_min(-1 if nbytes is None else nbytes))


def gather_qtiles(q: np.ndarray, f: np.ndarray, tokens: np.ndarray, zero: int = 0) -> np.ndarray:
    """Rows `tokens` [M] (int64, in range) of a block table in linear_qtiles' tiles, widened -> [M, K] f32."""
    k = q.shape[1]
    out = np.empty((tokens.shape[0], k), np.float32)
    qbits = QT_ROW_BITS[q.shape[2]]
    library().npud_gather_qtiles(q.ctypes.data, f.ctypes.data, k, k // f.shape[1], f.shape[2],
                                 int(f.dtype == np.float16), qbits, zero, tokens.ctypes.data, tokens.shape[0],
                                 out.ctypes.data)
    return out


def round_bf16(x: np.ndarray, kp: int | None = None) -> np.ndarray:
    """x: [M, K] f32 -> the bf16 bits [M, kp] (zero-padded) the bf16-dot GEMM multiplies (bf16dot.c says how)."""
    m, k = x.shape
    out = np.empty((m, k if kp is None else kp), np.uint16)
    library().npud_round_bf16(x.ctypes.data, m, k, out.shape[1], out.ctypes.data)
    return out


def bf16_dot_hardware(on: bool | None = None) -> bool:
    """Let the bf16-dot GEMM use vdpbf16ps (True), or only its emulation (False); None: ask.
    Returns whether the path in use runs the instruction (the bits are the same either way
    unless the self-check found otherwise, which then turns it off)."""
    return bool(library().npud_bf16dot_hardware(-1 if on is None else int(on)))


def embed(fmt: int, w: np.ndarray, k: int, d: int, tokens: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """Rows `tokens` [M] (int64, in range) of a tiled table with k stored columns -> [M, d] f32."""
    out = np.empty((tokens.shape[0], d), np.float32)
    library().npud_embed(fmt, w.ctypes.data, k, d, tokens.ctypes.data, tokens.shape[0], _ptr(scale), out.ctypes.data)
    return out


PARALLEL_MIN_WORK = 1 << 21  # attention elements below which waking a second thread costs more than it saves
ATTENTION_UNIT_WORK = 1 << 22  # rows x heads x keys x head size a threaded unit has at least (~0.2 ms)
_pool: ThreadPoolExecutor | None = None  # attention's and the per-row kernels' threads (the GEMMs have pool.c)
_pool_size = 0


def on_threads(n_threads: int, units, call) -> bool:
    """call(unit) for every unit, on n_threads threads (the caller's and n_threads - 1 of the
    persistent pool's), each taking the next unit from one shared queue; a call returning False
    ends that thread's share. Returns whether no call returned False."""
    global _pool, _pool_size
    with _lock:
        if _pool_size < n_threads - 1:  # the pool only grows (set_threads may raise the count)
            _pool = ThreadPoolExecutor(n_threads - 1, thread_name_prefix="npud-rows")
            _pool_size = n_threads - 1
    queue = iter(units)
    take = threading.Lock()

    def run() -> bool:
        while True:
            with take:
                unit = next(queue, None)
            if unit is None:
                return True
            if call(unit) is False:
                return False

    helpers = [_pool.submit(run) for _ in range(n_threads - 1)]
    ok = run()
    return all([f.result() for f in helpers]) and ok


def _attention_units(m: int, kv_heads: int, n_threads: int, work: int) -> list[tuple[int, int, int, int]]:
    """(first kv head, end kv head, first row, end row) units: whole rows of whole heads, so a thread
    computes every output it touches whole. One a thread for a small call (each unit is a ctypes
    call and a hand-over between Python threads); up to eight a thread for a large one, so that a
    thread whose core is busy with another process leaves its share to the others."""
    if n_threads == 1:
        return [(0, kv_heads, 0, m)]
    want = max(n_threads, min(8 * n_threads, work // ATTENTION_UNIT_WORK))
    if kv_heads % want == 0:
        return [(kv_heads * i // want, kv_heads * (i + 1) // want, 0, m) for i in range(want)]
    blocks = max(1, min(m, -(-want // kv_heads)))
    return [(h, h + 1, m * b // blocks, m * (b + 1) // blocks) for h in range(kv_heads) for b in range(blocks)]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, window: int, scale: float,
              parallel: bool) -> np.ndarray:
    """q [M, H, Dh], k/v [T, KVH, Dh] f32, positions [M] int64 in 0..T-1 -> [M, H, Dh] f32 (attention.c).

    With `parallel`, units of whole rows of whole kv heads go to threads (the caller's included)
    that take them from one queue; no output depends on which thread computed it. Raises
    MemoryError when a unit's scratch (its scores and a transposed key chunk) cannot be allocated."""
    lib = _lib or library()
    m, h, dh = q.shape
    t, kvh = k.shape[0], k.shape[1]
    out = np.empty_like(q)
    args = (ISA_NAMES.index(_isa_in_use), _addr(q), m, h, dh, _addr(k), _addr(v), t, kvh, _addr(positions),
            window, scale, _addr(out))
    n_threads = threads() if parallel else 1
    if n_threads == 1:  # a decode step's call: no more Python than the call itself
        ok = lib.npud_attention(*args, 0, kvh, 0, m) == 0
    else:
        units = _attention_units(m, kvh, n_threads, m * h * t * dh)
        ok = on_threads(n_threads, units, lambda unit: lib.npud_attention(*args, *unit) == 0)
    if not ok:
        raise MemoryError(f"no memory for the attention scratch of {m} rows over {t} keys")
    return out


def attention_exp(x: np.ndarray) -> np.ndarray:
    """Tests: attention.c's exponential of each element of x (f32), on the path in use."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    library().npud_attention_exp(ISA_NAMES.index(isa()), x.ctypes.data, x.size, out.ctypes.data)
    return out
