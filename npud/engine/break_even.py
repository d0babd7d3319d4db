"""The speculative loop's break-even fallback rule (npud/engine/speculative.py runs it after each
speculative round): whether the latest rounds paid for what they cost, by the cost model of
npud/engine/pass_costs.py when the base and the head have one, else by the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

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


class Acceptance:
    """How likely draft i of a round is kept, from the rounds seen: drafts are checked in order
    and the first reject ends a round, so a round of `take` accepts out of `drafted` checked
    drafts 1..take + 1 (1..drafted when all were kept) and kept 1..take.

    Per position i, the chance that draft i is kept given 1..i-1 were: (kept_i + 2 * pooled) /
    (checked_i + 2), pooled being every check's rate with one success and one failure added
    (0.5 before any round). Not one rate for every position: prompt lookup's drafts are copied
    runs, mostly all kept or lost at the first, which a single rate would price as decaying."""

    def __init__(self) -> None:
        self.successes, self.failures = 1, 1
        self.rounds = 0  # rounds observed
        self.checked: list[int] = []  # [i - 1]: rounds that checked draft i
        self.kept: list[int] = []  # [i - 1]: rounds that kept draft i

    def observe(self, take: int, drafted: int) -> None:
        rejected = take < drafted
        self.successes += take
        self.failures += 1 if rejected else 0
        self.rounds += 1
        checked = take + 1 if rejected else take
        while len(self.checked) < checked:
            self.checked.append(0)
            self.kept.append(0)
        for i in range(checked):
            self.checked[i] += 1
            self.kept[i] += 1 if i < take else 0

    @property
    def rate(self) -> float:
        return self.successes / (self.successes + self.failures)

    def at(self, i: int) -> float:
        """The chance draft i (1-based) is kept, given drafts 1..i-1 were."""
        pooled = self.rate
        if i > len(self.checked):
            return pooled
        return (self.kept[i - 1] + 2.0 * pooled) / (self.checked[i - 1] + 2.0)


def best_k(pass_rows: Callable[[int], float], draft_cost: Callable[[int], float], keep: Callable[[int], float],
           k_max: int, two_pass: bool) -> int:
    """The number of drafts, 1..k_max, whose round yields the most tokens per plain step when
    draft i is kept with chance keep(i) given drafts 1..i-1 were (Acceptance.at; npud/engine/
    speculative.py's rounds): expected tokens 1 + p1 + p1 p2 + ... (t1 and the kept run); cost,
    in plain steps, pass_rows(k + 1) + draft_cost(k) for a one-pass round (t1 and the k drafts in
    one batch), 1 + draft_cost(k) + p1 * pass_rows(k) for a two-pass round (a step, then the batch
    only when d1 is kept). With the exact path's steep row costs this is a few drafts unless the
    drafts are nearly always kept; with cheap rows (gguf-q8) it grows with the acceptance."""
    best, best_rate = 1, 0.0
    expected, run = 1.0, 1.0
    first = keep(1)
    for k in range(1, k_max + 1):
        run *= keep(k)
        expected += run
        if two_pass:
            cost = 1.0 + draft_cost(k) + first * pass_rows(k)
        else:
            cost = pass_rows(k + 1) + draft_cost(k)
        rate = expected / cost
        if rate > best_rate:
            best, best_rate = k, rate
    return best
