"""What a decode run reports: its rounds, counters, finish and fallbacks (npud/engine/speculative.py fills them in)."""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field


class RoundKind(enum.Enum):
    ONE_PASS = "one_pass"
    TWO_PASS = "two_pass"
    STEP = "step"


class LoopEnd(enum.Enum):
    """Why the decode loop stopped (stats["finish"]); the user-facing reason is
    npud.engine.api.FinishReason, which npud/engine/generate.py derives."""

    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    STOPPED = "stopped"  # the consumer returned False


class FallbackReason(enum.Enum):
    BELOW_BREAK_EVEN = "below_break_even"
    HEAD_ERROR = "head_error"


@dataclass(slots=True, frozen=True)
class Fallback:
    """One switch to plain decoding: when, why, and the figures that decided it."""

    round: int  # the speculative round after which the job fell back (1-based)
    emitted: int  # tokens emitted at that moment
    reason: FallbackReason
    message: str
    acceptance: float  # accepted / drafted over the rounds that decided it (the job's, on a head error)
    break_even_acceptance: float | None  # what those rounds needed to match plain decode
    cost_ratio: float | None  # their mean cost (draft + passes) in plain steps
    step_seconds: float | None  # the mean plain step they were measured against

    def as_dict(self) -> dict:
        return {
            "round": self.round,
            "emitted": self.emitted,
            "reason": self.reason.value,
            "message": self.message,
            "acceptance": self.acceptance,
            "break_even_acceptance": self.break_even_acceptance,
            "cost_ratio": self.cost_ratio,
            "step_seconds": self.step_seconds,
        }


@dataclass(slots=True)
class DecodeStats:
    """Counters of one run; filled in by the loop as it goes, final when it returns."""

    emitted: int = 0
    rounds: int = 0  # rounds that verified a draft
    plain_steps: int = 0  # rounds that ran t1 alone
    drafted: int = 0
    accepted: int = 0
    base_steps: int = 0  # one-row passes for emitted tokens (the prompt's last token excluded)
    base_batches: int = 0
    batch_rows: int = 0
    step_samples: list[float] = field(default_factory=list)  # every step, the prompt's last token included
    verify_samples: list[float] = field(default_factory=list)  # every verify batch
    draft_seconds_total: float = 0.0
    seconds: float = 0.0  # wall time from the prompt's last token to the latest round
    finish: LoopEnd | None = None
    fallbacks: list[Fallback] = field(default_factory=list)
    reprobes: int = 0
    # the break-even rule's cost model when it used one (npud/engine/pass_costs.py: source, ratios of an
    # r-row pass to a plain step, calibration key, and the drafter's costs in plain steps under
    # "drafter"); None: rounds were judged by their measured times
    cost_model: dict | None = None
    round_cost_steps: float = 0.0  # the speculative rounds' cost (passes + drafts) in plain steps, by the cost model

    @property
    def break_even_acceptance(self) -> float | None:
        """The acceptance the job's speculative rounds needed to match plain decode at their
        modelled cost: t1 plus cost - 1 accepted drafts a round (None without a cost model)."""
        if self.cost_model is None or not self.drafted:
            return None
        return (self.round_cost_steps - self.rounds) / self.drafted

    @property
    def base_passes(self) -> int:
        return self.base_steps + self.base_batches

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def passes_per_token(self) -> float:
        return self.base_passes / self.emitted if self.emitted else 0.0

    @property
    def step_seconds(self) -> float | None:
        """The median plain step: a machine shared with other work makes the mean an outlier's."""
        return statistics.median(self.step_samples) if self.step_samples else None

    @property
    def verify_step_ratio(self) -> float | None:
        """Median verify batch time over median plain step time."""
        if not self.verify_samples or not self.step_samples:
            return None
        return statistics.median(self.verify_samples) / self.step_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    @property
    def fell_back(self) -> bool:
        return bool(self.fallbacks)

    def as_dict(self) -> dict:
        """The stats as a generation result carries them (JSON types only)."""
        return {
            "emitted": self.emitted,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "base_passes": self.base_passes,
            "base_steps": self.base_steps,
            "base_batches": self.base_batches,
            "passes_per_token": self.passes_per_token,
            "step_seconds": self.step_seconds,
            "verify_step_ratio": self.verify_step_ratio,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "finish": None if self.finish is None else self.finish.value,
            "fell_back": self.fell_back,
            "fallbacks": [f.as_dict() for f in self.fallbacks],
            "reprobes": self.reprobes,
            "cost_model": self.cost_model,
            "round_cost_steps": self.round_cost_steps,
            "break_even_acceptance": self.break_even_acceptance,
        }


@dataclass(slots=True, frozen=True)
class RoundEvent:
    """What one round did; the generator yields one per round."""

    kind: RoundKind
    tokens: tuple[int, ...]  # emitted (and committed) this round, in order
    drafted: int
    accepted: int
