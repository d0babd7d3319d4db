"""Prepared weights in memory that transparent huge pages can back.

A one-row GEMM streams its weights from DRAM. On this project's development VM (Zen 4, one
thread, THP in `madvise` mode) a q8 layer of 1-3 MiB streamed at 14-18 GB/s from numpy's
own allocation and at 23-27 GB/s from 2 MiB pages: with 4 KiB pages every page costs a TLB
walk and the hardware prefetchers stop at each page boundary. numpy asks for huge pages
only for arrays of 4 MiB or more, and a huge page can back only a 2 MiB-aligned stretch, so
`resident_copy` packs the prepared weights one after another into 2 MiB-aligned anonymous
mappings of BLOCK_BYTES marked MADV_HUGEPAGE (an array of more than half a block gets a
mapping of its own). A mapping lives while any array in it does (numpy views keep it), so
unloading a model returns its blocks; the block being filled is held only weakly.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

BLOCK_BYTES = 32 << 20  # one mapping that consecutive weights share
HUGE_PAGE = 2 << 20
ALIGN = 64  # each array starts on a cache line

_lock = threading.Lock()
_current: weakref.ref | None = None  # the mapping being filled
_used = 0  # bytes of it handed out
_arena: weakref.WeakSet = weakref.WeakSet()  # every mapping made here, for is_arena


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with room for nbytes from a 2 MiB boundary; returns it and that offset."""
    # private: a shared anonymous mapping is shmem, which THP's `enabled` setting does not cover
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KiB pages, the same bits
            pass
    address = np.frombuffer(mapped, np.uint8).ctypes.data
    _arena.add(mapped)
    return mapped, -address % HUGE_PAGE


def is_arena(obj) -> bool:
    """Whether `obj` is one of the huge-page mappings made here (npud/engine/gguf/packed_cache.py asks)."""
    return isinstance(obj, mmap.mmap) and obj in _arena


def resident_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` in huge-page-backed memory (the same values, dtype and shape)."""
    out = resident_empty(a.nbytes).view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def resident_empty(nbytes: int) -> np.ndarray:
    """`nbytes` of huge-page-backed memory as a uint8 array (its values unset), placed as resident_copy places a copy."""
    global _current, _used
    with _lock:
        if nbytes > BLOCK_BYTES // 2:
            mapped, start = _mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        else:
            mapped = _current() if _current is not None else None
            if mapped is None or _used + nbytes > len(mapped):
                mapped, _used = _mapping(BLOCK_BYTES)  # the first array starts on the 2 MiB boundary
                _current = weakref.ref(mapped)
            start = _used
            _used = -(-(start + nbytes) // ALIGN) * ALIGN
    return np.frombuffer(mapped, np.uint8, count=nbytes, offset=start)
