"""What a base pass of r rows costs, in plain one-row steps: the speculation break-even rule's cost model.

The rule (engine/speculative.py's _BreakEven) compares what speculative rounds produced with
what they cost. Timing each round against the median plain step makes the neighbours decide:
on a busy machine every round looks slower and the job falls back. Instead the costs come from
a calibration of the model's own passes (r = 1 .. max rows, the fastest of a few runs of each),
made once per CPU, kernel path, weight format, thread count and model shape (about a second for
gemma-3-270m on a quiet machine) and kept in the
kernel cache directory, so that later loads read the same table and the same prompt makes the
same speculation choices however busy the machine is.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

CALIBRATION_VERSION = 1
REPEATS = 5  # runs of each row count; the fastest is kept (a preempted run only ever looks slower)


@dataclass(slots=True, frozen=True)
class PassCosts:
    """ratios[r - 1]: an r-row base pass in plain steps (ratios[0] = 1); `source` says where they came from."""

    ratios: tuple[float, ...]
    source: str  # "calibrated" (measured now), "cached" (read from the kernel cache), "injected" (tests)
    key: str = ""

    def __post_init__(self) -> None:
        if not self.ratios or self.ratios[0] != 1.0 or any(not (r > 0) for r in self.ratios):
            raise ValueError(f"PassCosts.ratios must start at 1.0 and be positive, got {self.ratios!r}")

    def rows(self, r: int) -> float:
        """The cost of an r-row pass in plain steps (past the table: its last ratio per row, scaled)."""
        if r <= len(self.ratios):
            return self.ratios[r - 1]
        return self.ratios[-1] * r / len(self.ratios)

    def as_dict(self) -> dict:
        return {"source": self.source, "ratios": list(self.ratios), "key": self.key}


def calibration_key(model, threads: int, max_rows: int) -> str:
    """CPU, kernel path, weight layouts, thread count, rows and the model's shape, as one digest."""
    from kernels.host import native

    w = model.weights
    layouts = sorted({f"{getattr(lw.fmt, 'value', lw.fmt)}/{lw.layout}" for lw in _linears(w)})
    parts = [_cpu_name(), native.isa(), ",".join(layouts), str(threads), str(max_rows), repr(model.config),
             str(CALIBRATION_VERSION)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def load_or_calibrate(model, threads: int, max_rows: int, directory: Path | None = None) -> PassCosts:
    """The model's pass costs for rows 1..max_rows: from the cache directory when there, else
    measured (REPEATS runs of each row count, the fastest kept) and stored there."""
    from kernels.host.cache import cache_dir

    key = calibration_key(model, threads, max_rows)
    path = (directory or cache_dir()) / "pass-costs" / f"{key}.json"
    try:
        ratios = tuple(float(r) for r in json.loads(path.read_text())["ratios"])
        return PassCosts(ratios, "cached", key)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = PassCosts(measure(model, max_rows), "calibrated", key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"ratios": list(costs.ratios), "cpu": _cpu_name()}, f)
        os.replace(tmp, path)
    except OSError as e:  # an unwritable cache: the table serves this process only
        log.warning("pass_costs_not_cached", error=str(e))
    log.info("pass_costs_calibrated", key=key, ratios=[round(r, 3) for r in costs.ratios])
    return costs


def measure(model, max_rows: int) -> tuple[float, ...]:
    """An r-row pass (after a 16-token prefix) over a one-row pass, r = 1..max_rows: the fastest of
    REPEATS runs at r = 1, 2, 4, 8, ... and max_rows (taken in turns, so a busy spell slows them
    alike), linear in between, never below the ratio of fewer rows."""
    from engine.forward import Forward

    f = Forward(model, max_batch_rows=max_rows)
    vocab = model.config.vocab_size
    prefix = [(7 * i + 1) % vocab for i in range(16)]
    f.prefill(prefix)
    counts = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
    fastest = {r: float("inf") for r in counts}
    for _ in range(REPEATS):
        for r in counts:
            rows = [(3 * i + 5) % vocab for i in range(r)]
            t = time.perf_counter()
            f.step_batch_all(rows, len(prefix)) if r > 1 else f.step(rows[0], len(prefix))
            fastest[r] = min(fastest[r], time.perf_counter() - t)
            f.truncate(len(prefix))
    ratios = [1.0]
    for r in range(2, max_rows + 1):
        lo = max(c for c in counts if c <= r)
        hi = min(c for c in counts if c >= r)
        t = fastest[lo] if hi == lo else fastest[lo] + (fastest[hi] - fastest[lo]) * (r - lo) / (hi - lo)
        ratios.append(max(ratios[-1], t / fastest[1]))
    return tuple(ratios)


def _linears(weights):
    from engine.weights import weight_arrays
    from kernels.base import LinearWeight

    out = [weights.lm_head]
    for layer in weights.layers:
        out += [o for o in weight_arrays(layer) if isinstance(o, LinearWeight)]
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
