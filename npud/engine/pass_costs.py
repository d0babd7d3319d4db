"""What a base pass of r rows costs, in plain one-row steps: the speculation break-even rule's cost model.

The rule (npud/engine/break_even.py) compares what speculative rounds produced with
what they cost. Timing each round against the median plain step makes the neighbours decide:
on a busy machine every round looks slower and the job falls back. Instead the costs come from
a calibration of the model's own passes (r = 1 .. max rows, the fastest of a few runs of each,
on the model's own thread count), made once and kept in the kernel cache directory under a key
over everything that changes the figures: the CPU (model, flags, microcode), the backend and
ISA path, the compiled library (a digest of the kernel sources and flags), the numerics
version, every linear's format, layout and shape, the model's config, the thread count and
the row count. Later loads read the same table (about a millisecond instead of a second or
more), so the same prompt makes the same speculation choices however busy the machine is.

An entry is checked on read: this file's format, the full key, the row count, and seconds that
are finite, positive and non-decreasing in the rows. Anything else (a torn write, another
key's entry copied over, a hand-edited table) is measured again and overwritten, never used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from npud.engine.cache_entry import reject

log = structlog.get_logger(__name__)

FORMAT = 2  # of the cache entry and of what the key covers
REPEATS = 5  # runs of each row count; the fastest is kept (a preempted run only ever looks slower)


@dataclass(slots=True, frozen=True)
class PassCosts:
    """ratios[r - 1]: an r-row base pass in plain steps (ratios[0] = 1); `source` says where they
    came from; `step_seconds` the fastest one-row pass the calibration saw (0.0: not measured),
    which puts a drafter's calibrated passes on the same scale."""

    ratios: tuple[float, ...]
    source: str  # "calibrated" (measured now), "cached" (read from the kernel cache), "injected" (tests)
    key: str = ""
    step_seconds: float = 0.0

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

    @classmethod
    def from_seconds(cls, seconds, source: str, key: str = "") -> PassCosts:
        step = seconds[0]
        return cls(tuple(1.0 if r == 1 else s / step for r, s in enumerate(seconds, 1)), source, key, step)


def calibration_key(model, threads: int, max_rows: int) -> str:
    """The full sha256 an entry is stored under (the module docstring says what it covers)."""
    from npud.kernels import base as kernels_base
    from npud.kernels.host import checkcache, native

    w = model.weights
    shapes = sorted({f"{getattr(lw.fmt, 'value', lw.fmt)}/{lw.layout}/{lw.out_features}x{lw.in_features}"
                     for lw in _linears(w)})
    parts = [str(FORMAT), checkcache._cpu(), getattr(model.backend, "name", "?"), native.isa(),
             native.library_path().name, str(kernels_base.NUMERICS_VERSION), ",".join(shapes),
             repr(model.config), str(threads), str(max_rows)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def entry_path(key: str, directory: Path | None = None) -> Path:
    from npud.kernels.host.cache import cache_dir

    return (directory or cache_dir()) / "pass-costs" / f"{key[:32]}.json"


def read_entry(key: str, max_rows: int, directory: Path | None = None) -> list[float] | None:
    """The cached table for `key` (seconds of the base's passes, or a drafter's work in base
    steps), or None: absent, unreadable, or failing any check."""
    path = entry_path(key, directory)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        reject(path, "pass-costs", f"unreadable: {e}")
        return None
    seconds = raw.get("table") if isinstance(raw, dict) else None
    reason = None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        reason = "format"
    elif raw.get("key") != key:
        reason = "key"
    elif not isinstance(seconds, list) or len(seconds) != max_rows:
        reason = "rows"
    elif not all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in seconds) \
            or any(b < a for a, b in zip(seconds, seconds[1:])):
        reason = "seconds"
    if reason is not None:
        reject(path, "pass-costs", reason)
        return None
    return seconds


def write_entry(table, key: str, directory: Path | None = None) -> None:
    """Store a table atomically; a cache that refuses is logged and otherwise ignored."""
    path = entry_path(key, directory)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "key": key, "table": [float(s) for s in table]}, f)
        os.replace(tmp, path)
    except OSError as e:  # an unwritable cache: the table serves this process only
        log.warning("pass_costs_not_cached", error=str(e))


def load_or_calibrate(model, threads: int, max_rows: int, directory: Path | None = None) -> PassCosts:
    """The model's pass costs for rows 1..max_rows on `threads` host threads: from the cache
    directory when a valid entry is there, else measured (REPEATS runs of each row count, the
    fastest kept, on `threads` threads) and stored there."""
    key = calibration_key(model, threads, max_rows)
    cached = read_entry(key, max_rows, directory)
    if cached is not None:
        return PassCosts.from_seconds(cached, "cached", key)
    started = time.perf_counter()
    with _threads(threads):
        seconds = measure(model, max_rows)
    write_entry(seconds, key, directory)
    costs = PassCosts.from_seconds(seconds, "calibrated", key)
    log.info("pass_costs_calibrated", key=key[:24], threads=threads, seconds=round(time.perf_counter() - started, 2),
             ratios=[round(r, 3) for r in costs.ratios])
    return costs


def model_threads(threads: int | None) -> int:
    """The thread count a model's rounds run on: its own `threads`, else the process default
    (NPUD_HOST_THREADS, else the CPUs it may use), whatever count another model left set."""
    from npud.kernels.host import native

    if threads:
        return threads
    with _threads(0):
        return native.threads()


@contextmanager
def _threads(n: int):
    """The host kernels on n threads for the calibration, the previous count after it."""
    from npud.kernels.host import native

    before = native.threads()
    native.set_threads(n)
    try:
        yield
    finally:
        native.set_threads(before)


def measure(model, max_rows: int) -> tuple[float, ...]:
    """Seconds of an r-row pass (after a 16-token prefix), r = 1..max_rows: the fastest of
    REPEATS runs at r = 1, 2, 4, 8, ... and max_rows (taken in turns, so a busy spell slows them
    alike), linear in between, never below the time of fewer rows."""
    fastest = _fastest(max_rows, {"pass": _passes(model, max_rows)})["pass"]
    return _interpolate(fastest, max_rows)


def _passes(model, max_rows: int):
    """run(r): one r-row pass of `model` after a 16-token prefix, rolled back after."""
    from npud.engine.forward import Forward

    f = Forward(model, max_batch_rows=max(max_rows, 1))
    vocab = model.config.vocab_size
    prefix = [(7 * i + 1) % vocab for i in range(16)]
    f.prefill(prefix)

    def run(r: int) -> None:
        rows = [(3 * i + 5) % vocab for i in range(r)]
        f.step_batch_all(rows, len(prefix)) if r > 1 else f.step(rows[0], len(prefix))
        f.truncate(len(prefix))

    return run


def _fastest(max_rows: int, runs: dict) -> dict:
    """{name: {r: fastest seconds}} of each run(r) at r = 1, 2, 4, ... and max_rows, REPEATS
    times in turns (every run at every count, then again), so a busy spell slows them alike."""
    counts = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
    fastest = {name: {r: float("inf") for r in counts} for name in runs}
    for _ in range(REPEATS):
        for r in counts:
            for name, run in runs.items():
                t = time.perf_counter()
                run(r)
                fastest[name][r] = min(fastest[name][r], time.perf_counter() - t)
    return fastest


def _interpolate(fastest: dict, max_rows: int) -> tuple[float, ...]:
    """Seconds for r = 1..max_rows from the measured counts: linear in between, never below
    the time of fewer rows."""
    counts = sorted(fastest)
    seconds = [fastest[1]]
    for r in range(2, max_rows + 1):
        lo = max(c for c in counts if c <= r)
        hi = min(c for c in counts if c >= r)
        t = fastest[lo] if hi == lo else fastest[lo] + (fastest[hi] - fastest[lo]) * (r - lo) / (hi - lo)
        seconds.append(max(seconds[-1], t))
    return tuple(seconds)


# --------------------------------------------------------------------------- drafters


@dataclass(slots=True, frozen=True)
class DraftCosts:
    """steps[r - 1]: a drafter's work for r rows in the base's plain steps (a draft model: one
    r-row pass of its own; DFlash: folding r + 1 context rows and drafting a block of r)."""

    steps: tuple[float, ...]
    source: str  # "calibrated", "cached", "free" (prompt lookup) or "injected" (tests)
    key: str = ""

    def __post_init__(self) -> None:
        if not self.steps or any(not (math.isfinite(s) and s >= 0) for s in self.steps):
            raise ValueError(f"DraftCosts.steps must be finite and >= 0, got {self.steps!r}")

    def rows(self, r: int) -> float:
        """The drafter's work for r rows in base steps (none for r = 0; past the table: scaled)."""
        if r <= 0:
            return 0.0
        if r <= len(self.steps):
            return self.steps[r - 1]
        return self.steps[-1] * r / len(self.steps)

    def as_dict(self) -> dict:
        return {"source": self.source, "steps": list(self.steps), "key": self.key}


FREE = DraftCosts((0.0,), "free")  # prompt lookup: a dictionary look-up, next to nothing beside a pass


def drafter_costs(base, draft, dflash, threads: int, max_rows: int) -> tuple[DraftCosts | None, DraftCosts | None]:
    """The costs of a served model's drafters (a draft model, a DFlash drafter; None for one it
    lacks) in its plain steps, on its thread count; base.pass_costs must be set."""
    return (None if draft is None else draft_model_costs(draft, base, base.pass_costs, threads, max_rows),
            None if dflash is None else dflash_costs(dflash, base, base.pass_costs, threads))


def draft_model_costs(draft, base, base_costs: PassCosts, threads: int, max_rows: int,
                      directory: Path | None = None) -> DraftCosts:
    """A draft model's r-row passes in the base's plain steps (its own calibration key and the
    base's make the entry's key)."""
    signature = "draft-model\0" + calibration_key(draft, threads, max_rows)
    return _drafter_costs(signature, base, base_costs, threads, max_rows, lambda: _passes(draft, max_rows), directory)


def dflash_costs(dflash, base, base_costs: PassCosts, threads: int, directory: Path | None = None) -> DraftCosts:
    """A DFlash drafter's round for n drafts (fold n + 1 context rows, draft a block of n, pick
    the tokens through the base's LM head), n = 1 .. block_size - 1, in the base's plain steps."""
    max_rows = max(dflash.config.block_size - 1, 1)
    signature = f"dflash\0{dflash.config!r}\0{getattr(dflash.weights.fc.fmt, 'value', dflash.weights.fc.fmt)}"

    def work():
        import numpy as np

        cache = dflash.new_cache()
        taps = np.random.default_rng(0).standard_normal((17 + max_rows, dflash.tap_width)).astype(np.float32)
        dflash.fold(cache, taps[:16])
        pick = dflash.proposer()

        def run(n: int) -> None:
            dflash.fold(cache, taps[16 : 17 + n])
            pick(dflash.block(cache, 1, n), [1] * (17 + n))
            cache.rows = 16

        return run

    return _drafter_costs(signature, base, base_costs, threads, max_rows, work, directory)


def _drafter_costs(signature: str, base, base_costs: PassCosts, threads: int, max_rows: int, work,
                   directory: Path | None) -> DraftCosts:
    """From the cache when a valid entry is there, else the drafter's work (`work()` gives
    run(r)) timed in turns with the base's one-row step on `threads` threads, as their ratio."""
    key = hashlib.sha256(f"{FORMAT}\0{signature}\0{base_costs.key}\0{max_rows}".encode()).hexdigest()
    cached = read_entry(key, max_rows, directory)
    if cached is not None:
        return DraftCosts(tuple(cached), "cached", key)
    started = time.perf_counter()
    with _threads(threads):
        step = _passes(base, 1)
        fastest = _fastest(max_rows, {"draft": work(), "step": lambda r: step(1)})
    base_step = min(fastest["step"].values())
    steps = tuple(s / base_step for s in _interpolate(fastest["draft"], max_rows))
    write_entry(steps, key, directory)
    log.info("draft_costs_calibrated", key=key[:24], threads=threads, seconds=round(time.perf_counter() - started, 2),
             steps=[round(s, 3) for s in steps])
    return DraftCosts(steps, "calibrated", key)


def _linears(weights):
    from npud.engine.weights import weight_arrays
    from npud.kernels.base import LinearWeight

    out = [weights.lm_head]
    for layer in weights.layers:
        out += [o for o in weight_arrays(layer) if isinstance(o, LinearWeight)]
    return out
