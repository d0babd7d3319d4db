"""Fixtures the host-kernel tests share."""

from __future__ import annotations

import pytest

from kernels.host import native


@pytest.fixture
def isa_and_threads():
    """Restores the kernel path and thread count a test changes."""
    isa, threads = native.isa(), native.threads()
    yield
    native.set_isa(isa)
    native.set_threads(threads)
