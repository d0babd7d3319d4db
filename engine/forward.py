"""The forward pass over one sequence's state: step, batched steps, prefill, truncate.

One body serves every entry point. `step` is `step_batch_all` with one row, and
`prefill` is the same body over chunks, so a row's logits are the same bits whichever way
it was computed: the host kernels are batch-invariant, and nothing here depends on M.
A verify of M rows streams each weight once (one GEMM of M rows per linear layer), then
norms every row and runs the LM head once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engine.config import AttentionKind
from engine.model import Model
from engine.state import ModelState, PlaneKind


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
        self.state = ModelState.for_config(model.config)
        self._max_batch_rows = max_batch_rows
        self._prefill_chunk = prefill_chunk
        self._last_hidden: np.ndarray | None = None
        self._tap_layers: tuple[int, ...] = ()
        self._tap_sink: TapSink | None = None
        for spec in self.config.layers:
            if spec.kind is AttentionKind.LINEAR:
                raise ValueError(f"layer {spec.index}: linear-attention layers are not supported by this forward")

    # ------------------------------------------------------------------ public API

    @property
    def positions_held(self) -> int:
        return self.state.positions_held()

    def max_batch_rows(self) -> int:
        return self._max_batch_rows

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
        """Append `tokens` after the positions held, in chunks; returns the last row's logits [V]."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        pos = self.positions_held
        for i in range(0, len(tokens), self._prefill_chunk):
            chunk = tokens[i : i + self._prefill_chunk]
            last = i + self._prefill_chunk >= len(tokens)
            out = self._run(chunk, pos, "last" if last else "none")
            pos += len(chunk)
        return out[0]

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

    # ------------------------------------------------------------------ the body

    def _run(self, tokens: Sequence[int], start_pos: int, logits_rows: str) -> np.ndarray:
        held = self.positions_held
        if start_pos != held:
            raise ValueError(f"pass starts at position {start_pos}, but {held} positions are held")
        m = len(tokens)
        if m == 0:
            raise ValueError("a pass needs at least one token")
        if held + m > self.config.max_position_embeddings:
            raise ValueError(
                f"positions {held}..{held + m - 1} exceed max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        b = self.backend
        w = self.model.weights
        cfg = self.config
        positions = np.arange(start_pos, start_pos + m, dtype=np.int64)
        x = b.embed(w.embed, np.asarray(tokens, dtype=np.int64))  # [M, D]
        self.state.begin_pass()
        taps = []
        try:
            for spec, lw in zip(cfg.layers, w.layers):
                h = b.rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
                x = x + self._attention(spec, lw.attn, h, positions)
                h = b.rms_norm(x, lw.post_attention_norm, cfg.rms_norm_eps)
                gate = b.linear(h, lw.mlp.gate)
                up = b.linear(h, lw.mlp.up)
                x = x + b.linear(b.silu_mul(gate, up), lw.mlp.down)
                if spec.index in self._tap_layers:
                    taps.append((spec.index, x))
        except BaseException:
            self.state.keep_positions(start_pos)  # a failed pass leaves nothing half-appended
            raise
        final = b.rms_norm(x, w.final_norm, cfg.rms_norm_eps)
        self._last_hidden = final
        if self._tap_sink is not None:
            by_layer = dict(taps)
            self._tap_sink.append(np.concatenate([by_layer[i] for i in self._tap_layers], axis=1))
        if logits_rows == "none":
            return np.empty((0, cfg.vocab_size), np.float32)
        rows = final if logits_rows == "all" else final[-1:]
        return b.linear(rows, w.lm_head)  # [M or 1, V]

    def _attention(self, spec, aw, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        b = self.backend
        m = h.shape[0]
        q = b.linear(h, aw.q).reshape(m, spec.num_heads, spec.head_dim)
        if aw.q_norm is not None:
            q = b.rms_norm(q, aw.q_norm, self.config.rms_norm_eps)
        inv_freq = self.model.inv_freq[spec.index]
        q = b.rope(q, positions, inv_freq)
        if spec.owns_kv:
            k = b.linear(h, aw.k).reshape(m, spec.num_kv_heads, spec.head_dim)
            v = b.linear(h, aw.v).reshape(m, spec.num_kv_heads, spec.head_dim)
            if aw.k_norm is not None:
                k = b.rms_norm(k, aw.k_norm, self.config.rms_norm_eps)
            k = b.rope(k, positions, inv_freq)
            self.state.planes[spec.index].append(k, v)
        plane = self.state.planes[spec.kv_owner]
        if plane.kind is not PlaneKind.KV:
            raise ValueError(f"layer {spec.index} reads KV from layer {spec.kv_owner}, which holds none")
        out = b.attention(q, plane.keys(), plane.values(), positions, spec.window, spec.head_dim**-0.5)
        return b.linear(out.reshape(m, spec.num_heads * spec.head_dim), aw.o)
