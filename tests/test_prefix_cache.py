"""The prefix cache (npud/engine/prefix_cache.py, npud/engine/prefix_store.py) over hand-built states.

States here are a deterministic function of the token ids (`state_after`), so the state a
hit serves can be compared with the one a model that saw only those tokens would hold. The
template has two KV widths and a KV-shared plane; `recurrent=True` adds a recurrent plane.
Bit equality of a restored prompt with a cold one through the real forward is in
tests/test_state.py.

Mutants and what they fail: the table at the top of tests/test_state.py.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from npud.engine import prefix_store as store
from npud.engine.prefix_cache import MatchSource, PrefixCache, PrefixCacheError
from npud.engine.state import KVPlane, ModelState, PlaneKind, RecurrentPlane, SharedPlane, StateError

B = 16  # block size in these tests
FP = "fingerprint-of-the-test-model"
P = [int(t) for t in np.random.default_rng(1).integers(1, 1000, 200)]  # a prompt


def make_state(recurrent: bool = False, narrow_head_dim: int = 4) -> ModelState:
    """Planes: KV 2x8 (width 16), KV 1x`narrow_head_dim` (width 4), shared (owner 0)[, recurrent]."""
    planes = [KVPlane(0, 2, 8), KVPlane(1, 1, narrow_head_dim), SharedPlane(2, 0)]
    if recurrent:
        planes.append(RecurrentPlane(3, {"conv": (2, 4), "ssm": (2, 3)}))
    return ModelState(planes)


def state_after(tokens, recurrent: bool = False, **kw) -> ModelState:
    """The state after `tokens`: KV rows depend on (token, position, layer); the recurrent
    state on every token so far, so it can only be had by running those tokens."""
    return feed(make_state(recurrent, **kw), tokens)


def feed(state: ModelState, tokens) -> ModelState:
    """Run `tokens` after the positions `state` holds, one pass per token."""
    start = state.positions_held()
    for pos, t in enumerate(tokens, start=start):
        state.begin_pass()
        for p in state.planes:
            if p.kind is PlaneKind.KV:
                base = np.float32(t * 0.001 + pos * 0.01 + p.layer)
                k = base + np.arange(p.width, dtype=np.float32).reshape(1, p.num_kv_heads, p.head_dim)
                p.append(k, -k)
            elif p.kind is PlaneKind.RECURRENT:
                conv = np.roll(p.arrays["conv"], 1, axis=0)
                conv[0] = np.float32(t % 97) * np.float32(0.01)
                ssm = p.arrays["ssm"] * np.float32(0.5) + conv[:, :3]
                p.advance({"conv": conv, "ssm": ssm})
    return state


def same_snapshot(a, b) -> bool:
    if a.positions != b.positions or len(a.planes) != len(b.planes):
        return False
    for pa, pb in zip(a.planes, b.planes):
        if (pa.kind, pa.layer, pa.positions, pa.geometry) != (pb.kind, pb.layer, pb.positions, pb.geometry):
            return False
        if set(pa.arrays) != set(pb.arrays):
            return False
        if not all(pa.arrays[n].dtype == pb.arrays[n].dtype and np.array_equal(pa.arrays[n], pb.arrays[n])
                   for n in pa.arrays):
            return False
    return True


def cache_with(tmp_path=None, recurrent=False, **kw) -> PrefixCache:
    return PrefixCache(FP, make_state(recurrent), state_dir=tmp_path, block_size=B, **kw)


def insert(cache, tokens, recurrent=False):
    return cache.insert(tokens, state_after(tokens, recurrent).snapshot())


def entry_bytes(n, recurrent=False) -> int:
    return state_after(P[:n], recurrent).snapshot().nbytes


# ---------------------------------------------------------------------------- lookups


def test_miss_then_hit_on_the_repeated_prompt():
    cache = cache_with()
    assert cache.lookup(P[:64]) is None
    key = insert(cache, P[:64])
    match = cache.lookup(P[:64])
    # a repeat leaves exactly one token to prefill: its logits start the reply
    assert match.key == key and match.num_cached_tokens == 63 and match.source is MatchSource.MEMORY
    assert match.entry_tokens == 64
    assert same_snapshot(match.snapshot, state_after(P[:63]).snapshot())
    s = cache.stats()
    assert (s.hits, s.misses, s.tokens_reused, s.entries, s.entries_in_memory) == (1, 1, 63, 1, 1)
    assert s.bytes_held == entry_bytes(64)


def test_hit_on_a_longer_prompt_serves_the_whole_entry():
    cache = cache_with()
    insert(cache, P[:64])
    match = cache.lookup(P[:100])
    assert match.num_cached_tokens == 64
    assert same_snapshot(match.snapshot, state_after(P[:64]).snapshot())


@pytest.mark.parametrize("diverge", [16, 17, 31, 32, 40, 63])
def test_partial_hit_serves_the_common_prefix(diverge):
    cache = cache_with()
    insert(cache, P[:64])
    other = P[:diverge] + [t + 1 for t in P[diverge:90]]
    match = cache.lookup(other)
    assert match.num_cached_tokens == diverge and match.entry_tokens == 64
    assert same_snapshot(match.snapshot, state_after(other[:diverge]).snapshot())


@pytest.mark.parametrize("diverge", [0, 1, 15])
def test_less_than_one_common_block_is_a_miss(diverge):
    cache = cache_with()
    insert(cache, P[:64])
    assert cache.lookup(P[:diverge] + [t + 1 for t in P[diverge:90]]) is None
    assert cache.stats().misses == 1


@pytest.mark.parametrize("length", [1, 2, 16, 17])
def test_short_prompts(length):
    cache = cache_with()
    insert(cache, P[:64])
    match = cache.lookup(P[:length])
    if length < B:
        assert match is None  # no full block to key on
    else:
        assert match.num_cached_tokens == length - 1  # a KV entry serves any prefix of itself


def test_token_ids_are_rechecked_when_hashes_agree(monkeypatch):
    cache = cache_with()
    real = cache._chain
    # every prompt of a length now hashes alike: only the token comparison tells them apart
    monkeypatch.setattr(cache, "_chain", lambda tokens, scope: real(np.zeros_like(tokens), scope))
    insert(cache, P[:64])
    assert cache.lookup([t + 1 for t in P[:80]]) is None
    assert cache.lookup(P[:80]).num_cached_tokens == 64


def test_longest_of_several_entries_wins():
    cache = cache_with()
    insert(cache, P[:32])
    insert(cache, [t + 1 for t in P[:64]])
    insert(cache, P[:32] + [t + 2 for t in P[32:96]])
    match = cache.lookup(P[:32] + [t + 2 for t in P[32:70]] + P[70:100])
    assert match.num_cached_tokens == 70


def test_recurrent_entry_serves_its_exact_length_only():
    cache = cache_with(recurrent=True)
    assert cache.insert_boundary(64) == 48  # a repeat of a 64-token prompt must leave a token
    key = insert(cache, P[:48], recurrent=True)
    match = cache.lookup(P[:64])
    assert match.key == key and match.num_cached_tokens == 48
    assert same_snapshot(match.snapshot, state_after(P[:48], recurrent=True).snapshot())
    assert cache.lookup(P[:48]) is None  # nothing would be left to prefill
    assert cache.lookup(P[:40] + [t + 1 for t in P[40:64]]) is None  # cannot be cut to 40 or 32
    with pytest.raises(StateError, match="recurrent"):
        cache.insert(P[:50], state_after(P[:50], recurrent=True).snapshot())


def test_a_recurrent_match_restores_a_state_that_continues_as_the_original(tmp_path):
    cache = cache_with(tmp_path, recurrent=True, max_bytes=0)  # every entry goes to disk
    insert(cache, P[:48], recurrent=True)
    match = cache.lookup(P[:64])
    assert match.source is MatchSource.DISK and match.num_cached_tokens == 48
    state = state_after([t + 1 for t in P[:20]], recurrent=True)  # holding something else
    state.restore(match.snapshot)
    feed(state, P[48:64])
    assert same_snapshot(state.snapshot(), state_after(P[:64], recurrent=True).snapshot())


@pytest.mark.parametrize("n,kv_only,recurrent", [
    (0, 0, 0), (1, 0, 0), (15, 0, 0), (16, 16, 0), (17, 16, 16), (47, 32, 32), (48, 48, 32), (64, 64, 48),
])
def test_insert_boundary(n, kv_only, recurrent):
    assert cache_with().insert_boundary(n) == kv_only
    assert cache_with(recurrent=True).insert_boundary(n) == recurrent


# ---------------------------------------------------------------------------- inserts


def test_insert_cuts_a_kv_snapshot_at_the_last_full_block():
    cache = cache_with()
    snap = state_after(P[:70]).snapshot()
    key = cache.insert(P[:70], snap)
    assert cache.stats().bytes_held == entry_bytes(64)
    match = cache.lookup(P[:100])
    assert match.key == key and match.num_cached_tokens == 64
    assert same_snapshot(match.snapshot, state_after(P[:64]).snapshot())
    # the entry owns its rows: it does not keep the 70-row arrays alive
    assert all(a.base is None for p in match.snapshot.planes for a in p.arrays.values())
    assert cache.insert(P[:15], state_after(P[:15]).snapshot()) is None  # less than a block


def test_cached_arrays_cannot_be_written_through_a_match():
    cache = cache_with()
    insert(cache, P[:64])
    arrays = cache.lookup(P[:80]).snapshot.planes[0].arrays
    with pytest.raises(ValueError, match="read-only"):
        arrays["k"][0] = 0.0


def test_insert_refuses_bad_arguments():
    cache = cache_with()
    with pytest.raises(PrefixCacheError, match="only 10 tokens"):
        cache.insert(P[:10], state_after(P[:32]).snapshot())
    with pytest.raises(StateError, match="geometry"):
        cache.insert(P[:32], state_after(P[:32], narrow_head_dim=2).snapshot())
    with pytest.raises(StateError, match="planes"):
        cache.insert(P[:32], state_after(P[:32], recurrent=True).snapshot())
    assert cache.stats().entries == 0


def test_a_longer_entry_supersedes_its_unpinned_prefixes():
    cache = cache_with()
    short = insert(cache, P[:32])
    pinned = insert(cache, P[:48])
    cache.pin("system", pinned)
    longer = insert(cache, P[:64])
    s = cache.stats()
    assert s.superseded == 1 and s.entries == 2
    assert cache.pins() == {"system": pinned}
    assert short != longer
    assert cache.lookup(P[:40] + [1, 2, 3]).num_cached_tokens == 40


# ---------------------------------------------------------------------------- budgets and pins


def test_lru_eviction_under_a_byte_budget():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=2 * size + size // 2)
    a, b, c = (insert(cache, [t + i for t in P[:32]]) for i in (1, 2, 3))
    s = cache.stats()
    assert (s.entries, s.evictions, s.bytes_held) == (2, 1, 2 * size)
    assert cache.lookup([t + 1 for t in P[:40]]) is None  # a, least recently used, went
    assert cache.lookup([t + 2 for t in P[:40]]).key == b  # b is now the most recent
    insert(cache, [t + 4 for t in P[:32]])
    assert cache.lookup([t + 3 for t in P[:40]]) is None  # so c went, not b
    assert cache.lookup([t + 2 for t in P[:40]]).key == b
    assert cache.stats().evictions == 2 and cache.stats().bytes_held <= cache.max_bytes


def test_an_entry_larger_than_the_budget_is_not_kept():
    cache = cache_with(max_bytes=entry_bytes(32) - 1)
    assert insert(cache, P[:32]) is None
    assert cache.stats().entries == 0 and cache.stats().bytes_held == 0


def test_pinned_entries_are_not_evicted():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=2 * size)
    a = insert(cache, [t + 1 for t in P[:32]])
    cache.pin("editor:main.py", a)
    for i in range(2, 6):
        insert(cache, [t + i for t in P[:32]])
    assert cache.lookup([t + 1 for t in P[:40]]).key == a
    assert cache.stats().evictions == 3
    assert cache.unpin("editor:main.py") and not cache.unpin("editor:main.py")
    insert(cache, [t + 9 for t in P[:32]])
    insert(cache, [t + 10 for t in P[:32]])
    assert cache.lookup([t + 1 for t in P[:40]]) is None


def test_pins_and_drops():
    cache = cache_with()
    a, b = insert(cache, P[:32]), insert(cache, [t + 1 for t in P[:32]])
    with pytest.raises(PrefixCacheError, match="no cached entry"):
        cache.pin("x", "0" * 32)
    cache.pin("x", a)
    cache.pin("x", b)  # a name pins one entry: it moves
    cache.pin("y", b)
    assert cache.pins() == {"x": b, "y": b}
    assert cache.drop(b) and not cache.drop(b)
    assert cache.pins() == {} and cache.stats().entries == 1
    assert cache.lookup([t + 1 for t in P[:40]]) is None


# ---------------------------------------------------------------------------- disk


def test_spill_to_disk_and_read_back(tmp_path):
    size = entry_bytes(32)
    cache = cache_with(tmp_path, max_bytes=size)
    a = insert(cache, [t + 1 for t in P[:32]])
    b = insert(cache, [t + 2 for t in P[:32]])
    s = cache.stats()
    assert (s.entries, s.entries_in_memory, s.spills, s.evictions) == (2, 1, 1, 0)
    assert (tmp_path / f"{a}.safetensors").is_file() and not (tmp_path / f"{b}.safetensors").exists()
    match = cache.lookup([t + 1 for t in P[:40]])
    assert match.key == a and match.source is MatchSource.DISK
    assert same_snapshot(match.snapshot, state_after([t + 1 for t in P[:32]]).snapshot())
    assert cache.stats().spills == 2  # b made room for a
    assert cache.lookup([t + 2 for t in P[:40]]).source is MatchSource.DISK


def test_disk_budget_evicts_least_recently_used_files(tmp_path):
    cache = cache_with(tmp_path)
    keys = [insert(cache, [t + i for t in P[:32]]) for i in range(3)]
    cache.flush()
    file_size = (tmp_path / f"{keys[0]}.safetensors").stat().st_size
    cache.lookup([t + 0 for t in P[:40]])  # keys[0] becomes the most recent
    cache.max_disk_bytes = 2 * file_size
    cache.flush()
    assert cache.stats().evictions == 1 and cache.stats().disk_bytes == 2 * file_size
    assert not (tmp_path / f"{keys[1]}.safetensors").exists()
    assert cache.lookup([t + 1 for t in P[:40]]) is None


def test_files_are_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    cache = cache_with(tmp_path, recurrent=True)
    key = insert(cache, P[:32], recurrent=True)
    assert cache.flush() == 1
    path = tmp_path / f"{key}.safetensors"
    arrays = load_file(path)
    snap = state_after(P[:32], recurrent=True).snapshot()
    assert sorted(arrays) == ["layer.0.k", "layer.0.v", "layer.1.k", "layer.1.v", "layer.3.conv", "layer.3.ssm"]
    assert np.array_equal(arrays["layer.1.k"], snap.planes[1].arrays["k"])
    assert np.array_equal(arrays["layer.3.ssm"], snap.planes[3].arrays["ssm"])
    with safe_open(path, "np") as f:
        meta = json.loads(f.metadata()[store.META_KEY])
    assert meta["tokens"] == P[:32] and meta["fingerprint"] == FP and meta["positions"] == 32
    assert [p["kind"] for p in meta["planes"]] == ["kv", "kv", "shared", "recurrent"]
    assert meta["planes"][1]["geometry"] == [["num_kv_heads", 1], ["head_dim", 4], ["window", 0]]


_CHILD = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
from test_prefix_cache import P, FP, B, make_state
from npud.engine.prefix_cache import PrefixCache
cache = PrefixCache(FP, make_state({recurrent}), state_dir={dir!r}, block_size=B, max_bytes={max_bytes})
out = {{"pins": cache.pins(), "entries": cache.stats().entries}}
for name, prompt in {prompts!r}.items():
    m = cache.lookup(prompt)
    h = hashlib.sha256()
    for p in m.snapshot.planes:
        for k in sorted(p.arrays):
            h.update(p.arrays[k].tobytes())
    out[name] = [m.num_cached_tokens, m.source.value, h.hexdigest()]
print(json.dumps(out))
"""


def _digest(snap) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in snap.planes:
        for k in sorted(p.arrays):
            h.update(p.arrays[k].tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("recurrent", [False, True])
def test_round_trip_through_a_fresh_process(tmp_path, recurrent):
    cache = cache_with(tmp_path, recurrent=recurrent)
    a = insert(cache, P[:64], recurrent)
    b = insert(cache, [t + 1 for t in P[:32]], recurrent)
    cache.pin("system", b)  # written at once
    assert cache.flush() == 1  # a
    prompts = {"a": P[:80], "b": [t + 1 for t in P[:40]]}
    code = _CHILD.format(tests=str(Path(__file__).parent), recurrent=recurrent, dir=str(tmp_path),
                         max_bytes=entry_bytes(32, recurrent), prompts=prompts)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["pins"] == {"system": b} and out["entries"] == 2
    assert out["a"] == [64, "disk", _digest(state_after(P[:64], recurrent).snapshot())]
    assert out["b"] == [32, "disk", _digest(state_after([t + 1 for t in P[:32]], recurrent).snapshot())]
    # reading does not consume files
    assert {p.name for p in tmp_path.iterdir()} == {f"{a}.safetensors", f"{b}.safetensors", "pins.json"}


def test_pins_survive_a_restart_and_hold_against_the_budget(tmp_path):
    cache = cache_with(tmp_path)
    a = insert(cache, P[:32])
    cache.pin("system", a)
    for i in range(1, 4):
        insert(cache, [t + i for t in P[:32]])
    cache.flush()
    size = (tmp_path / f"{a}.safetensors").stat().st_size
    again = cache_with(tmp_path, max_disk_bytes=size)
    assert again.pins() == {"system": a}
    assert again.stats().entries == 1 and again.stats().evictions == 3
    assert again.lookup(P[:40]).key == a


# ---------------------------------------------------------------------------- bad files


def _one_file(tmp_path, recurrent=False, fingerprint=FP, **state_kw) -> Path:
    cache = PrefixCache(fingerprint, make_state(recurrent, **state_kw), state_dir=tmp_path, block_size=B)
    cache.insert(P[:32], state_after(P[:32], recurrent, **state_kw).snapshot())
    cache.flush()
    (path,) = tmp_path.glob("*.safetensors")
    return path


def _reopen_expecting_drop(tmp_path, path, reason):
    with capture_logs() as logs:
        cache = cache_with(tmp_path)  # never raises
    dropped = [e for e in logs if e["event"] == "cache_entry_rejected"]
    assert len(dropped) == 1 and dropped[0]["path"] == str(path), logs
    assert reason in dropped[0]["reason"], dropped[0]["reason"]
    assert not path.exists()
    assert cache.stats().entries == 0 and cache.stats().files_dropped == 1
    assert cache.lookup(P[:40]) is None


@pytest.mark.parametrize("keep", [0, 5, 8, 100, -1])
def test_truncated_file_is_dropped(tmp_path, keep):
    path = _one_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep >= 0 else len(data) + keep])
    _reopen_expecting_drop(tmp_path, path, "truncated")


def test_appended_bytes_are_dropped(tmp_path):
    path = _one_file(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    _reopen_expecting_drop(tmp_path, path, "padded")


@pytest.mark.parametrize("where", ["length", "header", "everything"])
def test_garbage_in_the_header_is_dropped(tmp_path, where):
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(3)
    span = {"length": (0, 8), "header": (40, 80), "everything": (0, len(data))}[where]
    data[span[0] : span[1]] = rng.integers(0, 256, span[1] - span[0], dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    _reopen_expecting_drop(tmp_path, path, {"length": "header length", "header": "not readable",
                                            "everything": "header length"}[where])


def test_garbage_in_the_tensor_data_is_dropped_when_read(tmp_path):
    path = _one_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    cache = cache_with(tmp_path)  # the header is sound: indexed, data read on a hit only
    assert cache.stats().entries == 1
    with capture_logs() as logs:
        assert cache.lookup(P[:40]) is None
    assert [e["event"] for e in logs] == ["cache_entry_rejected"] and "digest" in logs[0]["reason"]
    assert not path.exists() and cache.stats().entries == 0 and cache.stats().misses == 1


def test_files_under_another_key_are_dropped_with_one_line(tmp_path):
    # another key: the same model computed with other numerics (npud/engine/fingerprint.py)
    _one_file(tmp_path / "a", fingerprint="other-numerics")
    old = PrefixCache("other-numerics", make_state(), state_dir=tmp_path / "a", block_size=B)
    old.insert(P[100:132], state_after(P[100:132]).snapshot())
    old.flush()
    paths = sorted((tmp_path / "a").glob("*.safetensors"))
    assert len(paths) == 2
    with capture_logs() as logs:
        cache = cache_with(tmp_path / "a")
    assert [e["event"] for e in logs] == ["prefix_cache_stale_dropped"] and logs[0]["files"] == 2
    assert not any(p.exists() for p in paths)
    assert cache.stats().entries == 0 and cache.stats().disk_bytes == 0 and cache.stats().files_dropped == 2
    assert cache.lookup(P[:40]) is None


@pytest.mark.parametrize("other", ["head_dim", "planes"])
def test_geometry_mismatch_is_dropped(tmp_path, other):
    kw = {"narrow_head_dim": 2} if other == "head_dim" else {"recurrent": True}
    path = _one_file(tmp_path, **kw)
    _reopen_expecting_drop(tmp_path, path, "geometry")


def _rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"][store.META_KEY])
    change(header, meta)
    if "__metadata__" in header:
        header["__metadata__"][store.META_KEY] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_rewritten_header_still_loads(tmp_path):
    # the control for the cases below: rewriting alone does not make a file bad
    path = _one_file(tmp_path)
    _rewrite_header(path, lambda header, meta: None)
    assert cache_with(tmp_path).lookup(P[:40]).num_cached_tokens == 32


@pytest.mark.parametrize("field", store.META_FIELDS)
def test_metadata_missing_a_field_is_dropped(tmp_path, field):
    path = _one_file(tmp_path)
    _rewrite_header(path, lambda header, meta: meta.pop(field))
    _reopen_expecting_drop(tmp_path, path, "lacks")


@pytest.mark.parametrize("case,reason", [
    ("no_metadata", "not readable"),
    ("plane_without_geometry", "incomplete"),
    ("plane_positions", "positions"),
    ("token_changed", "hash of its tokens"),
    ("tokens_short", "token ids"),
    ("block_size", "block size"),
    ("tensor_dtype", "float32"),
])
def test_inconsistent_metadata_is_dropped(tmp_path, case, reason):
    def change(header, meta):
        if case == "no_metadata":
            del header["__metadata__"]
        elif case == "plane_without_geometry":
            del meta["planes"][1]["geometry"]
        elif case == "plane_positions":
            meta["planes"][0]["positions"] = 16
        elif case == "token_changed":
            meta["tokens"][5] += 1
        elif case == "tokens_short":
            meta["tokens"] = meta["tokens"][:16]
        elif case == "block_size":
            meta["block_size"] = 32
        elif case == "tensor_dtype":
            header["layer.0.k"]["dtype"] = "F16"

    path = _one_file(tmp_path)
    _rewrite_header(path, change)
    _reopen_expecting_drop(tmp_path, path, reason)


def test_interrupted_write_leaves_no_entry(tmp_path):
    path = _one_file(tmp_path)
    tmp = path.with_name(path.name + ".123.tmp")
    tmp.write_bytes(path.read_bytes()[:100])
    cache = cache_with(tmp_path)
    assert not tmp.exists() and cache.stats().entries == 1


def test_unwritable_state_dir_does_not_lose_the_entry_in_memory(tmp_path, monkeypatch):
    cache = cache_with(tmp_path)
    key = insert(cache, P[:32])

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_atomic", refuse)
    with capture_logs() as logs:
        assert cache.flush() == 0
    assert [e["event"] for e in logs] == ["prefix_cache_write_failed"]
    assert cache.lookup(P[:40]).key == key and list(tmp_path.iterdir()) == []


def test_the_cache_imports_no_daemon_machinery():
    import ast

    root = Path(__file__).parent.parent
    for module in ("npud/engine/prefix_cache.py", "npud/engine/prefix_store.py", "npud/engine/state.py"):
        tree = ast.parse((root / module).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {n.split(".")[0] for n in names} & {"trio", "socket", "sqlite3"}, (module, names)
    # nor does anything it imports pull in trio or sqlite (structlog itself imports socket)
    code = "import sys, npud.engine.prefix_cache; print(sorted(m for m in ('trio', 'sqlite3') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


# -- scopes: one owner's entries are never found from another's (issue 17, defect 3) ---------------

def insert_in(cache, tokens, scope) -> str | None:
    return cache.insert(tokens, state_after(tokens).snapshot(), scope)


def test_an_entry_is_found_only_in_its_own_scope():
    cache = cache_with()
    insert_in(cache, P[:64], "uid:1000")
    assert cache.lookup(P[:80], "uid:1001") is None  # before: 64 cached tokens told uid 1001 the prompt
    assert cache.lookup(P[:80]) is None  # nor in the shared scope
    assert cache.lookup(P[:80], "uid:1000").num_cached_tokens == 64  # the owner keeps the benefit


def test_the_same_prefix_in_two_scopes_is_two_entries_with_their_own_keys():
    cache = cache_with()
    a, b = insert_in(cache, P[:64], "uid:1"), insert_in(cache, P[:64], "uid:2")
    assert a != b and cache.lookup(P[:80], "uid:1").key == a and cache.lookup(P[:80], "uid:2").key == b


def test_a_scoped_lookup_finds_shared_entries_only_when_pinned():
    cache = cache_with()
    key = insert_in(cache, P[:64], None)  # e.g. a system prompt run by an operator
    assert cache.lookup(P[:80], "uid:7") is None  # shared but not pinned: nobody else's business
    cache.pin("system", key)
    assert cache.lookup(P[:80], "uid:7").key == key
    own = insert_in(cache, P[:96], "uid:7")
    assert cache.lookup(P[:120], "uid:7").key == own  # the longer own entry wins
    assert cache.lookup(P[:80]).key == key  # the shared scope finds every shared entry


def test_scopes_survive_a_restart(tmp_path):
    cache = cache_with(tmp_path)
    key = insert_in(cache, P[:64], "uid:5")
    assert cache.flush() == 1
    again = cache_with(tmp_path)
    assert again.lookup(P[:80], "uid:6") is None and again.lookup(P[:80]) is None
    assert again.lookup(P[:80], "uid:5").key == key


# -- budget shares: one owner's inserts never push out another's entries (issue 17) ---------------

def shifted(i, n=32):
    return [t + i for t in P[:n]]


def test_an_owner_filling_the_cache_cannot_evict_another_owners_entry():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=3 * 2 * size, max_scopes=2)  # 3 shares of 2 entries each
    victim = insert_in(cache, shifted(0), "uid:2")
    for i in range(1, 20):  # uid:1 inserts far more than the whole cache holds
        insert_in(cache, shifted(i), "uid:1")
    # before: the victim's entry was the least recently used one of the cache, and went
    assert cache.lookup(shifted(0, 40), "uid:2").key == victim
    assert cache.stats().evictions == 17  # uid:1's own, LRU within its share of 2
    assert cache.lookup(shifted(19, 40), "uid:1") is not None and cache.lookup(shifted(1, 40), "uid:1") is None
    assert cache.stats().shares_reclaimed == 0


def test_an_owner_filling_the_disk_cannot_evict_another_owners_file(tmp_path):
    cache = cache_with(tmp_path, max_bytes=0, max_scopes=2)  # every entry goes to disk at once
    victim = insert_in(cache, shifted(0), "uid:2")
    file_size = (tmp_path / f"{victim}.safetensors").stat().st_size
    cache.max_disk_bytes = 3 * 3 * file_size  # 3 shares of 3 files each
    for i in range(1, 10):
        insert_in(cache, shifted(i), "uid:1")
    match = cache.lookup(shifted(0, 40), "uid:2")
    assert match.key == victim and match.source is MatchSource.DISK
    assert len(list(tmp_path.glob("*.safetensors"))) == 4  # uid:1's last 3 and the victim's


def test_the_shared_scope_has_its_own_share():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=3 * size, max_scopes=2)  # a share holds one entry
    shared = insert_in(cache, shifted(0), None)
    cache.pin("system", shared)
    kept = insert_in(cache, shifted(1), None)  # over the shared share, but the pinned one stays
    assert kept is None and cache.lookup(shifted(0, 40), "uid:1").key == shared
    own = insert_in(cache, shifted(2), "uid:1")  # pins do not crowd out an owner's share
    assert cache.lookup(shifted(2, 40), "uid:1").key == own


def test_a_new_scope_takes_the_share_of_the_scope_used_least_recently():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=3 * size, max_scopes=2)
    a = insert_in(cache, shifted(0), "uid:1")
    insert_in(cache, shifted(1), "uid:2")
    assert cache.lookup(shifted(0, 40), "uid:1").key == a  # uid:1 used its share last
    insert_in(cache, shifted(2), "uid:3")  # no share free: uid:2's goes
    assert cache.lookup(shifted(1, 40), "uid:2") is None and cache.lookup(shifted(0, 40), "uid:1").key == a
    assert cache.stats().shares_reclaimed == 1
    insert_in(cache, shifted(3), "uid:1")  # a scope with a share only ever evicts its own entries
    assert cache.lookup(shifted(2, 40), "uid:3") is not None and cache.stats().shares_reclaimed == 1


def test_max_scopes_zero_keeps_one_budget_for_every_scope():
    size = entry_bytes(32)
    cache = cache_with(max_bytes=2 * size)
    insert_in(cache, shifted(0), "uid:2")
    insert_in(cache, shifted(1), "uid:1")
    insert_in(cache, shifted(2), "uid:1")
    assert cache.lookup(shifted(0, 40), "uid:2") is None  # one LRU over every entry


def test_max_scopes_is_checked():
    with pytest.raises(PrefixCacheError, match="max_scopes"):
        cache_with(max_scopes=-1)


def test_a_file_of_format_1_under_this_key_is_dropped(tmp_path):
    # format 1 had no scope: its entry would be found from every owner's scope
    path = _one_file(tmp_path)

    def to_format_1(header, meta):
        meta["format"] = 1
        meta.pop("scope")

    _rewrite_header(path, to_format_1)
    _reopen_expecting_drop(tmp_path, path, "lacks ['scope']")


def test_a_scoped_file_under_another_key_is_dropped_as_stale(tmp_path):
    # the owner scope and the numerics key are both in the chain: neither survives a key change
    old = PrefixCache("other-numerics", make_state(), state_dir=tmp_path, block_size=B)
    insert_in(old, P[:64], "uid:5")
    assert old.flush() == 1
    with capture_logs() as logs:
        cache = cache_with(tmp_path)
    assert [e["event"] for e in logs] == ["prefix_cache_stale_dropped"] and logs[0]["files"] == 1
    assert not list(tmp_path.glob("*.safetensors")) and cache.lookup(P[:80], "uid:5") is None


def test_the_key_and_the_scope_both_salt_the_block_chain():
    a, b = PrefixCache("key-a", make_state(), block_size=B), PrefixCache("key-b", make_state(), block_size=B)
    tokens = np.asarray(P[:64])
    chains = {(c.fingerprint, s): tuple(c._chain(tokens, s)) for c in (a, b) for s in (None, "uid:1", "uid:2")}
    assert len(set(chains.values())) == 6
