"""Batched rounds: one round of several sessions, their base passes packed into shared weight streams.

A session's rounds are a generator (`Work`) that yields the base passes it needs
(npud.engine.packed.Pass; the driver sends each one's logits back) and, at the end of a round, the
events the round released. `run_round` advances every session to its next pass, packs the
passes of all sessions into one pass over the model (npud.engine.packed.run_packed: rows
concatenated, each session's contiguous and in order; GEMMs once over all rows; attention and
recurrent state per session), hands each session its own logits, and repeats until every
session has reached the end of its round. A session alone that needs two passes in a round (a
two-pass speculative round; the first decode round, which steps the prompt's last token and then
the first token) runs both; in a round of several sessions a pass that only comes once the
round's packs have run waits for the next round (its round ends there with no events): it
would be a pack of its own, a whole weight stream for one or a few rows, where the next round
carries it in the others' pack. A session alone goes through the same driver
(ModelSession.run_round), so there is one code path.

Prompt chunks (prefill passes) are limited per round by a row budget across the sessions:
a chunk that does not fit waits for the next round (its session's round ends there, with no
events), except that the first chunk of a round always runs, so a prompt alone always moves.
In a round of several sessions a chunk is also held to the room the other passes leave in one
pack: a chunk that would overflow it is cut there (at least MIN_CUT_ROWS rows) and its rest
runs as the session's next pass, the session seeing the whole chunk's logits only then; a
chunk that cannot be cut (it asks for every row's logits; a recurrent layer; layer taps) or
finds too little room waits, unless it is the round's first. A cut moves no bit: each row's
bits are independent of the rows beside it and of M, and attention reads the plane rows the
first part wrote. The steady state of a 64-prompt job at max_batch 16 is then one pack a
round (14-16 steps and a prompt's 48-50 rows), not a pack of steps and a 64-row pack beside it.

A pack never holds more than MAX_PACKED_ROWS rows: the host's start-up self-check
(npud/kernels/host/check.py) proves a row's bits independent of M for M = 1..CHECK_ROWS only.
Passes are never split across packs (a pass has at most a prefill chunk's 64 rows), so a round
with more rows runs several packs of whole passes: each weight is streamed once per pack, the same cost
as cutting every GEMM at 64 rows, while attention and recurrent state stay per whole pass.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import numpy as np

from npud.engine.api import DeviceFault, EngineError, TokenEvent
from npud.engine.packed import Pass, PassError, Rows, run_packed
from npud.engine.state import RecurrentPlane
from npud.kernels.host.check import CHECK_ROWS

MAX_PACKED_ROWS = CHECK_ROWS

Rounds = Generator["Pass | list[TokenEvent]", "np.ndarray | None", None]


class Work:
    """One session's rounds as the driver runs them: its forward (the base sequence it runs
    on), its generator, and the pass it waits on (kept over a round boundary when the prefill
    budget deferred it)."""

    def __init__(self, forward, rounds: Rounds):
        self.forward = forward
        self.rounds = rounds
        self.waiting: Pass | None = None
        self.rest: Pass | None = None  # what is left of a prefill chunk the driver cut (npud.engine.batch.run_round)
        self.finished = False

    def advance(self, sent: np.ndarray | None = None, error: BaseException | None = None):
        """Send `sent` (or throw `error`) in; returns the next Pass or round end, or None when
        the rounds are over."""
        try:
            item = self.rounds.throw(error) if error is not None else self.rounds.send(sent)
        except StopIteration:
            self.finished = True
            return None
        self.waiting = item if isinstance(item, Pass) else None
        return item

    def drain(self) -> None:
        """Run the rounds' tail after the generation has finished (no more passes come)."""
        while not self.finished:
            if isinstance(self.advance(), Pass):
                raise RuntimeError("a finished generation asked for a base pass")


_OPEN = object()  # a session still inside its round


def run_round(model, works: Sequence[Work], prefill_budget: int | None = None
              ) -> list[list[TokenEvent] | None | EngineError]:
    """One round of each of `works` (distinct sessions on `model`), passes packed.

    Returns per work the events its round released, None when its rounds were already over, or
    the EngineError that ended its round (the others go on). `prefill_budget`: prompt rows all
    sessions may prefill this round (None: no limit). Raises DeviceFault, and any error that is
    not an EngineError, as the sequential form would."""
    results: list = [_OPEN] * len(works)

    def advance(i: int, sent=None, error=None) -> None:
        try:
            item = works[i].advance(sent, error)
        except DeviceFault:
            raise
        except EngineError as exc:
            works[i].waiting = None
            results[i] = exc
            return
        if not isinstance(item, Pass):
            results[i] = item  # the round's events, or None: over

    for i, w in enumerate(works):
        if w.finished:
            results[i] = None
        elif w.waiting is None:
            advance(i)
    granted = 0  # prompt rows this round
    first = True
    batched = len(works) > 1 and prefill_budget is not None
    # the rows of the round's other passes: a prefill chunk is cut to the room they leave in one pack
    steps = sum(w.waiting.num_rows for i, w in enumerate(works) if results[i] is _OPEN and not w.waiting.prefill)
    while True:
        ready = []
        for i, w in enumerate(works):
            if results[i] is not _OPEN:
                continue
            p = w.waiting
            if not first and len(works) > 1:
                results[i] = []  # a second pass in this round waits for the next one (its own pack otherwise)
                continue
            if p.prefill:
                if batched and first:  # a chunk that would overflow the round's pack is cut to the room left
                    take = MAX_PACKED_ROWS - steps - granted
                    if (MIN_CUT_ROWS <= take < p.num_rows and (granted == 0 or granted + take <= prefill_budget)
                            and _cuttable(w, p)):
                        w.waiting = Pass(p.tokens[:take], p.start_pos, Rows.NONE, prefill=True)
                        w.rest = Pass(p.tokens[take:], p.start_pos + take, p.logits, prefill=True)
                        granted += take
                        ready.append(i)
                        continue
                over_budget = prefill_budget is not None and granted + p.num_rows > prefill_budget
                over_pack = batched and first and steps + granted + p.num_rows > MAX_PACKED_ROWS
                if granted > 0 and (over_budget or over_pack):
                    results[i] = []  # the chunk waits for the next round
                    continue
                granted += p.num_rows
            ready.append(i)
        if not ready:
            return results
        first = False
        for pack in _packs(ready, [works[i].waiting.num_rows for i in ready]):
            out = run_packed(model, [(works[i].forward, works[i].waiting) for i in pack])
            for i, logits in zip(pack, out):
                w = works[i]
                if isinstance(logits, PassError):
                    w.rest = None
                    advance(i, error=logits)
                elif w.rest is not None:  # the cut chunk's rest runs next round; the session sees the whole chunk then
                    w.waiting, w.rest = w.rest, None
                    results[i] = []
                else:
                    advance(i, sent=logits)


MIN_CUT_ROWS = 8  # a prefill chunk is cut to fill a pack only when at least this many rows fit


def _cuttable(w: Work, p: Pass) -> bool:
    """Whether `p` (a prefill chunk) may run as two passes with the same bits: it asks for no
    logits or the last row's (the rest's: the prefix cache's chunk up to a block boundary), the
    sequence has no recurrent plane (a recurrent layer keeps its
    state at pass boundaries: another boundary would be another state kept) and no layer taps (a
    drafter's sink sees the rows pass by pass)."""
    f = w.forward
    return (p.logits in (Rows.NONE, Rows.LAST) and f._tap_sink is None
            and not any(isinstance(plane, RecurrentPlane) for plane in f.state.planes))


def _packs(ready: list[int], rows: list[int]) -> list[list[int]]:
    """`ready` in packs of at most MAX_PACKED_ROWS rows, a pass never cut: each pass goes into the
    first pack with room for it (first fit), so one-row steps on either side of a prefill chunk
    share a pack rather than each side taking one; a pack keeps `ready`'s order."""
    packs: list[list[int]] = []
    held: list[int] = []
    for i, n in zip(ready, rows):
        for k, h in enumerate(held):
            if h + n <= MAX_PACKED_ROWS:
                packs[k].append(i)
                held[k] += n
                break
        else:
            packs.append([i])
            held.append(n)
    return packs
