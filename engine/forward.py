"""The forward pass over one sequence's state: step, batched steps, prefill, truncate.

One body serves every entry point. `step` is `step_batch_all` with one row, and
`prefill` is the same body over chunks, so a row's logits are the same bits whichever way
it was computed: the host kernels are batch-invariant, and nothing here depends on M.
A verify of M rows streams each weight once (one GEMM of M rows per linear layer), then
norms every row and runs the LM head once for all of them.

A layer makes few, large calls where the backend offers them (kernels/base.py; the bits are the
primitives'): one GEMM for q, k and v (the backend fused them at load: engine/weights/layout.py
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

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engine.config import AttentionKind
from engine.model import Model
from engine.state import ModelState, PlaneKind
from kernels.base import add_rms_norm, norm_rope


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
        self._record_rows = True

    # ------------------------------------------------------------------ public API

    @property
    def positions_held(self) -> int:
        return self.state.positions_held()

    def max_batch_rows(self) -> int:
        return self._max_batch_rows

    def pass_costs(self):
        """The model's calibrated cost of an r-row pass in plain steps (engine/pass_costs.py), or None."""
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
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        pos = self.positions_held
        for i in range(0, len(tokens), self._prefill_chunk):
            chunk = tokens[i : i + self._prefill_chunk]
            last = i + self._prefill_chunk >= len(tokens)
            out = self._run(chunk, pos, "last" if last else "none", record_rows=False)
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

    def _run(self, tokens: Sequence[int], start_pos: int, logits_rows: str, record_rows: bool = True) -> np.ndarray:
        """The body. record_rows: recurrent planes keep the state after every row, so that a
        verify can commit any prefix of the pass."""
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
        token_ids = np.asarray(tokens, dtype=np.int64)
        x = b.embed(w.embed, token_ids)  # [M, D]
        if cfg.embed_scale is not None:
            x = x * np.float32(cfg.embed_scale)
        per_layer = self._per_layer_inputs(token_ids, x) if cfg.per_layer_input_size else None
        self._record_rows = record_rows
        self.state.begin_pass()
        taps = []
        delta = None  # a layer's output is x + delta: the add waits for the next norm, which does it too
        try:
            for spec, lw in zip(cfg.layers, w.layers):
                x, delta = self._layer(spec, lw, x, delta, positions, per_layer)
                if spec.index in self._tap_layers:
                    if delta is not None:
                        x, delta = x + delta, None  # the bits add_rms_norm's sum would have
                    taps.append((spec.index, x))
        except BaseException:
            self._roll_back(start_pos)  # a failed pass leaves nothing half-appended
            raise
        if delta is None:
            final = b.rms_norm(x, w.final_norm, cfg.rms_norm_eps)
        else:
            final = add_rms_norm(b, x, delta, w.final_norm, cfg.rms_norm_eps)[1]
        self._last_hidden = final
        if self._tap_sink is not None:
            by_layer = dict(taps)
            self._tap_sink.append(np.concatenate([by_layer[i] for i in self._tap_layers], axis=1))
        if logits_rows == "none":
            return np.empty((0, cfg.vocab_size), np.float32)
        rows = final if logits_rows == "all" else final[-1:]
        logits = b.linear(rows, w.lm_head)  # [M or 1, V]
        if cfg.final_logit_softcapping is not None:
            logits = b.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def _roll_back(self, start_pos: int) -> None:
        """Cut every plane the failed pass grew back to start_pos (the planes disagree here)."""
        for plane in self.state.planes:
            if plane.positions_held is not None and plane.positions_held > start_pos:
                plane.keep_positions(start_pos)

    def _per_layer_inputs(self, token_ids: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Gemma4 PLE: every row's per-layer inputs [M, layers, P] from its token id and embedding x."""
        b, w, cfg = self.backend, self.model.weights, self.config
        m, n, p = x.shape[0], cfg.num_layers, cfg.per_layer_input_size
        identity = b.embed(w.embed_per_layer, token_ids) * np.float32(p**0.5)  # [M, layers * P]
        context = b.linear(x, w.per_layer_model_projection) * np.float32(cfg.hidden_size**-0.5)
        context = b.rms_norm(context.reshape(m, n, p), w.per_layer_projection_norm, cfg.rms_norm_eps)
        return (context + identity.reshape(m, n, p)) * np.float32(2**-0.5)

    def _layer(self, spec, lw, x: np.ndarray, delta: np.ndarray | None, positions: np.ndarray,
               per_layer: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """One decoder layer over the pass's M rows. Its input is x + delta [M, D] (delta None: x);
        returns its output as such a pair, the MLP's output left for the next norm to add where
        nothing comes between (kernels.base.add_rms_norm: the add and the norm in one call)."""
        b, cfg = self.backend, self.config
        eps = cfg.rms_norm_eps
        if delta is None:
            h = b.rms_norm(x, lw.input_norm, eps)
        else:
            x, h = add_rms_norm(b, x, delta, lw.input_norm, eps)
        if spec.kind is AttentionKind.LINEAR:
            mixed = self._linear_attention(spec, lw.linear_attn, h)
        else:
            mixed = self._attention(spec, lw.attn, h, positions)
        if cfg.sandwich_norms:
            # gemma4: the attention and MLP outputs are normed before they join the residual
            x = x + b.rms_norm(mixed, lw.post_attention_norm, eps)
            h = b.rms_norm(x, lw.pre_feedforward_norm, eps)
            x = x + b.rms_norm(self._mlp(lw.mlp, h), lw.post_feedforward_norm, eps)
        else:
            x, h = add_rms_norm(b, x, mixed, lw.post_attention_norm, eps)
            if per_layer is None and lw.layer_scalar is None:
                return x, self._mlp(lw.mlp, h)
            x = x + self._mlp(lw.mlp, h)
        if per_layer is not None:
            gated = self._act_mul(b.linear(x, lw.per_layer_gate), per_layer[:, spec.index, :])
            x = x + b.rms_norm(b.linear(gated, lw.per_layer_projection), lw.post_per_layer_norm, eps)
        if lw.layer_scalar is not None:
            x = x * lw.layer_scalar[0]
        return x, None

    def _act_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.config.hidden_act == "silu":
            return self.backend.silu_mul(gate, up)
        return self.backend.gelu_tanh_mul(gate, up)

    def _mlp(self, mw, h: np.ndarray) -> np.ndarray:
        b = self.backend
        if mw.gate_up is not None:  # one GEMM call; the activation reads the halves where they lie
            gate, up = mw.gate_up.split(b.linear(h, mw.gate_up.weight))
        else:
            gate, up = b.linear(h, mw.gate), b.linear(h, mw.up)
        return b.linear(self._act_mul(gate, up), mw.down)

    def _norm_rope(self, x: np.ndarray, norm: np.ndarray | None, positions: np.ndarray,
                   inv_freq: np.ndarray) -> np.ndarray:
        if norm is None:
            return self.backend.rope(x, positions, inv_freq)
        return norm_rope(self.backend, x, norm, positions, inv_freq, self.config.rms_norm_eps)

    def _attention(self, spec, aw, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        b = self.backend
        m = h.shape[0]
        inv_freq = self.model.inv_freq[spec.index]
        if aw.qkv is not None:  # one GEMM call for q, k, v (and the output gate), then column views
            q, k, v, *gate = aw.qkv.split(b.linear(h, aw.qkv.weight))
        else:
            q, k, v, gate = b.linear(h, aw.q), None, None, ()
        q = self._norm_rope(q.reshape(m, spec.num_heads, spec.head_dim), aw.q_norm, positions, inv_freq)
        if spec.owns_kv:
            if k is None:
                k = b.linear(h, aw.k)
                # k_eq_v: the values are the raw key projection, before the key's norm and RoPE
                v = k if aw.v is None else b.linear(h, aw.v)
            k = k.reshape(m, spec.num_kv_heads, spec.head_dim)
            v = v.reshape(m, spec.num_kv_heads, spec.head_dim)
            if aw.v_norm is not None:
                v = b.rms_norm(v, aw.v_norm, self.config.rms_norm_eps)
            k = self._norm_rope(k, aw.k_norm, positions, inv_freq)
            self.state.planes[spec.index].append(k, v)
        # a KV-shared layer reads the rows its owner appended, this pass's included
        plane = self.state.planes[spec.kv_owner]
        if plane.kind is not PlaneKind.KV:
            raise ValueError(f"layer {spec.index} reads KV from layer {spec.kv_owner}, which holds none")
        out = b.attention(q, plane.keys(), plane.values(), positions, spec.window, spec.scale)
        out = out.reshape(m, spec.num_heads * spec.head_dim)
        if aw.gate is not None:  # qwen3_5's output gate
            out = b.sigmoid_mul(out, gate[0] if gate else b.linear(h, aw.gate))
        return b.linear(out, aw.o)

    def _linear_attention(self, spec, gw, h: np.ndarray) -> np.ndarray:
        """A gated delta net layer (qwen3_5) over M rows, carrying its state row by row."""
        b = self.backend
        g = spec.linear
        m = h.shape[0]
        plane = self.state.planes[spec.index]
        mixed, conv_after = b.causal_conv1d_silu(b.linear(h, gw.in_qkv), plane.arrays["conv"], gw.conv)  # [M, C]
        q = mixed[:, : g.key_dim].reshape(m, g.num_key_heads, g.key_head_dim)
        k = mixed[:, g.key_dim : 2 * g.key_dim].reshape(m, g.num_key_heads, g.key_head_dim)
        v = mixed[:, 2 * g.key_dim :].reshape(m, g.num_value_heads, g.value_head_dim)
        q = b.l2_norm(q, 1e-6) * np.float32(g.key_head_dim**-0.5)
        k = b.l2_norm(k, 1e-6)
        log_decay, beta = b.gdn_gates(b.linear(h, gw.in_a), b.linear(h, gw.in_b), gw.a_log, gw.dt_bias)
        out, ssm_after = b.gated_delta_rule(q, k, v, log_decay, beta, plane.arrays["ssm"])
        for i in range(m):
            plane.advance({"conv": conv_after[i], "ssm": ssm_after[i]}, record=self._record_rows)
        z = b.linear(h, gw.in_z)
        rows = m * g.num_value_heads
        out = b.gated_rms_norm(out.reshape(rows, g.value_head_dim), z.reshape(rows, g.value_head_dim), gw.norm,
                               self.config.rms_norm_eps)
        return b.linear(out.reshape(m, g.value_dim), gw.out)
