"""Giving freed heap memory back to the kernel (glibc's malloc_trim).

A prompt of a megabyte passes through several buffers of its size on its way in (the line,
the parsed JSON, the stored request) and, once it runs, through the tokenizer's encoding of
it. glibc serves the first such buffer with mmap and returns it on free, but then raises its
mmap threshold to that size, so every later one comes from the heap (and from the arena of
the worker thread that made it), where freed memory stays in the process. After a user's
jobs end the daemon's RSS would stay at its peak. `Trimmer` counts the prompt bytes of ended
jobs and calls malloc_trim(0), which returns the free pages of every arena, once they add up
to `every_bytes`, or when the last unfinished job has ended (a prompt's tokenizer garbage is
many times its own size, so the bytes left below `every_bytes` can still be megabytes of
heap). Where there is no glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

TRIM_EVERY_BYTES = 4 << 20  # prompt bytes of ended jobs between two trims


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class Trimmer:
    """Calls malloc_trim(0) once `every_bytes` of released prompts have accumulated."""

    def __init__(self, every_bytes: int = TRIM_EVERY_BYTES, *, trim: Callable[[int], int] | None = None) -> None:
        self.every_bytes = every_bytes
        self.pending = 0
        self.trims = 0
        self._trim = trim or _malloc_trim()

    def released(self, num_bytes: int, *, idle: bool) -> bool:
        """Count `num_bytes` of freed prompts; trims (and returns True) when enough are pending,
        or when any are and the daemon is `idle` (no unfinished job left)."""
        self.pending += num_bytes
        if self._trim is None or self.pending == 0 or (self.pending < self.every_bytes and not idle):
            return False
        self.pending = 0
        self._trim(0)
        self.trims += 1
        return True
