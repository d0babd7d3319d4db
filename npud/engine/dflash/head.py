"""`DFlashHead`: a DFlash draft served to the speculative loop, and `TapRows`, the base's tap sink."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npud.engine.dflash.draft import DFlashDraft, Pick
from npud.engine.drafters import NO_DRAFT, Draft
from npud.engine.pass_costs import DraftCosts
from npud.engine.api import SamplingParams


class TapRows:
    """The base's tap sink: one row [width] per position, in the order the passes ran them."""

    def __init__(self, width: int, capacity: int = 256) -> None:
        self._rows = np.empty((capacity, width), np.float32)
        self._n = 0

    def append(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self._rows.shape[1]:
            raise ValueError(f"tap rows have shape {rows.shape}, the sink holds rows of {self._rows.shape[1]}")
        n = rows.shape[0]
        if self._n + n > self._rows.shape[0]:
            grown = np.empty((max(self._n + n, 2 * self._rows.shape[0]), self._rows.shape[1]), np.float32)
            grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n : self._n + n] = rows
        self._n += n

    def __len__(self) -> int:
        return self._n

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A view of rows start..stop-1 (valid until the next append)."""
        stop = self._n if stop is None else stop
        return self._rows[start:stop]

    def keep(self, n: int) -> None:
        """Drop every row past the first n."""
        if not 0 <= n <= self._n:
            raise ValueError(f"cannot keep {n} of {self._n} tap rows")
        self._n = n

    def clear(self) -> None:
        self._n = 0


class DFlashHead:
    """A DFlash draft behind the draft-head protocol (npud.engine.drafters.DraftHead).

    `attach(forward)` makes `sink` the base's tap sink before the prompt runs. The forward
    writes a row for every position a pass runs, rejected verify rows included, so after a
    verify `commit_rows` trims the sink to its size at draft time plus the committed rows; after
    a plain step the one row is committed as written. At draft time the rows not yet folded go
    into the draft cache, and the block [t1, mask, ...] is drafted. `pick` turns drafted rows
    into tokens (default: the draft's own rule, `DFlashDraft.proposer(sampling)`).
    """

    def __init__(self, draft: DFlashDraft, sampling: SamplingParams = SamplingParams(), pick: Pick | None = None,
                 costs: DraftCosts | None = None):
        self.draft_model = draft
        self.costs = costs  # the drafter's calibrated rounds in base steps (npud/engine/pass_costs.py), or None
        self._last_drafted = 0
        self.sink = TapRows(draft.tap_width)
        self.cache = draft.new_cache()
        self.pick = pick if pick is not None else draft.proposer(sampling)
        self._mark = 0  # the sink's size at the last draft
        self._drafted = False  # a draft awaits its commit
        self._error: str | None = None

    def attach(self, forward) -> None:
        """Register the sink for the draft's tapped layers on `forward` (an npud.engine.forward.Forward)."""
        forward.set_layer_taps(self.draft_model.config.target_layer_ids, self.sink)

    def needs_last_hidden(self) -> bool:
        return False

    def draft_cost(self) -> float | None:
        """The last draft (fold, block, pick) in base steps, None without a calibration."""
        return None if self.costs is None else self.costs.rows(self._last_drafted)

    def planned_cost(self, k: int) -> float | None:
        """What a block of k drafts costs in base steps, None without a calibration."""
        return None if self.costs is None else self.costs.rows(k)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        """Up to min(k, block_size - 1) tokens after context (which ends with t1, not yet run).
        Refused (empty, with error()) unless the sink ends at t1's position."""
        self._error, self._last_drafted = None, 0
        rows, pos = len(self.sink), len(context) - 1
        if rows != pos:
            self._error = f"drafting at position {pos} over {rows} committed rows"
            return NO_DRAFT
        if self.cache.rows > rows:
            self._error = f"the draft cache holds {self.cache.rows} rows but the sink {rows}: reset() the head between jobs"
            return NO_DRAFT
        n = min(k, self.draft_model.config.block_size - 1)
        if n < 1:
            return NO_DRAFT
        self.draft_model.fold(self.cache, self.sink.rows(self.cache.rows, rows))
        hidden = self.draft_model.block(self.cache, int(context[-1]), n)
        self._mark, self._drafted, self._last_drafted = rows, True, n
        return self.pick(hidden, context)

    def commit_rows(self, tokens: Sequence[int], rows: np.ndarray | None, count: int) -> None:
        if self._drafted:
            # the verify wrote rows for t1 and every draft; the first `count` were committed
            self.sink.keep(self._mark + count)
            self._drafted = False

    def reset(self) -> None:
        self.sink.clear()
        self.cache.clear()
        self._mark, self._drafted, self._error = 0, False, None

    def error(self) -> str | None:
        return self._error

