"""Random Gemma 4 base + assistant pairs built by transformers, and an independent reference of
what the assistant should draft, for tests/test_assistant*.py and bench/speculative.py."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from npud.engine.assistant import draft_step
from npud.engine.config import AttentionKind
from npud.engine.forward import Forward

VOCAB = 320
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, attention_k_eq_v=True,
    use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=512,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100000.0},
    },
    pad_token_id=0, eos_token_id=0, bos_token_id=None,
)
# the assistant's text stack: narrower than the base (32 vs 64), its own heads, the base's KV
# geometry per kind (sliding 1 x 16, full 2 x 32); window 6 != the base's 8
ASSISTANT_TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
    sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=512,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100000.0},
    },
    pad_token_id=0, eos_token_id=0, bos_token_id=None,
)


def _spread(model, gen) -> None:
    """Norm weights around 1 and layer scalars != 1, so a wrong norm form shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(0.6 + 0.8 * torch.rand(buf.shape, generator=gen))


def build_base(out_dir, seed: int = 0, dtype=torch.float32, **overrides):
    """Save a random Gemma 4 text model (tests/test_hybrid_models.py's shape); returns the directory."""
    from npud.engine.testing.checkpoints import write_tokenizer

    config = transformers.Gemma4TextConfig(**{**BASE, **overrides})
    config.initializer_range = 0.15
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).eval()
    _spread(model, torch.Generator().manual_seed(seed + 1))
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


def build_assistant(out_dir, seed: int = 0, ordered: bool = False, dtype=torch.float32, backbone: int = 64,
                    num_centroids: int = 16, top_k: int = 4, **text_overrides):
    """Save a random Gemma4AssistantForCausalLM for a BASE-shaped base; returns the directory."""
    text = transformers.Gemma4TextConfig(**{**ASSISTANT_TEXT, **text_overrides})
    config = transformers.Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=backbone, use_ordered_embeddings=ordered,
        num_centroids=num_centroids, centroid_intermediate_top_k=top_k,
    )
    config.initializer_range = 0.15
    config.text_config.initializer_range = 0.15
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    _spread(model, gen)
    if ordered:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=gen))
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def last_owner(config, kind: AttentionKind) -> int:
    """The base layer whose plane a `kind` assistant layer reads, found here independently of
    npud.engine.assistant: the highest-numbered layer of that kind that owns its KV."""
    return max(s.index for s in config.layers if s.kind is kind and s.kv_owner == s.index)


def reference_kv(forward: Forward) -> dict:
    """{kind: (keys, values)} of the base's last owning full and sliding planes (copies)."""
    cfg = forward.config
    out = {}
    for kind in (AttentionKind.FULL, AttentionKind.SLIDING):
        plane = forward.state.planes[last_owner(cfg, kind)]
        out[kind] = (plane.keys().copy(), plane.values().copy())
    return out


def reference_chain(assistant, stream: list[int], tokens: list[int], two_pass: bool) -> list[np.ndarray]:
    """The logits of every step of a draft after `stream` (ending with t1, at p), recomputed from
    scratch: a fresh base prefilled with stream[:p] (stream for two_pass) gives the hidden rows
    and planes, and the chain is run with the drafted `tokens` fed back."""
    p = len(stream) - 1
    f = Forward(assistant.base)
    f.prefill(stream if two_pass else stream[:-1])
    rows = f.last_hidden_rows()
    before = rows[-2] if two_pass else rows[-1]  # row p - 1
    kv = reference_kv(f)
    logits, state = draft_step(assistant, stream[-1], before, p, kv, p)
    out = [logits]
    at = kv_len = p
    for i in range(1, len(tokens)):
        if two_pass and i == 1:
            logits, state = draft_step(assistant, tokens[0], rows[-1], p + 1, kv, p + 1)
            at = kv_len = p + 1
        else:
            logits, state = draft_step(assistant, tokens[i - 1], state, at, kv, kv_len)
        out.append(logits)
    return out
