"""Speculative decoding: the draft/verify/commit loop, plain decode, and their stats.

A round starts with t1, the base's own choice for the next position, not yet run. Every token
the loop emits has been run through the base before the consumer sees it, so after any round
the base holds exactly prompt + emitted positions: the state a plain decode of the same tokens
leaves (the next job can continue from it).

- one-pass round (a head that does not read the hidden after t1): [t1, d1..dk] is verified as
  one batch of k + 1 rows; draft i is checked against row i; t1 plus the accepted drafts are
  committed (take + 1 rows) and the next t1 is the base's choice in row take.
- two-pass round (a head that reads the hidden after t1, MTP-style): t1 through `step`, the
  head reads its row and drafts; d1 is judged on the step's logits before any batch runs, and
  only if it is accepted are d1..dk verified in one batch (draft i against row i - 1).
- plain-step round: t1 through `step`. Taken when the head proposes nothing, when the budget
  leaves no room for a draft, on a one-row base, and after the break-even fallback.

Rejected rows are rolled back by `truncate`, never by snapshots.

The loops do not run the base's passes themselves: each pass is yielded as an
npud.engine.packed.Pass (tokens, start position, which logits rows) and its logits are sent
back, so one driver runs a session alone (npud.engine.forward.drive) and another packs the
passes of many sessions into one weight stream (npud/engine/batch.py). The loops also yield a
RoundEvent at the end of each round. A pass's time is measured around its yield, so in a
packed round it is the packed pass's time.

Break-even fallback: each speculative round is costed (draft + passes) in plain steps; once
the last `fallback_rounds` rounds together yielded fewer tokens than plain steps would have
for that cost, the job continues with plain-step rounds (optionally re-probing later). Those
are the rounds plain decode runs, so the output does not change. The cost comes from the
model's calibrated pass costs and the head's calibrated draft costs (npud/engine/pass_costs.py)
when both are known, so the choices depend on the tokens alone; otherwise from the round's
measured time over the median plain step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npud.engine.api import DEFAULT_SPEC_K, SpecParams, is_int
from npud.engine.break_even import Acceptance, BreakEven, best_k
from npud.engine.decode_stats import (  # re-exported: callers import the run's stats types from here too
    DecodeStats,
    Fallback,
    FallbackReason,
    LoopEnd,
    RoundEvent,
    RoundKind,
)
from npud.engine.drafters import NO_DRAFT, Draft, DraftHead
from npud.engine.packed import Pass, Rows
from npud.engine.pass_costs import FREE
from npud.engine.sampling import Sampler


class Base(Protocol):
    """The target model as the loop drives it (npud.engine.forward.Forward implements it). Heads
    that read layer taps also call its set_layer_taps(layer_ids, sink). The loops ask their
    driver for passes; run_on runs them through step and step_batch_all."""

    @property
    def positions_held(self) -> int: ...

    def step(self, token: int, pos: int) -> np.ndarray:
        """Run one token at pos == positions_held -> logits [V]; appends one position."""

    def step_batch_all(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Run M tokens from start_pos == positions_held -> logits [M, V]; appends M positions."""

    def truncate(self, n: int) -> None:
        """Keep the first n positions."""

    def max_batch_rows(self) -> int: ...

    def last_hidden_rows(self) -> np.ndarray:
        """[M, D] final-normed hidden rows of the last pass."""


OnToken = Callable[[int], "bool | None"]

FREE_REPROBE_AFTER = 16  # plain tokens after a fallback before a head with free drafts tries again

# what a decode loop yields: a base pass to run (the driver sends its logits back) or the end
# of a round; what a round generator returns at its end
Loop = Generator["Pass | RoundEvent", "np.ndarray | None", None]


def speculative_loop(
    base: Base,
    head: DraftHead | None,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    sampler: Sampler,
    on_token: OnToken,
    stats: DecodeStats,
    config: SpecParams = SpecParams(),
    eos_ids: frozenset[int] = frozenset(),
    clock: Callable[[], float] = time.perf_counter,
) -> Loop:
    """Decode up to max_new_tokens after prompt, speculating with head; yields each base pass
    (npud.engine.packed.Pass; send its logits back) and a RoundEvent after each round.

    The base must hold prompt[:-1]: the loop runs the prompt's last token itself through a plain
    step, which gives the first logits and times the plain step the break-even rule compares
    against. on_token(token) is called for each emitted token once it is committed; returning
    False stops the run there. The run also stops after an EOS id (emitted) or max_new_tokens.
    With a greedy sampler the tokens, positions and state equal plain_decode's whatever the
    head proposes. Raises ValueError when the base does not hold prompt[:-1].
    """
    _check_start(base, prompt, max_new_tokens)
    tokens = list(prompt)  # the committed stream, prompt + emitted: the base holds all of it
    passes = _Passes(base, stats, clock)
    emit = _Emitter(tokens, len(prompt) + max_new_tokens, on_token, eos_ids, stats)
    run = _Run(base, head, sampler, passes, emit, tokens, stats, clock)
    breakeven = BreakEven(config, stats, base, head)
    two_pass = head is not None and head.needs_last_hidden()
    speculating, reprobe_at = head is not None, None
    reprobe_after = config.reprobe_after
    if reprobe_after is None and getattr(head, "costs", None) is FREE:
        # free drafts: a fallback only saves verify rows, and a code edit's copying often starts
        # after a few rounds of preamble, so prompt lookup looks again
        reprobe_after = FREE_REPROBE_AFTER
    # drafts asked for at most: the request's k, else the head's default (prompt lookup's is larger)
    k_max = config.k if config.k is not None else getattr(head, "default_k", DEFAULT_SPEC_K)
    k_next = k_max  # drafts asked for next round, before the batch and budget limits
    # with a cost model, adapt_k also plans k from the calibrated row costs and the acceptance
    # seen so far (break_even.best_k): the most tokens per plain step, never more than k_max
    planned = getattr(head, "planned_cost", None)
    plan = config.adapt_k and breakeven.costs is not None and callable(planned) and planned(1) is not None
    acceptance = Acceptance()

    started = clock()
    t1 = sampler.choose((yield from passes.step(prompt[-1], len(prompt) - 1, counted=False)))
    while not emit.done:
        pos = len(tokens)  # t1's position
        if not speculating and reprobe_at is not None and stats.emitted >= reprobe_at:
            speculating, reprobe_at, k_next = True, None, k_max
            stats.reprobes += 1
        left = max_new_tokens - stats.emitted - 1  # tokens the run may emit after t1
        passes.round_rows.clear()
        # t1 takes a batch row in the one-pass round; in the two-pass round it runs alone
        if plan and speculating and acceptance.rounds:  # the first round drafts the head's k: nothing seen yet
            k_next = min(k_next, best_k(breakeven.costs.rows, planned, acceptance.at, k_max, two_pass))
        k = min(k_next, base.max_batch_rows() - (0 if two_pass else 1), left) if speculating else 0
        done = yield from (_two_pass_round(run, t1, pos, k) if two_pass else _one_pass_round(run, t1, pos, k))
        t1 = done.next_t1

        fallback = None
        if done.kind is RoundKind.STEP:
            stats.plain_steps += 1
        else:
            stats.rounds += 1
            stats.drafted += done.drafted
            stats.accepted += done.take
            if config.adapt_k:
                k_next = min(k_max, 2 * k_next) if done.take == done.drafted else done.take + 1
                acceptance.observe(done.take, done.drafted)
            fallback = breakeven.judge(done.seconds, done.take + 1, done.drafted, done.take, passes.round_rows)
        if done.problem is not None:
            fallback = breakeven.head_error(done.problem)
        if fallback is not None:
            stats.fallbacks.append(fallback)
            speculating = False
            if reprobe_after is not None:
                reprobe_at = stats.emitted + reprobe_after
        stats.seconds = clock() - started
        yield RoundEvent(done.kind, tuple(tokens[pos:]), done.drafted, done.take)


def speculative_decode(base: Base, head: DraftHead | None, prompt: Sequence[int], **kw) -> Iterator[RoundEvent]:
    """speculative_loop with its passes run on `base` itself (its step and step_batch_all);
    yields a RoundEvent after each round."""
    return run_on(base, speculative_loop(base, head, prompt, **kw))


def plain_decode(base: Base, prompt: Sequence[int], **kw) -> Iterator[RoundEvent]:
    """plain_loop with its passes run on `base` itself; yields a RoundEvent per token."""
    return run_on(base, plain_loop(base, prompt, **kw))


def run_on(base: Base, loop: Loop) -> Iterator[RoundEvent]:
    """Run `loop`'s passes on `base` alone (one row through step, more through step_batch_all)
    and yield its RoundEvents."""
    sent = None
    while True:
        try:
            item = loop.send(sent)
        except StopIteration:
            return
        if isinstance(item, Pass):
            if item.num_rows == 1:
                sent = base.step(item.tokens[0], item.start_pos)[None]
            else:
                sent = base.step_batch_all(item.tokens, item.start_pos)
        else:
            sent = None
            yield item


@dataclass(slots=True)
class _Run:
    """What every round of one run works with."""

    base: Base
    head: DraftHead | None
    sampler: Sampler
    passes: _Passes
    emit: _Emitter
    tokens: list[int]  # the committed stream, prompt + emitted: the base holds all of it
    stats: DecodeStats
    clock: Callable[[], float]


@dataclass(slots=True, frozen=True)
class _Round:
    """What one round did, for the loop's counters and its break-even rule."""

    kind: RoundKind
    next_t1: int | None  # the base's choice for the next position (None: the run stopped in a step)
    drafted: int
    take: int  # drafts accepted
    seconds: float  # draft + passes
    problem: str | None  # why the head gave no draft, or None


def _one_pass_round(run: _Run, t1: int, pos: int, k: int) -> Generator[Pass, np.ndarray, _Round]:
    """[t1, d1..dk] verified as one batch of k + 1 rows, draft i against row i; a plain-step
    round when k is 0 or the head proposes nothing."""
    draft, spent, problem = NO_DRAFT, 0.0, None
    if k > 0:
        draft, spent, problem = _draft(run.head, run.tokens + [t1], k, run.passes.vocab, run.stats, run.clock)
    if not draft.tokens:
        return (yield from _step_round(run, t1, pos, spent, problem))
    verify = yield from run.passes.batch([t1, *draft.tokens], pos)
    spent += run.passes.last_seconds
    take, next_t1 = _accept(run.sampler, draft, verify, first=0)
    kept = run.emit([t1, *draft.tokens[:take]])  # take + 1 unless the run stops inside
    run.base.truncate(pos + kept)
    run.head.commit_rows([t1, *draft.tokens], None, kept)
    return _Round(RoundKind.ONE_PASS, next_t1, len(draft.tokens), take, spent, problem)


def _step_round(run: _Run, t1: int, pos: int, spent: float, problem: str | None
                ) -> Generator[Pass, np.ndarray, _Round]:
    """t1 alone through a plain step: the round plain decode runs."""
    logits = yield from run.passes.step(t1, pos)
    spent += run.passes.last_seconds
    run.emit([t1])
    if run.head is not None:
        run.head.commit_rows([t1], None, 1)
    next_t1 = None if run.emit.done else run.sampler.choose(logits)
    return _Round(RoundKind.STEP, next_t1, 0, 0, spent, problem)


def _two_pass_round(run: _Run, t1: int, pos: int, k: int) -> Generator[Pass, np.ndarray, _Round]:
    """t1 through a plain step whose hidden row the head reads to draft d1..dk; d1 is judged on
    the step's logits (a wrong d1 costs no batch), and only a kept d1 sends d1..dk through one
    batch of k rows, draft i against row i - 1. A plain-step round when nothing is drafted."""
    logits = yield from run.passes.step(t1, pos)
    spent = run.passes.last_seconds
    run.emit([t1])
    run.head.commit_rows([t1], run.base.last_hidden_rows(), 1)
    draft, problem = NO_DRAFT, None
    if k > 0 and not run.emit.done:
        draft, draft_seconds, problem = _draft(run.head, run.tokens, k, run.passes.vocab, run.stats, run.clock)
        spent += draft_seconds
    if not draft.tokens:
        next_t1 = None if run.emit.done else run.sampler.choose(logits)
        return _Round(RoundKind.STEP, next_t1, 0, 0, spent, problem)
    take, next_t1 = 0, run.sampler.judge(draft.tokens[0], _q(draft, 0), logits)
    if next_t1 is None:  # d1 kept
        verify = yield from run.passes.batch(draft.tokens, pos + 1)
        rows = run.base.last_hidden_rows()
        spent += run.passes.last_seconds
        take, next_t1 = _accept(run.sampler, draft, verify, first=1)
        kept = run.emit(draft.tokens[:take])
        run.base.truncate(pos + 1 + kept)
        run.head.commit_rows(draft.tokens, rows, kept)
    return _Round(RoundKind.TWO_PASS, next_t1, len(draft.tokens), take, spent, problem)


def plain_loop(
    base: Base,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    sampler: Sampler,
    on_token: OnToken,
    stats: DecodeStats,
    eos_ids: frozenset[int] = frozenset(),
    clock: Callable[[], float] = time.perf_counter,
) -> Loop:
    """One step per token: the reference the speculative loop must equal; yields each step's
    pass (send its logits back) and a RoundEvent per token.

    Same contract as speculative_decode: the base holds prompt[:-1], every emitted token has
    been run when on_token sees it, and the run stops on False, an EOS id or max_new_tokens.
    Raises ValueError when the base does not hold prompt[:-1].
    """
    _check_start(base, prompt, max_new_tokens)
    tokens = list(prompt)
    passes = _Passes(base, stats, clock)
    emit = _Emitter(tokens, len(prompt) + max_new_tokens, on_token, eos_ids, stats)
    started = clock()
    logits = yield from passes.step(prompt[-1], len(prompt) - 1, counted=False)
    while not emit.done:
        token = sampler.choose(logits)
        logits = yield from passes.step(token, len(tokens))
        emit([token])
        stats.plain_steps += 1
        stats.seconds = clock() - started
        yield RoundEvent(RoundKind.STEP, (token,), 0, 0)


def _accept(sampler: Sampler, draft: Draft, verify: np.ndarray, first: int) -> tuple[int, int]:
    """Judge draft.tokens[first:] against verify rows (draft i against row i - first).

    Returns (take, next_t1): the number of drafts kept in a row from the start, and the base's
    token for the position after them, the replacement at the first reject or, when every
    draft is kept, the bonus choice from the row after the last one.
    """
    for i in range(first, len(draft.tokens)):
        replacement = sampler.judge(draft.tokens[i], _q(draft, i), verify[i - first])
        if replacement is not None:
            return i, replacement
    return len(draft.tokens), sampler.choose(verify[len(draft.tokens) - first])


def _q(draft: Draft, i: int) -> np.ndarray | None:
    return None if draft.probs is None else draft.probs[i]


def _draft(
    head: DraftHead, context: list[int], k: int, vocab: int, stats: DecodeStats, clock
) -> tuple[Draft, float, str | None]:
    """Ask the head for up to k tokens: (draft, seconds, why it failed or None)."""
    started = clock()
    draft = head.draft(context, k)
    seconds = clock() - started
    stats.draft_seconds_total += seconds
    if not draft.tokens:
        return NO_DRAFT, seconds, head.error()
    bad = [t for t in draft.tokens if not (0 <= t < vocab)]
    if bad:
        return NO_DRAFT, seconds, f"drafted token {bad[0]} is outside the base's vocabulary of {vocab}"
    if draft.probs is not None and draft.probs.shape != (len(draft.tokens), vocab):
        return NO_DRAFT, seconds, (
            f"draft distribution has shape {draft.probs.shape}, expected ({len(draft.tokens)}, {vocab})"
        )
    if len(draft.tokens) > k:
        probs = None if draft.probs is None else draft.probs[:k]
        draft = Draft(tuple(draft.tokens[:k]), probs)
    return draft, seconds, None


def _check_start(base: Base, prompt: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt) == 0:
        raise ValueError("decoding needs a prompt of at least one token")
    if not (is_int(max_new_tokens) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if base.positions_held != len(prompt) - 1:
        raise ValueError(
            f"decoding needs the base to hold the prompt but its last token: prompt of "
            f"{len(prompt)} tokens, base holds {base.positions_held} positions"
        )


class _Passes:
    """Asks the driver for the base's passes, and counts and times them into the stats."""

    def __init__(self, base: Base, stats: DecodeStats, clock: Callable[[], float]) -> None:
        self.base, self.stats, self.clock = base, stats, clock
        self.vocab = 0  # the logits width, known after the first pass
        self.last_seconds = 0.0
        self.round_rows: list[int] = []  # rows of each pass of the current round (the loop clears it)

    def step(self, token: int, pos: int, counted: bool = True) -> Generator[Pass, np.ndarray, np.ndarray]:
        """logits [V] of token at pos; counted=False for the prompt's last token."""
        started = self.clock()
        logits = (yield Pass((token,), pos, Rows.ALL))[0]
        self.last_seconds = self.clock() - started
        self.vocab = logits.shape[-1]
        self.stats.step_samples.append(self.last_seconds)
        self.stats.base_steps += counted
        self.round_rows.append(1)
        return logits

    def batch(self, tokens: Sequence[int], pos: int) -> Generator[Pass, np.ndarray, np.ndarray]:
        """logits [M, V] of tokens from pos; a single row goes through step."""
        if len(tokens) == 1:
            return (yield from self.step(tokens[0], pos))[None]
        started = self.clock()
        logits = yield Pass(tuple(tokens), pos, Rows.ALL)
        self.last_seconds = self.clock() - started
        self.stats.verify_samples.append(self.last_seconds)
        self.stats.base_batches += 1
        self.stats.batch_rows += len(tokens)
        self.round_rows.append(len(tokens))
        return logits


class _Emitter:
    """Appends emitted tokens to the stream, tells the consumer, and decides when to stop."""

    def __init__(self, tokens: list[int], limit: int, on_token: OnToken, eos_ids, stats) -> None:
        self.tokens, self.limit, self.on_token = tokens, limit, on_token
        self.eos_ids, self.stats = eos_ids, stats
        self.done = len(tokens) >= limit
        if self.done:
            stats.finish = LoopEnd.MAX_TOKENS

    def __call__(self, seq: Sequence[int]) -> int:
        """Emit seq in order until the run stops; returns how many were emitted."""
        for n, token in enumerate(seq, 1):
            self.tokens.append(token)
            self.stats.emitted += 1
            stopped = self.on_token(token) is False
            if token in self.eos_ids:
                self.stats.finish = LoopEnd.EOS
            elif stopped:
                self.stats.finish = LoopEnd.STOPPED
            elif len(self.tokens) >= self.limit:
                self.stats.finish = LoopEnd.MAX_TOKENS
            if self.stats.finish is not None:
                self.done = True
                return n
        return len(seq)
