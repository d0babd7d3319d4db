"""The Gemma 4 assistant drafter (npud/engine/assistant/): loading, the draft forward against
transformers, and the head in the speculative loop.

Parity: draft_step against transformers' Gemma4AssistantForCausalLM fed the same base states
(the engine's planes of the base's last full and last sliding layer as `shared_kv_states`, the
base's row and embedding as `inputs_embeds`), with and without ordered embeddings, with the
base holding fewer and more rows than the assistant's sliding window: logits and projected
states within 1e-4 x their max |value| (measured: about 2e-6).

The loop: greedy output equals plain decode's for k = 1..8 in one-pass and two-pass rounds.
Those equalities hold whatever the head drafts (the verify decides), so the head is also run
with an oracle pick rule (always right, every fourth position wrong, always wrong) and every draft step's
logits must equal, bit for bit, the chain recomputed from scratch: a fresh base prefilled with
the committed stream, the row before t1 (and t1's row, two-pass), the planes found
independently (tests/assistant_fixtures.py). No round may fall back on a head error.

Mutants, applied one at a time, this file run, then restored (see the report in docs/assistant.md):
- the wrong row: commit_rows keeps the last rows of the pass, not its committed prefix;
- a KV plane of the wrong layer type: BaseKV.read hands each kind the other kind's plane;
- state not advanced after a partial accept: commit_rows ignores a pass not fully kept.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from assistant_fixtures import VOCAB, build_assistant, build_base, reference_chain, reference_kv
from decoding import greedy_run
from npud.engine.assistant import Assistant, AssistantHead, AssistantMismatchError, draft_step, load_assistant_config
from npud.engine.config import AttentionKind, ConfigError
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine.weights import WeightsError

PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, VOCAB, 20)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant")
    return {
        "base": build_base(root / "base"),
        "plain": build_assistant(root / "plain", seed=3),
        "ordered": build_assistant(root / "ordered", seed=4, ordered=True),
        "plain_bf16": build_assistant(root / "plain_bf16", seed=5, dtype=torch.bfloat16),
        # a second pair: a base without KV sharing (the planes read are layers 4 and 5), bf16
        "base2": build_base(root / "base2", seed=9, dtype=torch.bfloat16, num_kv_shared_layers=0),
        "second": build_assistant(root / "second", seed=11, ordered=True, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def base(ckpts):
    return Model.load(ckpts["base"], "fp32")


@pytest.fixture(scope="module")
def assistants(ckpts, base):
    return {name: Assistant.load(ckpts[name], base, "fp32") for name in ("plain", "ordered", "plain_bf16")}


def _reference(ckpt):
    transformers.logging.set_verbosity_error()
    return transformers.Gemma4AssistantForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def _as_shared_kv(kv: dict) -> dict:
    # ours [T, KVH, Dh] -> transformers' [batch, KVH, T, Dh]
    return {kind.value: tuple(torch.from_numpy(np.ascontiguousarray(a.transpose(1, 0, 2)))[None] for a in pair)
            for kind, pair in kv.items()}


# ------------------------------------------------------------------ the draft forward against transformers


@pytest.mark.parametrize("name", ["plain", "ordered", "plain_bf16"])
@pytest.mark.parametrize("held", [3, 7, 20])  # fewer rows than the window + 1 (7), exactly, more
def test_draft_step_matches_transformers(ckpts, base, assistants, name, held):
    a, ref = assistants[name], _reference(ckpts[name])
    f = Forward(base)
    f.prefill(PROMPT[:held])
    kv = reference_kv(f)
    hidden = f.last_hidden_rows()[-1]
    state = hidden
    for step, token in enumerate([17, 200, 45]):  # a short chain: each step's state feeds the next
        logits, projected = draft_step(a, token, state, held, kv, held)
        x = torch.from_numpy(np.concatenate([a.embed(token), state]))[None, None]
        with torch.no_grad():
            out = ref(inputs_embeds=x, position_ids=torch.tensor([[held]]), shared_kv_states=_as_shared_kv(kv))
        want_logits, want_state = out.logits[0, 0].numpy(), out.last_hidden_state[0, 0].numpy()
        assert np.abs(logits - want_logits).max() <= TOLERANCE * np.abs(want_logits).max(), (step, name)
        assert np.abs(projected - want_state).max() <= TOLERANCE * np.abs(want_state).max(), (step, name)
        assert int(np.argmax(logits)) == int(np.argmax(want_logits))
        state = projected


def test_ordered_embeddings_score_only_the_chosen_clusters(assistants, base):
    a = assistants["ordered"]
    f = Forward(base)
    f.prefill(PROMPT)
    logits, _ = draft_step(a, 9, f.last_hidden_rows()[-1], len(PROMPT), reference_kv(f), len(PROMPT))
    floor = logits.min()
    scored = np.count_nonzero(logits > floor)
    # 4 of 16 centroids, 20 tokens each (one of the scored may tie the floor's + 1 only by chance)
    assert scored == a.config.centroid_top_k * a.config.tokens_per_centroid


def test_int8_and_bf16_formats_draft(ckpts, base):
    ref = Assistant.load(ckpts["plain"], base, "fp32")
    f = Forward(base)
    f.prefill(PROMPT)
    args = (5, f.last_hidden_rows()[-1], len(PROMPT), reference_kv(f), len(PROMPT))
    want, _ = draft_step(ref, *args)
    for fmt in ("bf16", "int8"):
        got, _ = draft_step(Assistant.load(ckpts["plain"], base, fmt), *args)
        assert got.shape == want.shape and np.all(np.isfinite(got))
        assert np.corrcoef(got, want)[0, 1] > 0.99, fmt


def test_reads_the_last_owning_plane_of_each_kind(assistants):
    # layers 0..3 own their KV (4 and 5 share): the last sliding owner is 2, the last full 3
    assert dict(assistants["plain"].kv.layers) == {AttentionKind.SLIDING: 2, AttentionKind.FULL: 3}


def test_the_planes_are_read_in_place(assistants, base):
    f = Forward(base)
    f.prefill(PROMPT)
    read = assistants["plain"].kv.read(f.state)
    for kind, layer in assistants["plain"].kv.layers:
        assert np.shares_memory(read[kind][0], f.state.planes[layer].k)
        assert np.shares_memory(read[kind][1], f.state.planes[layer].v)


# ------------------------------------------------------------------ configuration and checkpoint errors


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    text = changes.pop("text", {})
    raw.update(changes)
    raw["text_config"].update(text)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("changes, words", [
    ({"model_type": "gemma4_text"}, ["model_type", "gemma4_assistant"]),
    ({"text": {"num_kv_shared_layers": 1}}, ["num_kv_shared_layers", "every layer"]),
    ({"text": {"hidden_size_per_layer_input": 8}}, ["hidden_size_per_layer_input", "0"]),
    ({"text": {"use_double_wide_mlp": True}}, ["use_double_wide_mlp"]),
    ({"use_ordered_embeddings": True, "num_centroids": 7}, ["num_centroids", "320"]),
    ({"backbone_hidden_size": "wide"}, ["backbone_hidden_size", "wide"]),
])
def test_bad_configs_name_the_field(ckpts, tmp_path, changes, words):
    bad = _edit_config(ckpts["plain"], tmp_path / "bad", **changes)
    with pytest.raises(ConfigError) as err:
        load_assistant_config(bad)
    for word in words:
        assert word in str(err.value)


def test_a_base_it_was_not_made_for_is_refused(ckpts, base, tmp_path):
    with pytest.raises(AssistantMismatchError, match="hidden size 48"):
        Assistant.load(_edit_config(ckpts["plain"], tmp_path / "width", backbone_hidden_size=48), base, "fp32")
    with pytest.raises(AssistantMismatchError, match="vocabulary has 400 tokens, the base's 320"):
        Assistant.load(_edit_config(ckpts["plain"], tmp_path / "vocab", text={"vocab_size": 400}), base, "fp32")
    geometry = _edit_config(ckpts["plain"], tmp_path / "heads", text={"num_key_value_heads": 2})
    with pytest.raises(AssistantMismatchError, match=r"\(sliding_attention\) reads 2 KV heads of 16.*holds 1 of 16"):
        Assistant.load(geometry, base, "fp32")


def test_a_non_gemma4_base_is_refused(ckpts, tmp_path):
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    qwen = Model.load(build_tiny_checkpoint(tmp_path / "qwen", model_type="qwen3"), "fp32")
    with pytest.raises(AssistantMismatchError, match="Gemma 4 base, not 'qwen3'"):
        Assistant.load(ckpts["plain"], qwen, "fp32")


def test_an_untrained_token_ordering_is_refused(ckpts, base, tmp_path):
    from safetensors.torch import load_file, save_file

    import shutil

    bad = tmp_path / "zeros"
    shutil.copytree(ckpts["ordered"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["masked_embedding.token_ordering"] = torch.zeros(VOCAB, dtype=torch.int64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="not a permutation"):
        Assistant.load(bad, base, "fp32")
    del tensors["pre_projection.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="pre_projection.weight"):
        Assistant.load(bad, base, "fp32")


# ------------------------------------------------------------------ the head in the loop


def _plain(base, n):
    return greedy_run(Forward(base), PROMPT, n)[0]


@pytest.fixture(scope="module")
def second_pair(ckpts):
    base2 = Model.load(ckpts["base2"], "bf16")
    return base2, Assistant.load(ckpts["second"], base2, "bf16")


def test_the_second_pair_reads_layers_4_and_5(second_pair):
    assert dict(second_pair[1].kv.layers) == {AttentionKind.SLIDING: 4, AttentionKind.FULL: 5}


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_greedy_equals_plain(base, assistants, second_pair, two_pass, k):
    n = 24
    pairs = [(base, assistants["plain"]), (base, assistants["ordered"]), second_pair]
    for model, assistant in pairs:
        want = _plain(model, n)
        f = Forward(model)
        head = AssistantHead(assistant, two_pass=two_pass)
        head.attach(f)
        got, stats = greedy_run(f, PROMPT, n, head=head, k=k)
        assert got == want, k
        assert f.positions_held == len(PROMPT) + n  # every emitted token was run, nothing more
        assert not stats.fallbacks
        assert stats.drafted > 0


class Oracle:
    """A pick rule that knows plain decode's stream: right unless the drafted position is one
    it is told to get wrong; it records every step's logits and every draft's context."""

    def __init__(self, stream: list[int], wrong) -> None:
        self.stream, self.wrong = stream, wrong
        self.logits: list[np.ndarray] = []

    def __call__(self, logits: np.ndarray, position: int) -> int:
        self.logits.append(np.array(logits))
        right = self.stream[position] if position < len(self.stream) else 0
        return (right + 1) % VOCAB if self.wrong(position) else right


PATTERNS = {"always_right": lambda p: False, "every_fourth_wrong": lambda p: p % 4 == 0, "always_wrong": lambda p: True}


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("k", [2, 5])
def test_every_draft_is_the_chain_recomputed_from_scratch(base, assistants, two_pass, pattern, k):
    n = 30
    stream = PROMPT + _plain(base, n)
    oracle = Oracle(stream, PATTERNS[pattern])
    a = assistants["ordered"]
    f = Forward(base)
    head = AssistantHead(a, two_pass=two_pass, pick=oracle)
    head.attach(f)
    drafts = []
    real_draft = head.draft

    def recording_draft(context, k):
        before = len(oracle.logits)
        draft = real_draft(context, k)
        drafts.append((list(context), list(draft.tokens), oracle.logits[before:]))
        return draft

    head.draft = recording_draft
    got, stats = greedy_run(f, PROMPT, n, head=head, k=k)
    assert got == stream[len(PROMPT):]
    assert not stats.fallbacks, stats.fallbacks[0].message
    assert [d for d in drafts if d[1]], "no draft was made"
    for context, tokens, logits in drafts:
        if not tokens:
            continue
        want = reference_chain(a, context, tokens, two_pass)
        assert len(logits) == len(tokens)
        for i, (mine, ref) in enumerate(zip(logits, want)):
            assert np.array_equal(mine, ref), f"draft at position {len(context) - 1}, step {i}"
    if pattern == "always_right":
        assert stats.accepted == stats.drafted
    elif pattern == "always_wrong":
        assert stats.accepted == 0
    else:
        assert 0 < stats.accepted < stats.drafted


def test_a_head_that_is_not_attached_falls_back_with_a_reason(base, assistants):
    from npud.engine.sampling import Sampler
    from npud.engine.api import SpecParams as SpeculativeConfig
    from npud.engine.speculative import DecodeStats, speculative_decode

    f = Forward(base)
    f.prefill(PROMPT[:-1])
    out, stats = [], DecodeStats()
    loop = speculative_decode(f, AssistantHead(assistants["plain"]), PROMPT, max_new_tokens=8, sampler=Sampler(),
                              on_token=out.append, stats=stats, config=SpeculativeConfig(k=4))
    for _ in loop:
        pass
    assert out == _plain(base, 8)
    assert stats.fallbacks and "not attached" in stats.fallbacks[0].message


def test_reset_serves_a_second_job(base, assistants):
    head = AssistantHead(assistants["plain"])
    for _ in range(2):
        f = Forward(base)
        head.reset()
        head.attach(f)
        got, stats = greedy_run(f, PROMPT, 12, head=head, k=4)
        assert got == _plain(base, 12) and not stats.fallbacks


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int8-q8", "bf16-bf16"])
def test_the_ordered_head_gathers_the_rows_the_kernels_would(ckpts, base, fmt):
    from npud.engine.assistant.weights import gather_rows

    a = Assistant.load(ckpts["ordered"], base, fmt)
    assert a.weights.lm_head.layout == "rows"  # kept unprepared: only rows of it are read
    ids = np.array([0, 5, 319, 17, 5], np.int64)
    want = base.backend.embed(base.backend.prepare_linear(a.weights.lm_head), ids)
    assert np.array_equal(gather_rows(a.weights.lm_head, ids).view(np.uint32), want.view(np.uint32))


def test_the_break_even_fallback_keeps_plain_decodes_output(base, assistants):
    from npud.engine.sampling import Sampler
    from npud.engine.api import SpecParams as SpeculativeConfig
    from npud.engine.speculative import DecodeStats, FallbackReason, speculative_decode

    f = Forward(base)
    f.prefill(PROMPT[:-1])
    head = AssistantHead(assistants["plain"])
    head.attach(f)
    out, stats = [], DecodeStats()
    loop = speculative_decode(f, head, PROMPT, max_new_tokens=24, sampler=Sampler(), on_token=out.append, stats=stats,
                              config=SpeculativeConfig(k=4, fallback_rounds=2))
    for _ in loop:
        pass
    assert out == _plain(base, 24)
    # whether the random assistant's rounds lose is a timing; if they fell back, it was for that
    assert all(fb.reason is FallbackReason.BELOW_BREAK_EVEN for fb in stats.fallbacks)
