"""A Gemma 4 assistant's tensors: which ones its checkpoint must hold, and how they load.

Names are transformers' (Gemma4AssistantForCausalLM.save_pretrained): the text stack under
`model.` (its layers have no k/v projections: every layer reads the base's KV), plus
`pre_projection` ([hidden, 2 * backbone]), `post_projection` ([backbone, hidden]) and, with
ordered embeddings, `masked_embedding.centroids` ([centroids, hidden]) and the int64 buffer
`masked_embedding.token_ordering` ([vocab], the canonical token id of each cluster slot).
Linears load in any engine weight format (fp32, bf16, int8 per output row); norms, the layer
scalars and the ordering are float32 / int64 whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npud.engine.assistant.config import AssistantConfig
from npud.engine.weights import (
    AttentionWeights,
    LayerWeights,
    MlpWeights,
    WeightsError,
    checkpoint_fingerprint,
    open_checkpoint,
    prepare_linears,
)
# the checks and conversions every engine checkpoint goes through (package-private helpers)
from npud.engine.weights.convert import _convert_matrix, _vector
from npud.engine.weights.load import _check_tensors
from npud.kernels.base import Backend, LinearWeight, WeightFormat

ORDERING = "masked_embedding.token_ordering"


@dataclass(slots=True)
class AssistantWeights:
    layers: list[LayerWeights]  # attn.k / attn.v None: the base's planes are read instead
    final_norm: np.ndarray  # float32 [D]
    lm_head: LinearWeight  # [V, D]; model.embed_tokens when tied
    pre_projection: LinearWeight  # [D, 2 * backbone]
    post_projection: LinearWeight  # [backbone, D]
    fingerprint: str
    centroids: LinearWeight | None = None  # [C, D], ordered embeddings only
    token_ordering: np.ndarray | None = None  # int64 [C, V // C]: canonical ids of each centroid's tokens


def expected_tensors(cfg: AssistantConfig) -> dict[str, tuple[int, ...]]:
    """Returns the float tensors an assistant needs, by name, with their shapes."""
    t = cfg.text
    d, v, b = t.hidden_size, t.vocab_size, cfg.backbone_hidden_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
        "pre_projection.weight": (d, 2 * b), "post_projection.weight": (b, d),
    }
    for spec in t.layers:
        p = f"model.layers.{spec.index}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[f"{p}{name}.weight"] = (d,)
        out[f"{p}layer_scalar"] = (1,)
        f = t.mlp_width(spec)
        out.update({f"{p}mlp.gate_proj.weight": (f, d), f"{p}mlp.up_proj.weight": (f, d),
                    f"{p}mlp.down_proj.weight": (d, f)})
        q_width = spec.num_heads * spec.head_dim
        out[f"{p}self_attn.q_proj.weight"] = (q_width, d)
        out[f"{p}self_attn.o_proj.weight"] = (d, q_width)
        out[f"{p}self_attn.q_norm.weight"] = (spec.head_dim,)
        if t.qkv_bias:
            out[f"{p}self_attn.q_proj.bias"] = (q_width,)
        if t.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    if cfg.use_ordered_embeddings:
        out["masked_embedding.centroids.weight"] = (cfg.num_centroids, d)
    return out


def load_assistant_weights(cfg: AssistantConfig, checkpoint_dir, fmt: WeightFormat) -> AssistantWeights:
    """Returns the assistant's weights in `fmt`; every tensor is checked before any is converted.

    Raises WeightsError naming the file and tensor (missing, wrong shape or dtype, a token
    ordering that is not a permutation of the vocabulary).
    """
    if not isinstance(fmt, WeightFormat):
        raise WeightsError(f"fmt must be a WeightFormat, got {fmt!r}")
    directory = Path(checkpoint_dir)
    refs = open_checkpoint(directory)
    _check_tensors(refs, expected_tensors(cfg), directory)
    ordering = _token_ordering(cfg, refs, directory) if cfg.use_ordered_embeddings else None
    t = cfg.text

    def linear(name: str, has_bias: bool = False) -> LinearWeight:
        data, scale = _convert_matrix(refs[f"{name}.weight"], fmt)
        bias = _vector(refs[f"{name}.bias"]) if has_bias else None
        return LinearWeight(fmt=fmt, data=data, scale=scale, bias=bias)

    def norm(name: str) -> np.ndarray:
        return _vector(refs[f"{name}.weight"])

    layers = []
    for spec in t.layers:
        p = f"model.layers.{spec.index}."
        attn = AttentionWeights(q=linear(f"{p}self_attn.q_proj", t.qkv_bias), k=None, v=None,
                                o=linear(f"{p}self_attn.o_proj", t.o_bias), q_norm=norm(f"{p}self_attn.q_norm"),
                                k_norm=None)
        mlp = MlpWeights(gate=linear(f"{p}mlp.gate_proj"), up=linear(f"{p}mlp.up_proj"), down=linear(f"{p}mlp.down_proj"))
        layers.append(LayerWeights(
            input_norm=norm(f"{p}input_layernorm"), attn=attn, post_attention_norm=norm(f"{p}post_attention_layernorm"),
            mlp=mlp, pre_feedforward_norm=norm(f"{p}pre_feedforward_layernorm"),
            post_feedforward_norm=norm(f"{p}post_feedforward_layernorm"), layer_scalar=_vector(refs[f"{p}layer_scalar"]),
        ))
    return AssistantWeights(
        layers=layers, final_norm=norm("model.norm"),
        lm_head=linear("model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"),
        pre_projection=linear("pre_projection"), post_projection=linear("post_projection"),
        fingerprint=checkpoint_fingerprint(directory),
        centroids=linear("masked_embedding.centroids") if cfg.use_ordered_embeddings else None,
        token_ordering=ordering,
    )


def _token_ordering(cfg: AssistantConfig, refs, directory: Path) -> np.ndarray:
    """The ordering buffer as int64 [centroids, tokens per centroid]; it must be a permutation
    of the vocabulary (transformers initialises it to zeros: an untrained buffer is refused)."""
    ref = refs.get(ORDERING)
    v = cfg.vocab_size
    if ref is None:
        raise WeightsError(f"{directory}: tensor {ORDERING!r} is missing")
    if ref.shape != (v,) or ref.dtype not in ("I64", "I32"):
        raise WeightsError(f"{directory}: tensor {ORDERING!r} has {ref.dtype} {list(ref.shape)}, expected I64 [{v}]")
    raw = ref.buffer[ref.start:ref.end].view("<i8" if ref.dtype == "I64" else "<i4")
    ordering = np.array(raw, dtype=np.int64)
    if not np.array_equal(np.sort(ordering), np.arange(v)):
        raise WeightsError(f"{directory}: tensor {ORDERING!r} is not a permutation of the token ids 0..{v - 1}")
    return ordering.reshape(cfg.num_centroids, cfg.tokens_per_centroid)


def prepare(weights: AssistantWeights, backend: Backend, keep_rows: bool = False) -> AssistantWeights:
    """The weights with every linear laid out for `backend` once (a tied head stays one object).

    keep_rows leaves lm_head in its [V, D] rows: the ordered-embedding path only gathers rows
    of it (gather_rows), which a tiled layout makes a strided walk over the whole table.
    """
    return prepare_linears(weights, backend, keep=(weights.lm_head,) if keep_rows else ())


def gather_rows(w: LinearWeight, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a rows-layout weight, widened to float32 exactly as the kernels widen
    them (bf16 bits shifted into place, int8 times its row's scale): [len(ids), K]."""
    data = w.data[ids]
    if w.fmt.storage is WeightFormat.BF16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    if w.fmt.storage is WeightFormat.INT8:
        return data.astype(np.float32) * w.scale[ids][:, None]
    return np.asarray(data, np.float32)
