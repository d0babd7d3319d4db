"""A DFlash draft's tensors: which ones its checkpoint must hold, and how they load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npud.engine.dflash.config import DFlashConfig, Variant
from npud.engine.weights import (
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
from npud.kernels.base import LinearWeight, WeightFormat


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
    if fmt.storage is WeightFormat.BF16:
        data = ref.array().copy() if ref.dtype == "BF16" else f32_to_bf16_bits(_f32(ref))
        return LinearWeight(fmt, data, None, bias)
    if fmt.storage is WeightFormat.INT8:
        data, scale = quantize_int8_rows(_f32(ref))
        return LinearWeight(fmt, data, scale, bias)
    return LinearWeight(fmt, _f32(ref), None, bias)

