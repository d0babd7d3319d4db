"""Generation as a stream of (token id, text delta): prompt in, text out, a round at a time.

Wraps the decode loops of npud/engine/speculative.py with what a user sees: the prompt's
prefill, incremental detokenisation that never splits a UTF-8 character, stop tokens and
stop strings (text held back while it could still be the start of a stop string), and a
finish reason. The rounds are a generator so that a caller (the daemon's device-owner
task) can run one round at a time and check for cancellation in between.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import numpy as np

from npud.engine.api import FinishReason, GenerationParams, TokenEvent, TokenLogprob
from npud.engine.packed import Pass, Rows
from npud.engine.sampling import Sampler
from npud.engine.speculative import DecodeStats, plain_loop, speculative_loop


class Generation:
    """One prompt's generation over a `Forward` that holds a prefix of the prompt (often none),
    under `params` (max_tokens, sampling, stop strings; params.spec when a head is given).
    `stop_token_ids` end the run as the tokenizer's EOS ids do.

    Iterate `rounds()`; each item is the list of `TokenEvent`s one engine round released.
    Afterwards `text`, `token_ids`, `finish_reason` and `stats` describe the run.
    """

    def __init__(
        self,
        forward,
        tokenizer,
        prompt_ids: Sequence[int],
        params: GenerationParams = GenerationParams(),
        head=None,
        stop_token_ids: Sequence[int] = (),
        constraint=None,
    ):
        if not prompt_ids:
            raise ValueError("the prompt is empty: nothing to continue from")
        held = forward.positions_held
        if held >= len(prompt_ids):
            raise ValueError(f"the forward holds {held} positions, the prompt has only {len(prompt_ids)}")
        self.forward = forward
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.head = head
        self.stats = DecodeStats()
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = held
        self._decoder = tokenizer.decoder()
        self._pending = ""  # decoded text not yet released (could begin a stop string)
        self._events: list[TokenEvent] = []
        self._logprob: TokenLogprob | None = None  # the token _on_token is handling's
        self._cancelled = False
        self._stopped_by_string = False
        self._eos = frozenset(tokenizer.eos_token_ids) | frozenset(stop_token_ids)
        self._sampler: Sampler | None = None
        self.constraint = constraint  # npud.engine.grammar.Constraint of params.grammar, or None
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []

    def cancel(self) -> None:
        """The next round boundary ends the run with finish reason `cancelled`."""
        self._cancelled = True

    def rounds(self) -> Iterator[list[TokenEvent]]:
        """Prefill (first round), then one decode round per item; the passes run on the forward
        alone (work() is the same rounds for a driver that packs passes)."""
        sent = None
        work = self.work()
        while True:
            try:
                item = work.send(sent)
            except StopIteration:
                return
            sent = self.forward.run(item) if isinstance(item, Pass) else None
            if not isinstance(item, Pass):
                yield item

    def work(self) -> Generator[Pass | list[TokenEvent], np.ndarray | None, None]:
        """The rounds as a driver runs them: yields each base pass (npud.engine.packed.Pass; send its
        logits back) and, at the end of each round, the list of TokenEvents it released. The
        prefill's chunks come first, then an empty round end, then the decode rounds."""
        held = self.forward.positions_held
        if held < len(self.prompt_ids) - 1:
            yield from self.forward.prefill_passes(self.prompt_ids[held:-1], logits=Rows.NONE)
        if self._cancelled:
            self.finish_reason = FinishReason.CANCELLED
            return
        yield []
        # ids of a padded vocabulary that the tokenizer cannot decode are never chosen
        sampler = Sampler(self.params.sampling, self.tokenizer.decodable(self.forward.config.vocab_size),
                          logprobs=self.params.logprobs, constraint=self.constraint)
        self._sampler = sampler
        common = dict(
            max_new_tokens=self.params.max_tokens,
            sampler=sampler,
            on_token=self._on_token,
            stats=self.stats,
            eos_ids=self._eos,
        )
        if self.head is None:
            loop = plain_loop(self.forward, self.prompt_ids, **common)
        else:
            loop = speculative_loop(self.forward, self.head, self.prompt_ids, config=self.params.spec, **common)
        sent = None
        while True:
            try:
                item = loop.send(sent)
            except StopIteration:
                break
            if isinstance(item, Pass):
                sent = yield item
                continue
            sent = None
            if self._cancelled and self.finish_reason is None:
                self.finish_reason = FinishReason.CANCELLED
            if self.finish_reason is not None:
                break
            yield self._take_events()
        if self.finish_reason is None:
            last = self.token_ids[-1] if self.token_ids else None
            self.finish_reason = FinishReason.STOP if last in self._eos else FinishReason.LENGTH
        if not self._stopped_by_string:
            self._release_tail(self._pending + self._decoder.flush())
        yield self._take_events()

    @property
    def ended_at_eos(self) -> bool:
        """Whether the run ended with an end-of-sequence id (not max_tokens, a stop string, a
        cancel or a dead end). Under a grammar that means the grammar was complete: it allows EOS
        nowhere else."""
        return self.finish_reason == FinishReason.STOP and not self._stopped_by_string

    def _on_token(self, token: int) -> bool:
        self._logprob, dead_end = self._take_record(token)
        if dead_end:  # the grammar allowed nothing here: the run ends before this token
            self.finish_reason = FinishReason.GRAMMAR_DEAD_END
            return False
        self.token_ids.append(token)
        if self._logprob is not None:
            self.logprobs.append(self._logprob)
        if token in self._eos:
            self._events.append(TokenEvent(token, "", self._logprob))  # an EOS id is not shown as text
            return True  # the loop stops after an EOS id by itself
        self._pending += self._decoder.push(token)
        cut = _find_stop(self._pending, self.params.stop)
        if cut is not None:
            self._release(token, self._pending[:cut])
            self._pending = ""
            self._stopped_by_string = True
            self.finish_reason = FinishReason.STOP
            return False
        keep = _longest_stop_prefix_suffix(self._pending, self.params.stop)
        self._release(token, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]
        return True

    def _take_record(self, token: int) -> tuple[TokenLogprob | None, bool]:
        """The sampler's record of the row that chose `token` (the records come in the order the
        tokens were chosen or judged, and every emitted token was one of them): its logprob
        (None unless asked) and whether the grammar dead-ended there."""
        if self.logprobs is None and self.constraint is None:
            return None, False
        chosen, logprob, top, dead_end = self._sampler.take_record()
        if chosen != token:
            raise RuntimeError(f"sampler records out of step: token {token} emitted, {chosen} recorded")
        if logprob is None:
            return None, dead_end
        piece = self.tokenizer.token_bytes
        return TokenLogprob(token, piece(token), logprob, tuple(TokenLogprob(i, piece(i), lp) for i, lp in top)), \
            dead_end

    def _release(self, token: int, text: str) -> None:
        self.text += text
        self._events.append(TokenEvent(token, text, self._logprob))

    def _release_tail(self, text: str) -> None:
        """Text held back until the end (a possible stop-string start, an unfinished character)."""
        self._pending = ""
        if not text:
            return
        self.text += text
        if self._events:
            last = self._events[-1]
            self._events[-1] = TokenEvent(last.token_id, last.text + text, last.logprob)
        else:
            self._events.append(TokenEvent(None, text))

    def _take_events(self) -> list[TokenEvent]:
        out, self._events = self._events, []
        return out

    def run(self) -> str:
        """Run to the end; returns the text."""
        for _ in self.rounds():
            pass
        return self.text


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
