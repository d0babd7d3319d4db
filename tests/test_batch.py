"""Batched rounds (npud/engine/batch.py, npud/engine/packed.py): N sessions of mixed kinds run through
LoadedModel.run_batch give every session the same events, tokens, finish reason and final
state bytes as running it alone through run_round, on every architecture the suite builds
tiny checkpoints for and in every weight format (GGUF blocks included).

The mixes hold plain greedy, sampled with seeds, prompt lookup (greedy and sampled), a draft
model and DFlash; prompts of 2 to ~150 tokens (several prefill chunks, so the prefill budget
defers some); sessions that end early (max_tokens, a stop string) and one cancelled after its
second token. Speculative requests run with fallback_rounds=0: the break-even rule judges
wall time, which a packed pass shares with its neighbours (the greedy tokens would not move,
but a sampled speculative run draws differently once it falls back)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from npud.engine.api import EngineError, FinishReason, GenerateRequest, GenerationParams, SamplingParams, SpecParams
from npud.engine.batch import MAX_PACKED_ROWS, _packs
from npud.engine.forward import Forward
from npud.engine.session import LoadedModel
from npud.engine.testing.checkpoints import build_tiny_checkpoint

TEXTS = [
    "def add(a, b):\n",
    "The quick brown fox",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n" * 3,
    "for i in range(10):\n    total += i * i\n",
    "x",
    "Speculative decoding drafts tokens and verifies them in one batched pass. " * 4,
    "def greet(name):\n    print('hello, ' + name)\n" * 2,
    "naïve café — 東京 🙂 résumé ",
]
CANCEL_AFTER = 2  # tokens: the cancelled session is cancelled at the first round end after them


def _spec(method: str, k: int = 3) -> SpecParams:
    return SpecParams(method=method, k=k, fallback_rounds=0)


def mix(n: int, methods: tuple[str, ...] = ()) -> list[GenerateRequest]:
    """n requests cycling through the kinds (the speculative `methods` the model has, after the
    plain ones), each over one of TEXTS."""
    kinds = [
        GenerationParams(max_tokens=10, spec=_spec("none")),
        GenerationParams(max_tokens=9, sampling=SamplingParams(temperature=0.9, seed=7), spec=_spec("none")),
        GenerationParams(max_tokens=10, spec=_spec("ngram")),
        GenerationParams(max_tokens=3, spec=_spec("none")),  # ends early: max_tokens
        GenerationParams(max_tokens=12, stop=(" ",), spec=_spec("ngram")),  # ends early: a stop string
        GenerationParams(max_tokens=9, sampling=SamplingParams(temperature=0.7, top_k=40, seed=3), spec=_spec("ngram")),
        *[GenerationParams(max_tokens=10, spec=_spec(m)) for m in methods],
        *[GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=11), spec=_spec(m))
          for m in methods],
    ]
    out = []
    for i in range(n):
        params = kinds[i % len(kinds)]
        if params.sampling.temperature > 0:  # each sampled session its own seed
            params = GenerationParams(max_tokens=params.max_tokens, stop=params.stop, spec=params.spec,
                                      sampling=SamplingParams(temperature=params.sampling.temperature,
                                                              top_k=params.sampling.top_k, seed=100 + i))
        out.append(GenerateRequest(prompt=TEXTS[i % len(TEXTS)], params=params))
    return out


def state_bytes(session) -> bytes:
    snap = session.forward.state.snapshot()
    return b"".join(a.tobytes() for plane in snap.planes for _, a in sorted(plane.arrays.items()))


def outcome(session, events) -> tuple:
    r = session.result()
    counts = tuple(r.stats[k] for k in ("emitted", "rounds", "plain_steps", "drafted", "accepted", "base_batches"))
    return (tuple(events), r.token_ids, r.text, r.finish_reason, counts, state_bytes(session))


def run_alone(served, requests, cancel: int | None) -> list[tuple]:
    out = []
    for i, req in enumerate(requests):
        s, events = served.start(req), []
        while not s.done:
            events += s.run_round()
            if i == cancel and sum(e.token_id is not None for e in events) >= CANCEL_AFTER:
                s.cancel()
        out.append(outcome(s, events))
    return out


def run_batched(served, requests, cancel: int | None, budget: int | None = 64) -> tuple[list[tuple], int]:
    """Every request in one running batch; returns the outcomes and the rounds it took."""
    sessions = [served.start(req) for req in requests]
    events = [[] for _ in sessions]
    rounds = 0
    while live := [i for i, s in enumerate(sessions) if not s.done]:
        got = served.run_batch([sessions[i] for i in live], prefill_budget=budget)
        rounds += 1
        for i, item in zip(live, got):
            assert not isinstance(item, EngineError), item
            events[i] += item
            if i == cancel and sum(e.token_id is not None for e in events[i]) >= CANCEL_AFTER:
                sessions[i].cancel()
    return [outcome(s, e) for s, e in zip(sessions, events)], rounds


def check_same(served, requests, cancel=None, budget=64):
    alone = run_alone(served, requests, cancel)
    batched, rounds = run_batched(served, requests, cancel, budget)
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert a[:5] == b[:5], (i, requests[i].params, a[:5], b[:5])  # the same drafts kept, too
        assert a[5] == b[5], f"session {i}: final state differs"
    return alone, rounds


def stepwise_greedy(model, ids, n) -> list[int]:
    """n greedy tokens after `ids`, every position through a one-row step."""
    f = Forward(model)
    for pos, t in enumerate(ids):
        logits = f.step(t, pos)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = f.step(out[-1], f.positions_held)
    return out


# -- the architectures and formats ---------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("batch")


def _checkpoint(root, arch: str):
    if arch in ("llama", "qwen2", "qwen3"):
        return build_tiny_checkpoint(root / arch, model_type=arch)
    if arch == "mistral":
        return build_tiny_checkpoint(root / arch, model_type="mistral", sliding_window=8)
    if arch == "gemma3":
        from test_gemma3 import BASE, build_gemma3_checkpoint

        return build_gemma3_checkpoint(root / arch, BASE)
    if arch == "gemma4":  # with a Gemma 4 assistant: a head that drafts from the base's hidden row (two-pass rounds)
        from assistant_fixtures import build_assistant, build_base

        return build_base(root / arch), {"assistant_dir": build_assistant(root / "assistant", seed=7, ordered=True)}
    if arch == "qwen3_5":
        from test_hybrid_models import build_hybrid_checkpoint

        return build_hybrid_checkpoint(root / arch, arch)
    from gguf_checkpoints import write_tiny_gguf  # "gguf-<arch>": every block type in turn

    return write_tiny_gguf(root / f"{arch}.gguf", arch.removeprefix("gguf-"))


CASES = [  # (architecture, weight format, sessions): each format once, each architecture once
    ("llama", "bf16", 6),
    ("mistral", "int8", 6),  # a sliding window of 8 under prompts of up to ~150 tokens
    ("qwen2", "int8-q8", 6),
    ("gemma3", "bf16-bf16", 6),
    ("gemma4", "fp32", 8),  # KV-shared layers, per-layer inputs, sandwich norms, the assistant
    ("qwen3_5", "bf16", 6),  # recurrent (GDN) layers
    ("gguf-llama", "bf16", 5),  # Q4_K, Q6_K, Q8_0 ... blocks
    ("gguf-gemma3", "bf16", 5),
]


@pytest.mark.parametrize("arch, fmt, n", CASES, ids=[f"{a}-{f}" for a, f, _ in CASES])
def test_batched_rounds_equal_each_session_alone(root, arch, fmt, n):
    path, extra = _checkpoint(root, arch), {}
    if isinstance(path, tuple):
        path, extra = path
    served = LoadedModel.load(arch, path, weight_format=fmt, backend="host", **extra)
    requests = mix(n, methods=("assistant",) if extra else ())
    alone, _ = check_same(served, requests, cancel=1)
    # a plain greedy session's tokens are those of one-row steps over its prompt (no multi-row
    # pass: rows out of order inside a pass would show here, alone and batched alike)
    ids = served.prompt_ids(requests[0])
    assert list(alone[0][1]) == stepwise_greedy(served.model, ids, len(alone[0][1]))


@pytest.fixture(scope="module")
def spec_model(root):
    """qwen3 with a draft model (the base itself: its greedy drafts are all kept, sampled ones
    not all) and a DFlash drafter (tests/test_dflash.py's random one)."""
    from test_dflash import BASE_LAYERS, Variant, write_random_dflash

    base = build_tiny_checkpoint(root / "spec-base", model_type="qwen3", seed=0, num_hidden_layers=BASE_LAYERS)
    dflash = write_random_dflash(root / "spec-dflash", Variant.DFLASH2)
    return LoadedModel.load("spec", base, draft_dir=base, dflash_dir=dflash, weight_format="fp32", backend="host")


def test_sixteen_sessions_of_every_kind_equal_each_alone(spec_model, monkeypatch):
    import npud.engine.batch

    packed = []  # sequences per packed pass
    run_packed = npud.engine.batch.run_packed
    monkeypatch.setattr(npud.engine.batch, "run_packed", lambda model, jobs: packed.append(len(jobs)) or run_packed(model, jobs))
    requests = mix(16, methods=("draft", "dflash"))
    alone, rounds = check_same(spec_model, requests, cancel=5)
    assert max(packed) >= 12  # the batched run did pack (alone, every pack holds one)
    finishes = [a[3] for a in alone]
    # the mix is what it claims: early ends of each kind, a cancel, speculation that kept drafts
    assert FinishReason.CANCELLED in finishes and FinishReason.STOP in finishes
    assert sum(len(a[1]) < r.params.max_tokens for a, r in zip(alone, requests)) >= 3
    assert {r.params.spec.method for r in requests} >= {"none", "ngram", "draft", "dflash"}
    # each drafter drafted; the draft model had drafts kept, prompt lookup had some rejected
    stats = {method: _stats(spec_model, requests, method) for method in ("draft", "dflash", "ngram")}
    drafted = {m: sum(s["drafted"] for s in st) for m, st in stats.items()}
    accepted = {m: sum(s["accepted"] for s in st) for m, st in stats.items()}
    assert min(drafted.values()) > 0 and accepted["draft"] > 0 and accepted["ngram"] < drafted["ngram"]
    assert rounds > max(len(a[1]) for a in alone) // 4  # not one round: the batch kept running


def _stats(served, requests, method):
    out = []
    for req in requests:
        if req.params.spec.method == method:
            s = served.start(req)
            while not s.done:
                s.run_round()
            out.append(s.result().stats)
    return out


def test_a_small_prefill_budget_defers_chunks_and_changes_no_bits(spec_model):
    requests = mix(6)
    _, tight = check_same(spec_model, requests, budget=1)  # one chunk a round across the batch
    _, roomy = check_same(spec_model, requests, budget=None)
    assert tight > roomy


def test_prefill_budget_admits_chunks_up_to_the_budget(spec_model):
    """Two prompts of one chunk each (<= 64 rows): a budget of both rows runs both in the first
    round; one row less defers the second to the next round (its first round releases nothing
    and it still holds no positions)."""
    a = GenerateRequest(prompt=TEXTS[0], params=GenerationParams(max_tokens=2, spec=_spec("none"),
                                                                 use_prefix_cache=False))
    b = GenerateRequest(prompt=TEXTS[3], params=GenerationParams(max_tokens=2, spec=_spec("none"),
                                                                 use_prefix_cache=False))
    rows = [len(spec_model.prompt_ids(r)) - 1 for r in (a, b)]  # the decode loop runs the last token
    for budget, b_held in ((sum(rows), rows[1]), (sum(rows) - 1, 0)):
        sa, sb = spec_model.start(a), spec_model.start(b)
        spec_model.run_batch([sa, sb], prefill_budget=budget)
        assert (sa.forward.positions_held, sb.forward.positions_held) == (rows[0], b_held), budget


def test_packs_never_pass_the_checked_rows_and_keep_passes_whole():
    packs = _packs(list(range(6)), [64, 1, 63, 1, 16, 48])
    assert packs == [[0], [1, 2], [3, 4], [5]]
    assert _packs([3, 4], [5, 5]) == [[3, 4]] and MAX_PACKED_ROWS == 64


def test_packs_put_each_pass_in_the_first_pack_with_room():
    """One-row steps on both sides of a full prefill chunk share one pack (not one pack a side)."""
    assert _packs([5, 6, 7, 8], [1, 64, 1, 1]) == [[5, 7, 8], [6]]
    assert _packs(list(range(5)), [40, 30, 20, 30, 4]) == [[0, 2, 4], [1, 3]]
    for rows in ([1] * 70, [64, 64, 1], [33, 32, 31, 2, 64, 1]):
        packs = _packs(list(range(len(rows))), rows)
        assert sorted(i for p in packs for i in p) == list(range(len(rows)))  # every pass once, whole
        assert all(sum(rows[i] for i in p) <= MAX_PACKED_ROWS for p in packs) and all(p == sorted(p) for p in packs)
        assert len(packs) == -(-sum(rows) // MAX_PACKED_ROWS)  # as few as the rows need, here


def test_a_batched_round_runs_one_pack_when_its_passes_fit(spec_model, monkeypatch):
    """Plain greedy sessions past their prefill: every round of the batch is one pack, the first
    decode round too (it steps the prompt's last token, then the first token: alone that is two
    passes in one round; batched the second waits for the next round instead of a pack of its own),
    and the tokens are those of each session alone."""
    import npud.engine.batch

    packs = []
    run_packed = npud.engine.batch.run_packed
    monkeypatch.setattr(npud.engine.batch, "run_packed", lambda model, jobs: packs.append(len(jobs)) or run_packed(model, jobs))
    params = GenerationParams(max_tokens=6, spec=_spec("none"), use_prefix_cache=False)
    requests = [GenerateRequest(prompt=t, params=params) for t in TEXTS[:4]]
    sessions = [spec_model.start(r) for r in requests]
    spec_model.run_batch(sessions, prefill_budget=None)
    while any(s.forward.positions_held < len(s.prompt_ids) - 1 for s in sessions):
        spec_model.run_batch(sessions, prefill_budget=None)
    per_round = []
    while live := [s for s in sessions if not s.done]:
        before = len(packs)
        spec_model.run_batch(live)
        per_round.append(len(packs) - before)
    assert max(per_round) == 1 and sum(per_round) >= 6, per_round
    alone = []
    for r in requests:
        s = spec_model.start(r)
        while not s.done:
            s.run_round()
        alone.append(s.result().token_ids)
    assert [s.result().token_ids for s in sessions] == alone


def test_a_session_whose_pass_cannot_start_fails_alone(spec_model):
    """A pass past the position limit fails its session's round; the others' rounds go on and
    equal their rounds alone."""
    requests = mix(3)
    sessions = [spec_model.start(r) for r in requests]
    alone = [spec_model.start(r) for r in requests]
    sessions[1].forward.config = dataclasses.replace(spec_model.model.config, max_position_embeddings=1)
    got = spec_model.run_batch(sessions)
    assert isinstance(got[1], EngineError) and "max_position_embeddings" in got[1].message
    for i in (0, 2):
        assert got[i] == alone[i].run_round()
        assert state_bytes(sessions[i]) == state_bytes(alone[i])


def test_batched_prefix_cache_snapshots_equal_those_taken_alone(root):
    """Two fresh served models (one cache each): sessions sharing a long prefix, batched on one,
    alone on the other; every cached entry's snapshot has the same bytes, and a batched session
    restoring it continues as one alone does."""
    base = build_tiny_checkpoint(root / "cache-base", model_type="qwen3", seed=3)
    shared = TEXTS[2]
    requests = [GenerateRequest(prompt=shared + tail, params=GenerationParams(max_tokens=4, spec=_spec("none")))
                for tail in ("a", "def f(x):", "The quick brown fox jumps")]
    one = LoadedModel.load("one", base, weight_format="fp32", backend="host", cache_block=16)
    two = LoadedModel.load("two", base, weight_format="fp32", backend="host", cache_block=16)
    alone = run_alone(one, requests, None)
    batched, _ = run_batched(two, requests, None)
    assert [a[:4] for a in alone] == [b[:4] for b in batched]
    keys = set()
    for req in requests:
        ids = one.prompt_ids(req)
        a, b = one.prefix_cache.lookup(ids), two.prefix_cache.lookup(ids)
        assert a is not None and b is not None and a.key == b.key
        keys.add(a.key)
        assert [p.arrays[n].tobytes() for p in a.snapshot.planes for n in sorted(p.arrays)] == \
               [p.arrays[n].tobytes() for p in b.snapshot.planes for n in sorted(p.arrays)]
    assert keys
    # and the warm sessions (restored from the entries above) batched equal them alone
    warm_alone = run_alone(one, requests, None)
    warm_batched, _ = run_batched(two, requests, None)
    assert warm_alone == warm_batched and [w[:4] for w in warm_alone] == [a[:4] for a in alone]


class _Taps:
    def __init__(self):
        self.rows = []

    def append(self, rows):
        self.rows.append(np.array(rows))


def test_a_packed_pass_hands_each_sequence_its_own_rows(spec_model):
    """run_packed over three ragged sequences (one asking every row's logits, one only its last
    row's, one none and with layer taps) against each pass alone: logits, last hidden rows, tap rows and
    planes bit for bit."""
    from npud.engine.packed import Pass, Rows, run_packed

    model = spec_model.model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, n).tolist() for n in (9, 3, 17)]
    nxt = [rng.integers(3, 300, n).tolist() for n in (4, 1, 6)]
    wants = (Rows.ALL, Rows.LAST, Rows.NONE)

    def setup():
        fs = [Forward(model) for _ in prompts]
        for f, p in zip(fs, prompts):
            f.prefill(p)
        taps = _Taps()
        fs[2].set_layer_taps([1, 3], taps)  # the last: its rows lie after the others'
        return fs, taps

    alone, alone_taps = setup()
    want = [f.run(Pass(tuple(t), f.positions_held, w)) for f, t, w in zip(alone, nxt, wants)]
    packed, packed_taps = setup()
    got = run_packed(model, [(f, Pass(tuple(t), f.positions_held, w)) for f, t, w in zip(packed, nxt, wants)])
    for a, b, fa, fb in zip(want, got, alone, packed):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert np.array_equal(fa.last_hidden_rows().view(np.uint32), fb.last_hidden_rows().view(np.uint32))
        assert fa.state.snapshot().positions == fb.state.snapshot().positions
        assert [p.arrays[n].tobytes() for p in fa.state.snapshot().planes for n in sorted(p.arrays)] == \
               [p.arrays[n].tobytes() for p in fb.state.snapshot().planes for n in sorted(p.arrays)]
    assert len(packed_taps.rows) == 1 and packed_taps.rows[0].shape[0] == len(nxt[2])
    assert np.array_equal(alone_taps.rows[0], packed_taps.rows[0])


def test_round_cost_is_the_calibrated_pass_of_a_row_per_sequence(spec_model):
    costs = spec_model.model.pass_costs
    assert spec_model.round_cost(1) == 1.0
    assert [spec_model.round_cost(n) for n in (2, 8, 16, 20)] == [costs.rows(n) for n in (2, 8, 16, 20)]
    assert spec_model.round_cost(16) >= spec_model.round_cost(2)
    with pytest.raises(ValueError, match="at least one sequence"):
        spec_model.round_cost(0)
    saved, spec_model.model.pass_costs = costs, None
    try:
        assert spec_model.round_cost(4) is None  # not calibrated: not known
    finally:
        spec_model.model.pass_costs = saved


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_prefill_chunk_is_cut_to_the_room_the_steps_leave_and_changes_no_bits(spec_model, monkeypatch, cache):
    """Three sessions stepping and a long prompt joining: its 64-row chunk is cut to the 61 rows
    the three steps leave in one pack (not a pack of its own), the rest runs next round, and its
    tokens, events and final state bytes are those of running it alone. With the prefix cache the
    chunk up to a block boundary asks for its last row's logits: the rest's last row gives them."""
    import npud.engine.batch

    assert spec_model.prefix_cache is not None

    packs = []
    run_packed = npud.engine.batch.run_packed
    monkeypatch.setattr(npud.engine.batch, "run_packed",
                        lambda model, jobs: packs.append(sum(p.num_rows for _, p in jobs)) or run_packed(model, jobs))
    params = GenerationParams(max_tokens=8, spec=_spec("none"), use_prefix_cache=cache)
    stepping = [spec_model.start(GenerateRequest(prompt=t, params=params)) for t in (TEXTS[0], TEXTS[1], TEXTS[4])]
    while any(s.forward.positions_held < len(s.prompt_ids) - 1 for s in stepping):
        spec_model.run_batch(stepping)
    spec_model.run_batch(stepping)  # the first decode round
    # 66-90 prompt tokens: with the cache, one chunk up to the block boundary at 64 that asks for its last row
    long = next(r for n in range(20, len(TEXTS[2])) if 66 <= len(spec_model.prompt_ids(
        r := GenerateRequest(prompt=f"# cut, cache {cache}\n" + TEXTS[2][:n], params=params))) <= 90)
    joined = spec_model.start(long)
    events = []
    before = len(packs)
    events += spec_model.run_batch([*stepping, joined])[3]
    assert packs[before:] == [64] and joined.forward.positions_held == 61
    while not joined.done:
        live = [s for s in [*stepping, joined] if not s.done]
        events += spec_model.run_batch(live)[live.index(joined)]
    assert joined.result().stats["num_cached_tokens"] == 0  # a prompt no test ran before: nothing restored
    alone_params = dataclasses.replace(params, use_prefix_cache=False)
    alone, alone_events = spec_model.start(GenerateRequest(prompt=long.prompt, params=alone_params)), []
    while not alone.done:
        alone_events += alone.run_round()
    assert outcome(joined, events) == outcome(alone, alone_events)


def test_a_chunk_that_fits_the_budget_but_not_the_pack_waits(spec_model, monkeypatch):
    """Under a roomy budget a second joining prompt's chunk that would start a second pack waits for
    the next round, and both prompts' tokens are those of running them alone."""
    import npud.engine.batch

    packs = []
    run_packed = npud.engine.batch.run_packed
    monkeypatch.setattr(npud.engine.batch, "run_packed",
                        lambda model, jobs: packs.append(sum(p.num_rows for _, p in jobs)) or run_packed(model, jobs))
    params = GenerationParams(max_tokens=6, spec=_spec("none"), use_prefix_cache=False)
    stepping = [spec_model.start(GenerateRequest(prompt=t, params=params)) for t in (TEXTS[0], TEXTS[1])]
    while any(s.forward.positions_held < len(s.prompt_ids) - 1 for s in stepping):
        spec_model.run_batch(stepping)
    spec_model.run_batch(stepping)
    joining = [spec_model.start(GenerateRequest(prompt=t, params=params)) for t in (TEXTS[2], TEXTS[5])]
    assert all(len(s.prompt_ids) > 64 for s in joining)
    before = len(packs)
    spec_model.run_batch([*stepping, *joining], prefill_budget=1000)
    assert packs[before:] == [64] and [s.forward.positions_held for s in joining] == [62, 0]
    while live := [s for s in [*stepping, *joining] if not s.done]:
        spec_model.run_batch(live, prefill_budget=1000)
    for s in joining:
        alone = spec_model.start(GenerateRequest(prompt=s.request.prompt, params=params))
        while not alone.done:
            alone.run_round()
        assert s.result().token_ids == alone.result().token_ids
