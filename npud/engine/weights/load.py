"""A dense checkpoint (llama, mistral, qwen2, qwen3) loaded into ModelWeights.

Every tensor the model needs is checked (present, shape, dtype) before anything is
converted, so a bad checkpoint fails in milliseconds with a message naming the tensor,
not halfway through a large allocation. gemma4 and qwen3_5 go to npud/engine/weights/hybrid.py.
"""

from __future__ import annotations

from pathlib import Path

from npud.engine import progress
from npud.engine.config import HYBRID_MODEL_TYPES, ModelConfig
from npud.engine.weights.checkpoint import _LOADABLE, TensorRef, WeightsError, checkpoint_fingerprint, open_checkpoint
from npud.engine.weights.convert import _convert_matrix, _vector
from npud.engine.weights.hybrid import expected_hybrid_tensors, load_hybrid_weights
from npud.engine.weights.layout import AttentionWeights, LayerWeights, MlpWeights, ModelWeights
from npud.kernels.base import LinearWeight, WeightFormat


def _expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Returns the HF tensor names the model needs with their shapes."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in cfg.layers:
        p = f"model.layers.{layer.index}."
        q_width = layer.num_heads * layer.head_dim
        for proj, n, k in (("q", q_width, d), ("k", layer.kv_width, d), ("v", layer.kv_width, d),
                           ("o", d, q_width)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (n, k)
            if (cfg.o_bias if proj == "o" else cfg.qkv_bias):
                out[f"{p}self_attn.{proj}_proj.bias"] = (n,)
        if cfg.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = (layer.head_dim,)
            out[f"{p}self_attn.k_norm.weight"] = (layer.head_dim,)
        out[f"{p}input_layernorm.weight"] = (d,)
        out[f"{p}post_attention_layernorm.weight"] = (d,)
        for proj, n, k in (("gate", f, d), ("up", f, d), ("down", d, f)):
            out[f"{p}mlp.{proj}_proj.weight"] = (n, k)
            if cfg.mlp_bias:
                out[f"{p}mlp.{proj}_proj.bias"] = (n,)
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def _check_tensors(refs: dict[str, TensorRef], expected: dict[str, tuple[int, ...]], directory: Path) -> None:
    problems = []
    for name, shape in expected.items():
        ref = refs.get(name)
        if ref is None:
            problems.append(f"tensor {name!r} is missing")
        elif ref.shape != shape:
            problems.append(f"tensor {name!r} has shape {list(ref.shape)}, expected {list(shape)}")
        elif ref.dtype not in _LOADABLE:
            problems.append(
                f"tensor {name!r} in {ref.path.name} has dtype {ref.dtype}, which is not supported "
                f"(supported: {sorted(_LOADABLE)})"
            )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError(f"{directory}: " + "; ".join(problems[:5]) + more)



def load_weights(cfg: ModelConfig, checkpoint_dir, fmt: WeightFormat) -> ModelWeights:
    """Returns the model's weights in `fmt` (norms and biases always float32).

    Every needed tensor is checked for presence, shape and dtype first; then tensors
    are converted one at a time. Raises WeightsError naming the file and tensor.
    """
    if not isinstance(fmt, WeightFormat):
        raise WeightsError(f"fmt must be a WeightFormat, got {fmt!r}")
    directory = Path(checkpoint_dir)
    refs = open_checkpoint(directory)
    if cfg.model_type in HYBRID_MODEL_TYPES:
        _check_tensors(refs, expected_hybrid_tensors(cfg), directory)
        return load_hybrid_weights(cfg, refs, fmt, checkpoint_fingerprint(directory))
    _check_tensors(refs, _expected_tensors(cfg), directory)
    fingerprint = checkpoint_fingerprint(directory)
    progress.report("reading", 1, 1)
    progress.report("weights", 0, len(cfg.layers))

    def linear(prefix: str, has_bias: bool) -> LinearWeight:
        data, scale = _convert_matrix(refs[f"{prefix}.weight"], fmt)
        bias = _vector(refs[f"{prefix}.bias"]) if has_bias else None
        return LinearWeight(fmt=fmt, data=data, scale=scale, bias=bias)

    embed = linear("model.embed_tokens", False)
    layers = []
    for layer in cfg.layers:
        p = f"model.layers.{layer.index}."
        attn = AttentionWeights(
            q=linear(f"{p}self_attn.q_proj", cfg.qkv_bias),
            k=linear(f"{p}self_attn.k_proj", cfg.qkv_bias),
            v=linear(f"{p}self_attn.v_proj", cfg.qkv_bias),
            o=linear(f"{p}self_attn.o_proj", cfg.o_bias),
            q_norm=_vector(refs[f"{p}self_attn.q_norm.weight"]) if cfg.qk_norm else None,
            k_norm=_vector(refs[f"{p}self_attn.k_norm.weight"]) if cfg.qk_norm else None,
        )
        mlp = MlpWeights(
            gate=linear(f"{p}mlp.gate_proj", cfg.mlp_bias),
            up=linear(f"{p}mlp.up_proj", cfg.mlp_bias),
            down=linear(f"{p}mlp.down_proj", cfg.mlp_bias),
        )
        layers.append(LayerWeights(
            input_norm=_vector(refs[f"{p}input_layernorm.weight"]),
            attn=attn,
            post_attention_norm=_vector(refs[f"{p}post_attention_layernorm.weight"]),
            mlp=mlp,
        ))
        progress.report("weights", len(layers), len(cfg.layers))
    lm_head = embed if cfg.tie_word_embeddings else linear("lm_head", False)
    return ModelWeights(embed=embed, layers=layers, final_norm=_vector(refs["model.norm.weight"]),
                        lm_head=lm_head, fingerprint=fingerprint)
