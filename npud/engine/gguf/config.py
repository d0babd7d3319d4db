"""A GGUF file's metadata read as the config.json transformers would build from it.

The metadata is mapped to a config.json dict (keys as transformers' GGUF loader maps them)
and that dict goes through npud.engine.config.parse_config, so a GGUF model is validated by the
same code as a safetensors one. Architectures: llama (mistral when general.name says so,
as transformers decides), qwen2, qwen3, gemma3; any other is refused by name.
"""

from __future__ import annotations

from typing import Any

from npud.engine.config import ConfigError, ModelConfig, parse_config
from npud.engine.gguf.reader import GgufFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# {arch}.<key> -> config.json field, for every supported architecture
_FIELDS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
}
_TOKEN_FIELDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
                 "tokenizer.ggml.padding_token_id": "pad_token_id"}


def gguf_model_type(g: GgufFile) -> str:
    """The transformers model_type of the file; raises ConfigError for an unsupported architecture."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{g.path}: general.architecture = {arch!r}: GGUF architecture not supported; "
            f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
        )
    name = g.metadata.get("general.name")
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        return "mistral"  # llama.cpp writes Mistral models as llama
    return "gemma3_text" if arch == "gemma3" else arch


def gguf_config_dict(g: GgufFile) -> dict[str, Any]:
    """The config.json dict of a GGUF file. Raises ConfigError for an unsupported architecture
    or RoPE scaling."""
    model_type = gguf_model_type(g)
    arch = g.architecture
    raw: dict[str, Any] = {"model_type": model_type}
    for key, field in _FIELDS.items():
        value = g.arch_field(key)
        if value is not None:
            raw[field] = value
    for key, field in _TOKEN_FIELDS.items():
        if g.metadata.get(key) is not None:
            raw[field] = g.metadata[key]
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError(f"{g.path}: tensor 'token_embd.weight' is missing")
    raw["vocab_size"] = embed.shape[0]
    raw["tie_word_embeddings"] = "output.weight" not in g.tensors
    if "rope_freqs.weight" in g.tensors:
        raise ConfigError(f"{g.path}: tensor 'rope_freqs.weight' (llama3 RoPE frequency factors) is not supported")
    scaling = g.arch_field("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"{g.path}: {arch}.rope.scaling.type = {scaling!r}: only 'linear' RoPE scaling is supported")
        raw["rope_scaling"] = {"rope_type": "linear", "factor": g.arch_field("rope.scaling.factor")}
    if model_type in ("llama", "mistral"):
        raw["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        raw["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
        raw.pop("sliding_window", None)
    elif model_type in ("qwen2", "qwen3"):
        raw.pop("sliding_window", None)  # llama.cpp runs qwen2/qwen3 with full attention
        if model_type == "qwen3":
            raw["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    else:  # gemma3_text, llama.cpp's reading: every 6th layer full
        raw["rope_local_base_freq"] = 10_000.0
        # llama.cpp's gemma3: scores scaled by head_dim ** -0.5, except the 27B (62 layers),
        # scaled by (hidden / heads) ** -0.5 as its query_pre_attn_scalar says
        if raw.get("num_hidden_layers") == 62 and raw.get("hidden_size") and raw.get("num_attention_heads"):
            raw["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"]
        else:
            raw["query_pre_attn_scalar"] = raw.get("head_dim", 256)
        raw["hidden_activation"] = "gelu_pytorch_tanh"
    return raw


def gguf_config(g: GgufFile) -> ModelConfig:
    """The ModelConfig of a GGUF file; raises ConfigError."""
    return parse_config(gguf_config_dict(g), source=f"{g.path} (GGUF metadata)")
