"""DFlash and DFlash 2 block drafters over the base's layer taps.

A DFlash draft (Z Lab's `dflash` package is the reference this follows) is a few Qwen3-style
decoder layers that draft a whole block in one pass. Its context is not tokens but the base's
hidden rows: for every committed position the outputs of a few base layers (the taps),
concatenated, projected by `fc` and normed into one context row. Every draft layer reads keys
and values of those context rows (projected from the same fused row in each layer, so they are
computed once per position and kept in the draft's own KV cache) and of the block itself, with
no causal mask. The block is [last token, mask, ..., mask] embedded by the base, and the base's
LM head turns each drafted row into a token. DFlash 2 wraps attention and MLP of every layer in
a grouped dynamic causal convolution over the block, and picks the drafted path through the top
tokens of each row with a low-rank bigram score (the candidate selector).

`DFlashHead` serves a draft to the speculative loop: it is the base's tap sink, keeps the sink
holding exactly the committed positions' rows, folds new rows into its cache at draft time, and
takes the one-pass round (`needs_last_hidden() == False`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import ConfigError, ModelConfig, parse_config
from engine.drafters import NO_DRAFT, Draft, DraftMismatchError
from engine.model import Model
from engine.sampling import Sampler, SamplingConfig
from engine.weights import (
    AttentionWeights,
    LayerWeights,
    MlpWeights,
    TensorRef,
    WeightsError,
    checkpoint_fingerprint,
    f32_to_bf16_bits,
    open_checkpoint,
    quantize_int8_rows,
)
from kernels.base import LinearWeight, WeightFormat

# --------------------------------------------------------------------------- configuration


class Variant(enum.Enum):
    DFLASH = "DFlashDraftModel"
    DFLASH2 = "DFlash2DraftModel"


_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The base layers a draft taps when its config does not say: the reference's spread from
    layer 1 to layer num_target_layers - 3 (the middle layer for a one-layer draft)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    # Python's round (half to even), as the reference computes it
    return tuple(round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(slots=True, frozen=True)
class DFlashConfig:
    """A DFlash draft: its decoder layers (`model`, a Qwen3 config) and what dflash_config adds."""

    model: ModelConfig
    variant: Variant
    target_layer_ids: tuple[int, ...]
    block_size: int  # rows per drafted block: the last token and block_size - 1 masks
    mask_token_id: int
    causal: tuple[bool, ...]  # per draft layer; DFlash attention is bidirectional by default
    num_target_layers: int | None = None  # the base's depth the draft was built for, when given
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, value, why: str) -> ConfigError:
            return ConfigError(f"DFlashConfig.{field} = {value!r}: {why}")

        if not self.target_layer_ids or not all(_is_int(i) and i >= 0 for i in self.target_layer_ids):
            raise bad("target_layer_ids", self.target_layer_ids, "must be a non-empty list of layer ids >= 0")
        if not (_is_int(self.block_size) and self.block_size >= 2):
            raise bad("block_size", self.block_size, "must be an int >= 2 (one row for the last token, one to draft)")
        if not (_is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.model.vocab_size):
            raise bad("mask_token_id", self.mask_token_id, f"must be a token id below vocab_size {self.model.vocab_size}")
        if len(self.causal) != self.model.num_layers:
            raise bad("causal", self.causal, f"needs one entry per draft layer ({self.model.num_layers})")
        for spec, causal in zip(self.model.layers, self.causal):
            if spec.window and not causal:
                # the reference's mask is then two-sided, which the attention kernel does not take
                raise bad("causal", self.causal, f"layer {spec.index}: a bidirectional sliding window is not supported")
        if self.num_target_layers is not None and not (_is_int(self.num_target_layers) and self.num_target_layers >= 1):
            raise bad("num_target_layers", self.num_target_layers, "must be an int >= 1")
        for field in ("input_embedding_scale", "output_multiplier"):
            if not _is_number(getattr(self, field)):
                raise bad(field, getattr(self, field), "must be a finite number")
        if self.final_logit_softcapping is not None and not _is_number(self.final_logit_softcapping):
            raise bad("final_logit_softcapping", self.final_logit_softcapping, "must be a finite number or null")
        if self.variant is Variant.DFLASH2:
            for field in _DFLASH2_FIELDS:
                if not (_is_int(getattr(self, field)) and getattr(self, field) >= 1):
                    raise bad(field, getattr(self, field), "must be an int >= 1 for a DFlash 2 draft")
            if self.model.hidden_size % self.conv_group_size:
                raise bad("conv_group_size", self.conv_group_size, f"must divide hidden_size {self.model.hidden_size}")
            if self.selector_top_k > self.model.vocab_size:
                raise bad("selector_top_k", self.selector_top_k, f"exceeds vocab_size {self.model.vocab_size}")

    @property
    def conv_groups(self) -> int:
        return self.model.hidden_size // self.conv_group_size

    def describe(self) -> dict:
        return {
            "variant": self.variant.value,
            "layers": self.model.num_layers,
            "hidden_size": self.model.hidden_size,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
        }


def parse_dflash_config(raw: dict, source: str = "config.json") -> DFlashConfig:
    """Returns the DFlashConfig of a draft's config.json dict; raises ConfigError.

    A field is read from `dflash_config` first and from the top level second, as the reference
    does; missing ones get its defaults (block_size 16, scales 1, target layers spread over
    `num_target_layers`). DFlash 2 is named by `architectures`, or else by its fields.
    """
    model = parse_config(raw, source=source)
    extra = raw.get("dflash_config", {})
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: dflash_config = {extra!r}: must be an object")

    def value(name: str, default=None):
        return extra[name] if name in extra else raw.get(name, default)

    architectures = raw.get("architectures") or []
    if Variant.DFLASH2.value in architectures:
        variant = Variant.DFLASH2
    elif Variant.DFLASH.value in architectures:
        variant = Variant.DFLASH
    else:
        variant = Variant.DFLASH2 if any(value(f) is not None for f in _DFLASH2_FIELDS) else Variant.DFLASH
    num_target_layers = raw.get("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if not (_is_int(num_target_layers) and num_target_layers >= 1):
            raise ConfigError(
                f"{source}: dflash_config.target_layer_ids is missing, and num_target_layers "
                f"({num_target_layers!r}) cannot stand in for it"
            )
        ids = build_target_layer_ids(num_target_layers, model.num_layers)
    if not isinstance(ids, list | tuple):
        raise ConfigError(f"{source}: dflash_config.target_layer_ids = {ids!r}: must be a list")
    mask = value("mask_token_id")
    if mask is None:
        raise ConfigError(f"{source}: dflash_config.mask_token_id is missing")

    # the reference makes a layer causal when is_causal says so, else when it is a sliding one
    is_causal = raw.get("is_causal")
    types = raw.get("layer_types")
    if is_causal is not None:
        causal = (bool(is_causal),) * model.num_layers
    elif isinstance(types, list) and len(types) == model.num_layers:
        causal = tuple(t == "sliding_attention" for t in types)
    else:
        causal = tuple(bool(spec.window) for spec in model.layers)
    fields = {f: value(f) for f in _DFLASH2_FIELDS} if variant is Variant.DFLASH2 else {}
    return DFlashConfig(
        model=model,
        variant=variant,
        target_layer_ids=tuple(ids),
        block_size=value("block_size", 16),
        mask_token_id=mask,
        causal=causal,
        num_target_layers=num_target_layers,
        input_embedding_scale=value("input_embedding_scale", 1.0),
        output_multiplier=value("output_multiplier", 1.0),
        final_logit_softcapping=value("final_logit_softcapping"),
        **fields,
    )


def load_dflash_config(draft_dir) -> DFlashConfig:
    """Returns the DFlashConfig of a draft checkpoint directory; raises ConfigError."""
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    return parse_dflash_config(raw, source=str(path))


def check_against_base(cfg: DFlashConfig, base: ModelConfig) -> None:
    """Raises DraftMismatchError unless the draft can read this base's taps and share its
    embedding and LM head."""
    d = cfg.model
    why = "the draft fuses the base's layer outputs and drafts through the base's embedding and LM head"
    if d.hidden_size != base.hidden_size:
        raise DraftMismatchError(f"the DFlash draft's hidden_size is {d.hidden_size}, the base's {base.hidden_size}: {why}")
    if d.vocab_size != base.vocab_size:
        raise DraftMismatchError(f"the DFlash draft's vocab_size is {d.vocab_size}, the base's {base.vocab_size}: {why}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != base.num_layers:
        raise DraftMismatchError(
            f"the DFlash draft was built for a base of {cfg.num_target_layers} layers, this base has {base.num_layers}"
        )
    for i in cfg.target_layer_ids:
        if i >= base.num_layers:
            raise DraftMismatchError(
                f"the DFlash draft taps base layer {i}, but the base has {base.num_layers} layers (0..{base.num_layers - 1})"
            )


# --------------------------------------------------------------------------- weights


@dataclass(slots=True, frozen=True)
class ConvWeights:
    """GroupedDynamicCausalConv: a static kernel per channel plus one per group computed from
    the input, for the pass before (index 0) and after (index 1) the wrapped block."""

    base_kernel: np.ndarray  # [2, K, D] float32
    projection: LinearWeight  # [2 * K * G, D]: input row -> the dynamic kernels of both passes


@dataclass(slots=True, frozen=True)
class SelectorWeights:
    predecessor: np.ndarray  # [V, R] float32
    successor: np.ndarray  # [V, R] float32
    projection: LinearWeight  # [R, D]


@dataclass(slots=True, frozen=True)
class DFlashWeights:
    fc: LinearWeight  # [D, len(target_layer_ids) * D]
    hidden_norm: np.ndarray  # [D]
    layers: tuple[LayerWeights, ...]
    norm: np.ndarray  # [D]
    convs: tuple[tuple[ConvWeights, ConvWeights], ...] | None  # (attention, mlp) per layer, DFlash 2
    selector: SelectorWeights | None  # DFlash 2
    fingerprint: str


def _expected(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    m = cfg.model
    d, f, v = m.hidden_size, m.intermediate_size, m.vocab_size
    out = {"fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for spec in m.layers:
        p = f"layers.{spec.index}."
        q = spec.num_heads * spec.head_dim
        for proj, n, k in (("q", q, d), ("k", spec.kv_width, d), ("v", spec.kv_width, d), ("o", d, q)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (n, k)
            if m.o_bias if proj == "o" else m.qkv_bias:
                out[f"{p}self_attn.{proj}_proj.bias"] = (n,)
        out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (spec.head_dim,)
        out[f"{p}input_layernorm.weight"] = out[f"{p}post_attention_layernorm.weight"] = (d,)
        for proj, n, k in (("gate", f, d), ("up", f, d), ("down", d, f)):
            out[f"{p}mlp.{proj}_proj.weight"] = (n, k)
        if cfg.variant is Variant.DFLASH2:
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}{conv}.base_kernel"] = (2, cfg.conv_kernel_size, d)
                out[f"{p}{conv}.kernel_projection.weight"] = (2 * cfg.conv_kernel_size * cfg.conv_groups, d)
    if cfg.variant is Variant.DFLASH2:
        out["candidate_selector.hidden_projection.weight"] = (cfg.selector_rank, d)
        for book in ("predecessor_codebook", "successor_codebook"):
            out[f"candidate_selector.{book}.weight"] = (v, cfg.selector_rank)
    return out


def load_dflash_weights(cfg: DFlashConfig, draft_dir, fmt: WeightFormat) -> DFlashWeights:
    """Returns the draft's weights, linears in `fmt` (norms, conv kernels and codebooks float32).

    Every tensor is checked (present, shape, dtype) before any is converted; the codebooks may
    be stored without the `.weight` suffix, as the published DFlash 2 checkpoints name them.
    Raises WeightsError naming the directory and the tensors.
    """
    directory = Path(draft_dir)
    refs = open_checkpoint(directory)
    for book in ("predecessor_codebook", "successor_codebook"):
        bare = f"candidate_selector.{book}"
        if bare in refs and f"{bare}.weight" not in refs:
            refs[f"{bare}.weight"] = refs[bare]
    problems = []
    for name, shape in _expected(cfg).items():
        ref = refs.get(name)
        if ref is None:
            problems.append(f"tensor {name!r} is missing")
        elif ref.shape != shape:
            problems.append(f"tensor {name!r} has shape {list(ref.shape)}, expected {list(shape)}")
        elif ref.dtype not in ("F32", "F16", "BF16"):
            problems.append(f"tensor {name!r} has dtype {ref.dtype} (supported: BF16, F16, F32)")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError(f"{directory}: not a {cfg.variant.value} checkpoint: " + "; ".join(problems[:5]) + more)

    def vec(name: str) -> np.ndarray:
        return _f32(refs[name])

    def lin(name: str, bias: bool = False) -> LinearWeight:
        return _linear(refs[f"{name}.weight"], fmt, vec(f"{name}.bias") if bias else None)

    m = cfg.model
    layers, convs = [], []
    for spec in m.layers:
        p = f"layers.{spec.index}."
        attn = AttentionWeights(
            q=lin(f"{p}self_attn.q_proj", m.qkv_bias), k=lin(f"{p}self_attn.k_proj", m.qkv_bias),
            v=lin(f"{p}self_attn.v_proj", m.qkv_bias), o=lin(f"{p}self_attn.o_proj", m.o_bias),
            q_norm=vec(f"{p}self_attn.q_norm.weight"), k_norm=vec(f"{p}self_attn.k_norm.weight"),
        )
        mlp = MlpWeights(gate=lin(f"{p}mlp.gate_proj"), up=lin(f"{p}mlp.up_proj"), down=lin(f"{p}mlp.down_proj"))
        layers.append(LayerWeights(vec(f"{p}input_layernorm.weight"), attn, vec(f"{p}post_attention_layernorm.weight"), mlp))
        if cfg.variant is Variant.DFLASH2:
            convs.append(tuple(
                ConvWeights(vec(f"{p}{c}.base_kernel"), lin(f"{p}{c}.kernel_projection")) for c in ("attention_conv", "mlp_conv")
            ))
    selector = None
    if cfg.variant is Variant.DFLASH2:
        selector = SelectorWeights(
            predecessor=vec("candidate_selector.predecessor_codebook.weight"),
            successor=vec("candidate_selector.successor_codebook.weight"),
            projection=lin("candidate_selector.hidden_projection"),
        )
    return DFlashWeights(
        fc=lin("fc"), hidden_norm=vec("hidden_norm.weight"), layers=tuple(layers), norm=vec("norm.weight"),
        convs=tuple(convs) if convs else None, selector=selector, fingerprint=checkpoint_fingerprint(directory),
    )


def _f32(ref: TensorRef) -> np.ndarray:
    a = ref.array()
    if ref.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def _linear(ref: TensorRef, fmt: WeightFormat, bias: np.ndarray | None) -> LinearWeight:
    if fmt is WeightFormat.BF16:
        data = ref.array().copy() if ref.dtype == "BF16" else f32_to_bf16_bits(_f32(ref))
        return LinearWeight(fmt, data, None, bias)
    if fmt.storage is WeightFormat.INT8:
        data, scale = quantize_int8_rows(_f32(ref))
        return LinearWeight(fmt, data, scale, bias)
    return LinearWeight(fmt, _f32(ref), None, bias)


# --------------------------------------------------------------------------- the draft forward


class DraftCache:
    """The draft's keys and values of the context rows folded so far, positions 0..rows-1,
    per layer. Slots past `rows` are scratch for the block being drafted."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 256) -> None:
        self.rows = 0
        self._shape = (kv_heads, head_dim)
        self.keys = [np.empty((capacity, kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.values = [np.empty((capacity, kv_heads, head_dim), np.float32) for _ in range(num_layers)]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions, keeping the folded rows."""
        capacity = self.keys[0].shape[0]
        if total <= capacity:
            return
        capacity = max(total, 2 * capacity)
        for planes in (self.keys, self.values):
            for i, old in enumerate(planes):
                new = np.empty((capacity, *self._shape), np.float32)
                new[: self.rows] = old[: self.rows]
                planes[i] = new

    def clear(self) -> None:
        self.rows = 0


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

    def proposer(self, sampling: SamplingConfig = SamplingConfig()) -> Pick:
        """The rule that turns drafted rows into a Draft: argmax of the logits (DFlash) or the
        candidate selector's path (DFlash 2); with a temperature, drawn from the distribution
        the Draft carries (the loop's accept/resample rule needs it)."""
        return _Proposer(self, sampling)

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
    def __init__(self, draft: DFlashDraft, sampling: SamplingConfig) -> None:
        self.draft = draft
        self.sampler = Sampler(sampling)
        # an independent stream: the accept test must not reuse the numbers that drew the drafts
        self.sampler.rng = np.random.default_rng([sampling.seed, _DRAFT_STREAM])

    def __call__(self, hidden: np.ndarray, context: Sequence[int]) -> Draft:
        logits = self.draft.logits(hidden)
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


# --------------------------------------------------------------------------- the head


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
    """A DFlash draft behind the draft-head protocol (engine.drafters.DraftHead).

    `attach(forward)` makes `sink` the base's tap sink before the prompt runs. The forward
    writes a row for every position a pass runs, rejected verify rows included, so after a
    verify `commit_rows` trims the sink to its size at draft time plus the committed rows; after
    a plain step the one row is committed as written. At draft time the rows not yet folded go
    into the draft cache, and the block [t1, mask, ...] is drafted. `pick` turns drafted rows
    into tokens (default: the draft's own rule, `DFlashDraft.proposer(sampling)`).
    """

    def __init__(self, draft: DFlashDraft, sampling: SamplingConfig = SamplingConfig(), pick: Pick | None = None):
        self.draft_model = draft
        self.sink = TapRows(draft.tap_width)
        self.cache = draft.new_cache()
        self.pick = pick if pick is not None else draft.proposer(sampling)
        self._mark = 0  # the sink's size at the last draft
        self._drafted = False  # a draft awaits its commit
        self._error: str | None = None

    def attach(self, forward) -> None:
        """Register the sink for the draft's tapped layers on `forward` (an engine.forward.Forward)."""
        forward.set_layer_taps(self.draft_model.config.target_layer_ids, self.sink)

    def needs_last_hidden(self) -> bool:
        return False

    def draft(self, context: Sequence[int], k: int) -> Draft:
        """Up to min(k, block_size - 1) tokens after context (which ends with t1, not yet run).
        Refused (empty, with error()) unless the sink ends at t1's position."""
        self._error = None
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
        self._mark, self._drafted = rows, True
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)
