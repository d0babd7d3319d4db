"""How npuctl prints: aligned tables and a redrawn progress bar on a terminal, plain
tab-separated lines and one line per event otherwise (for pipes, logs and scripts)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from typing import Any, TextIO


def fmt_time(t: float | None) -> str:
    """Unix seconds as local `YYYY-MM-DD HH:MM:SS`, or `-`."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"  # unreachable: GiB returns above


def fmt_rate(accepted: int, drafted: int) -> str:
    """Acceptance as a percentage, or `-` when nothing was drafted."""
    return "-" if not drafted else f"{100 * accepted / drafted:.0f}%"


def load_stage(report: dict) -> str:
    """A load's progress ({"stage", "done", "total"}) as "weights, 43%"."""
    total = report.get("total") or 0
    pct = f", {100 * (report.get('done') or 0) // total}%" if total > 1 else ""
    return f"{report.get('stage')}{pct}"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(cell(v) for v in value) or "-"
    return str(value).replace("\t", " ").replace("\n", " ")


def print_table(out: TextIO, headers: Sequence[str], rows: Sequence[Sequence[Any]], *, tty: bool) -> None:
    """An aligned table with a header on a terminal; otherwise the same columns as tab-separated
    lines, the column names first (as `ps` and `ollama list` print them piped), so `cut -f`,
    `awk -F'\\t' 'NR > 1'` and a reader that wants the names all work."""
    cells = [[cell(v) for v in row] for row in rows]
    if not tty:
        out.write("\t".join(h.upper() for h in headers) + "\n")
        for row in cells:
            out.write("\t".join(row) + "\n")
        return
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    out.write("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    if not rows:
        out.write("(none)\n")


def print_fields(out: TextIO, fields: Sequence[tuple[str, Any]]) -> None:
    """`name: value` lines, names aligned."""
    width = max((len(name) for name, _ in fields), default=0)
    for name, value in fields:
        out.write(f"{(name + ':').ljust(width + 1)} {cell(value)}\n")


class Progress:
    """Counts of a batch being followed: prompts done, tokens/s, acceptance.

    Tokens of a prompt still running come from its token events; once it finishes its
    result's token count replaces them, with its drafted/accepted counts.
    """

    def __init__(self, total: int, clock=time.monotonic) -> None:
        self.total = total
        self.clock = clock
        self.started = clock()
        self.done_by_job: dict[int, int] = {}
        self.finished_tokens = 0
        self.live_tokens: dict[tuple[int, int], int] = {}
        self.drafted = 0
        self.accepted = 0
        self.failed = 0
        self.job: int | None = None
        self.state = "queued"
        self.load_s = 0.0  # time the daemon spent loading models (model_loaded events): not generation

    @property
    def done(self) -> int:
        return sum(self.done_by_job.values())

    @property
    def tokens(self) -> int:
        return self.finished_tokens + sum(self.live_tokens.values())

    def tokens_per_s(self) -> float:
        elapsed = self.clock() - self.started - self.load_s
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def on_tokens(self, job: int, prompt: int, count: int) -> None:
        self.live_tokens[(job, prompt)] = self.live_tokens.get((job, prompt), 0) + count

    def on_result(self, job: int, result: dict) -> None:
        self.live_tokens.pop((job, result.get("prompt", -1)), None)
        if "error" in result:
            self.failed += 1
            return
        self.finished_tokens += len(result.get("token_ids") or ())
        stats = result.get("stats") or {}
        self.drafted += int(stats.get("drafted") or 0)
        self.accepted += int(stats.get("accepted") or 0)

    def summary(self) -> str:
        elapsed = self.clock() - self.started
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"{self.done}/{self.total} prompts{failed}, {self.tokens} tokens in {fmt_duration(elapsed)} "
                f"({self.tokens_per_s():.1f} tok/s), acceptance {fmt_rate(self.accepted, self.drafted)}")


class ProgressBar:
    """A one-line bar redrawn in place on a terminal (at most every `interval` seconds).

    Every field has a fixed width, so the line keeps its length while the numbers grow:
    the bar does not shrink as tokens/s reaches another digit."""

    BAR_WIDTH = 30
    STATE_WIDTH = max(len(s) for s in ("queued", "running", "preempted", "cancelled", "faulted", "failed", "done"))

    def __init__(self, out: TextIO, progress: Progress, interval: float = 0.1) -> None:
        self.out = out
        self.p = progress
        self.interval = interval
        self._last = 0.0

    def line(self, width: int) -> str:
        """The bar, cut to the terminal's `width` (never wider than width - 1)."""
        p = self.p
        total = str(p.total)
        job = "-" if p.job is None else str(p.job)
        tail = (f" {str(p.done).rjust(len(total))}/{total} prompts  {p.tokens_per_s():8.1f} tok/s  "
                f"acceptance {fmt_rate(p.accepted, p.drafted):>4}  job {job:>6} {p.state:<{self.STATE_WIDTH}}")
        filled = min(self.BAR_WIDTH, self.BAR_WIDTH * p.done // p.total) if p.total else self.BAR_WIDTH
        return f"[{'#' * filled}{'-' * (self.BAR_WIDTH - filled)}]{tail}"[: max(width - 1, 20)]

    def update(self, force: bool = False) -> None:
        now = self.p.clock()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        width = shutil.get_terminal_size((80, 24)).columns
        self.out.write("\r" + self.line(width) + "\x1b[K")
        self.out.flush()

    def close(self) -> None:
        self.update(force=True)
        self.out.write("\n")
        self.out.flush()
