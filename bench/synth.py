"""Deterministic random checkpoints for benchmarks, built offline (no hub), cached on disk.

`qwen3_0p5b` is Qwen3-shaped: hidden 1024, 28 layers, 16 query heads, 8 KV heads of 128,
MLP 3072, vocabulary 65536, tied embeddings: 0.50B parameters, about 1.0 GB in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "bench" / "out"

QWEN3_0P5B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=65536,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    eos_token_id=0,
    bos_token_id=None,
    dtype="bfloat16",
)


def build_random_checkpoint(name: str, config: dict, seed: int = 0, std: float = 0.02) -> Path:
    """Write config.json + model.safetensors (bf16) + a test tokenizer under bench/out/NAME once."""
    import torch
    from safetensors.torch import save_file

    from npud.engine.testing.checkpoints import write_tokenizer

    out = OUT / name
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, h, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rnd(v, d), "model.norm.weight": norm(d)}
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rnd(v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rnd(h * hd, d),
            p + "self_attn.k_proj.weight": rnd(kv * hd, d),
            p + "self_attn.v_proj.weight": rnd(kv * hd, d),
            p + "self_attn.o_proj.weight": rnd(d, h * hd),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": rnd(f, d),
            p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f),
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    done.write_text("ok\n")
    return out



def build_random_dflash(name: str, base_config: dict, layers: int = 2, seed: int = 0, std: float = 0.02) -> Path:
    """A random DFlash draft (`layers` layers, the base's geometry, tapping the base's layers as
    the reference spreads them) for a checkpoint of `base_config`, under bench/out/NAME once."""
    from npud.engine.testing.checkpoints import write_random_dflash

    out = OUT / name
    done = out / ".complete"
    if done.exists():
        return out
    geometry = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings")
    raw = {k: base_config[k] for k in geometry}
    raw |= dict(model_type="qwen3", architectures=["DFlashDraftModel"], num_hidden_layers=layers,
                num_target_layers=base_config["num_hidden_layers"], dflash_config={"mask_token_id": 1})
    write_random_dflash(out, raw, seed=seed, std=std)
    done.write_text("ok\n")
    return out

# Gemma4-shaped: hidden 1024, 15 layers (sliding:full 4:1, window 512), 8 query heads, sliding
# KV 1 x 128, full KV 1 x 256 with keys as values, the last 5 layers KV-shared with a
# double-wide MLP, per-layer inputs of 128, softcapping 30, vocabulary 65536 tied: ~0.39B
# parameters (0.13B of them the per-layer embedding table).
GEMMA4_0P4B = dict(
    vocab_size=65536, hidden_size=1024, intermediate_size=3072, num_hidden_layers=15, num_attention_heads=8,
    num_key_value_heads=1, head_dim=128, global_head_dim=256, num_global_key_value_heads=1,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 3,
    attention_k_eq_v=True, sliding_window=512, num_kv_shared_layers=5, use_double_wide_mlp=True,
    hidden_size_per_layer_input=128, vocab_size_per_layer_input=65536, final_logit_softcapping=30.0,
    max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=0, bos_token_id=None, pad_token_id=0,
)

# Qwen3.5-shaped: hidden 1024, 16 layers (3 GDN : 1 full), full attention 8 heads x 256 with
# 2 KV heads and an output gate, GDN 16 key / 16 value heads of 128, conv 4, MLP 3072,
# vocabulary 65536 tied: ~0.37B parameters.
QWEN3_5_0P4B = dict(
    vocab_size=65536, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
    max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=0, bos_token_id=None, pad_token_id=0,
)


def build_transformers_checkpoint(name: str, arch: str, config: dict, seed: int = 0) -> Path:
    """Write a random gemma4_text / qwen3_5_text model (transformers' own init, bf16) and a test
    tokenizer under bench/out/NAME once; transformers writes what its loader reads."""
    import torch
    import transformers

    from npud.engine.testing.checkpoints import write_tokenizer

    out = OUT / name
    done = out / ".complete"
    if done.exists():
        return out
    classes = {
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    done.write_text("ok\n")
    return out
