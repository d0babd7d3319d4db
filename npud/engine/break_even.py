"""The speculative loop's break-even fallback rule (npud/engine/speculative.py runs it after each
speculative round): whether the latest rounds paid for what they cost, by the cost model of
npud/engine/pass_costs.py when the base and the head have one, else by the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from npud.engine.api import SpecParams
from npud.engine.decode_stats import DecodeStats, Fallback, FallbackReason


class BreakEven:
    """Decides the fallback: the last config.fallback_rounds speculative rounds, taken together,
    produced fewer tokens than plain steps would have for what they cost. Taking them together
    keeps one lucky round from hiding a losing streak.

    What a round costs: when the base has a cost model (`pass_costs()`: npud/engine/pass_costs.py,
    the kernels' calibration of an r-row pass in plain steps, cached per CPU, format, threads
    and shape) and the head has one for its drafts (`costs`, with `draft_cost()` for the last
    draft: none for prompt lookup, the draft model's calibrated passes, DFlash's calibrated
    block), its passes' costs plus its draft's, so the decision depends on the tokens alone,
    not on how busy the machine is; otherwise its measured seconds (draft + passes) over the
    median plain step."""

    def __init__(self, config: SpecParams, stats: DecodeStats, base: object = None, head: object = None) -> None:
        self.config, self.stats, self.head = config, stats, head
        # (seconds, produced, drafted, accepted, cost in plain steps or None) of the latest rounds
        self.window: deque[tuple[float, int, int, int, float | None]] = deque(maxlen=max(config.fallback_rounds, 1))
        pass_costs = getattr(base, "pass_costs", None)
        costs = pass_costs() if callable(pass_costs) else None
        head_costs = getattr(head, "costs", None)
        self.costs = costs if costs is not None and head_costs is not None else None
        stats.cost_model = None if self.costs is None else {**self.costs.as_dict(), "drafter": head_costs.as_dict()}

    def judge(self, seconds: float, produced: int, drafted: int, accepted: int,
              pass_rows: Sequence[int] = ()) -> Fallback | None:
        """One speculative round: its time, tokens produced (t1 + accepted), drafts, accepted
        drafts and the rows of each base pass it ran; a Fallback when the rule says stop."""
        cost = None
        if self.costs is not None:
            # the round's base passes and its draft, in plain steps
            cost = sum(self.costs.rows(r) for r in pass_rows) + self.head.draft_cost()
            self.stats.round_cost_steps += cost
        self.window.append((seconds, produced, drafted, accepted, cost))
        if self.config.fallback_rounds == 0 or len(self.window) < self.config.fallback_rounds:
            return None
        step = self.stats.step_seconds
        spent, produced, drafted, accepted = (sum(x[i] for x in self.window) for i in range(4))
        n = len(self.window)
        if self.costs is not None:
            steps = sum(x[4] for x in self.window)  # the rounds' passes and drafts
            if produced >= steps:
                return None
            cost = steps / n  # a round, in plain steps
        else:
            if produced * step >= spent:
                return None
            cost = spent / n / step
        acceptance = accepted / drafted
        # a round pays off when it yields `cost` tokens: t1 plus cost - 1 accepted drafts
        needed = (cost - 1.0) / (drafted / n)
        self.window.clear()
        basis = "calibrated pass costs" if self.costs is not None else "measured round times"
        return Fallback(
            round=self.stats.rounds,
            emitted=self.stats.emitted,
            reason=FallbackReason.BELOW_BREAK_EVEN,
            message=(
                f"{n} consecutive rounds below break-even: acceptance {acceptance:.2f} where "
                f"{needed:.2f} was needed at a round cost of {cost:.2f} plain steps ({basis})"
            ),
            acceptance=acceptance,
            break_even_acceptance=needed,
            cost_ratio=cost,
            step_seconds=step,
        )

    def head_error(self, message: str) -> Fallback:
        self.window.clear()
        return Fallback(
            round=self.stats.rounds,
            emitted=self.stats.emitted,
            reason=FallbackReason.HEAD_ERROR,
            message=message,
            acceptance=self.stats.acceptance_rate,
            break_even_acceptance=None,
            cost_ratio=None,
            step_seconds=self.stats.step_seconds,
        )
