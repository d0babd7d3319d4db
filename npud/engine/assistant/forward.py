"""The assistant's draft forward: one token in, its logits and projected state out, attending
over the base's own KV planes.

One draft step, as transformers' Gemma4AssistantForCausalLM computes it:
  x = pre_projection([base embedding of the token (scaled as the base scales it), hidden])
  every layer: q from x (q_norm, RoPE at `position`); attention over the first `kv_len` rows
    of the base's KV plane of the layer's kind (full: every row; sliding: the last `window`
    of them; no causal cut, the rows are all in the past); o_proj; the Gemma 4 sandwich norms,
    MLP and layer scalar
  h = final norm(x); projected = post_projection(h) -> the next step's hidden
  logits = lm_head(h), or with ordered embeddings: the top-k centroids' tokens get h . row,
    every other token min(those) - 1 (the "masked embedder").

The base planes read are those of the base's last KV-owning full-attention layer and last
KV-owning sliding layer (transformers' `shared_kv_states`, the layers whose sharing mode is
"store"), each at its own width. They are read in place: the step gets views of the plane's
first kv_len rows, nothing is copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from npud.engine.api import ModelError
from npud.engine.assistant.config import AssistantConfig, load_assistant_config
from npud.engine.assistant.weights import AssistantWeights, gather_rows, load_assistant_weights, prepare
from npud.engine.config import AttentionKind, ModelConfig
from npud.engine.model import Model
from npud.engine.state import ModelState, PlaneKind
from npud.engine.weights import weight_arrays
from npud.kernels.base import WeightFormat

_GEMMA4 = ("gemma4", "gemma4_text")

KV = Mapping[AttentionKind, tuple[np.ndarray, np.ndarray]]  # kind -> (keys, values) [T, KVH, Dh]


class AssistantMismatchError(ModelError):
    """The assistant cannot draft for this base (vocabulary, width or KV geometry differ)."""


@dataclass(slots=True, frozen=True)
class BaseKV:
    """The base layer whose KV plane each assistant layer kind reads."""

    layers: tuple[tuple[AttentionKind, int], ...]  # (kind, base layer index)

    @classmethod
    def for_base(cls, base: ModelConfig, assistant: AssistantConfig) -> "BaseKV":
        """The last KV-owning base layer of every kind the assistant uses, checked against the
        assistant's heads; raises AssistantMismatchError."""
        out = []
        for kind in assistant.kinds():
            owners = [s for s in base.layers if s.kind is kind and s.owns_kv]
            if not owners:
                raise AssistantMismatchError(
                    f"the assistant has {kind.value} layers but the base has no KV-owning {kind.value} layer"
                )
            plane = owners[-1]
            for spec in assistant.text.layers:
                if spec.kind is kind and (spec.num_kv_heads, spec.head_dim) != (plane.num_kv_heads, plane.head_dim):
                    raise AssistantMismatchError(
                        f"assistant layer {spec.index} ({kind.value}) reads {spec.num_kv_heads} KV heads of "
                        f"{spec.head_dim}, but the base's last {kind.value} layer ({plane.index}) holds "
                        f"{plane.num_kv_heads} of {plane.head_dim}"
                    )
            out.append((kind, plane.index))
        return cls(tuple(out))

    def read(self, state: ModelState) -> dict[AttentionKind, tuple[np.ndarray, np.ndarray]]:
        """(keys, values) of each kind's plane: views of the rows held, not copies."""
        out = {}
        for kind, layer in self.layers:
            plane = state.planes[layer]
            if plane.kind is not PlaneKind.KV:
                raise ValueError(f"base layer {layer} holds no KV plane")
            out[kind] = (plane.keys(), plane.values())
        return out


def check_base(config: AssistantConfig, base: ModelConfig) -> BaseKV:
    """The planes the assistant reads in `base`; raises AssistantMismatchError when it cannot
    draft for it (not Gemma 4, another vocabulary or width, KV heads of another shape)."""
    if base.model_type not in _GEMMA4:
        raise AssistantMismatchError(f"a Gemma 4 assistant drafts for a Gemma 4 base, not {base.model_type!r}")
    if config.vocab_size != base.vocab_size:
        raise AssistantMismatchError(
            f"the assistant's vocabulary has {config.vocab_size} tokens, the base's {base.vocab_size}"
        )
    if config.backbone_hidden_size != base.hidden_size:
        raise AssistantMismatchError(
            f"the assistant was built for a base of hidden size {config.backbone_hidden_size}, "
            f"this base has {base.hidden_size}"
        )
    return BaseKV.for_base(base, config)


class Assistant:
    """A loaded assistant bound to the base it drafts for (weights laid out for its backend)."""

    def __init__(self, config: AssistantConfig, weights: AssistantWeights, base: Model):
        self.kv = check_base(config, base.config)
        self.config = config
        self.base = base
        self.backend = base.backend
        self.weights = prepare(weights, self.backend, keep_rows=config.use_ordered_embeddings)
        self.fingerprint = weights.fingerprint
        cache: dict = {}
        self.inv_freq = [cache.setdefault(spec.rope, spec.rope.inv_freq()) for spec in config.text.layers]

    @classmethod
    def load(cls, checkpoint_dir, base: Model, fmt: WeightFormat | str = WeightFormat.BF16) -> "Assistant":
        """Read an assistant checkpoint for `base`; raises ConfigError, WeightsError or AssistantMismatchError."""
        if isinstance(fmt, str):
            fmt = WeightFormat.parse(fmt)
        config = load_assistant_config(checkpoint_dir)
        check_base(config, base.config)  # before reading any tensor: a mismatch is named as one
        return cls(config, load_assistant_weights(config, checkpoint_dir, fmt), base)

    @property
    def nbytes(self) -> int:
        """Bytes held by the assistant's arrays (a tied head counted once)."""
        seen: set[int] = set()
        total = 0
        for obj in weight_arrays(self.weights):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.nbytes
        return total

    def embed(self, token: int) -> np.ndarray:
        """The base's input embedding of `token`, [B] (scaled as the base scales it)."""
        x = self.backend.embed(self.base.weights.embed, np.array([token], np.int64))[0]
        scale = self.base.config.embed_scale
        return x * np.float32(scale) if scale is not None else x


def draft_step(a: Assistant, token: int, hidden: np.ndarray, position: int, kv: KV, kv_len: int) -> tuple[np.ndarray, np.ndarray]:
    """One assistant step: `token` (at `position`) with the hidden state [B] that preceded it,
    attending over the first kv_len rows of each kind's base plane in `kv`.

    Returns (logits [V], projected state [B]). Raises ValueError when kv_len is outside 1..rows held.
    """
    b, w, cfg = a.backend, a.weights, a.config.text
    eps = cfg.rms_norm_eps
    for kind, (keys, _) in kv.items():
        if not 1 <= kv_len <= keys.shape[0]:
            raise ValueError(f"the assistant attends over {kv_len} rows but the {kind.value} plane holds {keys.shape[0]}")
    x_in = np.concatenate([a.embed(token), np.asarray(hidden, np.float32)])[None]  # [1, 2B]
    x = b.linear(x_in, w.pre_projection)  # [1, D]
    positions = np.array([position], np.int64)
    # the mask: the query sees the kv_len rows (the last `window` of them on a sliding layer)
    last_row = np.array([kv_len - 1], np.int64)
    for spec, lw in zip(cfg.layers, w.layers):
        h = b.rms_norm(x, lw.input_norm, eps)
        q = b.linear(h, lw.attn.q).reshape(1, spec.num_heads, spec.head_dim)
        q = b.rope(b.rms_norm(q, lw.attn.q_norm, eps), positions, a.inv_freq[spec.index])
        keys, values = kv[spec.kind]
        # transformers' bidirectional window is inclusive (|q - kv| <= window), then flipped to
        # the past: a sliding layer sees the last window + 1 rows
        window = spec.window + 1 if spec.window else 0
        out = b.attention(q, keys[:kv_len], values[:kv_len], last_row, window, spec.scale)
        out = b.linear(out.reshape(1, spec.num_heads * spec.head_dim), lw.attn.o)
        x = x + b.rms_norm(out, lw.post_attention_norm, eps)
        h = b.rms_norm(x, lw.pre_feedforward_norm, eps)
        mlp = lw.mlp
        act = b.silu_mul if cfg.hidden_act == "silu" else b.gelu_tanh_mul
        x = x + b.rms_norm(b.linear(act(b.linear(h, mlp.gate), b.linear(h, mlp.up)), mlp.down),
                           lw.post_feedforward_norm, eps)
        x = x * lw.layer_scalar[0]
    h = b.rms_norm(x, w.final_norm, eps)  # [1, D]
    projected = b.linear(h, w.post_projection)[0]
    logits = _ordered_logits(a, h) if a.config.use_ordered_embeddings else b.linear(h, w.lm_head)[0]
    return logits, projected


def _ordered_logits(a: Assistant, h: np.ndarray) -> np.ndarray:
    """The masked embedder: h [1, D] -> logits [V], real only on the top-k centroids' tokens."""
    b, w, cfg = a.backend, a.weights, a.config
    centroid_logits = b.linear(h, w.centroids)[0]  # [C]
    top = np.argpartition(-centroid_logits, cfg.centroid_top_k - 1)[: cfg.centroid_top_k]  # the set; order is moot
    ids = w.token_ordering[top].reshape(-1)  # canonical ids of the selected clusters' tokens
    rows = gather_rows(w.lm_head, ids)  # [top_k * V / C, D], the head's rows of those tokens
    selected = rows @ h[0]
    logits = np.full(cfg.vocab_size, selected.min() - np.float32(1.0), np.float32)
    logits[ids] = selected
    return logits
