"""The packed-weights cache (npud/engine/gguf/packed_cache.py): a start that finds a GGUF model's
prepared weights reads them back instead of packing, and they are the build's bits (every
array, and the logits of a forward) on both block layouts; a fused projection's parts and a
tied head are views of one buffer again (no array held twice); entries are keyed by the file's
content; a damaged, truncated or foreign entry is rejected, removed and rebuilt; an entry holds
data, never code: a pickle planted in one runs nothing, and a tree of the wrong kinds is
rejected, removed and rebuilt; the oldest entries go past the limits."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import pickletools

import numpy as np
import pytest

from npud.engine import fingerprint
from npud.engine.forward import Forward
from npud.engine.gguf import load as gguf_load
from npud.engine.gguf import packed_cache as pc
from npud.engine.model import Model
from npud.engine.weights import ModelWeights
from gguf_checkpoints import write_tiny_gguf
from npud.kernels.base import LinearWeight

pytest.importorskip("gguf") if os.environ.get("CI") != "true" else __import__("gguf")

IDS = [1, 5, 9, 3, 7, 2, 11, 4]


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "_directory_memos", {})  # a memo per test, as a new process has
    monkeypatch.setattr(fingerprint, "SETTLE_NS", 0)  # files written just now may be remembered
    return tmp_path / "cache" / pc.SUBDIR


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("packed") / "gemma3.gguf", "gemma3")


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """Every matrix Q8_0, so each layer's projections fuse."""
    return write_tiny_gguf(tmp_path_factory.mktemp("packed") / "gemma3.gguf", "gemma3", matrix_types=("Q8_0",))


def entries(root):
    return sorted(root.glob(f"*{pc.SUFFIX}"))


def arrays(tree, prefix="w"):
    """Every array of a weights tree by its path."""
    out = {}
    if isinstance(tree, np.ndarray):
        out[prefix] = tree
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            out |= arrays(item, f"{prefix}[{i}]")
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            out |= arrays(getattr(tree, f.name), f"{prefix}.{f.name}")
    return out


def logits(model):
    f = Forward(model)
    return [f.step(t, i) for i, t in enumerate(IDS[:3])] + [f.step_batch_all(IDS[3:], 3)]


def no_packing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("packed the file again")

    monkeypatch.setattr(gguf_load, "load_gguf_weights", refuse)


@pytest.mark.parametrize("fmt", ["bf16", "gguf-q8"])
def test_a_hit_is_the_build_bit_for_bit(tiny, private_cache, monkeypatch, fmt):
    built = Model.load(tiny, fmt)
    (entry,) = entries(private_cache)
    # the entry holds the live bytes once: no array twice, no arena bytes a build left dead
    header = json.loads(entry.read_bytes().partition(b"\n")[0])
    assert sum(b["bytes"] for b in header["buffers"]) == built.nbytes
    no_packing(monkeypatch)
    read = Model.load(tiny, fmt)
    a, b = arrays(built.weights), arrays(read.weights)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name
    assert built.weights.fingerprint == read.weights.fingerprint and built.checkpoint_info == read.checkpoint_info
    for x, y in zip(logits(built), logits(read)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("fmt", ["bf16", "gguf-q8"])
def test_views_stay_views_and_the_tied_head_is_the_embedding(uniform, private_cache, monkeypatch, fmt):
    built = Model.load(uniform, fmt)
    (entry,) = entries(private_cache)
    # every projection fused: a q8 build left each part's own tiles dead in the arena, the entry has none of them
    header = json.loads(entry.read_bytes().partition(b"\n")[0])
    assert sum(b["bytes"] for b in header["buffers"]) == built.nbytes
    no_packing(monkeypatch)
    w = Model.load(uniform, fmt).weights
    assert w.lm_head is w.embed  # gemma's head is tied: one table serves the gather and the GEMM
    layer = w.layers[0]
    assert layer.attn.qkv is not None and layer.mlp.gate_up is not None
    for fused, parts in ((layer.attn.qkv, (layer.attn.q, layer.attn.k, layer.attn.v)),
                         (layer.mlp.gate_up, (layer.mlp.gate, layer.mlp.up))):
        for part in parts:
            assert np.shares_memory(part.data, fused.weight.data) and np.shares_memory(part.scale, fused.weight.scale)
        for part in fused.parts:  # the backend's own views, the ones the fused call's columns come from
            assert np.shares_memory(part.data, fused.weight.data)
    if fmt == "gguf-q8":  # read back into the huge-page arena, as resident_copy placed them
        from npud.kernels.host.resident import is_arena

        owner = layer.mlp.gate_up.weight.data
        while isinstance(owner, np.ndarray):
            owner = owner.base
        assert is_arena(owner.obj)  # np.frombuffer's memoryview of the mapping


def test_entries_are_keyed_by_content_and_layout(tmp_path, private_cache):
    a = write_tiny_gguf(tmp_path / "a.gguf", "gemma3", seed=1)
    b = write_tiny_gguf(tmp_path / "b.gguf", "gemma3", seed=2)
    Model.load(a, "bf16")
    Model.load(b, "bf16")
    Model.load(a, "gguf-q8")
    assert len(entries(private_cache)) == 3
    b.write_bytes(a.read_bytes())  # the same content under another name: the same entry
    Model.load(b, "bf16")
    assert len(entries(private_cache)) == 3


def test_the_key_covers_every_packing_source_and_the_pack_version(tmp_path, private_cache, monkeypatch):
    """A change of layout (the exact path's packed q tiles and float16 factors) cannot meet an
    entry of the old one: each module the packing runs through is hashed into the key, and so
    is PACK_VERSION."""
    import inspect
    from pathlib import Path

    from npud.kernels.ggml import blocks, gemm, nibbles
    from npud.kernels.host.backend import HostBackend

    root = Path(pc.__file__).resolve().parents[3]
    for fn in (gemm.pack_block_matrix, gemm.half_factors, nibbles.pack_rows, nibbles.pack, blocks.unpack_matrix):
        assert Path(inspect.getsourcefile(fn)).resolve().relative_to(root).as_posix() in pc.SOURCES, fn
    a = write_tiny_gguf(tmp_path / "a.gguf", "gemma3", seed=1)
    key = pc.entry_key(a, gemm.LAYOUT_FLOAT, HostBackend(), private_cache)
    monkeypatch.setattr(pc, "PACK_VERSION", pc.PACK_VERSION - 1)
    assert pc.entry_key(a, gemm.LAYOUT_FLOAT, HostBackend(), private_cache) != key


def damage_buffer(entry):
    raw = bytearray(entry.read_bytes())
    raw[-100] ^= 0x10  # a bit in the last buffer
    entry.write_bytes(bytes(raw))


def truncate(entry):
    raw = entry.read_bytes()
    entry.write_bytes(raw[: len(raw) - 4096])


def foreign_key(entry):
    first, _, rest = entry.read_bytes().partition(b"\n")
    header = json.loads(first)
    header["key"] = "0" * 64
    entry.write_bytes(json.dumps(header).encode() + b"\n" + rest)


def garbage(entry):
    entry.write_bytes(b"not an entry\n")


@pytest.mark.parametrize("spoil", [damage_buffer, truncate, foreign_key, garbage])
def test_an_unusable_entry_is_ignored_and_rebuilt(tiny, private_cache, spoil):
    want = logits(Model.load(tiny, "bf16"))
    (entry,) = entries(private_cache)
    spoil(entry)
    assert pc.load(entry.stem, private_cache) is None
    assert not entry.exists()  # removed, so the next load rebuilds it
    again = Model.load(tiny, "bf16")
    assert entries(private_cache) == [entry]
    for x, y in zip(want, logits(again)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    assert pc.load(entry.stem, private_cache) is not None


def small_weights(fill: int, n: int = 1000):
    """A ModelWeights of one tied table and no layers: the smallest tree an entry holds."""
    from npud.engine.weights import ModelWeights
    from npud.kernels.base import WeightFormat

    table = LinearWeight(WeightFormat.FP32, np.full((1, n), fill, np.float32))
    return ModelWeights(embed=table, layers=[], final_norm=np.ones(n, np.float32), lm_head=table, fingerprint="small")


def rewrite_header(entry, change):
    """The entry with `change` applied to its header and its buffers as they were: each buffer
    keeps its place relative to the first, which starts on the first boundary after the line."""
    raw = entry.read_bytes()
    first, _, _ = raw.partition(b"\n")
    start = -(-(len(first) + 1) // pc.ALIGN) * pc.ALIGN
    header = json.loads(first)
    change(header)
    line = json.dumps(header).encode()
    line += b" " * (-(len(line) + 1) % pc.ALIGN)
    entry.write_bytes(line + b"\n" + raw[start:])


def planted_pickle(command: str) -> bytes:
    """A protocol-4 pickle that calls os.system(command) through a dotted name inside an npud
    module (npud.kernels.host.cache's `os.system`): what passed the old reader's module-prefix check."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE

    return b"\x80\x04" + text("npud.kernels.host.cache") + text("os.system") + b"\x93" + text(command) + b"\x85R."


class _Gadget:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_pickle_planted_as_an_entry_runs_nothing(tiny, private_cache, tmp_path):
    """What issue 39 did from outside: a pickle whose class resolves to os.system, in an entry
    whose header and sums are valid. The reader builds its objects itself: nothing runs, the
    entry is rejected and removed, and the next load rebuilds it."""
    want = logits(Model.load(tiny, "bf16"))
    marker = tmp_path / "ran"
    planted = planted_pickle(f"touch {marker}")
    assert [op.name for op, _, _ in pickletools.genops(planted)][3] == "STACK_GLOBAL"
    # where the old format held its pickle: after the header line, before the buffers
    (entry,) = entries(private_cache)
    raw = entry.read_bytes()
    head, _, _ = raw.partition(b"\n")
    header = json.loads(head)
    start = -(-(len(head) + 1 + header.get("tree_bytes", 0)) // pc.ALIGN) * pc.ALIGN  # the first buffer's offset
    header.pop("tree", None)
    header["tree_bytes"] = len(planted)
    line = json.dumps(header).encode()
    line += b" " * (start - len(planted) - len(line) - 1)  # the buffers stay where the sums expect them
    entry.write_bytes(line + b"\n" + planted + raw[start:])
    loaded = pc.load(entry.stem, private_cache)
    assert not marker.exists()
    assert loaded is None and not entry.exists()
    # and in the tree's own place in the header
    Model.load(tiny, "bf16")
    (entry,) = entries(private_cache)
    rewrite_header(entry, lambda h: h.__setitem__("tree", planted.decode("latin-1")))
    assert pc.load(entry.stem, private_cache) is None and not entry.exists()
    assert not marker.exists()
    again = Model.load(tiny, "bf16")
    for x, y in zip(want, logits(again)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def _wrong_root(h):
    h["tree"] = h["tree"]["fields"]["embed"]  # a LinearWeight where the root is a ModelWeights


def _unknown_kind(h):
    h["tree"]["fields"]["layers"][0]["kind"] = "Popen"


def _wrong_field_type(h):
    h["tree"]["fields"]["final_norm"] = "not an array"


def _missing_field(h):
    del h["tree"]["fields"]["layers"][0]["fields"]["mlp"]


def _object_dtype(h):
    h["arrays"][0][2] = "|O"


def _array_past_its_buffer(h):
    h["arrays"][0][1] = 1 << 40


def _dangling_reference(h):
    h["tree"]["fields"]["lm_head"] = {"ref": 10**6}


def _nothing(h):
    pass


@pytest.mark.parametrize("spoil, reason", [(_wrong_root, "the root is a LinearWeight"), (_unknown_kind, "no known kind"),
                                           (_wrong_field_type, "final_norm: a str"), (_missing_field, "with fields"),
                                           (_object_dtype, "an array of '|O'"), (_array_past_its_buffer, "outside its buffer"),
                                           (_dangling_reference, "reference 1000000")])
def test_an_entry_of_the_wrong_kinds_is_rejected_removed_and_rebuilt(tiny, private_cache, spoil, reason, capsys):
    want = logits(Model.load(tiny, "bf16"))
    (entry,) = entries(private_cache)
    rewrite_header(entry, spoil)  # header and sums as valid as the writer made them
    capsys.readouterr()
    assert pc.load(entry.stem, private_cache) is None
    assert not entry.exists()
    log = capsys.readouterr().out
    assert log.count("cache_entry_rejected") == 1 and str(entry) in log and reason in log, log
    again = Model.load(tiny, "bf16")  # a load that succeeds, through a rebuild
    assert entries(private_cache) == [entry]
    for x, y in zip(want, logits(again)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


def test_a_rewritten_header_alone_leaves_an_entry_that_loads(tiny, private_cache):
    # the check on rewrite_header: the spoils above are all that make those entries bad
    Model.load(tiny, "bf16")
    (entry,) = entries(private_cache)
    rewrite_header(entry, _nothing)
    assert isinstance(pc.load(entry.stem, private_cache), ModelWeights)


def test_a_tree_of_anything_but_the_weights_kinds_is_not_stored(tmp_path):
    root = tmp_path / "root"
    pc.store({"w": np.zeros(4, np.uint8)}, "k" * 64, root)
    pc.store(_Gadget(), "j" * 64, root)
    assert entries(root) == []


def test_the_least_recently_used_entries_go_past_the_limits(tmp_path, monkeypatch):
    root = tmp_path / "root"
    monkeypatch.setattr(pc, "MAX_ENTRIES", 3)
    for i in range(4):
        pc.store(small_weights(i), f"{i:064d}", root)
        os.utime(root / f"{i:064d}{pc.SUFFIX}", ns=(i * 10**9, i * 10**9))
    assert [p.stem[-1] for p in entries(root)] == ["1", "2", "3"]
    assert pc.load(f"{1:064d}", root).embed.data[0, 0] == 1  # a read makes an entry the newest
    size = (root / f"{1:064d}{pc.SUFFIX}").stat().st_size
    monkeypatch.setattr(pc, "MAX_BYTES", 2 * size)
    pc.store(small_weights(9), f"{9:064d}", root)
    assert [p.stem[-1] for p in entries(root)] == ["1", "9"]


def test_a_backend_that_is_not_the_hosts_is_not_cached(tiny, private_cache):
    from npud.engine.testing.backends import PrimitivesOnly
    from npud.kernels.ggml.backend import BlockHostBackend
    from npud.kernels.host.backend import HostBackend

    backend = PrimitivesOnly(BlockHostBackend())
    assert not isinstance(backend, HostBackend)
    Model.load(tiny, "bf16", backend)
    assert entries(private_cache) == []


def test_a_header_of_the_right_key_but_not_of_this_shape_is_unusable(tiny, private_cache):
    Model.load(tiny, "bf16")
    (entry,) = entries(private_cache)
    first, _, rest = entry.read_bytes().partition(b"\n")
    header = json.loads(first)
    del header["arrays"]
    entry.write_bytes(json.dumps(header).encode() + b"\n" + rest)
    assert pc.load(entry.stem, private_cache) is None and not entry.exists()
