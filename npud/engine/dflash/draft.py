"""The DFlash draft forward: context rows folded into its cache, a block drafted in one pass,
and the proposer that turns drafted rows into tokens (DFlash 2: through the candidate selector)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from npud.engine.dflash.cache import DraftCache
from npud.engine.dflash.config import DFlashConfig, check_against_base, load_dflash_config
from npud.engine.dflash.weights import ConvWeights, DFlashWeights, SelectorWeights, load_dflash_weights
from npud.engine.drafters import Draft
from npud.engine.model import Model
from npud.engine.api import SamplingParams
from npud.engine.sampling import Sampler
from npud.engine.weights import AttentionWeights, LayerWeights, MlpWeights
from npud.kernels.base import WeightFormat


class DFlashDraft:
    """A loaded DFlash draft bound to its base `Model` (whose embedding, LM head and backend it
    uses). Stateless: the context lives in a `DraftCache`, so one draft serves every job."""

    def __init__(self, config: DFlashConfig, weights: DFlashWeights, base: Model) -> None:
        check_against_base(config, base.config)
        self.config = config
        self.base = base
        self.backend = b = base.backend
        prep = b.prepare_linear
        self.weights = DFlashWeights(
            fc=prep(weights.fc),
            hidden_norm=weights.hidden_norm,
            layers=tuple(
                LayerWeights(
                    lw.input_norm,
                    AttentionWeights(prep(lw.attn.q), prep(lw.attn.k), prep(lw.attn.v), prep(lw.attn.o),
                                     lw.attn.q_norm, lw.attn.k_norm),
                    lw.post_attention_norm,
                    MlpWeights(prep(lw.mlp.gate), prep(lw.mlp.up), prep(lw.mlp.down)),
                )
                for lw in weights.layers
            ),
            norm=weights.norm,
            convs=None if weights.convs is None else tuple(
                tuple(ConvWeights(c.base_kernel, prep(c.projection)) for c in pair) for pair in weights.convs
            ),
            selector=None if weights.selector is None else SelectorWeights(
                weights.selector.predecessor, weights.selector.successor, prep(weights.selector.projection)
            ),
            fingerprint=weights.fingerprint,
        )
        cache: dict = {}
        self.inv_freq = [cache.setdefault(spec.rope, spec.rope.inv_freq()) for spec in config.model.layers]
        d = base.config.hidden_size
        # transformers' hidden_states[L] (what the reference reads for a tap of the last layer)
        # is the final-normed row, where every other entry is a layer's raw output
        last = base.config.num_layers - 1
        self._normed_slots = [slice(j * d, (j + 1) * d) for j, i in enumerate(config.target_layer_ids) if i == last]

    @classmethod
    def load(cls, draft_dir, base: Model, fmt: WeightFormat | str | None = None) -> DFlashDraft:
        """Read a DFlash / DFlash 2 checkpoint for `base`; linears in `fmt` (default: the base's
        embedding format). Raises ConfigError, DraftMismatchError or WeightsError."""
        if fmt is None:
            fmt = base.weights.embed.fmt
        elif isinstance(fmt, str):
            fmt = WeightFormat.parse(fmt)
        config = load_dflash_config(draft_dir)
        check_against_base(config, base.config)
        return cls(config, load_dflash_weights(config, draft_dir, fmt), base)

    @property
    def tap_width(self) -> int:
        return len(self.config.target_layer_ids) * self.base.config.hidden_size

    def new_cache(self) -> DraftCache:
        spec = self.config.model.layers[0]
        return DraftCache(self.config.model.num_layers, spec.num_kv_heads, spec.head_dim)

    def fold(self, cache: DraftCache, taps: np.ndarray) -> None:
        """Append the context rows of taps [n, tap_width] (positions cache.rows onwards)."""
        n = taps.shape[0]
        if n == 0:
            return
        b, w, m = self.backend, self.weights, self.config.model
        if self._normed_slots:
            taps = np.array(taps, dtype=np.float32)
            base = self.base
            for s in self._normed_slots:
                taps[:, s] = b.rms_norm(taps[:, s], base.weights.final_norm, base.config.rms_norm_eps)
        context = b.rms_norm(b.linear(taps, w.fc), w.hidden_norm, m.rms_norm_eps)  # [n, D]
        positions = np.arange(cache.rows, cache.rows + n, dtype=np.int64)
        cache.reserve(cache.rows + n)
        for spec, lw in zip(m.layers, w.layers):
            k, v = self._kv(spec, lw.attn, context, positions)
            cache.keys[spec.index][cache.rows : cache.rows + n] = k
            cache.values[spec.index][cache.rows : cache.rows + n] = v
        cache.rows += n

    def block(self, cache: DraftCache, anchor: int, n: int) -> np.ndarray:
        """The drafted rows [n, D] for positions cache.rows + 1 .. cache.rows + n: one pass over
        [anchor, mask * n] at positions cache.rows .., attending to every folded row."""
        b, w, cfg = self.backend, self.weights, self.config
        m = cfg.model
        start, rows = cache.rows, n + 1
        x = b.embed(self.base.weights.embed, np.array([anchor] + [cfg.mask_token_id] * n, np.int64))  # [n+1, D]
        if cfg.input_embedding_scale != 1.0:
            x = x * np.float32(cfg.input_embedding_scale)
        positions = np.arange(start, start + rows, dtype=np.int64)
        cache.reserve(start + rows)
        for spec, lw in zip(m.layers, w.layers):
            conv_attn, conv_mlp = w.convs[spec.index] if w.convs is not None else (None, None)
            h = b.rms_norm(x, lw.input_norm, m.rms_norm_eps)
            h, after = self._conv_before(conv_attn, h)
            q = b.linear(h, lw.attn.q).reshape(rows, spec.num_heads, spec.head_dim)
            q = b.rope(b.rms_norm(q, lw.attn.q_norm, m.rms_norm_eps), positions, self.inv_freq[spec.index])
            k, v = self._kv(spec, lw.attn, h, positions)
            keys, values = cache.keys[spec.index], cache.values[spec.index]
            keys[start : start + rows], values[start : start + rows] = k, v  # scratch past the folded rows
            # bidirectional: every row sees the whole context and the whole block
            seen = positions if cfg.causal[spec.index] else np.full(rows, start + rows - 1, np.int64)
            out = b.attention(q, keys[: start + rows], values[: start + rows], seen, spec.window, spec.head_dim**-0.5)
            o = b.linear(out.reshape(rows, spec.num_heads * spec.head_dim), lw.attn.o)
            x = x + self._conv_after(conv_attn, o, after)
            h = b.rms_norm(x, lw.post_attention_norm, m.rms_norm_eps)
            h, after = self._conv_before(conv_mlp, h)
            mlp = b.linear(b.silu_mul(b.linear(h, lw.mlp.gate), b.linear(h, lw.mlp.up)), lw.mlp.down)
            x = x + self._conv_after(conv_mlp, mlp, after)
        return b.rms_norm(x[1:], w.norm, m.rms_norm_eps)

    def hidden_from_scratch(self, taps: np.ndarray, anchor: int, n: int) -> np.ndarray:
        """block() over a fresh cache holding taps [P, tap_width]: the drafted rows [n, D]."""
        cache = self.new_cache()
        self.fold(cache, taps)
        return self.block(cache, anchor, n)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """[n, D] drafted rows -> [n, V] through the base's LM head, scaled and soft-capped."""
        logits = self.backend.linear(hidden, self.base.weights.lm_head)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * np.float32(cfg.output_multiplier)
        cap = cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits

    def proposer(self, sampling: SamplingParams = SamplingParams(), allowed: np.ndarray | None = None) -> Pick:
        """The rule that turns drafted rows into a Draft: argmax of the logits (DFlash) or the
        candidate selector's path (DFlash 2); with a temperature, drawn from the distribution
        the Draft carries (the loop's accept/resample rule needs it). Ids outside `allowed`
        (bool [V], see npud.engine.sampling.Sampler) are never proposed."""
        return _Proposer(self, sampling, allowed)

    def _kv(self, spec, aw: AttentionWeights, h: np.ndarray, positions: np.ndarray):
        b, eps, rows = self.backend, self.config.model.rms_norm_eps, h.shape[0]
        k = b.linear(h, aw.k).reshape(rows, spec.num_kv_heads, spec.head_dim)
        k = b.rope(b.rms_norm(k, aw.k_norm, eps), positions, self.inv_freq[spec.index])
        v = b.linear(h, aw.v).reshape(rows, spec.num_kv_heads, spec.head_dim)
        return k, v

    def _conv_before(self, conv: ConvWeights | None, h: np.ndarray):
        """DFlash 2: the causal conv before the wrapped block, and the dynamic kernels for after."""
        if conv is None:
            return h, None
        size, groups = self.config.conv_kernel_size, self.config.conv_groups
        dynamic = self.backend.linear(h, conv.projection).reshape(h.shape[0], 2, size, groups)
        return _dynamic_conv(h, dynamic[:, 0], conv.base_kernel[0]), dynamic[:, 1]

    def _conv_after(self, conv: ConvWeights | None, h: np.ndarray, dynamic) -> np.ndarray:
        return h if conv is None else _dynamic_conv(h, dynamic, conv.base_kernel[1])


def _dynamic_conv(h: np.ndarray, dynamic: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Causal conv over the block's rows: out[t] = sum_o (kernel[o] + dynamic[t, o]) * h[t - o].

    h: [L, D], dynamic: [L, K, G] (one weight per channel group), kernel: [K, D] -> [L, D].
    The terms are added in the reference's order (offset by offset, static then dynamic).
    """
    rows, d = h.shape
    size, groups = dynamic.shape[1], dynamic.shape[2]
    blocks = h.reshape(rows, groups, d // groups)
    out = np.zeros_like(blocks)
    for o in range(size):
        shifted = np.zeros_like(blocks)
        shifted[o:] = blocks[: rows - o]
        out = out + kernel[o].reshape(groups, -1) * shifted
        out = out + dynamic[:, o, :, None] * shifted
    return out.reshape(rows, d)


Pick = Callable[[np.ndarray, Sequence[int]], Draft]
"""(drafted rows [n, D], context ending with the last token) -> the Draft of n tokens."""

_DRAFT_STREAM = 0xDF1A5  # keeps the draft's draws apart from the loop's accept draws


class _Proposer:
    def __init__(self, draft: DFlashDraft, sampling: SamplingParams, allowed: np.ndarray | None = None) -> None:
        self.draft = draft
        self.sampler = Sampler(sampling, allowed)  # a padded id (not decodable) is never proposed
        # an independent stream: the accept test must not reuse the numbers that drew the drafts
        self.sampler.rng = np.random.default_rng([sampling.seed, _DRAFT_STREAM])

    def __call__(self, hidden: np.ndarray, context: Sequence[int]) -> Draft:
        logits = self.sampler.masked(self.draft.logits(hidden))
        if self.draft.weights.selector is not None:
            return self._select(hidden, logits, int(context[-1]))
        if self.sampler.config.greedy:
            return Draft(tuple(int(t) for t in np.argmax(logits, axis=1)))
        probs = np.stack([self.sampler.probs(row) for row in logits])
        return Draft(tuple(self.sampler.draw(q) for q in probs), probs)

    def _select(self, hidden: np.ndarray, logits: np.ndarray, anchor: int) -> Draft:
        """DFlash 2's path: per row, among its top-k tokens, the best of logit plus a low-rank
        score of (previous token, row, candidate); greedy or drawn with the temperature."""
        cfg, sel = self.draft.config, self.draft.weights.selector
        candidates = np.argsort(-logits, axis=1, kind="stable")[:, : cfg.selector_top_k]  # [n, top]
        unary = np.take_along_axis(logits, candidates, axis=1)
        projected = self.draft.backend.linear(hidden, sel.projection)  # [n, R]
        greedy, temperature = self.sampler.config.greedy, self.sampler.config.temperature
        tokens, probs, previous = [], [], anchor
        for i in range(len(candidates)):
            pair = sel.predecessor[previous] * projected[i]  # [R]
            scores = unary[i] + (sel.successor[candidates[i]] * pair).sum(axis=1)
            if greedy:
                choice = int(np.argmax(scores))
            else:
                z = scores.astype(np.float64) / temperature
                q = np.exp(z - z.max())
                q /= q.sum()
                choice = self.sampler.draw(q)
                row = np.zeros(logits.shape[1])
                row[candidates[i]] = q
                probs.append(row)
            previous = int(candidates[i, choice])
            tokens.append(previous)
        return Draft(tuple(tokens), np.stack(probs) if probs else None)


