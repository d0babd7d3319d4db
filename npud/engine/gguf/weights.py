"""A GGUF file's tensors as npud's ModelWeights: block types kept in block form.

Names are llama.cpp's (token_embd, blk.N.attn_q, ..., output_norm, output). Matrices:
- Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K stay quantized (npud/kernels/ggml: one int8 per weight
  plus per-group float32 factors, widened inside the GEMM exactly as gguf dequantizes);
- F32 stays float32, BF16 stays bf16 bits, F16 widens to float32 (exact);
- any other type is a WeightsError naming the tensor and its type.
The embedding table is one of these matrices, gathered row by row; tied to the output
when the file has no output.weight.

Two transformations undo what llama.cpp's converter did, as transformers' GGUF loader
undoes them: llama/mistral q and k rows are stored permuted for interleaved RoPE (rows are
moved back whole, quant blocks intact), and Gemma 3 norm weights are stored as 1 + w (the
forward scales by 1 + (stored - 1), computed in float32 as transformers computes it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from npud.engine import progress
from npud.engine.config import ModelConfig
from npud.engine.gguf.reader import GgufFile, GgufTensor
from npud.engine.weights import AttentionWeights, LayerWeights, MlpWeights, ModelWeights, WeightsError, checkpoint_fingerprint
from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.ggml.blocks import BlockFormat
from npud.kernels.ggml.gemm import LAYOUT_FLOAT, LAYOUT_Q8, pack_block_matrix

BLOCK_TYPES = {fmt.name: fmt for fmt in BlockFormat}  # ggml type name -> BlockFormat
DENSE_TYPES = ("F32", "F16", "BF16")
RUNNABLE_TYPES = (*DENSE_TYPES, *BLOCK_TYPES)


def _is_gemma3(cfg: ModelConfig) -> bool:
    return cfg.model_type in ("gemma3", "gemma3_text")


def expected_gguf_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The llama.cpp tensor names the model needs, with their row-major shapes."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    gemma = _is_gemma3(cfg)
    for spec in cfg.layers:
        p = f"blk.{spec.index}."
        q_width = spec.num_heads * spec.head_dim
        for name, n, k in (("attn_q", q_width, d), ("attn_k", spec.kv_width, d), ("attn_v", spec.kv_width, d),
                           ("attn_output", d, q_width)):
            out[f"{p}{name}.weight"] = (n, k)
            if cfg.o_bias if name == "attn_output" else cfg.qkv_bias:
                out[f"{p}{name}.bias"] = (n,)
        if cfg.qk_norm:
            out[f"{p}attn_q_norm.weight"] = (spec.head_dim,)
            out[f"{p}attn_k_norm.weight"] = (spec.head_dim,)
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else [])
        for name in norms:
            out[f"{p}{name}.weight"] = (d,)
        f = cfg.mlp_width(spec)
        for name, n, k in (("ffn_gate", f, d), ("ffn_up", f, d), ("ffn_down", d, f)):
            out[f"{p}{name}.weight"] = (n, k)
            if cfg.mlp_bias:
                out[f"{p}{name}.bias"] = (n,)
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (v, d)
    return out


def check_gguf_tensors(g: GgufFile, cfg: ModelConfig) -> None:
    """Raises WeightsError naming every missing tensor, wrong shape or type npud cannot run (first 5)."""
    problems = []
    for name, shape in expected_gguf_tensors(cfg).items():
        t = g.tensors.get(name)
        if t is None:
            problems.append(f"tensor {name!r} is missing")
        elif t.shape != shape:
            problems.append(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        elif t.type_name not in (RUNNABLE_TYPES if len(shape) == 2 else DENSE_TYPES):
            problems.append(f"tensor {name!r} has type {t.type_name}, which npud cannot run "
                            f"(supported: {list(RUNNABLE_TYPES if len(shape) == 2 else DENSE_TYPES)})")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError(f"{g.path}: " + "; ".join(problems[:5]) + more)


def dense_array(t: GgufTensor) -> np.ndarray:
    """An F32/F16/BF16 tensor widened to float32 (exactly), a new array."""
    if t.type_name == "BF16":
        return (t.array().astype(np.uint32) << 16).view(np.float32)
    return np.array(t.array(), dtype=np.float32)


def _matrix(t: GgufTensor, rows: np.ndarray | None = None, layout: str = LAYOUT_FLOAT, release=None) -> LinearWeight:
    """A [N, K] tensor as a LinearWeight: block types in block form (`layout`: npud/kernels/ggml/gemm.py),
    dense types as they are. release: GgufFile.release, for the file's pages of block rows once
    they are packed."""
    if t.type_name in BLOCK_TYPES:
        w = pack_block_matrix(t.raw_rows(), BLOCK_TYPES[t.type_name], t.shape[1], rows, layout, done=release)
        if release is not None and rows is not None:
            release(t.data)
        return w
    if t.type_name == "BF16":
        data = t.array()
        return LinearWeight(WeightFormat.BF16, np.ascontiguousarray(data if rows is None else data[rows]))
    data = dense_array(t)
    return LinearWeight(WeightFormat.FP32, np.ascontiguousarray(data if rows is None else data[rows]))


def _unpermute_rows(n_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: row (h, s, i) of the checkpoint
    (head h, half s, pair i) is stored at h * head_dim + 2 i + s."""
    head_dim = n_rows // num_heads
    h, s, i = np.meshgrid(np.arange(num_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij")
    return (h * head_dim + 2 * i + s).reshape(-1)


def load_gguf_weights(g: GgufFile, cfg: ModelConfig, q8: bool = False) -> ModelWeights:
    """Returns the model's weights from a GGUF file whose config is `cfg`; q8: block matrices in
    the layout that multiplies them against q8 activation rows ("gguf-q8"), else the exact float one.

    Raises WeightsError for a missing tensor, a wrong shape, or a type npud cannot run.
    """
    check_gguf_tensors(g, cfg)
    progress.report("reading", 1, 1)
    progress.report("weights", 0, len(cfg.layers))
    layout = LAYOUT_Q8 if q8 else LAYOUT_FLOAT
    t = g.tensors
    gemma = _is_gemma3(cfg)
    permuted = cfg.model_type in ("llama", "mistral")
    one = np.float32(1.0)

    def vector(name: str) -> np.ndarray:
        return dense_array(t[name])

    def norm(name: str) -> np.ndarray:
        w = vector(name)
        # llama.cpp stores gemma's 1 + w; transformers subtracts the 1 and adds it back in float32
        return one + (w - one) if gemma else w

    def linear(name: str, has_bias: bool, rows: np.ndarray | None = None) -> LinearWeight:
        w = _matrix(t[f"{name}.weight"], rows, layout, g.release)
        if has_bias:
            bias = vector(f"{name}.bias")
            w = dataclasses.replace(w, bias=bias if rows is None else bias[rows])
        return w

    layers = []
    for spec in cfg.layers:
        p = f"blk.{spec.index}."
        q_rows = _unpermute_rows(spec.num_heads * spec.head_dim, spec.num_heads) if permuted else None
        k_rows = _unpermute_rows(spec.kv_width, spec.num_kv_heads) if permuted else None
        attn = AttentionWeights(
            q=linear(f"{p}attn_q", cfg.qkv_bias, q_rows), k=linear(f"{p}attn_k", cfg.qkv_bias, k_rows),
            v=linear(f"{p}attn_v", cfg.qkv_bias), o=linear(f"{p}attn_output", cfg.o_bias),
            q_norm=norm(f"{p}attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm(f"{p}attn_k_norm.weight") if cfg.qk_norm else None,
        )
        mlp = MlpWeights(gate=linear(f"{p}ffn_gate", cfg.mlp_bias), up=linear(f"{p}ffn_up", cfg.mlp_bias),
                         down=linear(f"{p}ffn_down", cfg.mlp_bias))
        if gemma:
            layers.append(LayerWeights(
                input_norm=norm(f"{p}attn_norm.weight"), attn=attn, post_attention_norm=norm(f"{p}post_attention_norm.weight"),
                mlp=mlp, pre_feedforward_norm=norm(f"{p}ffn_norm.weight"),
                post_feedforward_norm=norm(f"{p}post_ffw_norm.weight"),
            ))
        else:
            layers.append(LayerWeights(input_norm=norm(f"{p}attn_norm.weight"), attn=attn,
                                       post_attention_norm=norm(f"{p}ffn_norm.weight"), mlp=mlp))
        progress.report("weights", len(layers), len(cfg.layers))
    embed = _matrix(t["token_embd.weight"], None, layout, g.release)
    lm_head = embed if cfg.tie_word_embeddings else _matrix(t["output.weight"], None, layout, g.release)
    return ModelWeights(embed=embed, layers=layers, final_norm=norm("output_norm.weight"), lm_head=lm_head,
                        fingerprint=checkpoint_fingerprint(g.path))


def quant_mix(g: GgufFile) -> dict[str, int]:
    """Tensor count per ggml type name, e.g. {"Q4_K": 27, "F32": 109}."""
    out: dict[str, int] = {}
    for tensor in g.tensors.values():
        out[tensor.type_name] = out.get(tensor.type_name, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def parameter_count(g: GgufFile) -> int:
    """Weights in the file (a tied output is one tensor, counted once)."""
    return int(sum(np.prod(t.shape) for t in g.tensors.values()))

