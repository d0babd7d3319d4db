"""The speculative loop against plain decode, on a toy base whose logits are a function of
the whole committed prefix (a rolling hash per position), so a row that should have been
rolled back, or a position run twice, changes every later token; and on the real forward.
"""

# Mutants: each was applied alone to a scratch copy of engine/ (the shared tree was never
# edited), and tests/test_speculative.py, test_drafters.py and test_sampling.py were run
# (280 checks, all passing unmutated). Failing checks per mutant (the six first):
#
# | mutant                                                        | failing checks |
# |---------------------------------------------------------------|---------------:|
# | commit take rows instead of take + 1                          |            136 |
# | check draft i against row i + 1                               |            177 |
# | drop t1's row from commit_rows                                |             94 |
# | take the next t1 from row 0                                   |             87 |
# | let k use every batch row (max_batch_rows, not - 1)           |             18 |
# | skip commit_rows on the plain-step path                       |             55 |
# | skip the trim after a one-pass verify                         |             93 |
# | skip the trim after a two-pass verify                         |             31 |
# | k not held to the tokens the run may still emit               |              2 |
# | ignore needs_last_hidden() (always one-pass)                  |             70 |
# | two-pass: check draft i against row i (d1 judged twice)       |             66 |
# | commit the whole accepted chain past a consumer stop          |              3 |
# | fall back one round early                                     |              6 |
# | judge each round alone (a counter of consecutive losers)      |              1 |
# | adapt_k: shrink to take, not take + 1                         |              1 |
# | sampling: resample from p on reject, not the residual p - q   |              5 |
# | sampling: accept with p, ignoring q                           |              3 |
# | draft model: no truncation in commit_rows                     |              3 |
# | tap head: trim one row short                                  |              4 |

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from npud.engine.config import ConfigError
from npud.engine.drafters import NO_DRAFT, Draft
from npud.engine.api import SamplingParams
from npud.engine.sampling import Sampler
from npud.engine.api import SpecParams
from npud.engine.speculative import DecodeStats, FallbackReason, LoopEnd, RoundKind, plain_decode, speculative_decode

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 24
NO_FALLBACK = 0


def _mix(*values: int) -> int:
    """A deterministic 63-bit hash (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class ToyBase:
    """A `Base` whose row at position p is a function of (every token up to p, p).

    Keeps one hash per held position (its state), checks every pass starts at positions_held
    and never exceeds max_batch_rows, counts steps and batches, and advances a virtual clock
    by step_cost per pass plus row_cost per batch row, so break-even decisions are exact.
    With `markov` ([V, V] probabilities) the logits depend on the previous token only.
    """

    def __init__(self, vocab=32, rows=8, dim=6, hidden_is_logits=False, markov=None, step_cost=1.0, row_cost=0.25):
        self.vocab, self.rows, self.dim = vocab, rows, dim
        self.hidden_is_logits = hidden_is_logits
        self.markov = None if markov is None else np.log(np.asarray(markov, dtype=np.float64))
        self.step_cost, self.row_cost = step_cost, row_cost
        self.hashes: list[int] = []
        self.tokens: list[int] = []
        self.steps = self.batches = self.prefills = 0
        self.batch_sizes: list[int] = []
        self.now = 0.0
        self._hidden = None
        self.sink, self.tap_layers = None, ()

    @property
    def positions_held(self) -> int:
        return len(self.hashes)

    def max_batch_rows(self) -> int:
        return self.rows

    def clock(self) -> float:
        return self.now

    def logits_for(self, h: int, token: int) -> np.ndarray:
        if self.markov is not None:
            return self.markov[token].astype(np.float32)
        return np.random.default_rng(h).standard_normal(self.vocab).astype(np.float32)

    def hidden_for(self, h: int, token: int) -> np.ndarray:
        if self.hidden_is_logits:
            return self.logits_for(h, token)
        return np.random.default_rng(h ^ 0x5A5A).standard_normal(self.dim).astype(np.float32)

    def _run(self, tokens, start_pos) -> np.ndarray:
        if start_pos != len(self.hashes):
            raise AssertionError(f"pass at {start_pos} but {len(self.hashes)} positions held")
        logits, hidden, taps = [], [], []
        for token in tokens:
            if not 0 <= token < self.vocab:
                raise AssertionError(f"token {token} outside the vocabulary")
            prev = self.hashes[-1] if self.hashes else 0
            h = _mix(prev, token, len(self.hashes))
            self.hashes.append(h)
            self.tokens.append(token)
            logits.append(self.logits_for(h, token))
            hidden.append(self.hidden_for(h, token))
            taps.append(np.concatenate([self.tap_row(h, i) for i in self.tap_layers]) if self.tap_layers else None)
        self._hidden = np.stack(hidden)
        if self.sink is not None:
            self.sink.append(np.stack(taps))
        return np.stack(logits)

    def tap_row(self, h: int, layer: int) -> np.ndarray:
        return np.random.default_rng(_mix(h, layer)).standard_normal(self.dim).astype(np.float32)

    def step(self, token, pos):
        self.steps += 1
        self.now += self.step_cost
        return self._run([token], pos)[0]

    def step_batch_all(self, tokens, start_pos):
        if not 1 <= len(tokens) <= self.rows:
            raise AssertionError(f"batch of {len(tokens)} rows on a {self.rows}-row base")
        self.batches += 1
        self.batch_sizes.append(len(tokens))
        self.now += self.step_cost + self.row_cost * len(tokens)
        return self._run(tokens, start_pos)

    def prefill(self, tokens):
        self.prefills += 1
        return self._run(tokens, len(self.hashes))[-1]

    def truncate(self, n):
        if not 0 <= n <= len(self.hashes):
            raise AssertionError(f"truncate to {n} with {len(self.hashes)} held")
        del self.hashes[n:], self.tokens[n:]

    def last_hidden_rows(self):
        return self._hidden

    def set_layer_taps(self, layer_ids, sink):
        self.tap_layers, self.sink = tuple(layer_ids), sink


class OracleHead:
    """Drafts from a reference continuation: perfect, garbage (every draft wrong) or half
    (the first half of each draft right). Records every draft and every committed row."""

    def __init__(self, reference, quality="perfect", two_pass=False, vocab=32, prompt_len=len(PROMPT)):
        self.reference, self.quality, self.two_pass, self.vocab = reference, quality, two_pass, vocab
        self.prompt_len = prompt_len
        self.commits: list[tuple[int, np.ndarray | None]] = []
        self.draft_calls = 0
        self.hidden_seen = False

    def needs_last_hidden(self):
        return self.two_pass

    def draft(self, context, k):
        self.draft_calls += 1
        j = len(context) - self.prompt_len  # context ends with t1 = reference[j - 1]
        truth = [self.reference[i] if i < len(self.reference) else 0 for i in range(j, j + k)]
        wrong = [(t + 1) % self.vocab for t in truth]
        if self.quality == "perfect":
            return Draft(tuple(truth))
        if self.quality == "garbage":
            return Draft(tuple(wrong))
        half = (k + 1) // 2
        return Draft(tuple(truth[:half] + wrong[half:]))

    def commit_rows(self, tokens, rows, count):
        for i in range(count):
            row = None if rows is None else np.array(rows[i])
            self.hidden_seen |= rows is not None
            self.commits.append((tokens[i], row))

    def reset(self):
        self.commits.clear()

    def error(self):
        return None


def _start(base, prompt=PROMPT):
    base.prefill(prompt[:-1])
    return base


def run_plain(n=N, prompt=PROMPT, eos=frozenset(), stop_at=None, sampling=SamplingParams(), **base_kw):
    base = _start(ToyBase(**base_kw), prompt)
    out: list[int] = []

    def on_token(t):
        out.append(t)
        return stop_at is None or len(out) < stop_at

    stats = DecodeStats()
    events = list(
        plain_decode(base, prompt, max_new_tokens=n, sampler=Sampler(sampling), on_token=on_token, stats=stats, eos_ids=eos, clock=base.clock)
    )
    return out, base, stats, events


def run_spec(head, n=N, k=4, prompt=PROMPT, eos=frozenset(), stop_at=None, fallback_rounds=NO_FALLBACK,
             reprobe_after=None, sampling=SamplingParams(), base=None, adapt_k=False, **base_kw):
    base = _start(base if base is not None else ToyBase(**base_kw), prompt)
    out: list[int] = []

    def on_token(t):
        out.append(t)
        return stop_at is None or len(out) < stop_at

    stats = DecodeStats()
    config = SpecParams(k=k, adapt_k=adapt_k, fallback_rounds=fallback_rounds, reprobe_after=reprobe_after)
    events = list(
        speculative_decode(
            base, head, prompt, max_new_tokens=n, sampler=Sampler(sampling), on_token=on_token, stats=stats,
            config=config, eos_ids=eos, clock=base.clock,
        )
    )
    return out, base, stats, events


@pytest.fixture(scope="module")
def reference():
    out, base, _, _ = run_plain(n=N + 16)
    return out


# --------------------------------------------------------------------------- equality with plain decode


@pytest.mark.parametrize("adapt_k", [False, True], ids=["fixed_k", "adapt_k"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("k", [1, 2, 4, 7, 12])
@pytest.mark.parametrize("quality", ["perfect", "garbage", "half"])
@pytest.mark.parametrize("n", [N, 23])
def test_text_positions_state_equal_plain(reference, quality, k, two_pass, n, adapt_k):
    plain, plain_base, _, _ = run_plain(n=n)
    head = OracleHead(reference, quality, two_pass)
    out, base, stats, events = run_spec(head, n=n, k=k, adapt_k=adapt_k)
    assert out == plain
    assert base.positions_held == plain_base.positions_held == len(PROMPT) + n
    assert base.hashes == plain_base.hashes  # the state: every position, from the same prefix
    assert stats.emitted == n and stats.finish is LoopEnd.MAX_TOKENS
    assert [t for e in events for t in e.tokens] == out
    assert max(base.batch_sizes, default=0) <= 8  # k = 12 is clamped to the 8-row base
    # every committed row reaches the drafter once and in order, with its own hidden row
    assert [t for t, _ in head.commits] == out
    if two_pass:
        for i, (token, row) in enumerate(head.commits):
            h = base.hashes[len(PROMPT) + i]
            assert np.array_equal(row, base.hidden_for(h, token))
    else:
        assert not head.hidden_seen  # a one-pass head is never handed a hidden
    kinds = {e.kind for e in events}
    if quality != "garbage":
        assert (RoundKind.TWO_PASS if two_pass else RoundKind.ONE_PASS) in kinds
    assert stats.base_passes == base.steps - 1 + base.batches  # the prompt's last token excluded


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_stats_count_drafts_and_acceptance(reference, two_pass):
    head = OracleHead(reference, "half", two_pass)
    out, base, stats, events = run_spec(head, k=4)
    assert stats.rounds == sum(e.kind is not RoundKind.STEP for e in events)
    assert stats.plain_steps == sum(e.kind is RoundKind.STEP for e in events)
    assert stats.drafted == sum(e.drafted for e in events) > 0
    assert stats.accepted == sum(e.accepted for e in events)
    # half-right drafts of 4: the first two are kept in every round that verifies
    assert stats.acceptance_rate == pytest.approx(0.5, abs=0.1)
    assert stats.passes_per_token == stats.base_passes / N < 1.0
    assert stats.verify_step_ratio == pytest.approx(np.median([1.0 + 0.25 * m for m in base.batch_sizes]))
    assert stats.tokens_per_second == pytest.approx(N / base.now)  # the prompt step included, not the prefill
    d = stats.as_dict()
    assert d["finish"] == "max_tokens" and d["fell_back"] is False and d["emitted"] == N


# --------------------------------------------------------------------------- pass accounting


@pytest.mark.parametrize("k", [1, 2, 4, 7, 12])
def test_fully_accepted_chain_takes_ceil_batches_and_no_step(reference, k):
    head = OracleHead(reference, "perfect", two_pass=False)
    out, base, stats, _ = run_spec(head, k=k)
    rows = min(k, 7) + 1
    assert base.batches == math.ceil(N / rows)
    assert base.steps == 1  # the prompt's last token only; no decode step
    assert stats.accepted == stats.drafted == N - base.batches
    assert base.batch_sizes == [rows] * (N // rows) + ([N % rows] if N % rows else [])


def test_fully_accepted_two_pass_chain_costs_a_step_and_a_batch_per_round(reference):
    head = OracleHead(reference, "perfect", two_pass=True)
    out, base, stats, _ = run_spec(head, k=7)
    assert (base.steps - 1, base.batches) == (3, 3)
    assert stats.passes_per_token == pytest.approx(0.25)
    one_pass = run_spec(OracleHead(reference, "perfect"), k=7)[2]
    assert one_pass.passes_per_token == pytest.approx(0.125)


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("k", [1, 2, 4, 7, 12])
def test_garbage_head_costs_one_pass_per_token(reference, k, two_pass):
    head = OracleHead(reference, "garbage", two_pass)
    out, base, stats, _ = run_spec(head, k=k)
    assert stats.base_passes == N
    assert stats.accepted == 0
    if two_pass:
        assert base.batches == 0  # a wrong d1 is caught on the step's logits


def test_budget_holds_the_last_batch_to_what_may_still_be_emitted(reference):
    head = OracleHead(reference, "perfect")
    out, base, stats, _ = run_spec(head, n=5, k=7)
    assert base.batch_sizes == [5] and base.steps == 1 and out == reference[:5]


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("quality", ["perfect", "half"])
def test_one_row_base_gives_plain_steps_and_no_batch(reference, quality, two_pass):
    plain, plain_base, _, _ = run_plain(rows=1)
    head = OracleHead(reference, quality, two_pass)
    out, base, stats, _ = run_spec(head, k=4, rows=1)
    assert out == plain and base.hashes == plain_base.hashes
    assert base.batches == 0
    assert base.steps - 1 == stats.base_passes == N
    assert [t for t, _ in head.commits] == out


# --------------------------------------------------------------------------- stops


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("quality", ["perfect", "half", "garbage"])
def test_consumer_stop_on_sixth_token(reference, quality, two_pass):
    head = OracleHead(reference, quality, two_pass)
    out, base, stats, events = run_spec(head, k=4, stop_at=6)
    plain, plain_base, _, _ = run_plain(stop_at=6)
    assert out == plain == reference[:6]
    assert stats.emitted == 6 and stats.finish is LoopEnd.STOPPED
    assert base.positions_held == len(PROMPT) + 6
    assert base.hashes == plain_base.hashes
    assert [t for t, _ in head.commits] == out
    assert [t for e in events for t in e.tokens] == out


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("quality", ["perfect", "half"])
def test_eos_inside_an_accepted_chain_stops_like_plain(reference, quality, two_pass):
    eos = frozenset({reference[10]})
    stop = reference.index(reference[10]) + 1
    plain, plain_base, _, _ = run_plain(eos=eos)
    head = OracleHead(reference, quality, two_pass)
    out, base, stats, _ = run_spec(head, k=7, eos=eos)
    assert out == plain == reference[:stop]
    assert stats.finish is LoopEnd.EOS
    assert base.hashes == plain_base.hashes
    assert [t for t, _ in head.commits] == out


def test_zero_tokens_runs_the_prompt_and_emits_nothing(reference):
    out, base, stats, events = run_spec(OracleHead(reference), n=0)
    assert out == [] and events == [] and base.positions_held == len(PROMPT)
    assert stats.finish is LoopEnd.MAX_TOKENS


def test_base_must_hold_the_prompt_but_its_last_token(reference):
    base = ToyBase()
    base.prefill(PROMPT)
    with pytest.raises(ValueError, match="base holds 8 positions"):
        next(speculative_decode(base, OracleHead(reference), PROMPT, max_new_tokens=4,
                                sampler=Sampler(), on_token=lambda t: True, stats=DecodeStats()))


# --------------------------------------------------------------------------- fallback


def test_garbage_head_falls_back_after_the_configured_rounds_and_output_stays_equal(reference):
    plain, plain_base, _, _ = run_plain()
    head = OracleHead(reference, "garbage")
    out, base, stats, events = run_spec(head, k=4, fallback_rounds=3)
    assert out == plain and base.hashes == plain_base.hashes
    [fb] = stats.fallbacks
    assert fb.reason is FallbackReason.BELOW_BREAK_EVEN
    assert (fb.round, fb.emitted) == (3, 3)
    # a 5-row verify costs 1 + 5 * 0.25 steps on this base and yields t1 only
    assert fb.cost_ratio == pytest.approx(2.25)
    assert fb.break_even_acceptance == pytest.approx(1.25 / 4)
    assert fb.acceptance == 0.0 and "3 consecutive rounds below break-even" in fb.message
    assert head.draft_calls == 3
    assert [e.kind for e in events] == [RoundKind.ONE_PASS] * 3 + [RoundKind.STEP] * (N - 3)
    assert stats.as_dict()["fallbacks"][0]["round"] == 3


@pytest.mark.parametrize("rounds", [1, 5])
def test_fallback_rounds_is_configurable(reference, rounds):
    out, _, stats, _ = run_spec(OracleHead(reference, "garbage"), k=4, fallback_rounds=rounds)
    assert out == reference[:N]
    assert stats.fallbacks[0].round == rounds


def test_fallback_reprobes_after_the_configured_tokens(reference):
    plain, plain_base, _, _ = run_plain()
    head = OracleHead(reference, "garbage")
    out, base, stats, events = run_spec(head, k=4, fallback_rounds=2, reprobe_after=5)
    assert out == plain and base.hashes == plain_base.hashes
    # 2 rounds, fall back, 5 plain tokens, re-probe: 2 rounds, fall back, ...
    assert [f.emitted for f in stats.fallbacks] == [2, 9, 16, 23]
    assert stats.reprobes == 3
    assert [t for t, _ in head.commits] == out  # plain steps keep the head in sync


@pytest.mark.parametrize("quality", ["perfect", "half"])
def test_a_head_above_break_even_never_falls_back(reference, quality):
    out, _, stats, _ = run_spec(OracleHead(reference, quality), k=4, fallback_rounds=1)
    assert out == reference[:N] and not stats.fell_back


class ScheduledHead(OracleHead):
    """Garbage, garbage, then `lucky` quality, round after round."""

    def __init__(self, reference, lucky):
        super().__init__(reference)
        self.lucky = lucky

    def draft(self, context, k):
        self.quality = self.lucky if self.draft_calls % 3 == 2 else "garbage"
        return super().draft(context, k)


@pytest.mark.parametrize("lucky, falls_back", [("half", True), ("perfect", False)])
def test_fallback_judges_the_last_rounds_together(reference, lucky, falls_back):
    # a 5-row verify costs 2.25 steps: 3 rounds cost 6.75 steps; garbage, garbage and a half
    # round (t1 + 2 drafts) yield 5 tokens (fall back, though the half round alone paid off);
    # with a perfect round they yield 7 (keep speculating)
    out, _, stats, _ = run_spec(ScheduledHead(reference, lucky), k=4, fallback_rounds=3)
    assert out == reference[:N]
    assert stats.fell_back is falls_back
    if falls_back:
        assert stats.fallbacks[0].round == 3 and stats.fallbacks[0].acceptance == pytest.approx(2 / 12)


def test_adapt_k_shrinks_after_a_reject_and_grows_after_full_accepts(reference):
    plain, plain_base, _, _ = run_plain()
    # garbage: 8 rows, then t1 + 1 draft (take 0 -> 1 draft) every round
    out, base, _, _ = run_spec(OracleHead(reference, "garbage"), k=7, adapt_k=True)
    assert out == plain and base.batch_sizes[:3] == [8, 2, 2]
    # perfect: never shrinks, so the full-chain count holds
    out, base, _, _ = run_spec(OracleHead(reference, "perfect"), k=7, adapt_k=True)
    assert out == plain and base.batch_sizes == [8, 8, 8]
    # half-right at k = 4: 2 of 4 kept -> 3 drafts, 2 kept -> 3, ...; a full accept doubles
    out, base, stats, events = run_spec(OracleHead(reference, "half"), k=4, adapt_k=True)
    assert out == plain and base.hashes == plain_base.hashes
    assert [e.drafted for e in events][:3] == [4, 3, 3]


def test_adapt_k_cuts_the_cost_of_a_losing_streak_before_the_fallback(reference):
    out, base, stats, _ = run_spec(OracleHead(reference, "garbage"), k=7, adapt_k=True, fallback_rounds=3)
    assert out == reference[:N]
    # rounds of 8, 2 and 2 rows: 3 + 1.5 + 1.5 steps for 3 tokens, against 3 x 3 at a fixed k
    [fb] = stats.fallbacks
    assert fb.round == 3 and fb.cost_ratio == pytest.approx(6.0 / 3)


class FailingHead(OracleHead):
    def draft(self, context, k):
        self.draft_calls += 1
        return NO_DRAFT

    def error(self):
        return "draft container lost its weights"


def test_a_head_error_falls_back_with_its_message(reference):
    head = FailingHead(reference)
    out, _, stats, _ = run_spec(head, k=4, fallback_rounds=3)
    assert out == reference[:N]
    [fb] = stats.fallbacks
    assert fb.reason is FallbackReason.HEAD_ERROR and fb.message == "draft container lost its weights"
    assert fb.break_even_acceptance is None and fb.cost_ratio is None
    assert head.draft_calls == 1
    json.dumps(stats.as_dict(), allow_nan=False)  # the generation result carries it as JSON


def test_out_of_vocabulary_drafts_fall_back_without_touching_the_base(reference):
    class Wild(OracleHead):
        def draft(self, context, k):
            return Draft((1000,) * k)

    out, base, stats, _ = run_spec(Wild(reference), k=4)
    assert out == reference[:N] and base.batches == 0
    assert "outside the base's vocabulary of 32" in stats.fallbacks[0].message


def test_config_is_validated():
    with pytest.raises(ConfigError, match="SpecParams.k"):
        SpecParams(k=0)
    with pytest.raises(ConfigError, match="fallback_rounds"):
        SpecParams(fallback_rounds=-1)
    with pytest.raises(ConfigError, match="reprobe_after"):
        SpecParams(reprobe_after=0)


# --------------------------------------------------------------------------- speculative sampling


# A 4-token Markov base (the logits depend on the previous token only) and drafters that
# propose from a different distribution. Over many tokens the transition counts must match the
# base's matrix. Statistic: sum over previous tokens a of sum_b (n_ab - n_a P_ab)^2 / (n_a P_ab),
# chi-square with V (V - 1) = 12 degrees of freedom; threshold chi2.ppf(0.999, 12) = 32.91.
MARKOV = np.array(
    [[0.50, 0.25, 0.15, 0.10], [0.10, 0.60, 0.20, 0.10], [0.25, 0.25, 0.25, 0.25], [0.05, 0.15, 0.30, 0.50]]
)
CHI2_999_DF12 = 32.91
SAMPLES = 12000


class MarkovDraftHead:
    """Drafts by sampling its own Markov matrix Q (returned as q rows), or deterministically
    (q one-hot) by repeating t1."""

    def __init__(self, q_matrix=None, seed=7):
        self.q = q_matrix
        self.rng = np.random.default_rng(seed)

    def needs_last_hidden(self):
        return False

    def draft(self, context, k):
        if self.q is None:
            return Draft((context[-1],) * k)
        tokens, probs, prev = [], [], context[-1]
        for _ in range(k):
            row = self.q[prev]
            prev = int(self.rng.choice(4, p=row))
            tokens.append(prev)
            probs.append(row)
        return Draft(tuple(tokens), np.array(probs))

    def commit_rows(self, tokens, rows, count):
        pass

    def reset(self):
        pass

    def error(self):
        return None


def _chi_square(tokens, start):
    counts = np.zeros((4, 4))
    prev = start
    for t in tokens:
        counts[prev, t] += 1
        prev = t
    n_a = counts.sum(axis=1, keepdims=True)
    expected = n_a * MARKOV
    return float(((counts - expected) ** 2 / expected).sum())


Q_FAR = np.array(
    [[0.10, 0.20, 0.30, 0.40], [0.40, 0.10, 0.10, 0.40], [0.70, 0.10, 0.10, 0.10], [0.25, 0.25, 0.25, 0.25]]
)


@pytest.mark.parametrize("q_matrix", [Q_FAR, None], ids=["sampled_q", "deterministic"])
def test_speculative_sampling_preserves_the_base_distribution(q_matrix):
    sampling = SamplingParams(temperature=1.0, seed=1234)
    head = MarkovDraftHead(q_matrix)
    out, base, stats, _ = run_spec(head, n=SAMPLES, k=3, sampling=sampling, vocab=4, markov=MARKOV,
                                   prompt=[0, 1])
    assert 0.2 < stats.acceptance_rate < 0.9  # both accept and reject paths ran many times
    assert _chi_square(out, start=1) < CHI2_999_DF12


def test_plain_sampling_has_the_base_distribution_and_the_check_can_fail():
    sampling = SamplingParams(temperature=1.0, seed=1234)
    out, _, _, _ = run_plain(n=SAMPLES, sampling=sampling, vocab=4, markov=MARKOV, prompt=[0, 1])
    assert _chi_square(out, start=1) < CHI2_999_DF12
    # the statistic sees a sampler drawing from the drafter's matrix instead
    skewed = run_plain(n=SAMPLES, sampling=sampling, vocab=4, markov=Q_FAR, prompt=[0, 1])[0]
    assert _chi_square(skewed, start=1) > 10 * CHI2_999_DF12


# --------------------------------------------------------------------------- the real forward


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    pytest.importorskip("npud.engine.forward", reason="npud/engine/forward.py has not landed")
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "qwen3", model_type="qwen3")


@pytest.fixture(scope="module")
def real_model(real_checkpoint):
    from npud.engine.model import Model

    return Model.load(real_checkpoint, "fp32")


REAL_PROMPT = [11, 57, 200, 3, 98, 140, 7, 77, 31]


def _real(model, head, n=N, k=4, rows=8, adapt_k=False):
    from npud.engine.forward import Forward

    f = Forward(model, max_batch_rows=rows)
    f.prefill(REAL_PROMPT[:-1])
    out, stats = [], DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
    if head is None:
        loop = plain_decode(f, REAL_PROMPT, **common)
    else:
        loop = speculative_decode(f, head, REAL_PROMPT, config=SpecParams(k=k, adapt_k=adapt_k, fallback_rounds=0), **common)
    for _ in loop:
        pass
    return out, f, stats


@pytest.fixture(scope="module")
def real_reference(real_model):
    return _real(real_model, None, n=N + 16)[0]


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("k", [1, 2, 4, 7, 12])
@pytest.mark.parametrize("quality", ["perfect", "garbage", "half", "half_adapt_k"])
def test_real_forward_equals_plain_decode(real_model, real_reference, quality, k, two_pass):
    plain, plain_f, _ = _real(real_model, None)
    adapt_k = quality.endswith("adapt_k")
    head = OracleHead(real_reference, quality.removesuffix("_adapt_k"), two_pass, vocab=real_model.config.vocab_size,
                      prompt_len=len(REAL_PROMPT))
    out, f, stats = _real(real_model, head, k=k, adapt_k=adapt_k)
    assert out == plain == real_reference[:N]
    assert f.positions_held == plain_f.positions_held == len(REAL_PROMPT) + N
    # one step past the run: the whole state agrees bit for bit with plain decode's
    assert np.array_equal(f.step(out[-1], f.positions_held), plain_f.step(out[-1], plain_f.positions_held))
    assert [t for t, _ in head.commits] == out
    if quality == "perfect" and not two_pass:
        assert (stats.base_batches, stats.base_steps) == (math.ceil(N / (min(k, 7) + 1)), 0)
    if quality == "garbage":
        assert stats.base_passes == N


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8-q8", "bf16-bf16"])
def test_real_forward_equals_plain_decode_in_every_weight_format(real_checkpoint, fmt):
    # the verify's rows must be the one-row bits in each format's arithmetic too (bf16-bf16's
    # bf16 activations and int8-q8's quantized blocks included): greedy output byte-equal
    from npud.engine.model import Model

    model = Model.load(real_checkpoint, fmt)
    reference = _real(model, None, n=N + 16)[0]
    for quality, k in (("half", 4), ("perfect", 7)):
        head = OracleHead(reference, quality, False, vocab=model.config.vocab_size, prompt_len=len(REAL_PROMPT))
        out, f, _ = _real(model, head, k=k)
        assert out == reference[:N], (fmt, quality, k)


def test_real_forward_two_pass_head_gets_the_final_normed_row_of_each_token(real_model, real_reference):
    from npud.engine.forward import Forward

    head = OracleHead(real_reference, "half", two_pass=True, vocab=real_model.config.vocab_size, prompt_len=len(REAL_PROMPT))
    out, f, _ = _real(real_model, head, k=4)
    replay = Forward(real_model)
    replay.prefill(REAL_PROMPT)
    for token, row in head.commits:
        replay.step(token, replay.positions_held)
        assert np.array_equal(row, replay.last_hidden_rows()[0])
