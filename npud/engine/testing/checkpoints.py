"""Tiny checkpoints built on the fly: a trained byte-level BPE tokenizer and random models
saved by transformers itself, so the loader reads exactly what the reference writes.

Everything is deterministic under its seed and small enough to build in about a second.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# fill-in-the-middle tokens a test tokenizer can be given (npud/engine/fim.py), appended after the
# trained vocabulary: "qwen" as Qwen2.5-Coder (with a file separator), "starcoder" without one
FIM_TOKENS = {
    "qwen": ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
    "starcoder": ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"],
}

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello, ' + name)\n",
    "for i in range(10):\n    total += i * i\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. ",
    "Speculative decoding drafts tokens and verifies them in one batched pass. ",
    "naïve café — 東京 🙂 résumé ",
] * 20


@lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def write_tokenizer(out_dir: Path, vocab_size: int = 320, fim: str | None = None) -> None:
    """tokenizer.json (byte-level BPE), tokenizer_config.json with a ChatML template; with
    `fim` (a key of FIM_TOKENS) those special tokens follow the trained ids."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json(vocab_size)
    if fim is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(text)
        tok.add_special_tokens(FIM_TOKENS[fim])
        text = tok.to_str()
    (out_dir / "tokenizer.json").write_text(text)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )


_BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)


def build_tiny_checkpoint(
    out_dir: Path,
    model_type: str = "qwen3",
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.2,
    fim: str | None = None,
    **overrides,
) -> Path:
    """Save a random transformers model of `model_type` (llama, mistral, qwen2, qwen3) with a tokenizer
    (with the FIM tokens FIM_TOKENS[fim], and embedding rows for them, when `fim` is given).

    `init_std` is larger than transformers' default so that logits are spread and greedy
    choices are decided by clear margins (parity tests compare argmax sequences).
    Returns the checkpoint directory.
    """
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    params = dict(_BASE)
    if fim is not None:
        params["vocab_size"] += len(FIM_TOKENS[fim])
    if model_type == "qwen3":
        params["head_dim"] = 32
    params.update(overrides)
    config = config_cls(**params)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # norms start at 1.0 in transformers; give them spread so a norm bug shows
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    out_dir = Path(out_dir)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, vocab_size=min(params["vocab_size"], 320), fim=fim)
    return out_dir


def load_reference(ckpt: Path, dtype: str = "float32"):
    """The transformers model for a checkpoint directory, on the CPU in eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    return model.eval()


def write_random_dflash(out: Path, raw: dict, seed: int = 0, std: float = 0.2, bare_codebooks: bool = True) -> Path:
    """A random DFlash / DFlash 2 draft in the published layout, for the config.json `raw` (the
    reference's save_pretrained shape: geometry, num_target_layers, dflash_config), written
    without the reference; the DFlash 2 codebooks under their bare names unless
    `bare_codebooks` is false, as the published checkpoints store them."""
    import numpy as np
    from safetensors.numpy import save_file

    from npud.engine.dflash import Variant, parse_dflash_config

    rng = np.random.default_rng(seed)
    cfg = parse_dflash_config(raw)
    d, v = cfg.model.hidden_size, cfg.model.vocab_size
    spec = cfg.model.layers[0]
    q, kv = spec.num_heads * spec.head_dim, spec.kv_width

    def mat(n, k):
        return (rng.standard_normal((n, k)) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    f = cfg.model.intermediate_size
    t = {"fc.weight": mat(d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(len(cfg.model.layers)):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": mat(q, d), p + "self_attn.k_proj.weight": mat(kv, d),
              p + "self_attn.v_proj.weight": mat(kv, d), p + "self_attn.o_proj.weight": mat(d, q),
              p + "self_attn.q_norm.weight": norm(spec.head_dim), p + "self_attn.k_norm.weight": norm(spec.head_dim),
              p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
              p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d), p + "mlp.down_proj.weight": mat(d, f)}
        if cfg.variant is Variant.DFLASH2:
            for conv in ("attention_conv", "mlp_conv"):
                t[p + conv + ".base_kernel"] = (rng.standard_normal((2, cfg.conv_kernel_size, d)) * 0.5).astype(np.float32)
                t[p + conv + ".kernel_projection.weight"] = mat(2 * cfg.conv_kernel_size * cfg.conv_groups, d)
    if cfg.variant is Variant.DFLASH2:
        suffix = "" if bare_codebooks else ".weight"
        t["candidate_selector.hidden_projection.weight"] = mat(cfg.selector_rank, d)
        t["candidate_selector.predecessor_codebook" + suffix] = mat(v, cfg.selector_rank) * 5
        t["candidate_selector.successor_codebook" + suffix] = mat(v, cfg.selector_rank) * 5
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw))
    return out
