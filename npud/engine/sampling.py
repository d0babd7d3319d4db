"""Token choice: greedy or seeded sampling, and the speculative accept/resample rule.

One `Sampler` per job. Plain decode calls `choose(logits)` per token; the speculative loop
calls `judge(draft, q, logits)` per drafted position and `choose` for the bonus token after a
fully accepted chain. With temperature 0 both are argmax, so speculation is byte-equal to
plain greedy decode; with temperature > 0 the rule of Leviathan et al. / Chen et al. makes
every emitted token distributed exactly as plain sampling would (not byte-equal: the random
stream is consumed differently).

A checkpoint may pad its embedding past the tokenizer (Qwen: 151,936 rows for 151,669 ids).
A sampler built with `allowed` never returns a padded id: `choose`, `judge` and `probs` all
read the logits through `masked`, so plain decode, every verify and the resample after a
reject see the same masked distribution and speculation stays byte-equal to plain greedy.

A sampler built with `logprobs` (a number of alternatives) records, for every token it
chooses or judges, in the order it does so, the token's log probability and the row's most
likely tokens: the log-softmax in float64 of the float32 row (masked as above), which is the
same row whether a plain step or a verify batch made it. The consumer takes the records in
the same order (`take_record`), one per emitted token; records of tokens judged past the
point where the run stopped are never taken.

A sampler built with a `constraint` (npud/engine/grammar.py: a request's grammar) masks, on top of
the padding, every row it chooses or judges from with the grammar's mask at that point, and
advances the grammar past each token it chooses or judges, in that order: a speculative round
judges its drafts one after another, each against its row masked after the ones before it,
so greedy output is byte-identical to plain decode's, and a draft the grammar forbids is
rejected (its masked logit is -inf). A row where the grammar allows no id is a dead end: the
record says so and the consumer ends the run there. Logprobs stay those of the raw model
distribution (the padding masked, the grammar not).
"""

from __future__ import annotations

import collections

import numpy as np

from npud.engine.api import SamplingParams


class Sampler:
    """Chooses tokens from logits under one `SamplingParams`, with its own seeded stream.

    `allowed` (bool [V], or None for all) names the ids it may return: the ones the tokenizer
    can decode (npud.engine.tokenizer.Tokenizer.decodable).
    """

    def __init__(self, config: SamplingParams = SamplingParams(), allowed: np.ndarray | None = None, *,
                 logprobs: int | None = None, constraint=None) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        self.allowed = None if allowed is None else np.asarray(allowed, dtype=bool)
        self._masked_ids = None if allowed is None else np.flatnonzero(~self.allowed)
        self.logprobs = logprobs  # alternatives to record per token; None: no logprobs
        self.constraint = constraint  # npud.engine.grammar.Constraint, or None
        self._recording = logprobs is not None or constraint is not None
        # (token, logprob, ((id, logprob), ...), dead end) per chosen or judged token, oldest first
        self._records: collections.deque[tuple[int, float | None, tuple[tuple[int, float], ...], bool]] = \
            collections.deque()

    def log_softmax(self, logits: np.ndarray) -> np.ndarray:
        """The raw distribution's log probabilities [V] float64: log-softmax of the row with the
        padding masked (not the grammar)."""
        z = self._pad_masked(logits).astype(np.float64)
        m = z.max()
        return z - (m + np.log(np.sum(np.exp(z - m))))

    def _record(self, logits: np.ndarray, token: int, dead_end: bool = False) -> int:
        """Note `token` as chosen from `logits` (and advance the grammar past it); returns it."""
        if self.constraint is not None and not dead_end:
            self.constraint.consume(token)
        if not self._recording:
            return token
        logprob, top = None, ()
        if self.logprobs is not None:
            lp = self.log_softmax(logits)
            n = min(self.logprobs, int(np.isfinite(lp).sum()))
            if n > 0:
                ids = np.argpartition(-lp, n - 1)[:n]
                top = tuple((int(i), float(lp[i])) for i in sorted(ids, key=lambda i: (-lp[i], i)))
            logprob = float(lp[token])
        self._records.append((token, logprob, top, dead_end))
        return token

    def _dead_end(self, logits: np.ndarray) -> int | None:
        """When the grammar allows no id of this row: the row's raw argmax, recorded as a dead
        end (never given to the grammar); else None."""
        if self.constraint is None or np.isfinite(self.masked(logits)).any():
            return None
        return self._record(logits, int(np.argmax(self._pad_masked(logits))), dead_end=True)

    def take_record(self) -> tuple[int, float | None, tuple[tuple[int, float], ...], bool]:
        """The oldest record not yet taken: (token, logprob or None, top alternatives, whether
        the grammar had dead-ended there). Raises IndexError when none is left (a consumer out
        of step with the loop)."""
        return self._records.popleft()

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] with every id outside `allowed`, and with a constraint every id its
        grammar forbids now, at -inf (a copy; the input itself when all ids are allowed)."""
        out = self._pad_masked(logits)
        if self.constraint is None:
            return out
        return np.where(self.constraint.allowed(), out, np.float32(-np.inf)).astype(out.dtype, copy=False)

    def _pad_masked(self, logits: np.ndarray) -> np.ndarray:
        """logits [..., V] with every id outside `allowed` at -inf (a copy; the input itself when
        all ids are allowed). Raises ValueError when V is not the width of `allowed`."""
        logits = np.asarray(logits)
        if self.allowed is None:
            return logits
        if logits.shape[-1] != self.allowed.size:
            raise ValueError(f"logits of width {logits.shape[-1]} for a sampler that allows ids of {self.allowed.size}")
        out = np.array(logits, copy=True)
        out[..., self._masked_ids] = -np.inf
        return out

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a token is drawn from: [V] float64 summing to 1.

        Greedy is the one-hot of the argmax. Otherwise softmax(logits / T), restricted to the
        top_k largest and then to the smallest set whose mass reaches top_p, renormalised.
        """
        logits = self.masked(logits)
        if self.config.greedy:
            p = np.zeros(logits.shape[-1], dtype=np.float64)
            p[int(np.argmax(logits))] = 1.0
            return p
        z = logits.astype(np.float64) / self.config.temperature
        z -= z.max()
        p = np.exp(z)
        if 0 < self.config.top_k < p.size:
            # ties at the k-th value are all kept: which of equal tokens to drop is arbitrary
            kth = np.partition(p, -self.config.top_k)[-self.config.top_k]
            p[p < kth] = 0.0
        p /= p.sum()
        if self.config.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            mass_before = np.cumsum(p[order]) - p[order]
            p[order[mass_before >= self.config.top_p]] = 0.0
            p /= p.sum()
        return p

    def choose(self, logits: np.ndarray) -> int:
        """The next token: argmax when greedy, else one draw from `probs(logits)`."""
        if (dead := self._dead_end(logits)) is not None:
            return dead
        if self.config.greedy:
            return self._record(logits, int(np.argmax(self.masked(logits))))
        return self._record(logits, self.draw(self.probs(logits)))

    def judge(self, draft: int, q: np.ndarray | None, logits: np.ndarray) -> int | None:
        """Verify one drafted token against the base's logits at its position.

        q is the drafter's distribution [V] the draft was drawn from, or None for a
        deterministic drafter (q is then the one-hot of the draft). Returns None when the
        draft is accepted, else the token to emit in its place (after which the round stops).
        """
        if (dead := self._dead_end(logits)) is not None:
            return dead
        if self.config.greedy:
            choice = self._record(logits, int(np.argmax(self.masked(logits))))
            return None if choice == draft else choice
        p = self.probs(logits)
        q_draft = 1.0 if q is None else float(q[draft])
        # accept with probability min(1, p/q): the accepted mass at each token is min(p, q)
        if q_draft > 0.0 and self.rng.random() * q_draft < p[draft]:
            self._record(logits, draft)
            return None
        # on reject draw from the normalised residual max(0, p - q): min(p, q) + residual = p
        residual = p.copy()
        if q is None:
            residual[draft] = 0.0
        else:
            residual = np.maximum(residual - q, 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: a reject had probability ~0
            residual = p
        return self._record(logits, self.draw(residual))

    def draw(self, weights: np.ndarray) -> int:
        """One index drawn with probability proportional to weights [V] (>= 0, not all 0)."""
        cdf = np.cumsum(weights)
        # side="right" never lands on a zero-weight token: cdf does not rise there
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        if i >= weights.size:  # u * total rounded up to total: the last token with weight
            i = int(np.flatnonzero(weights)[-1])
        return i
