"""Fixtures and references the host-kernel tests share."""

from __future__ import annotations

import numpy as np
import pytest

from npud.kernels.host import native


@pytest.fixture
def isa_and_threads():
    """Restores the kernel path and thread count a test changes."""
    isa, threads = native.isa(), native.threads()
    yield
    native.set_isa(isa)
    native.set_threads(threads)


def _fma32(a, b, c) -> np.ndarray:
    """fma(a, b, c) on float32 arrays, rounded once: a * b is exact in float64, TwoSum gives the
    sum's float64 rounding s and its error, and the error breaks the tie when s lies halfway
    between two floats (the one case where rounding s again to float32 goes wrong)."""
    a, b, c = (np.asarray(x, np.float32) for x in (a, b, c))
    p = a.astype(np.float64) * b
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
    halfway = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2)
    return np.where(halfway & (np.sign(err) == np.sign(s - r64)), other, r).astype(np.float32)
