"""Gemma 3 (text) on the host engine against transformers fp32, on tiny random checkpoints.

Two configs, both built and saved by transformers itself (tests/checkpoints.py's pattern:
a large init std and norms spread around 0, which Gemma 3 scales by (1 + w)):
- 6 layers, five sliding (window 8 < the 32-token prompt) then one full, per-type RoPE
  theta, query_pre_attn_scalar != head_dim, 4 heads over 2 KV heads;
- the legacy form: rope_theta + rope_local_base_freq + linear rope_scaling on the full
  layers, layer_types from sliding_window_pattern, final logit softcapping.
Tolerance as tests/test_forward.py: max |ours - transformers| <= 1e-4 x max |logit| over
the prompt's 32 positions, and 32 identical greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from npud.engine.testing.checkpoints import load_reference, write_tokenizer
from npud.engine.config import AttentionKind, ConfigError, parse_config
from npud.engine.forward import Forward
from npud.engine.model import Model

VOCAB = 320
PROMPT = [(i * 37 + 11) % VOCAB for i in range(32)]

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=256,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
LEGACY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, sliding_window=6, sliding_window_pattern=2, rope_theta=50000.0,
    rope_local_base_freq=5000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=20.0,
    max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
CONFIGS = {"base": BASE, "legacy": LEGACY}


def build_gemma3_checkpoint(out_dir, config: dict, seed: int = 0, init_std: float = 0.15):
    """Save a random transformers Gemma3ForCausalLM with a tokenizer; returns the directory."""
    cfg = transformers.Gemma3TextConfig(**config)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))  # (1 + w): around 1
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {name: build_gemma3_checkpoint(root / name, cfg) for name, cfg in CONFIGS.items()}


def test_config_reads_layer_types_ropes_and_scale(ckpts):
    cfg = Model.load(ckpts["base"], "fp32").config
    assert [l.kind for l in cfg.layers] == [AttentionKind.SLIDING] * 5 + [AttentionKind.FULL]
    assert [l.window for l in cfg.layers] == [8] * 5 + [0]
    assert cfg.layers[0].rope.theta == 10000.0 and cfg.layers[5].rope.theta == 100000.0
    assert cfg.layers[0].scale == 24**-0.5
    assert cfg.embed_scale == 64**0.5 and cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms
    legacy = Model.load(ckpts["legacy"], "fp32").config
    assert [l.kind for l in legacy.layers] == [AttentionKind.SLIDING, AttentionKind.FULL] * 2
    assert legacy.layers[1].rope.scaling == "linear" and legacy.layers[1].rope.factor == 4.0
    assert legacy.layers[0].rope.scaling == "default" and legacy.layers[0].rope.theta == 5000.0
    assert legacy.final_logit_softcapping == 20.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_match_transformers(ckpts, name):
    model = Model.load(ckpts[name], "fp32")
    ref = load_reference(ckpts[name])
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0].numpy()
        generated = ref.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(PROMPT):].tolist()
    got = Forward(model).step_batch_all(PROMPT, 0)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    f = Forward(model)
    logits = f.prefill(PROMPT)
    ours = []
    for _ in range(32):
        ours.append(int(np.argmax(logits)))
        logits = f.step(ours[-1], f.positions_held)
    assert ours == generated


@pytest.mark.parametrize(
    "override, words",
    [
        ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ({"hidden_activation": "relu"}, ["hidden_activation", "relu"]),
        ({"layer_types": ["chunked_attention"] * 6}, ["layer_types[0]"]),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                              "sliding_attention": {"rope_type": "default"}}}, ["yarn"]),
    ],
)
def test_unsupported_fields_are_config_errors(override, words):
    raw = {"model_type": "gemma3_text", **BASE, **override}
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    for word in words:
        assert word in str(info.value)


def test_multimodal_wrapper_reads_its_text_config():
    raw = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", **BASE}, "eos_token_id": [1, 106]}
    cfg = parse_config(raw)
    assert cfg.weight_prefix == "model.language_model." and cfg.eos_token_ids == (1, 106)
