"""The Gemma 4 assistant as a speculative head: k tokens per round from the base's hidden rows
and its KV planes, read in place.

What a draft reads. The assistant was trained (transformers' Gemma4AssistantCandidateGenerator)
to draft the token after x_p from x_p's embedding, the base's final-normed hidden row of
position p - 1 (the row whose logits chose x_p) and the base's KV rows of positions < p; later
steps feed back their own drafted token and projected state at the same position, over the same
rows. So a draft at t1's position p needs exactly what the last pass that committed position
p - 1 produced.

- One-pass round (the default, needs_last_hidden() False): [t1, d1..dk] is verified in one
  batch; commit_rows keeps the hidden row of the last accepted row, which is the row before the
  next t1, and the base's planes hold exactly positions < t1's. Every draft is the trained
  recipe, at one base pass per round.
- Two-pass round (two_pass=True): t1 runs through a step first and its row (position p) is
  handed over. d1 is drafted as above (t1, row p - 1, KV < p), and the chain is then re-anchored
  on the base's own state: d2 from d1's embedding with t1's row and KV <= p at position p + 1
  (the trained recipe one position on, with the base's real hidden in place of the assistant's
  projection). It costs a step per round; what it buys is d2 onward drafted from base state.
  At a job's first round the row before t1 is not known yet (the prompt's last step is not
  reported to heads): that round makes no proposal.

Rows are kept with their positions, and a draft whose row is not the one it needs is refused
with a reason (error()), so a bookkeeping slip turns into a fallback, never a silent wrong draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from npud.engine.assistant.forward import Assistant, draft_step
from npud.engine.drafters import NO_DRAFT, Draft

Pick = Callable[[np.ndarray, int], int]  # (logits [V], the drafted token's position) -> token


def argmax_pick(logits: np.ndarray, position: int) -> int:
    """The default rule: the assistant's greedy choice."""
    return int(np.argmax(logits))


class AssistantHead:
    """Drafts with an `Assistant` over the planes of the base `Forward` it is attached to.

    pick turns a draft step's logits into its token (argmax; tests pass an oracle to steer
    acceptance). Drafts are deterministic (Draft.probs None), which the loop's accept rule
    also serves under sampling.
    """

    def __init__(self, assistant: Assistant, two_pass: bool = False, pick: Pick = argmax_pick) -> None:
        self.assistant = assistant
        self.two_pass = two_pass
        self.pick = pick
        self.forward = None
        self._rows: list[tuple[int, np.ndarray]] = []  # (position, base row): the last two committed
        self._error: str | None = None

    def attach(self, forward) -> None:
        """Read the hidden rows and KV planes of `forward` (an npud.engine.forward.Forward)."""
        self.forward = forward

    def needs_last_hidden(self) -> bool:
        return self.two_pass

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self._error = None
        f = self.forward
        if f is None:
            return self._fail("the assistant head is not attached to a base forward")
        p = len(context) - 1  # t1's position
        held = f.positions_held
        if held != p + (1 if self.two_pass else 0):
            return self._fail(f"drafting at position {p} over a base holding {held} positions")
        if not self._rows and not self.two_pass:
            # a job's first round: the last pass was the prompt's last token, row p - 1
            self._rows = [(held - 1, np.array(f.last_hidden_rows()[-1], np.float32))]
        before = self._row(p - 1)
        if before is None:
            if self.two_pass and len(self._rows) < 2:
                return NO_DRAFT  # the first round of a job: no row before t1 yet
            return self._fail(f"no base row for position {p - 1} (rows held: {[r for r, _ in self._rows]})")
        a = self.assistant
        kv = a.kv.read(f.state)
        logits, state = draft_step(a, context[-1], before, p, kv, p)
        tokens = [self.pick(logits, p + 1)]
        at, kv_len = p, p
        if self.two_pass and k > 1:
            # re-anchor on t1's own row: d1 at p + 1 over the rows up to t1's
            logits, state = draft_step(a, tokens[-1], self._row(p), p + 1, kv, p + 1)
            tokens.append(self.pick(logits, p + 2))
            at, kv_len = p + 1, p + 1
        while len(tokens) < k:
            logits, state = draft_step(a, tokens[-1], state, at, kv, kv_len)
            tokens.append(self.pick(logits, p + 1 + len(tokens)))
        return Draft(tuple(tokens))

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        if count <= 0 or self.forward is None:
            return
        if rows is None:  # a one-pass head is not handed rows: they are the base's last pass's
            rows = self.forward.last_hidden_rows()
        end = self.forward.positions_held  # the loop has cut the base to the committed rows
        for i in range(max(0, count - 2), count):
            self._rows.append((end - count + i, np.array(rows[i], np.float32)))
        del self._rows[:-2]

    def reset(self) -> None:
        self._rows = []
        self._error = None

    def error(self) -> str | None:
        return self._error

    def _row(self, position: int) -> np.ndarray | None:
        for at, row in self._rows:
            if at == position:
                return row
        return None

    def _fail(self, message: str) -> Draft:
        self._error = message
        return NO_DRAFT
