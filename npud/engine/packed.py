"""The forward body over packed rows: one or more sequences' passes in one weight stream.

Every pass (npud.engine.forward.Forward's step, verify batch, prefill chunk) runs here, alone or
packed with the passes of other sequences (npud/engine/batch.py), so a sequence's rows take the
same path either way. The rows of all sequences are concatenated, each sequence's rows
contiguous and in order:

- every GEMM (the backend's `linear`) runs once over all rows; embeddings, norms, RoPE and
  the activations are per row, each row at its own position. The host kernels make a row's
  bits independent of the rows beside it and of M (npud/kernels/host/check.py proves it at start-up
  for M = 1..CHECK_ROWS; npud/engine/batch.py never packs more rows than that);
- attention runs per sequence over that sequence's own planes (ragged lengths, sliding windows,
  a KV-shared layer reading its owner's plane), and a gated delta net (GDN) layer carries each
  sequence's recurrent state over that sequence's rows only;
- the attention layers between two things the engine must see (a GDN layer, gemma4's per-layer
  inputs, a layer whose output a tap reads) are one backend call over all rows
  (npud.kernels.base.decoder_stack: the host runs it as one native call; else a call a layer,
  decoder_layer, which a backend without it composes from the primitives); their KV rows are
  written in place into planes reserved for the pass, and counted as held after the call;
- the LM head runs once, over the rows whose logits some sequence asked for.

A backend that offers a layer group (npud/kernels/layers.py: the NPU's, whose GEMMs are a worker
round trip away) runs each layer's stretch from its attention output to the next layer's
projections in one call; the attention stays here. The ops and their order are the same, so
the bits are (`layer_group_for` says which models qualify).

A sequence whose pass cannot start (its start is not the positions it holds, it would pass the
model's position limit) gets its error back and takes no rows; the others run.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from npud.engine.api import RequestError
from npud.engine.config import AttentionKind
from npud.engine.state import PlaneKind
from npud.kernels.base import (
    LayerCall, PlaneRows, RoundRows, StackCall, add_rms_norm, decoder_layer, decoder_stack, layer_tail, norm_rope,
)
from npud.kernels.layers import LayerGroupSpec, LayerSpecRows


class Rows(enum.Enum):
    """Which rows of a pass the caller wants logits for."""

    ALL = "all"
    LAST = "last"
    NONE = "none"


@dataclass(slots=True, frozen=True)
class Pass:
    """A base pass a decode loop asks its driver for: `tokens` from `start_pos` (== the positions
    the sequence holds), logits of `logits` rows sent back ([M, V], [1, V] or [0, V]). A
    `prefill` pass is a prompt chunk: it counts against a batched round's prefill budget, and a
    recurrent plane keeps no state per row of it (a prefill is never cut inside)."""

    tokens: tuple[int, ...]
    start_pos: int
    logits: Rows = Rows.ALL
    prefill: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.tokens)


class PassError(RequestError):
    """A pass that cannot start on its sequence (the others in the pack go on)."""


def check_pass(forward, p: Pass) -> PassError | None:
    """Why `p` cannot run on `forward`'s state, or None."""
    held = forward.positions_held
    m = p.num_rows
    if p.start_pos != held:
        return PassError(f"pass starts at position {p.start_pos}, but {held} positions are held")
    if m == 0:
        return PassError("a pass needs at least one token")
    limit = forward.config.max_position_embeddings
    if held + m > limit:
        return PassError(f"positions {held}..{held + m - 1} exceed max_position_embeddings {limit}")
    return None


def run_packed(model, jobs: Sequence[tuple[object, Pass]]) -> list[np.ndarray | PassError]:
    """Run each (forward, pass) of `jobs` (distinct forwards of `model`) in one packed pass.

    Returns, per job, its logits (the rows its pass asked for) or the PassError that kept it
    out. Any other failure rolls every sequence back to where its pass started, and raises."""
    out: list[np.ndarray | PassError] = [check_pass(f, p) for f, p in jobs]
    live = [(i, f, p) for i, (f, p) in enumerate(jobs) if out[i] is None]
    if live:
        logits = _Packed(model, [(f, p) for _, f, p in live]).run()
        for (i, _, _), rows in zip(live, logits):
            out[i] = rows
    return out


_NO_GROUP = object()


def layer_group_for(model):
    """The model's layer group on its backend (built once, kept on the model), or None: the
    backend has none, or the model has a layer the group does not run (a recurrent or KV-shared
    layer, per-layer inputs, a layer scalar, an output gate, values that are the keys, fused
    projections), or one of its linears does not run on the backend's device."""
    group = getattr(model, "_layer_group", _NO_GROUP)
    if group is _NO_GROUP:
        group = _build_layer_group(model)
        model._layer_group = group
    return group


def _build_layer_group(model):
    make = getattr(model.backend, "layer_group", None)
    cfg, w = model.config, model.weights
    if make is None or cfg.per_layer_input_size:
        return None
    rows, linears = [], []
    for spec, lw in zip(cfg.layers, w.layers):
        aw, mw = lw.attn, lw.mlp
        if (spec.kind is AttentionKind.LINEAR or aw is None or not spec.owns_kv or spec.kv_owner != spec.index
                or aw.gate is not None or aw.v is None or aw.k is None or aw.qkv is not None or aw.v_norm is not None
                or mw.gate_up is not None or lw.layer_scalar is not None or lw.per_layer_gate is not None):
            return None
        if cfg.sandwich_norms and (lw.pre_feedforward_norm is None or lw.post_feedforward_norm is None):
            return None
        named = {"q": aw.q, "k": aw.k, "v": aw.v, "o": aw.o, "gate": mw.gate, "up": mw.up, "down": mw.down}
        linears.append(named)
        rows.append(LayerSpecRows(lw.input_norm, lw.post_attention_norm,
                                  lw.pre_feedforward_norm if cfg.sandwich_norms else None,
                                  lw.post_feedforward_norm if cfg.sandwich_norms else None,
                                  tuple((n, lin.bias) for n, lin in named.items() if lin.bias is not None)))
    spec = LayerGroupSpec(tuple(rows), w.final_norm, float(cfg.rms_norm_eps),
                          "silu" if cfg.hidden_act == "silu" else "gelu_tanh", bool(cfg.sandwich_norms))
    return make(spec, linears, w.lm_head)


class _Packed:
    """One packed pass: the sequences (forward, pass), their row ranges and positions."""

    def __init__(self, model, seqs: list[tuple[object, Pass]]):
        self.model, self.backend, self.config = model, model.backend, model.config
        self.seqs = seqs
        bounds = np.cumsum([0] + [p.num_rows for _, p in seqs])
        self.slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.positions = np.concatenate([np.arange(p.start_pos, p.start_pos + p.num_rows, dtype=np.int64)
                                         for _, p in seqs])
        self.token_ids = np.asarray([t for _, p in seqs for t in p.tokens], dtype=np.int64)
        self.tap_layers = frozenset(i for f, _ in seqs for i in f._tap_layers)
        self.rows = RoundRows(self.positions, tuple((s.start, s.stop) for s in self.slices))

    def run(self) -> list[np.ndarray]:
        b, w, cfg = self.backend, self.model.weights, self.config
        x = b.embed(w.embed, self.token_ids)  # [M, D], M: the rows of every sequence
        if cfg.embed_scale is not None:
            x = x * np.float32(cfg.embed_scale)
        group = None if self.tap_layers else layer_group_for(self.model)
        if group is not None:
            return self._run_grouped(group, x)
        per_layer = self._per_layer_inputs(x) if cfg.per_layer_input_size else None
        for f, p in self.seqs:
            f.state.begin_pass()
        taps = {}
        delta = None  # a layer's output is x + delta: the add waits for the next norm, which does it too
        try:
            for f, p in self.seqs:  # room for the pass's KV rows, which the layer calls write in place
                for plane in f.state.planes:
                    if plane.kind is PlaneKind.KV:
                        plane.reserve(p.num_rows)
            for run in self._runs(per_layer is not None):
                if len(run) == 1 and (run[0].kind == AttentionKind.LINEAR.value or per_layer is not None):
                    x, delta = self._layer(run[0], x, delta, per_layer)
                else:
                    x, delta = self._stack(run, x, delta)
                if run[-1].index in self.tap_layers:
                    if delta is not None:
                        x, delta = x + delta, None  # the bits add_rms_norm's sum would have
                    taps[run[-1].index] = x
        except BaseException:
            for f, p in self.seqs:
                _roll_back(f.state, p.start_pos)  # a failed pass leaves nothing half-appended
            raise
        if delta is None:
            final = b.rms_norm(x, w.final_norm, cfg.rms_norm_eps)
        else:
            final = add_rms_norm(b, x, delta, w.final_norm, cfg.rms_norm_eps)[1]
        for (f, p), rows in zip(self.seqs, self.slices):
            f._last_hidden = final[rows]
            if f._tap_sink is not None:
                f._tap_sink.append(np.concatenate([taps[i][rows] for i in f._tap_layers], axis=1))
        wanted = self._wanted()  # the rows of `final` whose logits are asked for, and each sequence's share
        picked = np.concatenate(wanted)
        if len(picked) == 0:
            return [np.empty((0, cfg.vocab_size), np.float32) for _ in self.seqs]
        rows = final if len(picked) == final.shape[0] else final[picked]
        logits = b.linear(rows, w.lm_head)  # [rows asked for, V], one weight stream
        if cfg.final_logit_softcapping is not None:
            logits = b.softcap(logits, cfg.final_logit_softcapping)
        bounds = np.cumsum([0] + [len(a) for a in wanted])
        return [logits[a:z] for a, z in zip(bounds[:-1], bounds[1:])]

    def _wanted(self) -> list[np.ndarray]:
        """Each sequence's rows whose logits its pass asks for."""
        wanted = []
        for (f, p), rows in zip(self.seqs, self.slices):
            if p.logits is Rows.ALL:
                wanted.append(np.arange(rows.start, rows.stop))
            elif p.logits is Rows.LAST:
                wanted.append(np.arange(rows.stop - 1, rows.stop))
            else:
                wanted.append(np.arange(0))
        return wanted

    def _run_grouped(self, group, x: np.ndarray) -> list[np.ndarray]:
        """run() with the layers' stretches between attentions in the backend's layer group: one
        call per layer (npud/kernels/layers.py), the attention here between the calls."""
        cfg, w = self.config, self.model.weights
        wanted = self._wanted()
        picked = np.concatenate(wanted)
        for f, p in self.seqs:
            f.state.begin_pass()
        try:
            q, k, v = group.begin(x)
            last = len(cfg.layers) - 1
            for spec, lw in zip(cfg.layers, w.layers):
                got = group.step(spec.index, self._attend(spec, lw.attn, q, k, v), x, picked)
                if spec.index < last:
                    x, (q, k, v) = got
                else:
                    x, final, logits = got
        except BaseException:
            for f, p in self.seqs:
                _roll_back(f.state, p.start_pos)  # a failed pass leaves nothing half-appended
            raise
        for (f, p), rows in zip(self.seqs, self.slices):
            f._last_hidden = final[rows]
        if len(picked) == 0:
            return [np.empty((0, cfg.vocab_size), np.float32) for _ in self.seqs]
        if cfg.final_logit_softcapping is not None:
            logits = self.backend.softcap(logits, cfg.final_logit_softcapping)
        bounds = np.cumsum([0] + [len(a) for a in wanted])
        return [logits[a:z] for a, z in zip(bounds[:-1], bounds[1:])]

    def _per_layer_inputs(self, x: np.ndarray) -> np.ndarray:
        """Gemma4 PLE: every row's per-layer inputs [M, layers, P] from its token id and embedding x."""
        b, w, cfg = self.backend, self.model.weights, self.config
        m, n, p = x.shape[0], cfg.num_layers, cfg.per_layer_input_size
        identity = b.embed(w.embed_per_layer, self.token_ids) * np.float32(p**0.5)  # [M, layers * P]
        context = b.linear(x, w.per_layer_model_projection) * np.float32(cfg.hidden_size**-0.5)
        context = b.rms_norm(context.reshape(m, n, p), w.per_layer_projection_norm, cfg.rms_norm_eps)
        return (context + identity.reshape(m, n, p)) * np.float32(2**-0.5)

    def _runs(self, per_layer: bool) -> list[tuple]:
        """The model's layers in the runs the pass calls: a GDN layer, or with per-layer inputs any
        layer, alone; else the attention layers up to the next such layer or tap layer, together."""
        runs, current = [], []
        for layer in self.model.decoder_layers:
            if per_layer or layer.kind == AttentionKind.LINEAR.value:
                if current:
                    runs.append(tuple(current))
                    current = []
                runs.append((layer,))
                continue
            current.append(layer)
            if layer.index in self.tap_layers:
                runs.append(tuple(current))
                current = []
        if current:
            runs.append(tuple(current))
        return runs

    def _planes(self, layer) -> tuple[PlaneRows, ...]:
        """Each sequence's plane the attention layer reads (its kv_owner's), reserved for the pass."""
        planes = []
        for f, p in self.seqs:
            plane = f.state.planes[layer.kv_owner]
            if plane.kind is not PlaneKind.KV:
                raise ValueError(f"layer {layer.index} reads KV from layer {layer.kv_owner}, which holds none")
            planes.append(PlaneRows(plane.k, plane.v, p.start_pos))
        return tuple(planes)

    def _norm_rope(self, x: np.ndarray, norm: np.ndarray | None, inv_freq: np.ndarray) -> np.ndarray:
        if norm is None:
            return self.backend.rope(x, self.positions, inv_freq)
        return norm_rope(self.backend, x, norm, self.positions, inv_freq, self.config.rms_norm_eps)

    def _attend(self, spec, aw, q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None) -> np.ndarray:
        """A layer's attention from its projections q [M, H*Dh] (k, v [M, KVH*Dh]; None on a
        KV-shared layer): the head norms and RoPE, this pass's rows appended to each sequence's
        plane, each sequence attending over its own plane -> [M, H*Dh], before the output projection."""
        b = self.backend
        m = q.shape[0]
        inv_freq = self.model.inv_freq[spec.index]
        q = self._norm_rope(q.reshape(m, spec.num_heads, spec.head_dim), aw.q_norm, inv_freq)
        if spec.owns_kv:
            k = k.reshape(m, spec.num_kv_heads, spec.head_dim)
            v = v.reshape(m, spec.num_kv_heads, spec.head_dim)
            if aw.v_norm is not None:
                v = b.rms_norm(v, aw.v_norm, self.config.rms_norm_eps)
            k = self._norm_rope(k, aw.k_norm, inv_freq)
            for (f, _), rows in zip(self.seqs, self.slices):
                f.state.planes[spec.index].append(k[rows], v[rows])
        # each sequence attends over its own plane; a KV-shared layer reads the rows its owner
        # appended, this pass's included
        outs = []
        for (f, _), rows in zip(self.seqs, self.slices):
            plane = f.state.planes[spec.kv_owner]
            if plane.kind is not PlaneKind.KV:
                raise ValueError(f"layer {spec.index} reads KV from layer {spec.kv_owner}, which holds none")
            outs.append(b.attention(q[rows], plane.keys(), plane.values(), self.positions[rows], spec.window,
                                    spec.scale))
        return (outs[0] if len(outs) == 1 else np.concatenate(outs)).reshape(m, spec.num_heads * spec.head_dim)

    def _held(self, layers) -> None:
        """The KV rows the layers wrote are held now."""
        for layer in layers:
            if layer.owns_kv:
                for f, p in self.seqs:
                    f.state.planes[layer.index].extend(p.num_rows)

    def _stack(self, layers: tuple, x: np.ndarray, delta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Consecutive attention layers over all rows in one backend call (npud.kernels.base.decoder_stack)."""
        planes = tuple(self._planes(layer) for layer in layers)
        out = decoder_stack(self.backend, StackCall(layers, self.rows, x, delta, planes))
        self._held(layers)
        return out

    def _layer(self, layer, x: np.ndarray, delta: np.ndarray | None,
               per_layer: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """One decoder layer (npud.kernels.base.DecoderLayer) over all rows. Its input is x + delta
        [M, D] (delta None: x); returns its output as such a pair, the MLP's output left for the next
        norm to add where nothing comes between (npud.kernels.base.add_rms_norm: the add and the norm
        in one call)."""
        mine = None if per_layer is None else per_layer[:, layer.index, :]
        if layer.kind == AttentionKind.LINEAR.value:
            b, lw = self.backend, layer.weights
            if delta is None:
                h = b.rms_norm(x, lw.input_norm, layer.eps)
            else:
                x, h = add_rms_norm(b, x, delta, lw.input_norm, layer.eps)
            return layer_tail(b, layer, x, self._linear_attention(layer, lw.linear_attn, h), mine)
        out = decoder_layer(self.backend, LayerCall(layer, self.rows, x, delta, self._planes(layer), mine))
        self._held((layer,))
        return out

    def _linear_attention(self, layer, gw, h: np.ndarray) -> np.ndarray:
        """A gated delta net layer (qwen3_5): the projections over all rows, the convolution and
        the delta rule per sequence, each carrying its own state row by row."""
        b = self.backend
        g = self.config.layers[layer.index].linear
        m = h.shape[0]
        in_qkv = b.linear(h, gw.in_qkv)  # [M, C]
        log_decay_all, beta_all = b.gdn_gates(b.linear(h, gw.in_a), b.linear(h, gw.in_b), gw.a_log, gw.dt_bias)
        outs = []
        for (f, p), rows in zip(self.seqs, self.slices):
            plane = f.state.planes[layer.index]
            n = rows.stop - rows.start
            mixed, conv_after = b.causal_conv1d_silu(in_qkv[rows], plane.arrays["conv"], gw.conv)  # [n, C]
            q = mixed[:, : g.key_dim].reshape(n, g.num_key_heads, g.key_head_dim)
            k = mixed[:, g.key_dim : 2 * g.key_dim].reshape(n, g.num_key_heads, g.key_head_dim)
            v = mixed[:, 2 * g.key_dim :].reshape(n, g.num_value_heads, g.value_head_dim)
            q = b.l2_norm(q, 1e-6) * np.float32(g.key_head_dim**-0.5)
            k = b.l2_norm(k, 1e-6)
            out, ssm_after = b.gated_delta_rule(q, k, v, log_decay_all[rows], beta_all[rows], plane.arrays["ssm"])
            for i in range(n):
                plane.advance({"conv": conv_after[i], "ssm": ssm_after[i]}, record=not p.prefill)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        z = b.linear(h, gw.in_z)
        rows = m * g.num_value_heads
        out = b.gated_rms_norm(out.reshape(rows, g.value_head_dim), z.reshape(rows, g.value_head_dim), gw.norm,
                               self.config.rms_norm_eps)
        return b.linear(out.reshape(m, g.value_dim), gw.out)


def _roll_back(state, start_pos: int) -> None:
    """Cut every plane the failed pass grew back to start_pos (the planes disagree here)."""
    for plane in state.planes:
        if plane.positions_held is not None and plane.positions_held > start_pos:
            plane.keep_positions(start_pos)
