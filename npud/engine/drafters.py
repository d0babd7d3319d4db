"""Drafters for the speculative loop, all behind one protocol (`DraftHead`).

- `PromptLookupHead`: the longest recent n-gram match in prompt + output proposes what
  followed it. No model; this is what makes code edits fast.
- `DraftModelHead`: a small model with the base's tokenizer and a state of its own, rolled
  back by truncation after each verify.
- `HiddenStateHead`: a toy head fed by the base's hidden rows, either the final-normed row
  after t1 (MTP-style, two-pass rounds) or the committed rows of layer taps (DFlash-style,
  one-pass rounds). Its weights are arguments, so a trained head of that shape drops in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npud.engine.api import DEFAULT_LOOKUP_K, ConfigError, ModelError, SamplingParams
from npud.engine.pass_costs import FREE, DraftCosts
from npud.engine.prefix_match import common_prefix
from npud.engine.sampling import Sampler


@dataclass(slots=True, frozen=True)
class Draft:
    """Proposed tokens, and the distribution each was drawn from ([len(tokens), V]) for a
    sampling drafter; probs None means a deterministic drafter (q is one-hot at the token)."""

    tokens: tuple[int, ...] = ()
    probs: np.ndarray | None = None


NO_DRAFT = Draft()


class DraftHead(Protocol):
    """A drafter. Per round the loop calls `draft` at most once, and `commit_rows` right after
    each base pass whose rows are committed, so every committed row reaches the head once and
    in order (the prompt's rows excepted: the head sees the prompt in `draft`'s context)."""

    def needs_last_hidden(self) -> bool:
        """True when drafting reads the base's hidden after t1: such a head gets two-pass
        rounds and final-normed rows in commit_rows. False gets one-pass rounds, rows None."""

    def draft(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow context (prompt + committed tokens, ending with t1).
        An empty draft with error() None means "no proposal this round"."""

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        """tokens[:count] were committed, in order, by the base's last pass, and rows[:count]
        are their final-normed hidden rows (rows is None for a head that does not read them).
        Read exactly `count` entries: tokens and rows may be longer, and the entries past
        `count` describe positions that were rolled back (rejected drafts, or tokens after a
        stop), which the base will recompute differently."""

    def reset(self) -> None:
        """Forget the job; the head can then serve another one."""

    def error(self) -> str | None:
        """Why the last draft came back empty when that is a failure, else None."""


class DraftMismatchError(ModelError):
    """The draft model cannot serve this base: vocabularies or special tokens differ."""


# --------------------------------------------------------------------------- prompt lookup


class PromptLookupHead:
    """Finds the most recent earlier occurrence of the context's last n tokens (n from max_n
    down to min_n, longest first) and proposes the k tokens that followed it. Where the
    continuation runs into the end of the context it repeats with the match's period, so a
    repeating pattern keeps proposing. lookback bounds the search to the last tokens.

    An index from each n-gram to its latest start is extended as the context grows, so a
    draft costs O(new tokens), not O(context): within a job each context extends the last one
    (reset() starts a job; a context that does not extend the indexed one is re-indexed).
    """

    costs = FREE  # drafting costs next to nothing: the break-even rule counts only base passes
    default_k = DEFAULT_LOOKUP_K  # drafts a round when the request leaves k out

    def __init__(self, min_n: int = 2, max_n: int = 4, lookback: int | None = None) -> None:
        if not (isinstance(min_n, int) and min_n >= 1):
            raise ConfigError(f"PromptLookupHead.min_n must be an integer >= 1, got {min_n!r}")
        if not (isinstance(max_n, int) and max_n >= min_n):
            raise ConfigError(f"PromptLookupHead.max_n must be an integer >= min_n ({min_n}), got {max_n!r}")
        if lookback is not None and not (isinstance(lookback, int) and lookback > max_n):
            raise ConfigError(f"PromptLookupHead.lookback must be None or an integer > max_n, got {lookback!r}")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback
        self.committed = 0  # rows reported by commit_rows
        self._seq: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> latest start with a successor

    def needs_last_hidden(self) -> bool:
        return False

    def draft_cost(self) -> float:
        return 0.0

    def planned_cost(self, k: int) -> float:
        """What drafting k tokens costs in base steps: nothing beside a pass."""
        return 0.0

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self._extend(context)
        seq, size = self._seq, len(self._seq)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            found = self._latest.get(tuple(seq[size - n :]))
            if found is None or (self.lookback is not None and found < size - self.lookback):
                continue
            start = found + n  # what followed the most recent match
            period = size - start  # the context repeats with this period from there on
            out = seq[start : start + min(k, period)]
            while len(out) < k:
                out.append(out[len(out) - period])
            return Draft(tuple(out))
        return NO_DRAFT

    def _extend(self, context: Sequence[int]) -> None:
        known = len(self._seq)
        if known > len(context) or (known and context[known - 1] != self._seq[-1]):
            self._seq, self._latest, known = [], {}, 0
        seq = self._seq
        for token in context[known:]:
            seq.append(int(token))
            end = len(seq) - 1  # the n-grams ending just before `token` now have a successor
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self._latest[tuple(seq[end - n : end])] = end - n

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        self.committed += count

    def reset(self) -> None:
        self.committed = 0
        self._seq, self._latest = [], {}

    def error(self) -> str | None:
        return None


# --------------------------------------------------------------------------- draft model


def check_same_tokenizer(base_tokenizer, draft_tokenizer) -> None:
    """Raise DraftMismatchError unless the two tokenizers (npud.engine.tokenizer.Tokenizer) agree on
    vocabulary size, special tokens and the text of every id (all ids up to 4096, else 4096
    spread ones plus the top 256, where added and special tokens live)."""

    def differ(what: str, draft_value, base_value) -> DraftMismatchError:
        return DraftMismatchError(
            f"the draft model's tokenizer differs from the base's: {what} is {draft_value!r} "
            f"in the draft, {base_value!r} in the base"
        )

    if base_tokenizer.vocab_size != draft_tokenizer.vocab_size:
        raise differ("vocab_size", draft_tokenizer.vocab_size, base_tokenizer.vocab_size)
    if base_tokenizer.bos_token_id != draft_tokenizer.bos_token_id:
        raise differ("bos_token_id", draft_tokenizer.bos_token_id, base_tokenizer.bos_token_id)
    for name in ("eos_token_ids", "special_token_ids"):
        a, b = sorted(getattr(base_tokenizer, name)), sorted(getattr(draft_tokenizer, name))
        if a != b:
            raise differ(name, b, a)
    vocab = base_tokenizer.vocab_size
    if vocab <= 4096:
        ids = range(vocab)
    else:
        spread = np.linspace(0, vocab - 1, 4096).astype(int).tolist()
        ids = sorted(set(spread) | set(range(vocab - 256, vocab)))
    for i in ids:
        a, b = base_tokenizer.decode([i]), draft_tokenizer.decode([i])
        if a != b:
            raise differ(f"the text of token {i}", b, a)


_DRAFT_STREAM = 0x6472616674  # "draft"


class DraftModelHead:
    """Drafts with a small model (a `Base`, e.g. a second npud.engine.forward.Forward) that has the
    base's tokenizer and its own state.

    The draft forward holds the context it has seen plus its own drafts but the last; after a
    verify, commit_rows truncates it to the committed stream, and each draft first truncates to
    the longest prefix that agrees with the context and runs only what is new (after a
    fallback that is every token emitted meanwhile, in batches of max_batch_rows()). With a
    temperature the drafts are sampled from the draft's own distribution q, which the loop
    needs for the accept/resample rule; greedy drafts are deterministic. `costs` (the draft
    model's calibrated passes in base steps, npud/engine/pass_costs.py) lets the break-even rule
    cost a draft by the passes it ran rather than by the clock.
    Raises DraftMismatchError at construction when the tokenizers disagree.
    """

    def __init__(self, forward, base_tokenizer, draft_tokenizer, sampling: SamplingParams = SamplingParams(),
                 allowed: np.ndarray | None = None, costs: DraftCosts | None = None) -> None:
        check_same_tokenizer(base_tokenizer, draft_tokenizer)
        self.forward = forward
        self.costs = costs
        self.last_passes: list[int] = []  # rows of each draft pass the last draft ran
        forward.truncate(0)
        # allowed: the draft's logit ids the tokenizer decodes; a padded id would only be rejected
        self.sampler = Sampler(sampling, allowed)
        # a stream of its own: the job's sampler has the same seed, and drafts drawn with the
        # uniforms the accept test then reuses would be correlated with it
        self.sampler.rng = np.random.default_rng([sampling.seed, _DRAFT_STREAM])
        self.held: list[int] = []  # the tokens the draft forward holds, one per position
        self.context_len: int | None = None  # len(context) of a draft not yet committed
        self.committed = 0

    def needs_last_hidden(self) -> bool:
        return False

    def draft_cost(self) -> float | None:
        """The last draft's passes in base steps, None without a calibration."""
        return None if self.costs is None else sum(self.costs.rows(r) for r in self.last_passes)

    def planned_cost(self, k: int) -> float | None:
        """What drafting k tokens costs in base steps (k one-row passes of the draft model once it
        holds the context), None without a calibration."""
        return None if self.costs is None else k * self.costs.rows(1)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self.last_passes = []
        # keep the agreeing prefix, and at least the last context token to run for its logits
        keep = min(common_prefix(self.held, context), len(context) - 1)
        self.forward.truncate(keep)
        del self.held[keep:]
        logits = self._run(list(context[keep:]))
        tokens, probs = [], []
        for i in range(k):
            if self.sampler.config.greedy:
                tokens.append(self.sampler.choose(logits))
            else:
                q = self.sampler.probs(logits)
                tokens.append(self.sampler.draw(q))
                probs.append(q)
            if i < k - 1:
                logits = self._run(tokens[-1:])
        self.context_len = len(context)
        return Draft(tuple(tokens), np.stack(probs) if probs else None)

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        self.committed += count
        if self.context_len is not None:
            # one-pass round: tokens[0] is t1, the context's last token; drafts kept: count - 1
            keep = self.context_len + max(count - 1, 0)
            if keep < len(self.held):
                self.forward.truncate(keep)
                del self.held[keep:]
            self.context_len = None

    def reset(self) -> None:
        self.forward.truncate(0)
        self.held.clear()
        self.context_len = None
        self.committed = 0

    def error(self) -> str | None:
        return None

    def _run(self, tokens: list[int]) -> np.ndarray:
        """Append tokens to the draft forward; logits [V] of the last."""
        rows = self.forward.max_batch_rows()
        for i in range(0, len(tokens), rows):
            chunk = tokens[i : i + rows]
            pos = self.forward.positions_held
            logits = self.forward.step(chunk[0], pos) if len(chunk) == 1 else self.forward.step_batch_all(chunk, pos)[-1]
            self.held.extend(chunk)
            self.last_passes.append(len(chunk))
        return logits


# --------------------------------------------------------------------------- hidden-reading head


@dataclass(slots=True, frozen=True)
class HeadWeights:
    """A small recurrent drafter: h0 = w_in @ feature (+ embed[t1] for the tap feed), then per
    draft: token = argmax(w_out @ h), h = tanh(w_state @ h + embed[token])."""

    w_in: np.ndarray  # [D, F]: a feature row of the base -> head state
    w_state: np.ndarray  # [D, D]
    embed: np.ndarray  # [V, D]
    w_out: np.ndarray  # [V, D]

    def __post_init__(self) -> None:
        d = self.w_in.shape[0]
        if self.w_state.shape != (d, d) or self.embed.shape[1] != d or self.w_out.shape[1] != d:
            raise ConfigError(
                f"HeadWeights shapes disagree: w_in {self.w_in.shape}, w_state {self.w_state.shape}, "
                f"embed {self.embed.shape}, w_out {self.w_out.shape}"
            )
        if self.embed.shape[0] != self.w_out.shape[0]:
            raise ConfigError(f"HeadWeights vocabularies differ: embed {self.embed.shape}, w_out {self.w_out.shape}")

    @classmethod
    def random(cls, features: int, dim: int, vocab: int, seed: int = 0) -> HeadWeights:
        rng = np.random.default_rng(seed)
        return cls(
            w_in=rng.standard_normal((dim, features)).astype(np.float32) / np.sqrt(features),
            w_state=rng.standard_normal((dim, dim)).astype(np.float32) / np.sqrt(dim),
            embed=rng.standard_normal((vocab, dim)).astype(np.float32),
            w_out=rng.standard_normal((vocab, dim)).astype(np.float32),
        )


class HiddenStateHead:
    """Drafts from the base's hidden rows.

    taps None (MTP-style): needs_last_hidden() is True; the feature is the final-normed row of
    the last committed token, which in a two-pass round is t1's, handed over by commit_rows.
    taps=(base, layer_ids) (DFlash-style): needs_last_hidden() is False; the head registers as
    the base's tap sink, which gets a row for every position of every pass, rejected verify
    rows included; commit_rows keeps the first `count` rows of the last pass and drops the
    rest, so `tap_rows` always holds exactly the committed positions' rows. The feature is the
    last committed tap row, and t1 (not yet run) enters through its embedding.
    """

    def __init__(self, weights: HeadWeights, taps: tuple[object, Sequence[int]] | None = None) -> None:
        self.weights = weights
        self.feature: np.ndarray | None = None
        self.tap_rows: list[np.ndarray] = []
        self._last_pass_rows = 0
        self.reads_taps = taps is not None
        if taps is not None:
            base, layer_ids = taps
            base.set_layer_taps(list(layer_ids), self)

    def needs_last_hidden(self) -> bool:
        return not self.reads_taps

    def append(self, rows: np.ndarray) -> None:
        """The tap sink: rows [M, len(layer_ids) * D] of one pass."""
        self.tap_rows.extend(np.array(r, dtype=np.float32) for r in rows)
        self._last_pass_rows = len(rows)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        w = self.weights
        feature = self.tap_rows[-1] if self.reads_taps and self.tap_rows else self.feature
        if feature is None:
            return NO_DRAFT
        h = w.w_in @ feature
        if self.reads_taps:
            h = np.tanh(h + w.embed[context[-1]])
        tokens = []
        for _ in range(k):
            tokens.append(int(np.argmax(w.w_out @ h)))
            h = np.tanh(w.w_state @ h + w.embed[tokens[-1]])
        return Draft(tuple(tokens))

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        if self.reads_taps:
            # the last pass appended _last_pass_rows rows; its first `count` are committed
            del self.tap_rows[len(self.tap_rows) - self._last_pass_rows + count :]
            self._last_pass_rows = 0
        elif count > 0:
            self.feature = np.array(rows[count - 1], dtype=np.float32)

    def reset(self) -> None:
        self.feature = None
        self.tap_rows.clear()
        self._last_pass_rows = 0

    def error(self) -> str | None:
        return None
