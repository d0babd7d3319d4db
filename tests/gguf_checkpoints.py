"""Tiny GGUF files written with ggml-org's writer (`gguf` package), for fast tests.

The weights are random and stored in every type npud runs (F32, F16, BF16, Q8_0, Q4_0,
Q5_0 quantized from random floats by gguf itself; Q4_K, Q5_K, Q6_K as random blocks with
small scales), under llama.cpp's tensor names, with what llama.cpp's converter does to them
(llama q/k rows permuted for interleaved RoPE, Gemma norms stored as 1 + w). Tokenizers:
`gpt2` (byte-level BPE with merges, from tests/checkpoints.py's trained one) and `llama`
(a SentencePiece-style vocabulary with scores and byte tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
_K_QUANTS = {"Q4_K": (144, (0, 4)), "Q5_K": (176, (0, 4)), "Q6_K": (210, (208, 2))}


def _gpt2_vocab() -> tuple[list[str], list[str], list[int]]:
    from npud.engine.testing.checkpoints import _tokenizer_json

    model = json.loads(_tokenizer_json(320))["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return tokens, merges, types


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    words = ("def return the a of and to in is for print self value total import class while if else "
             "café naïve speculative decoding").split()
    pieces: list[str] = []
    for w in words:
        w = "\u2581" + w
        for n in range(2, min(len(w), 6) + 1):
            for i in range(len(w) - n + 1):
                if w[i:i + n] not in pieces:
                    pieces.append(w[i:i + n])
    chars = sorted({c for p in pieces for c in p})
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces
    scores = [0.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(chars) + len(pieces))]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (len(chars) + len(pieces))
    return tokens, scores, types


def _matrix(rng, type_name: str, n: int, k: int):
    """(array, raw_dtype) of a random [n, k] weight stored as `type_name`."""
    import gguf
    from gguf import GGMLQuantizationType as T

    w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
    if type_name == "F32":
        return w, None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in ("BF16", "Q8_0", "Q4_0", "Q5_0"):
        return gguf.quants.quantize(w, T[type_name]), T[type_name]
    size, (where, width) = _K_QUANTS[type_name]
    blocks = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    scales = rng.uniform(0.0005, 0.004, size=(blocks.shape[0], width // 2)).astype(np.float16)
    blocks[:, where:where + width] = scales.view(np.uint8)
    return blocks.reshape(n, -1), T[type_name]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (half-split RoPE rows -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_spm_vocabulary(w, tokens: list[str], scores: list[float], types: list[int], *, unk: bool, pad: bool) -> None:
    """A SentencePiece ("llama") vocabulary's metadata on GGUFWriter `w`: <s> = 2 (prepended to a
    raw prompt), </s> = 1, <unk> = 3 and <pad> = 0 when asked."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    if unk:
        w.add_unk_token_id(3)
    if pad:
        w.add_pad_token_id(0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, tokenizer: str | None = None, chat_template: str | None = None,
                    name: str | None = None, matrix_types: tuple[str, ...] = TYPES, **meta) -> Path:
    """A random arch ("llama", "qwen2", "qwen3", "gemma3") model; returns `path`.

    Hidden 256 and MLP 512 so every block type fits a row. The matrices take `matrix_types` in turn.
    `meta` adds or overrides {arch}.* metadata (a value None removes the key).
    """
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    tokenizer = tokenizer or ("llama" if arch in ("llama", "gemma3") else "gpt2")
    if tokenizer == "gpt2":
        tokens, merges, types = _gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
    else:
        tokens, scores, types = _spm_vocab()
        add_spm_vocabulary(w, tokens, scores, types, unk=True, pad=True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if name is not None:
        w.add_name(name)
    vocab, hidden, ffn, layers, heads, kv_heads, head_dim = len(tokens), 256, 512, 3, 4, 2, 64
    if arch == "qwen3":
        heads, kv_heads, head_dim = 2, 1, 128  # transformers reads qwen3 GGUFs with its default head_dim
    if arch == "gemma3":
        # transformers scales gemma3 GGUF scores by its default query_pre_attn_scalar (256),
        # llama.cpp by head_dim: the two agree when head_dim is 256, as in Gemma 3 1B..12B
        heads, kv_heads, head_dim = 2, 1, 256
    fields = {
        "context_length": 512, "embedding_length": hidden, "feed_forward_length": ffn, "block_count": layers,
        "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
        "attention.value_length": head_dim, "rope.dimension_count": head_dim, "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    if arch == "gemma3":
        fields["attention.sliding_window"] = 8
    fields.update(meta)
    for key, value in fields.items():
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_uint32(full, value)
    kinds = iter(matrix_types * 400)

    def add(name, n, k, permute_heads=None):
        type_name = next(kinds)
        data, raw = _matrix(rng, type_name, n, k)
        if permute_heads:
            data = _permute(data, permute_heads)
        w.add_tensor(name, data, raw_dtype=raw)

    def vec(name, n, around=1.0):
        w.add_tensor(name, (around + 0.2 * rng.standard_normal(n)).astype(np.float32))

    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        llama = arch == "llama"
        add(p + "attn_q.weight", heads * head_dim, hidden, heads if llama else None)
        add(p + "attn_k.weight", kv_heads * head_dim, hidden, kv_heads if llama else None)
        add(p + "attn_v.weight", kv_heads * head_dim, hidden)
        add(p + "attn_output.weight", hidden, heads * head_dim)
        if arch == "qwen2":
            for name, n in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim), ("attn_v", kv_heads * head_dim)):
                vec(p + name + ".bias", n, 0.0)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        vec(p + "attn_norm.weight", hidden)
        vec(p + "ffn_norm.weight", hidden)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", hidden)
            vec(p + "post_ffw_norm.weight", hidden)
        add(p + "ffn_gate.weight", ffn, hidden)
        add(p + "ffn_up.weight", ffn, hidden)
        add(p + "ffn_down.weight", hidden, ffn)
    vec("output_norm.weight", hidden)
    if arch != "gemma3":
        add("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
