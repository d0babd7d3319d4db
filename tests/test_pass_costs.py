"""The break-even rule's cost model (npud/engine/pass_costs.py): calibrated once and cached, it decides
the fallback from the tokens alone, so the same prompt makes the same speculation choices with
the CPU busy as without (prompt lookup, draft model, DFlash).

MUTANTS. Each was applied, this file run, the failing checks named, and the code restored:

    mutant (where)                                          failing checks
    break-even comparison flipped (speculative.py)          injected costs x3
    a pass costed as one row more, rows(r + 1)              injected costs x3, hog: ngram, draft, dflash
    the draft model's first pass not costed (drafters.py)   hog: draft (round_cost_steps)
    the drafter's cost left out of a round                  hog: draft, dflash
    cache key without the thread count (pass_costs.py)      cached per key, foreign entry
    cache key without the weights' format                   cached per key
    a rejected entry used anyway                            foreign key, short, negative, decreasing
    the entry's key not compared                            foreign key
    calibration on the process's threads                    runs on the model's threads
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from npud.engine.api import SpecParams
from npud.engine.dflash import DFlashDraft, DFlashHead
from npud.engine.drafters import Draft, DraftModelHead, PromptLookupHead
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine import pass_costs
from npud.engine.pass_costs import FREE, DraftCosts, PassCosts, calibration_key, entry_path, load_or_calibrate
from npud.engine.sampling import Sampler
from npud.engine.speculative import FREE_REPROBE_AFTER, DecodeStats, RoundKind, plain_decode, speculative_decode
from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.kernels.base import WeightFormat
from test_dflash import BASE_LAYERS, write_random_dflash
from test_drafters import FakeTokenizer
from test_speculative import N, OracleHead, ToyBase, run_spec


class CostedBase(ToyBase):
    """ToyBase (its clock: a step 1.0, each verify row 0.25 more) with an injected cost model."""

    def __init__(self, ratios, **kw):
        super().__init__(**kw)
        self.costs = PassCosts(tuple(ratios), "injected")

    def pass_costs(self):
        return self.costs


class FreeOracle(OracleHead):
    costs = FREE

    def draft_cost(self):
        return 0.0


@pytest.fixture(scope="module")
def reference():
    from test_speculative import run_plain

    return run_plain(n=64)[0]


@pytest.mark.parametrize("five_rows, quality, falls_back", [
    (3.5, "half", True),  # t1 + 2 of 4 drafts = 3 tokens < 3.5 steps: fall back (the clock's 2.25 would keep it)
    (1.2, "garbage", True),  # 1 token < 1.2 steps
    (0.9 + 0.1, "garbage", False),  # a 5-row pass costing one step: t1 alone pays for it (the clock says 2.25)
])
def test_injected_costs_decide_whatever_the_clock_says(reference, five_rows, quality, falls_back):
    ratios = [1.0, 1.0, 1.0, 1.0, five_rows, five_rows + 1, five_rows + 2, five_rows + 3]
    base = CostedBase(ratios, row_cost=10.0)  # the clock: a 5-row verify 51 steps; ignored
    out, _, stats, _ = run_spec(FreeOracle(reference, quality), k=4, fallback_rounds=1, base=base)
    assert out == reference[:N]
    assert stats.fell_back is falls_back
    assert stats.cost_model == {"source": "injected", "ratios": ratios, "key": "",
                                "drafter": {"source": "free", "steps": [0.0], "key": ""}}
    assert stats.as_dict()["cost_model"] == stats.cost_model
    if falls_back:
        fb = stats.fallbacks[0]
        produced = 3 if quality == "half" else 1
        assert fb.round == 1 and fb.cost_ratio == pytest.approx(five_rows)
        # t1 plus (cost - 1) accepted drafts of the 4 pay for the round
        assert fb.break_even_acceptance == pytest.approx((five_rows - 1) / 4)
        assert fb.acceptance == pytest.approx((produced - 1) / 4)
        assert "calibrated pass costs" in fb.message


def test_free_drafts_look_again_after_a_fallback_others_stay_plain(reference):
    """reprobe_after None: prompt lookup (free drafts) speculates again FREE_REPROBE_AFTER plain
    tokens after its fallback; a head whose drafts cost something stays on plain decode."""
    base = CostedBase([1.0] * 4 + [3.5] * 4)
    out, _, stats, events = run_spec(FreeOracle(reference, "garbage"), n=48, k=4, fallback_rounds=1, base=base)
    first = stats.fallbacks[0]
    assert out == reference[:48] and stats.reprobes >= 1 and len(stats.fallbacks) == stats.reprobes + 1
    # the tokens emitted before the next speculative round: the fallback's, then 16 plain steps
    emitted = [sum(len(e.tokens) for e in events[: i + 1]) for i in range(len(events))]
    speculative = [i for i, e in enumerate(events) if e.kind is not RoundKind.STEP]
    assert emitted[speculative[0]] == first.emitted and emitted[speculative[1] - 1] == first.emitted + FREE_REPROBE_AFTER
    out, _, stats, _ = run_spec(OracleHead(reference, "garbage"), n=48, k=4, fallback_rounds=1,
                                base=ToyBase())
    assert out == reference[:48] and stats.fell_back and stats.reprobes == 0


def test_without_free_drafts_or_costs_the_clock_decides(reference):
    # a head that does not say its drafts are free: the measured times (a 5-row verify 2.25 steps)
    out, _, stats, _ = run_spec(OracleHead(reference, "half"), k=4, fallback_rounds=1,
                                base=CostedBase([1.0] * 4 + [3.5] * 4))
    assert out == reference[:N] and not stats.fell_back and stats.cost_model is None


def test_pass_costs_are_validated():
    with pytest.raises(ValueError, match="ratios"):
        PassCosts((2.0, 3.0), "injected")
    assert PassCosts((1.0, 1.5), "injected").rows(4) == pytest.approx(3.0)


PROMPT = [11, 57, 200, 3, 98, 140, 7, 77, 31, 11, 57, 200, 3, 98, 11, 57, 200, 5, 98, 140, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("costs")
    path = build_tiny_checkpoint(root / "qwen3", model_type="qwen3", num_hidden_layers=BASE_LAYERS)  # layers to tap
    return Model.load(path, "fp32"), root / "cache"


class Spotty:
    """A head whose drafts go wrong after their first token when the context length is a
    multiple of 3: the tokens decide which rounds pay off, so both outcomes of the rule occur."""

    def draft(self, context, k):
        d = super().draft(context, k)
        if len(context) % 3 or len(d.tokens) < 2:
            return d
        return Draft((d.tokens[0], *((t + 1) % 320 for t in d.tokens[1:])))


class SpottyLookup(Spotty, PromptLookupHead):
    pass


class SpottyDraftModel(Spotty, DraftModelHead):
    pass


class SpottyDFlash(Spotty, DFlashHead):
    pass


def _head(method, model, tmp_path):
    """The method's head on `model`, its draft costs a fixed table (so the outcomes are known)."""
    if method == "ngram":
        return SpottyLookup()
    if method == "draft":  # the base itself drafts (exactly, but for Spotty), each pass costed 0.3 steps
        return SpottyDraftModel(Forward(model), FakeTokenizer(vocab=320), FakeTokenizer(vocab=320),
                                costs=DraftCosts(tuple(0.3 + 0.03 * r for r in range(16)), "injected"))
    # a random DFlash draft runs its fold and block for real; its pick proposes the plain text
    plain = _plain_text(model)
    dflash = DFlashDraft.load(write_random_dflash(tmp_path / "dflash", block_size=8), model, "fp32")
    oracle = lambda hidden, context: Draft(tuple(plain[len(context) - len(PROMPT) :][: len(hidden)]))
    return SpottyDFlash(dflash, pick=oracle, costs=DraftCosts((0.5,) * 7, "injected"))


def _plain_text(model) -> list[int]:
    f = Forward(model, max_batch_rows=8)
    f.prefill(PROMPT[:-1])
    out = []
    for _ in plain_decode(f, PROMPT, max_new_tokens=MAX_NEW + 8, sampler=Sampler(), on_token=out.append,
                          stats=DecodeStats()):
        pass
    return out


MAX_NEW = 96


def _decisions(model, head) -> tuple:
    """What the break-even rule decided on one run, and everything it decided from."""
    f = Forward(model, max_batch_rows=8)
    if isinstance(head, DFlashHead):
        head.attach(f)
    f.prefill(PROMPT[:-1])
    stats, out, drafter_rows = DecodeStats(), [], []
    if isinstance(head, DraftModelHead):  # every pass the draft model runs, by its rows
        fw = head.forward
        fw.step = lambda t, p, step=fw.step: drafter_rows.append(1) or step(t, p)
        fw.step_batch_all = lambda ts, p, batch=fw.step_batch_all: drafter_rows.append(len(ts)) or batch(ts, p)
    config = SpecParams(k=6, fallback_rounds=1, reprobe_after=3)
    cost = 0.0  # what the rounds cost by the tables, counted here from what ran
    for event in speculative_decode(f, head, PROMPT, max_new_tokens=MAX_NEW, sampler=Sampler(),
                                    on_token=out.append, stats=stats, config=config):
        if event.kind is RoundKind.ONE_PASS:
            cost += model.pass_costs.rows(event.drafted + 1)  # [t1, d1..dk] verified in one pass
            if isinstance(head, DFlashHead):
                cost += head.costs.rows(event.drafted)  # its fold, block and pick for k drafts
    head.reset()
    if isinstance(head, DraftModelHead):
        del fw.step, fw.step_batch_all
        cost += sum(head.costs.rows(r) for r in drafter_rows)
    assert stats.round_cost_steps == pytest.approx(cost)
    fallbacks = [(b.round, b.emitted, b.acceptance, b.break_even_acceptance, b.cost_ratio) for b in stats.fallbacks]
    return out, stats.rounds, stats.drafted, stats.accepted, stats.plain_steps, stats.round_cost_steps, fallbacks


def test_calibration_is_cached_per_key_and_monotone(tiny):
    model, cache = tiny
    first = load_or_calibrate(model, 2, 8, cache / "own")
    again = load_or_calibrate(model, 2, 8, cache / "own")
    assert first.source == "calibrated" and first.step_seconds > 0
    assert again.source == "cached" and again.ratios == first.ratios and again.key == first.key
    assert first.ratios[0] == 1.0 and list(first.ratios) == sorted(first.ratios) and len(first.ratios) == 8
    # the thread count, the row count and the weights' format each make another key
    assert len({first.key, calibration_key(model, 1, 8), calibration_key(model, 2, 16)}) == 3
    fp32, model.weights.lm_head = model.weights.lm_head, dataclasses.replace(model.weights.lm_head, fmt=WeightFormat.BF16)
    try:
        assert calibration_key(model, 2, 8) != first.key
    finally:
        model.weights.lm_head = fp32


@pytest.mark.parametrize("damage", ["torn", "foreign key", "short", "negative", "decreasing", "not a dict"])
def test_a_damaged_or_foreign_entry_is_measured_again(tiny, damage):
    model, cache = tiny
    where = cache / damage
    good = load_or_calibrate(model, 2, 8, where)
    path = entry_path(good.key, where)
    entry = json.loads(path.read_text())
    seconds = [0.5 + 0.1 * r for r in range(8)]  # a table this test can tell apart from a measured one
    bad = {
        "torn": path.read_text()[:20],
        "foreign key": json.dumps({**entry, "key": calibration_key(model, 1, 8), "seconds": seconds}),
        "short": json.dumps({**entry, "table": seconds[:7]}),
        "negative": json.dumps({**entry, "table": [-s for s in seconds]}),
        "decreasing": json.dumps({**entry, "table": seconds[::-1]}),
        "not a dict": json.dumps(seconds),
    }[damage]
    path.write_text(bad)
    again = load_or_calibrate(model, 2, 8, where)
    assert again.source == "calibrated" and again.ratios != PassCosts.from_seconds(seconds, "x").ratios
    assert json.loads(path.read_text())["table"] != seconds  # rewritten with the new measurement
    assert load_or_calibrate(model, 2, 8, where).source == "cached"


def test_calibration_runs_on_the_models_threads(tiny, monkeypatch):
    from npud.kernels.host import native

    model, cache = tiny
    seen = []
    monkeypatch.setattr(pass_costs, "measure", lambda m, rows: seen.append(native.threads()) or (1.0,) * rows)
    before = native.threads()
    load_or_calibrate(model, 1, 8, cache / "threads")
    assert seen == [1] and native.threads() == before
    assert pass_costs.model_threads(3) == 3 and pass_costs.model_threads(None) >= 1


@pytest.mark.parametrize("method", ["ngram", "draft", "dflash"])
def test_same_speculation_decisions_with_a_cpu_hog_running(tiny, tmp_path, method):
    """The base's table as a calibration left it in the cache (a fixed one here, and fixed draft
    costs, so that the prompt's decisions are known to include both outcomes), then the same
    run quiet and twice under a hog on every core: the same rounds, fallbacks and inputs."""
    model, cache = tiny
    pass_costs.write_entry([0.01 * (1.0 + 0.15 * r) for r in range(8)], calibration_key(model, 2, 8), cache)
    model.pass_costs = load_or_calibrate(model, 2, 8, cache)
    head = _head(method, model, tmp_path)
    try:
        quiet = _decisions(model, head)
        out, rounds, _, _, _, _, fallbacks = quiet
        assert out == _plain_text(model)[:MAX_NEW]
        assert rounds > len(fallbacks) > 0  # both outcomes of the rule occur on this prompt
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            model.pass_costs = load_or_calibrate(model, 2, 8, cache)  # a later load: the cached table
            assert model.pass_costs.source == "cached"
            busy = [_decisions(model, head) for _ in range(2)]
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        assert busy == [quiet, quiet]
    finally:
        model.pass_costs = None
