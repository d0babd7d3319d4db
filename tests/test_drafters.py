"""Drafters: prompt lookup, draft model, the hidden-reading toy head; on the toy base of
test_speculative and, where npud.engine.forward exists, on tiny real checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import (
    MARKOV,
    PROMPT,
    Q_FAR,
    SAMPLES,
    CHI2_999_DF12,
    OracleHead,
    ToyBase,
    _chi_square,
    run_plain,
    run_spec,
)

from npud.engine.config import ConfigError
from npud.engine.drafters import (
    NO_DRAFT,
    Draft,
    DraftMismatchError,
    DraftModelHead,
    HeadWeights,
    HiddenStateHead,
    PromptLookupHead,
    check_same_tokenizer,
)
from npud.engine.api import SamplingParams
from npud.engine.sampling import Sampler
from npud.engine.speculative import RoundKind

# --------------------------------------------------------------------------- prompt lookup


def test_prompt_lookup_proposes_what_followed_the_most_recent_match():
    head = PromptLookupHead(min_n=2, max_n=3)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    # [1, 2, 3] occurred twice before; the later one (followed by 4 5 6) wins
    assert head.draft(context, 3) == Draft((4, 5, 6))


def test_prompt_lookup_prefers_the_longest_n_gram():
    head = PromptLookupHead(min_n=1, max_n=3)
    context = [7, 8, 9, 11, 12, 5, 9, 13, 7, 8, 9]
    # 1-gram [9] last occurred before 13; the 3-gram [7, 8, 9] is older and followed by 11 12
    assert head.draft(context, 2) == Draft((11, 12))
    assert PromptLookupHead(min_n=1, max_n=1).draft(context, 2) == Draft((13, 7))


def test_prompt_lookup_without_a_match_of_min_n_proposes_nothing():
    head = PromptLookupHead(min_n=2, max_n=4)
    assert head.draft([1, 2, 3, 4, 5, 1], 4) is NO_DRAFT
    assert head.draft([1], 4) is NO_DRAFT
    assert head.error() is None
    assert PromptLookupHead(min_n=1, max_n=4).draft([1, 2, 3, 4, 5, 1], 2) == Draft((2, 3))


def test_prompt_lookup_repeats_a_pattern_past_the_end_of_the_context():
    head = PromptLookupHead(min_n=2, max_n=4)
    assert head.draft([5, 6, 5, 6, 5], 4) == Draft((6, 5, 6, 5))
    assert head.draft([4, 4, 4], 5) == Draft((4, 4, 4, 4, 4))


def test_prompt_lookup_lookback_limits_the_search():
    context = [1, 2, 3] + [0] * 20 + [1, 2]
    assert PromptLookupHead(min_n=2, max_n=2).draft(context, 1) == Draft((3,))
    assert PromptLookupHead(min_n=2, max_n=2, lookback=10).draft(context, 1) is NO_DRAFT


def _lookup_by_search(context, k, min_n, max_n, lookback=None):
    """The specification, by brute force: latest earlier match of the longest suffix n-gram."""
    size = len(context)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        lo = 0 if lookback is None else max(0, size - lookback)
        for i in range(size - n - 1, lo - 1, -1):
            if context[i : i + n] == context[size - n :]:
                ext = list(context)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return tuple(ext[size:])
    return ()


@pytest.mark.parametrize("min_n, max_n, lookback", [(1, 3, None), (2, 4, None), (2, 2, 12)])
def test_prompt_lookup_index_agrees_with_a_brute_force_search(min_n, max_n, lookback):
    rng = np.random.default_rng(min_n * 10 + max_n)
    head = PromptLookupHead(min_n=min_n, max_n=max_n, lookback=lookback)
    for job in range(3):
        head.reset()
        context = [int(t) for t in rng.integers(0, 4, 3)]
        for _ in range(120):  # the loop's contexts only grow within a job
            context += [int(t) for t in rng.integers(0, 4, rng.integers(1, 4))]
            k = int(rng.integers(1, 9))
            assert head.draft(context, k).tokens == _lookup_by_search(context, k, min_n, max_n, lookback)


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(min_n=0), "min_n"), (dict(min_n=3, max_n=2), "max_n"), (dict(lookback=2), "lookback")],
)
def test_prompt_lookup_config_is_validated(kwargs, field):
    with pytest.raises(ConfigError, match=f"PromptLookupHead.{field}"):
        PromptLookupHead(**kwargs)


def _cycle_markov(vocab=32, seed=3):
    """A base whose greedy choice is perm[previous token]: its output cycles, as edited code
    repeats its source, so prompt lookup has something to find."""
    perm = np.random.default_rng(seed).permutation(vocab)
    m = np.full((vocab, vocab), 0.1 / (vocab - 1))
    m[np.arange(vocab), perm] = 0.9
    return m


@pytest.mark.parametrize("k", [1, 4, 7])
def test_prompt_lookup_in_the_loop_equals_plain_and_saves_passes(k):
    markov = _cycle_markov()
    plain, plain_base, _, _ = run_plain(n=40, markov=markov)
    head = PromptLookupHead(min_n=1, max_n=3)
    out, base, stats, events = run_spec(head, n=40, k=k, markov=markov)
    assert out == plain and base.hashes == plain_base.hashes
    assert head.committed == 40
    assert stats.acceptance_rate > 0.5 and stats.passes_per_token < 0.75


# --------------------------------------------------------------------------- draft model


class FakeTokenizer:
    def __init__(self, vocab=32, eos=(0,), bos=None, special=(0,), texts=None):
        self.vocab_size, self.eos_token_ids, self.bos_token_id = vocab, tuple(eos), bos
        self.special_token_ids = frozenset(special)
        self.texts = texts or {}

    def decode(self, ids):
        return "".join(self.texts.get(i, f"<{i}>") for i in ids)


@pytest.mark.parametrize(
    "draft_tok, what",
    [
        (FakeTokenizer(vocab=40), "vocab_size is 40 in the draft, 32 in the base"),
        (FakeTokenizer(eos=(0, 5)), "eos_token_ids is [0, 5] in the draft, [0] in the base"),
        (FakeTokenizer(bos=1), "bos_token_id is 1 in the draft, None in the base"),
        (FakeTokenizer(special=(0, 1)), "special_token_ids"),
        (FakeTokenizer(texts={17: "x"}), "the text of token 17 is 'x' in the draft, '<17>' in the base"),
    ],
)
def test_draft_model_with_another_tokenizer_is_refused(draft_tok, what):
    with pytest.raises(DraftMismatchError, match=what.replace("[", r"\[").replace("]", r"\]")):
        DraftModelHead(ToyBase(), FakeTokenizer(), draft_tok)


class CountingBase(ToyBase):
    """A draft forward that counts the rows it runs."""

    rows_run = 0

    def _run(self, tokens, start_pos):
        self.rows_run += len(tokens)
        return super()._run(tokens, start_pos)


@pytest.mark.parametrize("k", [1, 4, 7, 12])
@pytest.mark.parametrize("same", [True, False], ids=["same_model", "other_model"])
def test_draft_model_in_the_loop_equals_plain_and_rolls_back(k, same):
    plain, plain_base, _, _ = run_plain()
    # the same toy function drafts perfectly; another vocabulary mapping drafts garbage
    draft = CountingBase(rows=16) if same else CountingBase(rows=16, markov=_cycle_markov())
    head = DraftModelHead(draft, FakeTokenizer(), FakeTokenizer())
    out, base, stats, events = run_spec(head, k=k)
    assert out == plain and base.hashes == plain_base.hashes
    if same:
        assert stats.accepted == stats.drafted  # fully accepted chains
    committed = PROMPT + out
    # the draft forward holds a prefix of the committed stream plus at most k - 1 own drafts
    assert draft.tokens[: len(draft.tokens) - (k - 1)] == committed[: len(draft.tokens) - (k - 1)]
    # and never re-runs the context: each committed token once, plus the drafts it ran
    assert draft.rows_run <= len(committed) + stats.drafted


def test_draft_model_rolled_back_after_a_reject_holds_the_committed_stream():
    base_markov = _cycle_markov(seed=3)
    head = DraftModelHead(ToyBase(markov=_cycle_markov(seed=4)), FakeTokenizer(), FakeTokenizer())
    out, base, stats, _ = run_spec(head, n=16, k=4, markov=base_markov)
    assert stats.accepted < stats.drafted
    # after the last commit the draft forward kept only committed positions (and no reject)
    committed = PROMPT + out
    assert head.forward.tokens == committed[: len(head.forward.tokens)]
    assert head.committed == 16


class CheckedDraftModelHead(DraftModelHead):
    """After every commit, the draft forward must hold only committed tokens: a prefix of
    what the base holds (the base is truncated before commit_rows is called)."""

    base = None
    checks = 0

    def commit_rows(self, tokens, rows, count):
        super().commit_rows(tokens, rows, count)
        held = self.forward.tokens
        assert held == self.base.tokens[: len(held)], "a rejected draft is still in the draft forward"
        self.checks += 1


@pytest.mark.parametrize("k", [2, 4, 7])
def test_draft_model_is_rolled_back_at_each_commit(k):
    base = ToyBase(markov=_cycle_markov(seed=3))
    head = CheckedDraftModelHead(ToyBase(markov=_cycle_markov(seed=4)), FakeTokenizer(), FakeTokenizer())
    head.base = base
    out, _, stats, _ = run_spec(head, n=24, k=k, base=base)
    assert stats.accepted < stats.drafted and head.checks == stats.rounds + stats.plain_steps


def test_draft_model_catches_up_after_a_fallback_in_batches_of_its_rows():
    plain, plain_base, _, _ = run_plain(n=40)
    draft = CountingBase(rows=4, markov=_cycle_markov())  # drafts garbage: the job falls back
    head = DraftModelHead(draft, FakeTokenizer(), FakeTokenizer())
    out, base, stats, _ = run_spec(head, n=40, k=4, fallback_rounds=2, reprobe_after=9)
    assert out == plain and base.hashes == plain_base.hashes
    assert stats.reprobes >= 2
    # the 9 plain tokens between probes reach the draft forward as batches of at most 4 rows
    assert max(draft.batch_sizes) == 4
    assert draft.rows_run <= len(PROMPT) + 40 + stats.drafted
    head.reset()  # a fresh job
    assert draft.positions_held == 0 and head.held == []


def test_draft_model_sampling_preserves_the_base_distribution():
    # the session hands the draft the job's own sampling config, seed included
    sampling = SamplingParams(temperature=1.0, seed=99)
    draft = ToyBase(vocab=4, markov=Q_FAR, rows=16)
    head = DraftModelHead(draft, FakeTokenizer(vocab=4), FakeTokenizer(vocab=4), sampling)
    # its draws come from a stream of their own, not a copy of the accept test's uniforms
    assert head.sampler.rng.random(8).tolist() != Sampler(sampling).rng.random(8).tolist()
    out, _, stats, _ = run_spec(head, n=SAMPLES // 2, k=3, sampling=sampling, vocab=4, markov=MARKOV, prompt=[0, 1])
    assert 0.2 < stats.acceptance_rate < 0.9
    assert _chi_square(out, start=1) < CHI2_999_DF12
    d = head.draft([0, 1, 2], 3)
    assert d.probs.shape == (3, 4) and np.allclose(d.probs.sum(axis=1), 1.0)
    assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens))


# --------------------------------------------------------------------------- hidden-reading head


def _identity_weights(vocab=32):
    eye = np.eye(vocab, dtype=np.float32)
    zeros = np.zeros((vocab, vocab), np.float32)
    return HeadWeights(w_in=eye, w_state=zeros, embed=zeros, w_out=eye)


@pytest.mark.parametrize("k", [1, 4, 12])
def test_mtp_style_head_reads_the_row_after_t1_in_two_pass_rounds(k):
    plain, plain_base, _, _ = run_plain(hidden_is_logits=True)
    # the toy base's hidden row is its logits row, so an identity head's d1 is the base's choice
    head = HiddenStateHead(_identity_weights())
    out, base, stats, events = run_spec(head, k=k, hidden_is_logits=True)
    assert out == plain and base.hashes == plain_base.hashes
    assert head.needs_last_hidden()
    spec_rounds = [e for e in events if e.kind is RoundKind.TWO_PASS]
    assert spec_rounds and all(e.accepted >= 1 for e in spec_rounds)  # d1, from t1's row, always right


class OracleTapHead(HiddenStateHead):
    """The tap bookkeeping of HiddenStateHead with half-right oracle drafts, so rows are
    committed after partial accepts too."""

    def __init__(self, reference, base, layers):
        super().__init__(HeadWeights.random(features=6 * len(layers), dim=8, vocab=32), taps=(base, layers))
        self.oracle = OracleHead(reference, "half")

    def draft(self, context, k):
        super().draft(context, k)  # the real feature path runs too
        return self.oracle.draft(context, k)


@pytest.mark.parametrize("k", [2, 4, 7])
def test_tap_head_holds_exactly_the_committed_rows(k):
    plain, plain_base, _, _ = run_plain()
    reference = run_plain(n=40)[0]
    base = ToyBase()
    head = OracleTapHead(reference, base, layers=[0, 1])
    assert not head.needs_last_hidden()
    out, base, stats, events = run_spec(head, k=k, base=base)
    assert out == plain and base.hashes == plain_base.hashes
    assert 0 < stats.accepted < stats.drafted  # partial accepts: rejected tap rows were dropped
    expected = [np.concatenate([base.tap_row(h, 0), base.tap_row(h, 1)]) for h in base.hashes]
    assert len(head.tap_rows) == len(expected) == len(PROMPT) + len(out)
    assert all(np.array_equal(a, b) for a, b in zip(head.tap_rows, expected))


def test_random_tap_head_runs_one_pass_rounds_and_equals_plain():
    plain, plain_base, _, _ = run_plain()
    base = ToyBase()
    head = HiddenStateHead(HeadWeights.random(features=6, dim=8, vocab=32, seed=1), taps=(base, [1]))
    out, base, stats, events = run_spec(head, k=4, base=base)
    assert out == plain and base.hashes == plain_base.hashes
    # one-pass rounds; the last token alone, with no room for a draft, takes a plain step
    assert [e.kind for e in events][:-1] == [RoundKind.ONE_PASS] * (len(events) - 1)
    assert len(head.tap_rows) == base.positions_held


def test_head_weights_shapes_are_checked():
    w = HeadWeights.random(features=6, dim=8, vocab=32)
    with pytest.raises(ConfigError, match="HeadWeights shapes disagree"):
        HeadWeights(w_in=w.w_in, w_state=w.w_state[:4], embed=w.embed, w_out=w.w_out)


# --------------------------------------------------------------------------- the real forward


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    pytest.importorskip("npud.engine.forward", reason="npud/engine/forward.py has not landed")
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    from npud.engine.forward import Forward
    from npud.engine.model import Model
    from npud.engine.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("spec")
    base_dir = build_tiny_checkpoint(root / "base", model_type="qwen3", seed=0)
    draft_dir = build_tiny_checkpoint(root / "draft", model_type="qwen3", seed=1, num_hidden_layers=1)
    other_tok = root / "other_tok"
    from npud.engine.testing.checkpoints import write_tokenizer

    write_tokenizer(other_tok, vocab_size=300)

    class Real:
        base_model = Model.load(base_dir, "fp32")
        draft_model = Model.load(draft_dir, "fp32")
        tokenizer = Tokenizer.from_dir(base_dir)
        draft_tokenizer = Tokenizer.from_dir(draft_dir)
        other_tokenizer = Tokenizer.from_dir(other_tok)

        @staticmethod
        def forward(model, rows=8):
            return Forward(model, max_batch_rows=rows)

    return Real


def _real_run(real, head, prompt, n, k, rows=8):
    from decoding import greedy_run

    f = real.forward(real.base_model, rows)
    out, stats = greedy_run(f, prompt, n, head, k)
    return out, f, stats


def _code_edit_prompt(real):
    src = "def add(a, b):\n    return a + b\n\ndef greet(name):\n    print('hello, ' + name)\n"
    return real.tokenizer.encode("Repeat with one change:\n" + src + "\n" + src)


@pytest.mark.parametrize("k", [2, 7])
def test_real_forward_prompt_lookup_is_byte_equal_to_plain_greedy(real, k):
    prompt = _code_edit_prompt(real)
    plain, plain_f, _ = _real_run(real, None, prompt, 32, k)
    out, f, stats = _real_run(real, PromptLookupHead(min_n=1, max_n=3), prompt, 32, k)
    assert out == plain
    assert real.tokenizer.decode(out).encode() == real.tokenizer.decode(plain).encode()
    assert f.positions_held == plain_f.positions_held == len(prompt) + 32
    # one step past the run: the states agree bit for bit
    nxt = out[-1]
    assert np.array_equal(f.step(nxt, f.positions_held), plain_f.step(nxt, plain_f.positions_held))
    assert stats.drafted > 0


@pytest.mark.parametrize("k", [1, 4, 12])
def test_real_forward_draft_model_is_byte_equal_to_plain_greedy(real, k):
    prompt = real.tokenizer.encode("The quick brown fox jumps over the lazy dog. ")
    plain, plain_f, _ = _real_run(real, None, prompt, 24, k)
    draft = real.forward(real.draft_model, rows=16)
    head = DraftModelHead(draft, real.tokenizer, real.draft_tokenizer)
    out, f, stats = _real_run(real, head, prompt, 24, k)
    assert out == plain and f.positions_held == plain_f.positions_held
    assert np.array_equal(f.step(out[-1], f.positions_held), plain_f.step(out[-1], plain_f.positions_held))
    assert stats.drafted > 0 and draft.positions_held <= len(prompt) + 24 + k


def test_real_forward_self_draft_accepts_everything(real):
    prompt = real.tokenizer.encode("for i in range(10):\n")
    plain, _, _ = _real_run(real, None, prompt, 24, 7)
    head = DraftModelHead(real.forward(real.base_model), real.tokenizer, real.tokenizer)
    out, f, stats = _real_run(real, head, prompt, 24, 7)
    assert out == plain
    assert stats.accepted == stats.drafted and stats.base_batches == 3 and stats.base_steps == 0


def test_real_tokenizers_that_differ_are_refused(real):
    check_same_tokenizer(real.tokenizer, real.draft_tokenizer)  # same training, same vocabulary
    with pytest.raises(DraftMismatchError, match="vocab_size is 300 in the draft, 320 in the base"):
        DraftModelHead(real.forward(real.draft_model), real.tokenizer, real.other_tokenizer)
