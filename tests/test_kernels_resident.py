"""Prepared weights packed into huge-page-backed mappings (npud/kernels/host/resident.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from npud.kernels.base import WeightFormat
from npud.kernels.host import KERNELS, HostBackend, resident
from npud.kernels.host.resident import ALIGN, BLOCK_BYTES, HUGE_PAGE, resident_copy


@pytest.fixture(autouse=True)
def fresh_block(monkeypatch):
    """Each test starts a block of its own (arrays of other tests may still be alive in the current one)."""
    monkeypatch.setattr(resident, "_current", None)


def _span(mapped) -> tuple[int, int]:
    start = np.frombuffer(mapped, np.uint8).ctypes.data
    return start, start + len(mapped)


def test_copies_hold_the_values_packed_one_after_another_in_one_mapping():
    rng = np.random.default_rng(0)
    first = rng.standard_normal((3, 5, 7)).astype(np.float32)  # 420 bytes: the next starts 64-aligned
    second = rng.integers(0, 256, (1000, 3), dtype=np.uint8)
    a, b = resident_copy(first), resident_copy(second)
    assert np.array_equal(a, first) and np.array_equal(b, second)  # neither overwrote the other
    assert a.dtype == first.dtype and a.shape == first.shape and a.flags.c_contiguous
    assert b.ctypes.data == a.ctypes.data + -(-first.nbytes // ALIGN) * ALIGN
    lo, hi = _span(resident._current())
    assert lo <= a.ctypes.data and b.ctypes.data + b.nbytes <= hi


def test_a_full_block_starts_a_new_mapping_on_a_huge_page_boundary():
    parts = [resident_copy(np.full(12 << 20, i, np.uint8)) for i in range(3)]  # 36 MiB > one block
    assert parts[1].ctypes.data == parts[0].ctypes.data + (12 << 20)
    assert parts[2].ctypes.data % HUGE_PAGE == 0
    lo, hi = _span(resident._current())
    assert lo <= parts[2].ctypes.data < hi and not lo <= parts[0].ctypes.data < hi
    assert [int(p[0]) for p in parts] == [0, 1, 2] and all(int(p[-1]) == i for i, p in enumerate(parts))


def test_a_big_array_gets_a_mapping_of_its_own():
    small = resident_copy(np.ones(100, np.float32))
    big = resident_copy(np.arange(BLOCK_BYTES // 2 // 4 + 1, dtype=np.float32))
    after = resident_copy(np.ones(100, np.float32))
    assert big.ctypes.data % HUGE_PAGE == 0 and big[-1] == big.size - 1
    assert after.ctypes.data == small.ctypes.data + 448  # the block being filled goes on after `small`


def test_the_block_being_filled_goes_when_its_arrays_do():
    a = resident_copy(np.ones(10, np.float32))
    assert resident._current() is not None
    del a
    assert resident._current() is None  # nothing of a dropped model stays mapped


def test_prepared_weights_are_resident():
    host = HostBackend()
    for fmt in WeightFormat:
        w = host.prepare_linear(KERNELS[fmt].sample(np.random.default_rng(1), 70, 40))
        lo, hi = _span(resident._current())
        assert lo <= w.data.ctypes.data < hi, fmt


def test_the_mappings_are_private_anonymous_memory():
    # a shared anonymous mapping is shmem (/dev/zero in the maps), which THP's `enabled`
    # setting does not back with huge pages: it streamed slower than numpy's own memory
    a = resident_copy(np.ones(10, np.float32))
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= a.ctypes.data < hi:
            assert fields[1] == "rw-p" and len(fields) == 5, line  # private, no file behind it
            return
    raise AssertionError("the copy is in no mapping")
