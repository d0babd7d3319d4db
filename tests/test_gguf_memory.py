"""A GGUF file's weights in memory once: the pages of the file's mapping are let go as its
block rows are packed (GgufFile.release), and a loaded model keeps none of them resident, so
no tensor is held twice (mapped and packed) at the end of a load, nor for long during it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from npud.engine.gguf import open_gguf
from npud.engine.model import Model
from gguf_checkpoints import write_tiny_gguf

pytest.importorskip("gguf") if os.environ.get("CI") != "true" else __import__("gguf")


def resident_kib(path) -> int:
    """KiB of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    target = str(os.path.realpath(path))
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("mem") / "gemma3.gguf", "gemma3")


def test_release_lets_the_mapped_pages_go(tiny):
    g = open_gguf(tiny)
    tensors = [t for t in g.tensors.values() if t.data is not None]
    assert sum(int(t.data.sum(dtype=np.uint64)) for t in tensors) > 0  # every page read
    first = min(t.data.ctypes.data for t in tensors) - g.mapping.ctypes.data
    before = resident_kib(tiny)
    assert before * 1024 >= g.file_bytes - first  # the tensors' pages are resident
    for t in tensors:
        g.release(t.data)
    after = resident_kib(tiny)
    assert after * 1024 <= first + os.sysconf("SC_PAGE_SIZE")  # only the header's pages are left
    assert np.array_equal(g.tensors[tensors[0].name].data, tensors[0].data)  # and a read brings them back


def test_a_loaded_model_keeps_no_page_of_the_file(tiny):
    model = Model.load(tiny)
    assert model.nbytes > 0
    assert resident_kib(tiny) == 0


def test_packing_lets_each_block_tensor_go(tiny):
    from npud.engine.gguf.config import gguf_config
    from npud.engine.gguf.weights import BLOCK_TYPES, load_gguf_weights

    g = open_gguf(tiny)  # kept open: what is resident after packing is what packing left
    weights = load_gguf_weights(g, gguf_config(g))
    page = os.sysconf("SC_PAGE_SIZE")
    tensors = [t for t in g.tensors.values() if t.data is not None]
    header = min(t.data.ctypes.data for t in tensors) - g.mapping.ctypes.data
    dense = [t for t in tensors if t.type_name not in BLOCK_TYPES]
    assert len(dense) < len(tensors)
    assert resident_kib(tiny) * 1024 <= header + sum(t.data.nbytes + 2 * page for t in dense)
    assert weights.embed.nbytes > 0
