"""npud.engine.config against configs written by transformers itself, and every ConfigError case."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from npud.engine.config import (
    AttentionKind,
    ConfigError,
    LayerSpec,
    ModelConfig,
    RopeSpec,
    load_config,
    parse_config,
)

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2,
)

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def saved(tmp_path, model_type, **overrides):
    """Saves a transformers config with save_pretrained; returns (dir, the reloaded config)."""
    cls = CONFIG_CLASSES[model_type]
    cls(**{**TINY, **overrides}).save_pretrained(tmp_path)
    return tmp_path, cls.from_pretrained(tmp_path)


def raw_config(model_type="llama", **overrides):
    raw = {
        "model_type": model_type, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not ...}


def ulps(a, b):
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def reference_inv_freq(hf_config):
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        base = hf_config.rope_parameters["rope_theta"]
        dim = hf_config.head_dim
        return (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).numpy()
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)[0].numpy()


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_saved_by_transformers_matches_the_model_it_builds(tmp_path, model_type):
    overrides = {"head_dim": 16} if model_type == "qwen3" else {}
    if model_type == "qwen2":
        overrides = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    directory, hf = saved(tmp_path, model_type, **overrides)
    cfg = load_config(directory)

    assert cfg.model_type == model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (300, 64, 128, 3)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings

    # the model transformers builds from this config is the ground truth for biases and norms
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf)
    for spec, layer in zip(cfg.layers, model.model.layers, strict=True):
        attn = layer.self_attn
        assert spec.num_heads * spec.head_dim == attn.q_proj.out_features
        assert spec.kv_width == attn.k_proj.out_features == attn.v_proj.out_features
        assert spec.head_dim == attn.head_dim
        assert spec.owns_kv and spec.kv_owner == spec.index
        expected_window = attn.sliding_window if hasattr(attn, "sliding_window") else None
        if model_type == "mistral":
            expected_window = hf.sliding_window
        assert spec.window == (expected_window or 0)
        assert spec.kind is (AttentionKind.SLIDING if expected_window else AttentionKind.FULL)
        assert cfg.qkv_bias == (attn.q_proj.bias is not None) == (attn.k_proj.bias is not None)
        assert cfg.o_bias == (attn.o_proj.bias is not None)
        assert cfg.mlp_bias == (layer.mlp.gate_proj.bias is not None)
        assert cfg.qk_norm == hasattr(attn, "q_norm")
        assert ulps(spec.rope.inv_freq(), model.model.rotary_emb.inv_freq.numpy()) <= 1
    json.dumps(cfg.describe())


def test_qwen2_window_only_from_max_window_layers_on(tmp_path):
    directory, _ = saved(tmp_path, "qwen2", num_hidden_layers=4, use_sliding_window=True,
                         sliding_window=8, max_window_layers=2)
    cfg = load_config(directory)
    assert [layer.kind for layer in cfg.layers] == [AttentionKind.FULL] * 2 + [AttentionKind.SLIDING] * 2
    assert [layer.window for layer in cfg.layers] == [0, 0, 8, 8]


def test_qwen2_sliding_switched_off_means_full_everywhere():
    raw = raw_config("qwen2", use_sliding_window=False, sliding_window=8,
                     layer_types=["full_attention", "sliding_attention"])
    assert [layer.window for layer in parse_config(raw).layers] == [0, 0]
    raw = raw_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert [layer.window for layer in parse_config(raw).layers] == [8, 8]


def test_mistral_null_window_is_full_attention():
    cfg = parse_config(raw_config("mistral", sliding_window=None))
    assert all(layer.kind is AttentionKind.FULL and layer.window == 0 for layer in cfg.layers)
    cfg = parse_config(raw_config("mistral", sliding_window=5))
    assert all(layer.kind is AttentionKind.SLIDING and layer.window == 5 for layer in cfg.layers)


def test_llama_attention_and_mlp_bias_flags():
    cfg = parse_config(raw_config(attention_bias=True, mlp_bias=True))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (True, True, True)
    cfg = parse_config(raw_config("qwen3", attention_bias=True, head_dim=16))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (True, True, False, True)


def test_head_dim_from_config_or_derived():
    assert parse_config(raw_config(head_dim=32)).layers[0].head_dim == 32
    assert parse_config(raw_config()).layers[0].head_dim == 16
    # Qwen3Config's own default, not hidden // heads
    assert parse_config(raw_config("qwen3")).layers[0].head_dim == 128


ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 8192},
]


@pytest.mark.parametrize("scaling", ROPE_CASES, ids=["default", "linear", "llama3", "llama3-long"])
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 1234567.5])
def test_inv_freq_as_transformers_computes_it(tmp_path, scaling, theta):
    directory, hf = saved(tmp_path, "llama", hidden_size=512, num_attention_heads=4, rope_theta=theta,
                          rope_scaling=copy.deepcopy(scaling), max_position_embeddings=131072)
    rope = load_config(directory).layers[0].rope
    reference = reference_inv_freq(hf)
    mine = rope.inv_freq()
    assert mine.dtype == np.float32 and mine.shape == (64,)
    assert ulps(mine, reference) <= 2
    # given torch's unscaled frequencies, the scaling step is bit-identical
    dim = rope.rotary_dim
    base = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).numpy()
    if rope.scaling == "linear":
        assert np.array_equal(base / np.float32(rope.factor), reference)
    elif rope.scaling == "llama3":
        assert np.array_equal(rope._llama3(base), reference)
        assert not np.array_equal(rope._llama3(base), base)


def test_old_and_new_rope_forms_agree():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = parse_config(raw_config(rope_theta=500000.0, rope_scaling=scaling))
    new = parse_config(raw_config(rope_theta=..., rope_parameters={**scaling, "rope_theta": 500000.0}))
    assert old.layers[0].rope == new.layers[0].rope
    assert old.layers[0].rope == RopeSpec(theta=500000.0, rotary_dim=16, scaling="llama3", factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    legacy_key = parse_config(raw_config(rope_scaling={"type": "linear", "factor": 4.0}))
    assert legacy_key.layers[0].rope.scaling == "linear" and legacy_key.layers[0].rope.factor == 4.0
    # no theta anywhere: transformers' default
    assert parse_config(raw_config(rope_theta=...)).layers[0].rope.theta == 10000.0


def test_llama3_original_max_defaults_to_max_position():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = parse_config(raw_config(rope_scaling=scaling, max_position_embeddings=4096))
    assert cfg.layers[0].rope.original_max_position == 4096


def test_eos_merged_with_generation_config_and_bos_pad():
    cfg = parse_config(raw_config(eos_token_id=[2, 3], bos_token_id=1), {"eos_token_id": 7, "pad_token_id": 0})
    assert cfg.eos_token_ids == (2, 3, 7)
    assert (cfg.bos_token_id, cfg.pad_token_id) == (1, 0)
    cfg = parse_config(raw_config(eos_token_id=4), {"eos_token_id": [4, 5], "bos_token_id": 9})
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((4, 5), 9)
    assert parse_config(raw_config()).eos_token_ids == ()


def test_load_config_reads_generation_config(tmp_path):
    directory, _ = saved(tmp_path, "llama", eos_token_id=2)
    transformers.GenerationConfig(eos_token_id=[6, 2]).save_pretrained(directory)
    assert load_config(directory).eos_token_ids == (2, 6)


def test_dtype_both_spellings():
    assert parse_config(raw_config(dtype="bfloat16")).torch_dtype == "bfloat16"
    assert parse_config(raw_config(torch_dtype="float16")).torch_dtype == "float16"
    assert parse_config(raw_config()).torch_dtype is None


def test_frozen():
    cfg = parse_config(raw_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layers[0].window = 3


def error_of(raw, generation=None):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, generation, source="x/config.json")
    return str(info.value)


@pytest.mark.parametrize("field", ["model_type", "vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads"])
def test_missing_required_field(field):
    message = error_of(raw_config(**{field: ...}))
    assert field in message and "x/config.json" in message and "missing" in message


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"model_type": "gpt2"}, ["model_type", "gpt2"]),
        ({"hidden_size": "64"}, ["hidden_size", "'64'"]),
        ({"vocab_size": True}, ["vocab_size", "True"]),
        ({"num_hidden_layers": 2.0}, ["num_hidden_layers", "2.0"]),
        ({"hidden_size": 0}, ["hidden_size", "0"]),
        ({"intermediate_size": -5}, ["intermediate_size", "-5"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads", "3"]),
        ({"num_attention_heads": 3}, ["num_attention_heads", "3"]),
        ({"head_dim": 15}, ["head_dim", "15"]),
        ({"rms_norm_eps": -1e-6}, ["rms_norm_eps", "-1e-06"]),
        ({"rms_norm_eps": float("nan")}, ["rms_norm_eps", "nan"]),
        ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
        ({"tie_word_embeddings": "yes"}, ["tie_word_embeddings", "yes"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_type", "yarn"]),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_type", "dynamic"]),
        ({"rope_scaling": {"rope_type": "linear"}}, ["factor", "missing"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, ["factor", "0"]),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                           "high_freq_factor": 4.0}}, ["high_freq_factor", "4.0"]),
        ({"rope_scaling": "linear"}, ["rope_scaling", "linear"]),
        ({"rope_theta": 0}, ["rope_theta", "0"]),
        ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor", "0.5"]),
        ({"eos_token_id": "</s>"}, ["eos_token_id", "</s>"]),
        ({"bos_token_id": -1}, ["bos_token_id", "-1"]),
        ({"dtype": 16}, ["dtype", "16"]),
        ({"model_type": "mistral", "sliding_window": 0}, ["sliding_window", "0"]),
    ],
)
def test_config_errors_name_field_and_value(overrides, names):
    message = error_of(raw_config(**overrides))
    assert "x/config.json" in message
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    "layer_types, names",
    [
        (["full_attention", "linear_attention"], ["layer_types[1]", "linear_attention"]),
        (["full_attention"], ["layer_types"]),
        ("full_attention", ["layer_types"]),
    ],
)
def test_layer_types_errors(layer_types, names):
    message = error_of(raw_config("qwen3", head_dim=16, layer_types=layer_types))
    for name in names:
        assert name in message


def test_generation_config_errors():
    assert "generation_config.json" in error_of(raw_config(), {"eos_token_id": [1, "x"]})
    assert "generation_config.json" in error_of(raw_config(), ["not", "a", "dict"])
    assert "must be a JSON object" in error_of(["config"])


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json: no such file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw_config(hidden_size=-1)))
    with pytest.raises(ConfigError, match=r"config\.json: hidden_size = -1"):
        load_config(tmp_path)


def rope16(**kw):
    return RopeSpec(theta=10000.0, rotary_dim=16, **kw)


def layer(**kw):
    args = dict(index=0, kind=AttentionKind.FULL, num_heads=4, num_kv_heads=2, head_dim=16, window=0,
                kv_owner=0, rope=rope16())
    args.update(kw)
    return LayerSpec(**args)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"window": 4}, "window"),
        ({"kind": AttentionKind.SLIDING}, "window"),
        ({"window": -1}, "window"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_heads": 0}, "num_heads"),
        ({"kv_owner": 1}, "kv_owner"),
        ({"index": 2, "kv_owner": -1}, "kv_owner"),
        ({"head_dim": 8}, "rotary_dim"),
        ({"kind": "full_attention"}, "kind"),
    ],
)
def test_layer_spec_validation(kw, name):
    with pytest.raises(ConfigError, match=name):
        layer(**kw)


def test_layer_spec_properties():
    spec = layer(index=3, kv_owner=1)
    assert spec.kv_width == 32 and not spec.owns_kv
    assert layer(kind=AttentionKind.SLIDING, window=4).window == 4


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"scaling": "yarn"}, "scaling"),
        ({"factor": 0.0}, "factor"),
        ({"scaling": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
        ({"original_max_position": 0}, "original_max_position"),
    ],
)
def test_rope_spec_validation(kw, name):
    with pytest.raises(ConfigError, match=name):
        rope16(**kw)
    with pytest.raises(ConfigError, match="rotary_dim"):
        RopeSpec(theta=1e4, rotary_dim=7)
    with pytest.raises(ConfigError, match="theta"):
        RopeSpec(theta=float("inf"), rotary_dim=8)


def test_model_config_validation():
    good = parse_config(raw_config())
    with pytest.raises(ConfigError, match="hidden_act"):
        dataclasses.replace(good, hidden_act="relu")
    with pytest.raises(ConfigError, match=r"layers\[0\]"):
        dataclasses.replace(good, layers=(good.layers[1],))
    with pytest.raises(ConfigError, match="layers"):
        dataclasses.replace(good, layers=())
    with pytest.raises(ConfigError, match="eos_token_ids"):
        dataclasses.replace(good, eos_token_ids=[1])
    with pytest.raises(ConfigError, match="model_type"):
        dataclasses.replace(good, model_type="gemma")
    assert isinstance(good, ModelConfig) and good.num_layers == 2


def test_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    raw = raw_config(rope_theta=5000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                     rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 7000.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.LlamaConfig.from_pretrained(tmp_path)
    rope = load_config(tmp_path).layers[0].rope
    assert (rope.scaling, rope.factor, rope.theta) == (
        hf.rope_parameters["rope_type"], hf.rope_parameters["factor"], hf.rope_parameters["rope_theta"])
    assert (rope.factor, rope.theta) == (2.0, 5000.0)
