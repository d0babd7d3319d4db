"""The forward pass over one sequence's state: step, batched steps, prefill, truncate.

The body itself is npud/engine/packed.py's, which runs one sequence's pass or several sequences'
passes packed into one weight stream (npud/engine/batch.py); a `Forward` is one sequence (its
state, its taps, its last hidden rows) and its passes alone.

One body serves every entry point. `step` is `step_batch_all` with one row, and
`prefill` is the same body over chunks, so a row's logits are the same bits whichever way
it was computed: the host kernels are batch-invariant, and nothing here depends on M.
A verify of M rows streams each weight once (one GEMM of M rows per linear layer), then
norms every row and runs the LM head once for all of them.

A layer makes few, large calls where the backend offers them (npud/kernels/base.py; the bits are the
primitives'): one GEMM for q, k and v (the backend fused them at load: npud/engine/weights/layout.py
`fuse_projections`) and one for gate and up, whose outputs are split into column views; the
residual add joined to the RMS norm after it (the MLP's output is added by the next layer's
input norm, or the final norm); a head's RMS norm joined to its RoPE. Gemma 4's sandwich norms,
per-layer inputs and layer scalars keep the primitive calls.

Gemma 4 and Qwen3.5 run the same body, row for row as a one-token step:
- every row's per-layer inputs (PLE) come from its token id: the per-layer embedding rows,
  plus the projection of the row's embedding (an M-row GEMM), normed, summed, scaled; each
  layer's PLE gate and projection are M-row GEMMs too. (There is no entry point for
  injected embeddings: a PLE model needs the token ids.)
- a KV-shared layer attends over its owner's plane, which the owner appended every row of
  the pass to earlier in the same pass, and appends nothing;
- a gated delta net (GDN) layer carries its recurrent state row by row (conv window and
  delta-rule state), and records the state after each row in its RecurrentPlane, so a
  verify that keeps the first n rows leaves the state after row n.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Protocol, TypeVar

import numpy as np

from npud.engine.model import Model
from npud.engine.packed import Pass, PassError, Rows, run_packed
from npud.engine.state import ModelState

R = TypeVar("R")


class TapSink(Protocol):
    def append(self, rows: np.ndarray) -> None:
        """rows: [M, len(layer_ids) * hidden], one per position of the pass, in order."""


class Forward:
    """Runs `model` over a state of its own. Positions are appended in order, from 0."""

    def __init__(self, model: Model, max_batch_rows: int = 16, prefill_chunk: int = 64):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model = model
        self.config = model.config
        self.backend = model.backend
        # a recurrent plane keeps max_batch_rows positions of earlier passes: enough for a
        # draft model that stepped its k <= max_batch_rows - 1 drafts one pass each to be cut
        # back to the accepted ones
        self.state = ModelState.for_config(model.config, recurrent_retain=max_batch_rows)
        self._max_batch_rows = max_batch_rows
        self._prefill_chunk = prefill_chunk
        self._last_hidden: np.ndarray | None = None
        self._tap_layers: tuple[int, ...] = ()
        self._tap_sink: TapSink | None = None

    # ------------------------------------------------------------------ public API

    @property
    def positions_held(self) -> int:
        return self.state.positions_held()

    def max_batch_rows(self) -> int:
        return self._max_batch_rows

    def pass_costs(self):
        """The model's calibrated cost of an r-row pass in plain steps (npud/engine/pass_costs.py), or None."""
        return self.model.pass_costs

    def step(self, token: int, pos: int) -> np.ndarray:
        """Run one token at `pos` (== positions_held); returns its logits [V]."""
        return self._run([token], pos, "all")[0]

    def step_batch(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Run M tokens from `start_pos`; returns the last row's logits [V]."""
        return self._run(tokens, start_pos, "last")[0]

    def step_batch_all(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Run M tokens from `start_pos`; returns every row's logits [M, V]."""
        return self._run(tokens, start_pos, "all")

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens` after the positions held, in chunks; returns the last row's logits [V].

        A recurrent (GDN) layer keeps no state per prefill row, so a truncate to a position
        inside a prefill raises StateError on such a model (the pass start and end are kept).
        """
        return drive(self, self.prefill_passes(tokens))[0]

    def truncate(self, n: int) -> None:
        """Keep the first n positions on every plane (each at its own width)."""
        self.state.keep_positions(n)

    def last_hidden_rows(self) -> np.ndarray:
        """The final-normed hidden rows [M, D] of the last pass."""
        if self._last_hidden is None:
            raise RuntimeError("no pass has run yet")
        return self._last_hidden

    def set_layer_taps(self, layer_ids: Sequence[int], sink: TapSink | None) -> None:
        """Send the output of `layer_ids` for every row of every pass to `sink` (None: stop)."""
        for i in layer_ids:
            if not 0 <= i < self.config.num_layers:
                raise ValueError(f"tap layer {i} is outside 0..{self.config.num_layers - 1}")
        self._tap_layers = tuple(layer_ids)
        self._tap_sink = sink if layer_ids else None

    # ------------------------------------------------------------------ passes

    def run(self, p: Pass) -> np.ndarray:
        """Run one pass over this sequence alone; returns the logits of the rows it asks for.
        Raises PassError (a ValueError) when the pass cannot start here."""
        (out,) = run_packed(self.model, [(self, p)])
        if isinstance(out, PassError):
            raise out
        return out

    def prefill_passes(self, tokens: Sequence[int], logits: Rows = Rows.LAST) -> Iterator[Pass]:
        """The prefill of `tokens` after the positions held as chunk passes, for a driver to run
        (npud/engine/batch.py); the last chunk asks for `logits`. Returns the last chunk's logits."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        pos = self.positions_held
        out = None
        for i in range(0, len(tokens), self._prefill_chunk):
            chunk = tuple(tokens[i : i + self._prefill_chunk])
            last = i + self._prefill_chunk >= len(tokens)
            out = yield Pass(chunk, pos, logits if last else Rows.NONE, prefill=True)
            pos += len(chunk)
        return out

    def _run(self, tokens: Sequence[int], start_pos: int, logits_rows: str, record_rows: bool = True) -> np.ndarray:
        return self.run(Pass(tuple(int(t) for t in tokens), start_pos, Rows(logits_rows), prefill=not record_rows))


def drive(forward: Forward, work: Generator[Pass, np.ndarray, R]) -> R:
    """Run the passes `work` yields on `forward` alone, sending each one's logits back; returns
    what `work` returns (the one-sequence driver; npud/engine/batch.py packs several)."""
    try:
        p = next(work)
        while True:
            p = work.send(forward.run(p))
    except StopIteration as stop:
        return stop.value
