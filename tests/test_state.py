"""State planes on a model with two KV widths and KV-shared layers (issue 4).

shared/seeds/002 is the defect this guards against: snapshot, restore and rollback counted
every layer at one KV width, so on a model with two attention geometries each cut kept half
the positions of the wide layers, silently. The model here has full layers of width 32
(2 KV heads x 16) and sliding layers of width 16 (2 x 8), and one KV-shared layer of each
kind. `OldSingleWidthState` keeps that single-width cut as a negative control: it must fail
the very checks the planes pass.

Mutants, applied one at a time to a copy of the tree (never to the working tree); the
count is failing tests, out of this file's 42 and tests/test_prefix_cache.py's 73:

  mutant                                                        test_state  test_prefix_cache
  single width: ModelState.keep_positions and StateSnapshot         25              8
    .prefix cut each KV plane at n * (smallest KV width) / its own
  block boundary off by one: _chain hashes range(0, len - B, B),     0              5
    so a prefix of exactly k blocks is keyed by k - 1 of them (the
    KV lookup re-checks tokens past the last matched block, which
    hides it from this file; recurrent entries are never served)
  block boundary off by one: insert keys an entry at                 2             23
    ((positions - 1) // B) * B
  lookup off by one: it may serve the whole prompt (limit = len)     2              4
  restore forgets the recurrent plane (ModelState.restore skips)     1              1
"""

from __future__ import annotations

import numpy as np
import pytest

from npud.engine.config import AttentionKind, LayerSpec, ModelConfig, RopeSpec
from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.prefix_cache import MatchSource, PrefixCache
from npud.engine.state import (
    KVPlane, ModelState, PlaneKind, PlaneSnapshot, RecurrentPlane, SharedPlane, StateError, StateSnapshot,
)
from npud.engine.weights import AttentionWeights, LayerWeights, MlpWeights, ModelWeights
from npud.kernels.base import LinearWeight, WeightFormat

F32 = np.float32
WIDE, NARROW = (2, 16), (2, 8)  # (KV heads, head_dim): widths 32 and 16
WINDOW = 6
HELD = 20


def two_width_config() -> ModelConfig:
    """Six layers: full (wide), sliding (narrow), full, sliding, then a full layer sharing
    layer 2's KV and a sliding layer sharing layer 3's."""
    kinds = [AttentionKind.FULL, AttentionKind.SLIDING] * 3
    owners = [0, 1, 2, 3, 2, 3]
    layers = []
    for i, (kind, owner) in enumerate(zip(kinds, owners)):
        kv_heads, head_dim = WIDE if kind is AttentionKind.FULL else NARROW
        layers.append(LayerSpec(
            index=i, kind=kind, num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim,
            window=WINDOW if kind is AttentionKind.SLIDING else 0, kv_owner=owner,
            rope=RopeSpec(theta=10000.0, rotary_dim=head_dim),
        ))
    return ModelConfig(
        model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, layers=tuple(layers),
        rms_norm_eps=1e-6, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False,
        tie_word_embeddings=False, max_position_embeddings=256, eos_token_ids=(0,), bos_token_id=None,
        pad_token_id=None, hidden_act="silu", torch_dtype=None,
    )


def random_weights(cfg: ModelConfig, seed: int = 0) -> ModelWeights:
    rng = np.random.default_rng(seed)

    def linear(n, k):
        return LinearWeight(WeightFormat.FP32, (rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32))

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(F32)

    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for spec in cfg.layers:
        q = spec.num_heads * spec.head_dim
        attn = AttentionWeights(linear(q, d), linear(spec.kv_width, d), linear(spec.kv_width, d), linear(d, q),
                                norm(spec.head_dim), norm(spec.head_dim))
        layers.append(LayerWeights(norm(d), attn, norm(d), MlpWeights(linear(f, d), linear(f, d), linear(d, f))))
    embed = LinearWeight(WeightFormat.FP32, rng.standard_normal((cfg.vocab_size, d)).astype(F32))
    return ModelWeights(embed, layers, norm(d), linear(cfg.vocab_size, d), fingerprint=f"two-width-{seed}")


CFG = two_width_config()
TOKENS = [int(t) for t in np.random.default_rng(5).integers(1, 96, 160)]


def filled_state(positions=HELD, seed=0):
    """A state holding `positions` random rows on each KV plane (appended in two passes),
    and those rows by layer (None for a shared layer)."""
    state = ModelState.for_config(CFG)
    rng = np.random.default_rng(seed)
    rows = {}
    for p in state.planes:
        if p.kind is PlaneKind.KV:
            k, v = (rng.standard_normal((positions, p.num_kv_heads, p.head_dim)).astype(F32) for _ in "kv")
            p.append(k[:7], v[:7])
            p.append(k[7:], v[7:])
            rows[p.layer] = (k, v)
        else:
            rows[p.layer] = None
    return state, rows


def cut_problems(held, holdings, rows, n) -> list[str]:
    """What is wrong with a state that should hold exactly the first n of `rows` on every plane.

    held: its positions-held count (or the error it raised); holdings: layer -> (K rows,
    V rows) as that state would hand them to attention, or a string describing why it cannot.
    """
    problems = []
    if held != n:
        problems.append(f"positions held is {held}, expected {n}")
    for layer, want in rows.items():
        got = holdings[layer]
        if isinstance(got, str):
            problems.append(f"layer {layer}: {got}")
        elif want is None:
            if got[0].size or got[1].size:
                problems.append(f"layer {layer} is KV-shared but holds {got[0].shape[0]} rows")
        elif not (got[0].shape == want[0][:n].shape and np.array_equal(got[0], want[0][:n])
                  and np.array_equal(got[1], want[1][:n])):
            problems.append(f"layer {layer}: holds {got[0].shape[0]} rows, expected the first {n}")
    return problems


def plane_view(state: ModelState):
    try:
        held = state.positions_held()
    except StateError as exc:
        held = f"StateError({exc})"
    holdings = {}
    for p in state.planes:
        if p.kind is PlaneKind.KV:
            holdings[p.layer] = (p.keys(), p.values())
        else:
            snap = p.snapshot()
            holdings[p.layer] = (np.zeros(p.nbytes // 4), np.zeros(sum(a.size for a in snap.arrays.values())))
    return held, holdings


class OldSingleWidthState:
    """The cut this design replaces (seeds/002), kept as a negative control.

    Every layer's K and V are one flat float buffer; positions are counted, snapshotted and
    cut at one width for all layers (the config's KV heads x head_dim), read off layer 0.
    """

    def __init__(self, rows, width):
        self.width = width
        self.geometry = {s.index: (s.num_kv_heads, s.head_dim) for s in CFG.layers}
        self.k = {layer: (r[0].reshape(-1).copy() if r else np.zeros(0, F32)) for layer, r in rows.items()}
        self.v = {layer: (r[1].reshape(-1).copy() if r else np.zeros(0, F32)) for layer, r in rows.items()}

    def positions_held(self) -> int:
        return len(self.k[0]) // self.width

    def keep_positions(self, n) -> None:
        for layer in self.k:
            self.k[layer] = self.k[layer][: n * self.width]
            self.v[layer] = self.v[layer][: n * self.width]

    def snapshot_prefix(self, n):
        return {layer: (self.k[layer][: n * self.width].copy(), self.v[layer][: n * self.width].copy())
                for layer in self.k}

    def restore(self, snap) -> None:
        self.k = {layer: kv[0].copy() for layer, kv in snap.items()}
        self.v = {layer: kv[1].copy() for layer, kv in snap.items()}

    def view(self):
        holdings = {}
        for layer, (heads, head_dim) in self.geometry.items():
            width = heads * head_dim
            if len(self.k[layer]) % width:
                holdings[layer] = f"holds {len(self.k[layer]) / width} rows, not a whole number"
            else:
                holdings[layer] = (self.k[layer].reshape(-1, heads, head_dim), self.v[layer].reshape(-1, heads, head_dim))
        return self.positions_held(), holdings


# ---------------------------------------------------------------------------- KV and shared planes


def test_kv_widths_are_per_plane():
    state = ModelState.for_config(CFG)
    assert [p.kind for p in state.planes] == [PlaneKind.KV] * 4 + [PlaneKind.SHARED] * 2
    # one width per plane, none missing: there is no shorter list to extrapolate from
    assert state.kv_widths() == [32, 16, 32, 16, 0, 0]
    assert [p.owner for p in state.planes[4:]] == [2, 3]


@pytest.mark.parametrize("n", [0, 1, 6, 7, 12, 19, HELD])
def test_keep_positions_keeps_exactly_n_on_every_plane(n):
    state, rows = filled_state()
    assert cut_problems(*plane_view(state), rows, HELD) == []
    state.keep_positions(n)
    assert cut_problems(*plane_view(state), rows, n) == []
    assert state.nbytes == n * 2 * 4 * (32 + 16 + 32 + 16)


@pytest.mark.parametrize("n", [0, 1, 6, 7, 12, 19, HELD])
def test_snapshot_prefix_and_restore_keep_exactly_n_on_every_plane(n):
    state, rows = filled_state()
    snap = state.snapshot().prefix(n)
    assert snap.positions == n
    fresh = ModelState.for_config(CFG)
    fresh.restore(snap)
    assert cut_problems(*plane_view(fresh), rows, n) == []
    other, _ = filled_state(positions=11, seed=9)  # a restore replaces whatever was held
    other.restore(snap)
    assert cut_problems(*plane_view(other), rows, n) == []


def test_snapshot_is_a_copy():
    state, rows = filled_state()
    snap = state.snapshot()
    state.keep_positions(3)
    state.planes[0].append(np.zeros((5, *WIDE), F32), np.zeros((5, *WIDE), F32))
    fresh = ModelState.for_config(CFG)
    fresh.restore(snap)
    assert cut_problems(*plane_view(fresh), rows, HELD) == []


@pytest.mark.parametrize("width", [16, 32], ids=["narrow", "wide"])
@pytest.mark.parametrize("n", [1, 6, 7, 12])
def test_old_single_width_cut_fails_the_same_checks(width, n):
    _, rows = filled_state()
    old = OldSingleWidthState(rows, width)
    cut = OldSingleWidthState(rows, width)
    cut.keep_positions(n)
    restored = OldSingleWidthState(rows, width)
    restored.restore(old.snapshot_prefix(n))
    wrong = {0, 2} if width == 16 else {1, 3}  # the planes whose width is not the one counted
    for state in (cut, restored):
        problems = cut_problems(*state.view(), rows, n)
        assert problems, "the old cut passed: the checks would not catch seeds/002"
        named = {int(p.split()[1].rstrip(":")) for p in problems if p.startswith("layer")}
        assert named == wrong, problems
    if width == 16:
        # the count reads twice the positions off a wide layer, as seeds/002 describes
        assert old.positions_held() == 2 * HELD


def test_shared_plane_stays_empty_through_snapshot_restore_and_cuts():
    state, rows = filled_state()
    shared = state.planes[4:]
    snap = state.snapshot()
    assert [(p.kind, p.positions, p.arrays) for p in snap.planes[4:]] == [(PlaneKind.SHARED, 0, {})] * 2
    state.keep_positions(5)
    state.restore(snap.prefix(9))
    assert all(p.nbytes == 0 and p.positions_held is None and p.width == 0 for p in shared)
    assert state.positions_held() == 9  # the shared planes are not counted
    bad = PlaneSnapshot(PlaneKind.SHARED, 4, 3, snap.planes[4].geometry, {"k": np.zeros((3, 2, 16), F32)})
    with pytest.raises(StateError, match="KV-shared"):
        state.restore(StateSnapshot(snap.positions, snap.planes[:4] + (bad, snap.planes[5])))


def test_refused_cut_or_restore_changes_nothing():
    state, rows = filled_state()
    with pytest.raises(StateError, match="cannot keep 21"):
        state.keep_positions(HELD + 1)
    other = ModelState([KVPlane(0, 2, 16), KVPlane(1, 1, 8), KVPlane(2, 2, 16), KVPlane(3, 2, 8),
                        SharedPlane(4, 2), SharedPlane(5, 3)])
    other.planes[0].append(np.zeros((4, 2, 16), F32), np.zeros((4, 2, 16), F32))
    for p in other.planes[1:4]:
        p.append(np.zeros((4, p.num_kv_heads, p.head_dim), F32), np.zeros((4, p.num_kv_heads, p.head_dim), F32))
    with pytest.raises(StateError, match="geometry"):
        state.restore(other.snapshot())
    assert cut_problems(*plane_view(state), rows, HELD) == []


def test_restore_refuses_arrays_of_another_dtype():
    state, rows = filled_state()
    snap = state.snapshot()
    p0 = snap.planes[0]
    wide = PlaneSnapshot(p0.kind, p0.layer, p0.positions, p0.geometry,
                         {"k": p0.arrays["k"].astype(np.float64), "v": p0.arrays["v"]})
    with pytest.raises(StateError, match="float32"):
        ModelState.for_config(CFG).restore(StateSnapshot(snap.positions, (wide,) + snap.planes[1:]))


# ---------------------------------------------------------------------------- recurrent plane

SHAPES = {"conv": (3, 4), "ssm": (2, 4, 4)}


def recurrent_state() -> ModelState:
    return ModelState([KVPlane(0, *WIDE), RecurrentPlane(1, SHAPES), SharedPlane(2, 0), KVPlane(3, *NARROW)])


def row_input(token: int) -> np.ndarray:
    return np.random.default_rng(token).standard_normal(8).astype(F32)


def run_pass(state: ModelState, tokens) -> None:
    """One batched pass: every plane takes each row in order (a toy gated-delta update)."""
    state.begin_pass()
    for t in tokens:
        x = row_input(t)
        for p in state.planes:
            if p.kind is PlaneKind.KV:
                k = np.resize(x, (1, p.num_kv_heads, p.head_dim)) * F32(p.layer + 1)
                p.append(k, k + F32(1))
            elif p.kind is PlaneKind.RECURRENT:
                conv = np.concatenate([p.arrays["conv"][1:], x[None, :4]])
                key, value = conv.sum(0), x[4:]
                ssm = p.arrays["ssm"] * F32(0.9) + (key[:, None] * value[None, :])[None]
                p.advance({"conv": conv, "ssm": ssm.astype(F32)})


def same_state(a: ModelState, b: ModelState) -> bool:
    sa, sb = a.snapshot(), b.snapshot()
    return sa.positions == sb.positions and all(
        set(pa.arrays) == set(pb.arrays) and all(np.array_equal(pa.arrays[k], pb.arrays[k]) for k in pa.arrays)
        for pa, pb in zip(sa.planes, sb.planes)
    )


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_recurrent_commit_after_partial_accept_equals_a_state_that_saw_only_those_rows(accepted):
    prompt, drafts = TOKENS[:5], TOKENS[5:9]
    state = recurrent_state()
    run_pass(state, prompt)
    run_pass(state, drafts)  # a verify pass over 4 drafted rows
    state.keep_positions(5 + accepted)
    only = recurrent_state()
    run_pass(only, prompt)
    if accepted:
        run_pass(only, drafts[:accepted])
    assert state.positions_held() == 5 + accepted
    assert same_state(state, only)
    run_pass(state, [7])  # and they stay equal from there on
    run_pass(only, [7])
    assert same_state(state, only)


def test_recurrent_plane_cannot_be_cut_before_its_pass_and_the_refusal_changes_nothing():
    state = recurrent_state()
    run_pass(state, TOKENS[:5])
    run_pass(state, TOKENS[5:9])
    before = state.snapshot()
    with pytest.raises(StateError, match="recurrent"):
        state.keep_positions(3)
    assert [p.positions_held for p in state.planes] == [9, 9, None, 9]
    after = state.snapshot()
    assert all(np.array_equal(a.arrays[k], b.arrays[k]) for a, b in zip(before.planes, after.planes) for k in a.arrays)
    with pytest.raises(StateError, match="recurrent"):
        before.prefix(8)


def test_recurrent_snapshot_restore_continues_as_the_original():
    state = recurrent_state()
    run_pass(state, TOKENS[:6])
    snap = state.snapshot()
    target = recurrent_state()
    run_pass(target, TOKENS[20:23])  # holds other rows and another recurrent state
    target.restore(snap)
    assert same_state(target, state)
    run_pass(target, TOKENS[6:8])
    run_pass(state, TOKENS[6:8])
    assert same_state(target, state)
    target.keep_positions(7)  # inside the pass after the restore
    only = recurrent_state()
    run_pass(only, TOKENS[:7])
    assert same_state(target, only)


# ---------------------------------------------------------------------------- through the forward


@pytest.fixture(scope="module")
def model():
    return Model(CFG, random_weights(CFG))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    return Model.load(build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3"), "fp32")


def fresh_after(model, tokens) -> Forward:
    f = Forward(model)
    if tokens:
        f.prefill(tokens)
    return f


@pytest.mark.parametrize("n", [1, 6, 7, 13, 24])
def test_next_step_after_restore_equals_a_forward_that_only_saw_those_positions(model, n):
    f = fresh_after(model, TOKENS[:24])
    snap = f.state.snapshot()
    g = fresh_after(model, TOKENS[40:45])  # a restore replaces what g held
    g.state.restore(snap.prefix(n))
    assert [p.positions_held for p in g.state.planes] == [n] * 4 + [None] * 2
    ref = fresh_after(model, TOKENS[:n]).step_batch_all(TOKENS[n : n + 3], n)
    assert rows_equal(g.step_batch_all(TOKENS[n : n + 3], n), ref)
    f.truncate(n)  # the same cut through the forward
    assert rows_equal(f.step_batch_all(TOKENS[n : n + 3], n), ref)


def test_a_rolled_back_verify_continues_as_a_forward_that_saw_only_the_accepted_rows(model):
    f = fresh_after(model, TOKENS[:10])
    f.step_batch_all(TOKENS[10:14], 10)  # 4 drafted rows
    f.truncate(12)  # 2 accepted
    ref = fresh_after(model, TOKENS[:12])
    assert rows_equal(f.step(TOKENS[30], 12), ref.step(TOKENS[30], 12))


def serve(forward: Forward, cache: PrefixCache, prompt):
    """The cache's caller protocol; returns (last-row logits, match)."""
    done = cache.prefill(forward, prompt)
    return done.logits, done.match


@pytest.mark.parametrize("which", ["two_width", "qwen3"])
def test_prefix_cache_restore_then_continue_equals_a_full_prefill(request, tmp_path, which):
    m = request.getfixturevalue("model" if which == "two_width" else "qwen3")
    vocab = m.config.vocab_size
    first = [t % vocab for t in TOKENS[:70]]
    longer = first + [t % vocab for t in TOKENS[70:100]]
    prompts = {  # in this order; block size 16
        "cold": first,  # a miss; prefills 64, snapshots, prefills 6
        "longer": longer,  # the whole 64-token entry; inserts one of 96
        "repeat": first,  # 69 of the 96-token entry: one token is left to prefill
        "diverging": longer[:50] + [(t + 1) % vocab for t in longer[50:90]],  # 50 of it
    }
    served = {"cold": None, "longer": 64, "repeat": 69, "diverging": 50}
    cache = PrefixCache(m.fingerprint, ModelState.for_config(m.config), state_dir=tmp_path, block_size=16)
    for name, prompt in prompts.items():
        logits, match = serve(Forward(m), cache, prompt)
        assert (match.num_cached_tokens if match else None) == served[name], name
        assert rows_equal(logits, Forward(m).prefill(prompt)), name
        f = Forward(m)  # and the decode step after it
        serve(f, cache, prompt)
        assert rows_equal(f.step(3, len(prompt)), fresh_after(m, prompt).step(3, len(prompt))), name
    cache.flush()
    reopened = PrefixCache(m.fingerprint, ModelState.for_config(m.config), state_dir=tmp_path, block_size=16)
    prompt = longer + [5, 6]
    logits, match = serve(Forward(m), reopened, prompt)
    assert match.source is MatchSource.DISK and match.num_cached_tokens == 96
    assert rows_equal(logits, Forward(m).prefill(prompt))


def test_prefix_cache_prefill_defers_the_insert_at_the_prompt_end(model):
    prompt = TOKENS[:64]  # a multiple of the block: the insert boundary is the prompt's end
    cache = PrefixCache(model.fingerprint, ModelState.for_config(model.config), block_size=16)
    f = Forward(model)
    done = cache.prefill(f, prompt, defer_insert=True)
    assert done.match is None and rows_equal(done.logits, Forward(model).prefill(prompt))
    assert cache.stats().entries == 0 and done.insert is not None
    done.insert()
    assert cache.stats().entries == 1 and cache.lookup(prompt + [7]).num_cached_tokens == 64
    assert rows_equal(f.step(3, 64), fresh_after(model, prompt).step(3, 64))
    longer = TOKENS[:90]  # its boundary (80) is not its end: that insert is not deferred
    late = cache.prefill(Forward(model), longer, defer_insert=True)
    assert late.insert is None and cache.lookup(longer).num_cached_tokens == 80


def test_prefix_cache_prefill_without_the_rest_leaves_the_last_token_to_the_caller(model):
    prompt = TOKENS[:64]
    cache = PrefixCache(model.fingerprint, ModelState.for_config(model.config), block_size=16)
    f = Forward(model)
    first = cache.prefill(f, prompt, rest=False)  # the boundary of prompt[:-1] is 48
    assert first.match is None and first.insert is None and f.positions_held == 48
    assert cache.stats().entries == 1
    g = Forward(model)
    again = cache.prefill(g, prompt, rest=False)
    assert again.match.num_cached_tokens == 48 and again.logits is None and g.positions_held == 48
    assert cache.stats().entries == 1
    g.prefill(prompt[48:63])
    assert rows_equal(g.step(prompt[63], 63), fresh_after(model, prompt[:63]).step(prompt[63], 63))
    h = Forward(model)
    blind = cache.prefill(h, prompt, rest=False, restore=False)  # no lookup: prefilled from 0
    assert blind.match is None and h.positions_held == 48 and cache.stats().hits == 1
    assert cache.prefill(Forward(model), prompt[:1], rest=False).match is None and cache.stats().misses == 1
