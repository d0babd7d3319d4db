"""DFlash / DFlash 2 drafts: the config and its defaults, the checks against the base, parity
with the reference (`dflash` package) on random weights, and DFlashHead through the speculative
loop on the real forward.

MUTANTS. Each was applied to npud/engine/dflash.py, this file run (79 checks), the failing checks
counted, and the file restored (the suite then passes again):

    mutant                                          failing  where
    no trim after a verify (keep every row)            22    sink 4, acceptance 4 (head refused),
                                                             own pick 4, reference run 3, multi-row 3,
                                                             adaptive k 2, reset 1, sampled 1
    trim one row short (mark + count - 1)              29    sink 6, acceptance 6, multi-row 6,
                                                             own pick 4, reference run 3,
                                                             adaptive k 2, reset 1, sampled 1
    trim after a plain step too (stale mark)            9    sink 2 (always-wrong ends on a step),
                                                             own pick 4, adaptive k 1, reset 1,
                                                             sampled 1
    fold one row short (fold up to rows - 1)           17    from-scratch drafts 6, multi-row 6,
                                                             reference run 3, adaptive k 2
    skip the position check                             1    a draft the sink does not end at
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from npud.engine.config import ConfigError
from npud.engine.dflash import (
    DFlashDraft,
    DFlashHead,
    TapRows,
    Variant,
    build_target_layer_ids,
    check_against_base,
    load_dflash_config,
    load_dflash_weights,
    parse_dflash_config,
)
from npud.engine.drafters import Draft, DraftMismatchError
from npud.engine.api import SamplingParams
from npud.engine.sampling import Sampler
from npud.engine.api import SpecParams
from npud.engine.speculative import DecodeStats, FallbackReason, plain_decode, speculative_decode
from npud.engine.testing import checkpoints
from npud.engine.weights import WeightsError

# the tiny base of npud/engine/testing/checkpoints.py with five layers, so there are layers to tap
BASE_LAYERS = 5
GEOMETRY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)
MASK = 7
PROMPT = [11, 57, 200, 3, 98, 140, 7, 77, 31, 5, 250, 64]
N = 30
DFLASH2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


def _raw_config(layers=2, dflash=None, **top) -> dict:
    """A draft's config.json as the reference's save_pretrained writes it (trimmed)."""
    raw = dict(GEOMETRY, model_type="qwen3", architectures=["DFlashDraftModel"], num_hidden_layers=layers,
               num_target_layers=BASE_LAYERS, dflash_config={"mask_token_id": MASK, **(dflash or {})})
    raw.update(top)
    return raw


def write_random_dflash(out: Path, variant=Variant.DFLASH, layers=2, seed=0, bare_codebooks=True, top=None,
                       **dflash) -> Path:
    """A random draft for the tiny base (npud/engine/testing/checkpoints.py's writer); `top`
    overrides top-level config fields (a padded base's vocab_size, say)."""
    extra = dict(dflash)
    if variant is Variant.DFLASH2:
        extra = {**DFLASH2, **extra}
    raw = _raw_config(layers, extra, architectures=[variant.value], **(top or {}))
    return checkpoints.write_random_dflash(out, raw, seed=seed, bare_codebooks=bare_codebooks)


# --------------------------------------------------------------------------- config


def test_defaults_are_derived_as_the_reference_derives_them():
    cfg = parse_dflash_config(_raw_config(layers=2))
    assert cfg.variant is Variant.DFLASH
    assert cfg.target_layer_ids == build_target_layer_ids(BASE_LAYERS, 2) == (1, 2)
    assert (cfg.block_size, cfg.mask_token_id, cfg.causal) == (16, MASK, (False, False))
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, 1.0, None)
    # the published Qwen3-8B drafts tap layers 1, 9, 17, 25, 33 of 36 with five layers
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(6, 1) == (3,)


def test_target_layer_ids_match_the_reference_function():
    model = pytest.importorskip("dflash.model", reason="the reference (pip install --no-deps dflash) is missing")
    for base in range(4, 40):
        for draft in range(1, 7):
            assert list(build_target_layer_ids(base, draft)) == model.build_target_layer_ids(base, draft), (base, draft)


def test_dflash_config_wins_over_the_top_level_which_wins_over_defaults():
    cfg = parse_dflash_config(_raw_config(dflash={"block_size": 8}, block_size=4, output_multiplier=2.0))
    assert (cfg.block_size, cfg.output_multiplier) == (8, 2.0)
    assert parse_dflash_config(_raw_config(block_size=4)).block_size == 4


def test_dflash2_is_named_by_architectures_or_by_its_fields():
    raw = _raw_config(dflash=DFLASH2, architectures=["DFlash2DraftModel"])
    cfg = parse_dflash_config(raw)
    assert (cfg.variant, cfg.conv_groups, cfg.selector_top_k) == (Variant.DFLASH2, 4, 6)
    assert parse_dflash_config(_raw_config(dflash=DFLASH2, architectures=None)).variant is Variant.DFLASH2
    assert parse_dflash_config(_raw_config(dflash=DFLASH2)).variant is Variant.DFLASH  # architectures decide


@pytest.mark.parametrize(
    "raw, message",
    [
        (_raw_config(dflash={"mask_token_id": None}), "mask_token_id is missing"),
        (_raw_config(num_target_layers=None), "target_layer_ids is missing, and num_target_layers"),
        (_raw_config(dflash={"block_size": 1}), "block_size = 1"),
        (_raw_config(dflash={"mask_token_id": 320}), "mask_token_id = 320"),
        (_raw_config(dflash={"target_layer_ids": []}), "target_layer_ids = ()"),
        (_raw_config(dflash={"target_layer_ids": 3}), "target_layer_ids = 3: must be a list"),
        (_raw_config(dflash={**DFLASH2, "selector_rank": None}, architectures=["DFlash2DraftModel"]), "selector_rank = None"),
        (_raw_config(dflash={**DFLASH2, "conv_group_size": 24}, architectures=["DFlash2DraftModel"]), "conv_group_size = 24"),
        (_raw_config(dflash={"output_multiplier": "2"}), "output_multiplier = '2'"),
        (_raw_config(use_sliding_window=True, sliding_window=4, max_window_layers=0, is_causal=False), "bidirectional sliding"),
        ({**_raw_config(), "dflash_config": [1]}, "dflash_config = [1]"),
    ],
)
def test_bad_configs_are_refused_with_the_field(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_dflash_config(raw)


def test_causality_follows_is_causal_then_the_layer_types():
    assert parse_dflash_config(_raw_config(is_causal=True)).causal == (True, True)
    sliding = parse_dflash_config(_raw_config(use_sliding_window=True, sliding_window=4, max_window_layers=1))
    assert sliding.causal == (False, True) and [s.window for s in sliding.model.layers] == [0, 4]
    # a layer typed sliding with the window switched off is causal over everything
    typed = parse_dflash_config(_raw_config(layer_types=["sliding_attention", "full_attention"]))
    assert typed.causal == (True, False) and [s.window for s in typed.model.layers] == [0, 0]


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_dflash_config(tmp_path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    from npud.engine.model import Model

    root = tmp_path_factory.mktemp("dflash")
    path = build_tiny_checkpoint(root / "base", model_type="qwen3", seed=0, num_hidden_layers=BASE_LAYERS)
    return path, Model.load(path, "fp32")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=128), "hidden_size is 128, the base's 64"),
        (dict(vocab_size=400), "vocab_size is 400, the base's 320"),
        (dict(dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 5]}),
         "taps base layer 5, but the base has 5 layers"),
        (dict(num_target_layers=36), "built for a base of 36 layers, this base has 5"),
    ],
)
def test_a_draft_for_another_base_is_refused(base, change, message):
    raw = _raw_config()
    raw.update(change)
    if "hidden_size" in change:
        raw["head_dim"] = 32
    with pytest.raises(DraftMismatchError, match=message):
        check_against_base(parse_dflash_config(raw), base[1].config)


def test_missing_and_misshapen_tensors_are_named(base, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = write_random_dflash(tmp_path / "d", Variant.DFLASH2)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.1.mlp_conv.base_kernel"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :64]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"'fc.weight' has shape \[64, 64\], expected \[64, 128\].*"
                                           r"'layers.1.mlp_conv.base_kernel' is missing"):
        DFlashDraft.load(path, base[1], "fp32")


@pytest.mark.parametrize("bare", [True, False], ids=["bare_codebooks", "suffixed_codebooks"])
def test_both_codebook_spellings_load(base, tmp_path, bare):
    a = DFlashDraft.load(write_random_dflash(tmp_path / "a", Variant.DFLASH2, bare_codebooks=bare), base[1], "fp32")
    b = DFlashDraft.load(write_random_dflash(tmp_path / "b", Variant.DFLASH2, bare_codebooks=not bare), base[1], "fp32")
    assert np.array_equal(a.weights.selector.successor, b.weights.selector.successor)


def test_tap_rows_grow_and_refuse_to_keep_rows_they_do_not_hold():
    sink = TapRows(3, capacity=2)
    sink.append(np.arange(9, dtype=np.float32).reshape(3, 3))
    sink.append(np.ones((2, 3), np.float32))
    assert len(sink) == 5 and sink.rows(2, 4).tolist() == [[6, 7, 8], [1, 1, 1]]
    sink.keep(3)
    assert len(sink) == 3
    with pytest.raises(ValueError, match="cannot keep 4 of 3"):
        sink.keep(4)
    with pytest.raises(ValueError, match="rows of 3"):
        sink.append(np.ones((1, 4), np.float32))


# --------------------------------------------------------------------------- parity with the reference

# Our kernels add in a fixed order, torch in its own, and our base's taps differ from
# transformers' hidden states by a few ulps; through two draft layers that stays below
# 2e-5 of the largest drafted value (measured: 0.7e-6 to 5.2e-6 over these drafts and rounds).
HIDDEN_RTOL = 2e-5


def _reference_draft(cls, root: Path, name: str, seed: int, dflash: dict, layers=2):
    import torch
    from transformers import Qwen3Config

    cfg = Qwen3Config(**GEOMETRY, num_hidden_layers=layers, num_target_layers=BASE_LAYERS,
                      dflash_config={"mask_token_id": MASK, **dflash})
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            scale = 1.0 if "codebook" in pname else 0.2
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if pname.endswith("norm.weight")
                    else scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / name)
    return model


REFERENCE_DRAFTS = {
    "dflash": ("DFlashDraftModel", dict(block_size=6)),
    # the last base layer is tapped: transformers' hidden_states[5] is final-normed
    "dflash_last_layer": ("DFlashDraftModel", dict(block_size=5, target_layer_ids=[0, 4])),
    "dflash2": ("DFlash2DraftModel", dict(block_size=6, **DFLASH2, input_embedding_scale=0.5,
                                          output_multiplier=1.5, final_logit_softcapping=4.0)),
}


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    dflash_model = pytest.importorskip("dflash.model", reason="the reference (pip install --no-deps dflash) is missing")
    import torch
    from npud.engine.testing.checkpoints import load_reference

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reference")
    drafts = {}
    for i, (name, (cls, dflash)) in enumerate(REFERENCE_DRAFTS.items()):
        ref = _reference_draft(getattr(dflash_model, cls), root, name, 10 + i, dflash)
        drafts[name] = (ref, DFlashDraft.load(root / name, base[1], "fp32"))
    return dflash_model, load_reference(base[0]), drafts


def _reference_hidden(reference, name, ids):
    """The reference's drafted rows for the block after ids[:-1], with ids[-1] as last token."""
    import torch

    dflash_model, target, drafts = reference
    ref = drafts[name][0]
    n = ref.block_size - 1
    with torch.no_grad():
        out = target(torch.tensor([ids[:-1]]), output_hidden_states=True)
        context = dflash_model.extract_context_feature(out.hidden_states, ref.target_layer_ids)
        block = torch.tensor([[ids[-1]] + [MASK] * n])
        scale = float(dflash_model._draft_value(ref.config, "input_embedding_scale", 1.0))
        noise = dflash_model._raw_input_embeddings(target, block, scale)
        positions = torch.arange(len(ids) + n)[None]
        hidden = ref(target_hidden=context, noise_embedding=noise, position_ids=positions)[:, 1:]
    return hidden


def _our_taps(model, draft, ids):
    from npud.engine.forward import Forward

    f = Forward(model)
    sink = TapRows(draft.tap_width)
    f.set_layer_taps(draft.config.target_layer_ids, sink)
    f.prefill(ids)
    return sink.rows().copy()


@pytest.mark.parametrize("name", list(REFERENCE_DRAFTS))
def test_draft_pass_matches_the_reference(base, reference, name):
    import torch

    dflash_model, target, drafts = reference
    ref, ours = drafts[name]
    assert ours.config.target_layer_ids == tuple(ref.target_layer_ids)
    assert (ours.config.block_size, ours.config.mask_token_id) == (ref.block_size, ref.mask_token_id)
    ids = PROMPT
    expected = _reference_hidden(reference, name, ids)
    hidden = ours.hidden_from_scratch(_our_taps(base[1], ours, ids[:-1]), ids[-1], ref.block_size - 1)
    scale = float(expected.abs().max())
    assert np.abs(hidden - expected[0].numpy()).max() <= HIDDEN_RTOL * scale
    # the same proposed tokens: argmax of the head's logits, or the selector's greedy path
    with torch.no_grad():
        head = dflash_model._output_head(target)
        if ours.config.variant is Variant.DFLASH2:
            want = ref.propose(expected, torch.tensor([ids[-1]]), head, 0.0)[0][0].tolist()
        else:
            want = torch.argmax(ref.compute_logits(expected, head), dim=-1)[0].tolist()
    assert list(ours.proposer()(hidden, ids).tokens) == want


def _run(model, head, n=N, k=7, rows=8, prompt=PROMPT, sampling=SamplingParams(), attach=True, adapt_k=False):
    """speculative_decode (head) or plain_decode (None) on a fresh Forward; the head is attached
    before the prompt runs unless attach is False. k is fixed (as the reference's block is)
    unless adapt_k, and the break-even fallback is off."""
    from npud.engine.forward import Forward

    f = Forward(model, max_batch_rows=rows)
    if head is not None and attach:
        head.attach(f)
    f.prefill(prompt[:-1])
    if head is not None and not attach:
        head.attach(f)
    out, stats = [], DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(sampling), on_token=out.append, stats=stats)
    if head is None:
        loop = plain_decode(f, prompt, **common)
    else:
        loop = speculative_decode(f, head, prompt, config=SpecParams(k=k, adapt_k=adapt_k, fallback_rounds=0), **common)
    for _ in loop:
        pass
    return out, f, stats


class Recording:
    """Wraps a pick rule and keeps every (context, drafted rows, draft)."""

    def __init__(self, pick):
        self.pick, self.calls = pick, []

    def __call__(self, hidden, context):
        draft = self.pick(hidden, context)
        self.calls.append((list(context), hidden.copy(), draft))
        return draft


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # inside dflash_generate
@pytest.mark.parametrize("name", list(REFERENCE_DRAFTS))
def test_speculative_run_matches_dflash_generate_and_plain_greedy(base, reference, name):
    import torch

    dflash_model, target, drafts = reference
    ref, ours = drafts[name]
    proposals = []
    method = "propose" if ours.config.variant is Variant.DFLASH2 else "compute_logits"
    original = getattr(ref, method)

    def recorded(*args):
        result = original(*args)
        tokens = result[0] if method == "propose" else torch.argmax(result, dim=-1)
        proposals.append(tokens[0].tolist())
        return result

    setattr(ref, method, recorded)  # an instance attribute shadows the method for this run
    try:
        expected = dflash_model.dflash_generate(ref, target, torch.tensor([PROMPT]), N, None)[0, len(PROMPT):].tolist()
    finally:
        delattr(ref, method)
    recording = Recording(ours.proposer())
    head = DFlashHead(ours, pick=recording)
    out, _, stats = _run(base[1], head, k=ref.block_size - 1, rows=ref.block_size)
    plain = _run(base[1], None)[0]
    assert out == expected == plain
    assert [list(d.tokens) for _, _, d in recording.calls] == proposals
    assert stats.rounds == len(proposals) and stats.drafted > 0


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("rule", ["right", "third_wrong"])
@pytest.mark.parametrize("name", list(REFERENCE_DRAFTS))
def test_drafted_rows_after_multi_row_commits_match_the_reference(base, reference, name, rule):
    """Random drafts are almost never accepted, so every fold above is one row. Here both runs
    pick with the same oracle, so rounds commit several rows and the caches grow by several;
    the drafted rows of every round still match the reference's."""
    import torch

    dflash_model, target, drafts = reference
    ref, ours = drafts[name]
    stream = PROMPT + _run(base[1], None, n=N + ref.block_size)[0]
    ref_oracle, ref_rows = Oracle(stream, rule, 320), []
    start = len(PROMPT)
    method = "propose" if ours.config.variant is Variant.DFLASH2 else "compute_logits"

    def oracle_pick(hidden, *_):
        nonlocal start
        ref_rows.append(hidden[0].numpy().copy())
        tokens = ref_oracle(hidden[0].numpy(), stream[: start + 1]).tokens
        right = [t == stream[start + 1 + i] for i, t in enumerate(tokens)]
        start += (right.index(False) if False in right else len(tokens)) + 1
        chosen = torch.tensor([tokens])
        if method == "propose":
            return chosen, None, None
        return torch.nn.functional.one_hot(chosen, 320).float()

    setattr(ref, method, oracle_pick)
    try:
        with torch.no_grad():
            expected = dflash_model.dflash_generate(ref, target, torch.tensor([PROMPT]), N, None)[0, len(PROMPT):].tolist()
    finally:
        delattr(ref, method)
    ours_oracle = Oracle(stream, rule, 320)
    out, _, stats = _run(base[1], DFlashHead(ours, pick=ours_oracle), k=ref.block_size - 1, rows=ref.block_size)
    assert out == expected == stream[len(PROMPT) : len(PROMPT) + N]
    assert stats.emitted >= 2 * stats.rounds  # rounds commit several rows
    assert len(ours_oracle.calls) == len(ref_rows)
    for (_, hidden, _), want in zip(ours_oracle.calls, ref_rows):
        assert np.abs(hidden - want).max() <= HIDDEN_RTOL * np.abs(want).max()


def test_dflash2_proposal_probabilities_match_the_reference_selector(base, reference, monkeypatch):
    """With a temperature the Draft carries the selector's q (over the top tokens, zero
    elsewhere), which is what the loop's accept/resample rule divides by."""
    import torch

    dflash_model, target, drafts = reference
    ref, ours = drafts["dflash2"]
    hidden = ours.hidden_from_scratch(_our_taps(base[1], ours, PROMPT[:-1]), PROMPT[-1], ref.block_size - 1)
    sampling = SamplingParams(temperature=0.8, seed=5)
    draft = ours.proposer(sampling)(hidden, PROMPT)
    assert draft.probs.shape == (len(draft.tokens), 320)
    # replay the reference's selector along our path, recording its q rows
    h = torch.from_numpy(hidden)[None]
    logits = ref.compute_logits(h, dflash_model._output_head(target))
    candidates = torch.topk(logits, ref.candidate_selector.top_k, dim=-1, sorted=False)[1][0]
    rows, step = [], iter(range(len(draft.tokens)))

    def follow(q):
        i = next(step)
        rows.append(q[0].clone())
        return torch.tensor([candidates[i].tolist().index(draft.tokens[i])])

    monkeypatch.setattr(dflash_model, "_sample_probs", follow)
    with torch.no_grad():
        path = ref.candidate_selector.select(h, logits, torch.tensor([PROMPT[-1]]), 0.8)[0][0].tolist()
    assert path == list(draft.tokens)
    for i, q in enumerate(rows):
        np.testing.assert_allclose(draft.probs[i][candidates[i].numpy()], q.numpy(), rtol=1e-5, atol=1e-7)
        assert math.isclose(draft.probs[i].sum(), 1.0, rel_tol=1e-9)


def test_dflash_proposal_probabilities_match_the_reference_sampling_filter(base, reference):
    import torch

    dflash_model, target, drafts = reference
    ref, ours = drafts["dflash"]
    hidden = ours.hidden_from_scratch(_our_taps(base[1], ours, PROMPT[:-1]), PROMPT[-1], ref.block_size - 1)
    draft = ours.proposer(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3))(hidden, PROMPT)
    with torch.no_grad():
        logits = ref.compute_logits(torch.from_numpy(hidden)[None], dflash_model._output_head(target))
        want = dflash_model._sampling_probs(logits, 0.7, 0.9, 40)[0].numpy()
    np.testing.assert_allclose(draft.probs, want, atol=1e-6)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))


def test_selector_draws_follow_its_proposal_distribution(base, tmp_path):
    """The first drafted token, drawn 3000 times over the same rows, has the selector's q."""
    draft = DFlashDraft.load(write_random_dflash(tmp_path / "d", Variant.DFLASH2, seed=4), base[1], "fp32")
    hidden = draft.hidden_from_scratch(_our_taps(base[1], draft, PROMPT[:-1]), PROMPT[-1], 3)
    pick = draft.proposer(SamplingParams(temperature=2.0, seed=9))
    draws = [pick(hidden, PROMPT) for _ in range(3000)]
    q = draws[0].probs[0]
    assert all(np.array_equal(d.probs[0], q) for d in draws)  # the first row does not depend on the draw
    support = np.flatnonzero(q)
    counts = np.bincount([d.tokens[0] for d in draws], minlength=q.size)[support]
    expected = 3000 * q[support]
    assert len(support) == 6 and counts.sum() == 3000
    assert ((counts - expected) ** 2 / expected).sum() < 20.5  # chi-square, 5 df, p = 0.001


# --------------------------------------------------------------------------- through the loop on the real forward

BLOCK = 8


@pytest.fixture(scope="module")
def loop_setup(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    draft = DFlashDraft.load(write_random_dflash(root / "d1", Variant.DFLASH, block_size=BLOCK, seed=1), base[1], "fp32")
    draft2 = DFlashDraft.load(write_random_dflash(root / "d2", Variant.DFLASH2, block_size=BLOCK, seed=2), base[1], "fp32")
    plain = _run(base[1], None, n=N + BLOCK)[0]
    return base[1], draft, draft2, PROMPT + plain


def _committed_taps(model, draft, stream):
    """The tap rows of `stream`, computed by a fresh forward in one prefill."""
    return _our_taps(model, draft, stream)


class Oracle:
    """Pick rules that know plain decode's stream: always right, every third drafted token
    wrong (counted over the run), or always wrong; each draft is recorded."""

    def __init__(self, stream, rule, vocab):
        self.stream, self.rule, self.vocab = stream, rule, vocab
        self.drafted = 0
        self.calls = []

    def __call__(self, hidden, context):
        tokens = []
        for i in range(hidden.shape[0]):
            right = self.stream[len(context) + i]
            self.drafted += 1
            wrong = self.rule == "wrong" or (self.rule == "third_wrong" and self.drafted % 3 == 0)
            tokens.append((right + 1) % self.vocab if wrong else right)
        self.calls.append((list(context), hidden.copy(), tokens))
        return Draft(tuple(tokens))


RULES = ["right", "third_wrong", "wrong"]


@pytest.fixture(scope="module")
def runs(loop_setup):
    """One run per (pick rule, k); the checks below each read them."""
    model, draft, _, stream = loop_setup
    out = {}
    for rule in RULES:
        for k in (2, 7):
            oracle = Oracle(stream, rule, model.config.vocab_size)
            head = DFlashHead(draft, pick=oracle)
            tokens, f, stats = _run(model, head, k=k)
            out[rule, k] = (tokens, f, stats, head, oracle)
    return out


CASES = [(rule, k) for rule in RULES for k in (2, 7)]
IDS = [f"{rule}-k{k}" for rule, k in CASES]


@pytest.mark.parametrize("rule, k", CASES, ids=IDS)
def test_loop_text_equals_plain_decode(loop_setup, runs, rule, k):
    tokens, f, stats, _, _ = runs[rule, k]
    stream = loop_setup[3]
    assert tokens == stream[len(PROMPT) : len(PROMPT) + N]
    assert f.positions_held == len(PROMPT) + N


@pytest.mark.parametrize("rule, k", CASES, ids=IDS)
def test_loop_sink_holds_exactly_the_committed_rows(loop_setup, runs, rule, k):
    model, draft, _, _ = loop_setup
    tokens, _, _, head, _ = runs[rule, k]
    want = _committed_taps(model, draft, PROMPT + tokens)
    assert head.sink.rows().view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


@pytest.mark.parametrize("rule, k", CASES, ids=IDS)
def test_loop_every_draft_equals_one_from_scratch_over_the_committed_rows(loop_setup, runs, rule, k):
    model, draft, _, stream = loop_setup
    _, _, stats, _, oracle = runs[rule, k]
    rows = _committed_taps(model, draft, stream[: len(PROMPT) + N])
    assert len(oracle.calls) == stats.rounds > 0
    for context, hidden, _ in oracle.calls:
        assert context == stream[: len(context)]
        fresh = draft.hidden_from_scratch(rows[: len(context) - 1], context[-1], hidden.shape[0])
        assert np.array_equal(fresh.view(np.uint32), hidden.view(np.uint32))


@pytest.mark.parametrize("rule, k", CASES, ids=IDS)
def test_loop_acceptance_follows_the_pick_rule(runs, rule, k):
    _, _, stats, _, oracle = runs[rule, k]
    assert stats.fallbacks == []  # the head never refused a draft
    for context, _, tokens in oracle.calls:
        left = N - (len(context) - 1 - len(PROMPT)) - 1  # tokens the run may emit after t1
        assert len(tokens) == min(k, BLOCK - 1, left)
    if rule == "right":
        assert stats.accepted == stats.drafted > 0
        # every round emits k + 1 tokens; the budget bounds the last one
        assert stats.rounds == math.ceil(N / (k + 1)) and stats.plain_steps == 0
    elif rule == "wrong":
        assert stats.accepted == 0 and stats.base_passes == N
    else:
        assert 0 < stats.accepted < stats.drafted
        # each round keeps the drafts before its first wrong one
        ordinal, want = 0, 0
        for _, _, tokens in oracle.calls:
            wrong = [(ordinal + i + 1) % 3 == 0 for i in range(len(tokens))]
            want += wrong.index(True) if True in wrong else len(tokens)
            ordinal += len(tokens)
        assert stats.accepted == want


@pytest.mark.parametrize("rule, k", CASES, ids=IDS)
def test_loop_state_one_step_past_the_run_equals_plain_decode(loop_setup, runs, rule, k):
    model = loop_setup[0]
    tokens, f, _, _, _ = runs[rule, k]
    plain, plain_f, _ = _run(model, None)
    assert np.array_equal(f.step(tokens[-1], f.positions_held), plain_f.step(plain[-1], plain_f.positions_held))


@pytest.mark.parametrize("which", ["dflash", "dflash2"])
@pytest.mark.parametrize("k", [2, 7])
def test_loop_with_the_drafts_own_pick_equals_plain_greedy(loop_setup, which, k):
    model, draft, draft2, stream = loop_setup
    recording = Recording((draft if which == "dflash" else draft2).proposer())
    head = DFlashHead(draft if which == "dflash" else draft2, pick=recording)
    tokens, _, stats = _run(model, head, k=k)
    assert tokens == stream[len(PROMPT) : len(PROMPT) + N]
    assert stats.drafted > 0 and len(recording.calls) == stats.rounds
    rows = _committed_taps(model, head.draft_model, PROMPT + tokens)
    assert np.array_equal(head.sink.rows(), rows)


@pytest.mark.parametrize("rule", ["third_wrong", "wrong"])
def test_loop_with_adaptive_k_keeps_the_bookkeeping(loop_setup, rule):
    """The loop shrinks k after a reject; the head then drafts shorter blocks (as the reference
    does near the end of a run) and the sink and every draft stay exact."""
    model, draft, _, stream = loop_setup
    oracle = Oracle(stream, rule, model.config.vocab_size)
    head = DFlashHead(draft, pick=oracle)
    tokens, _, stats = _run(model, head, adapt_k=True)
    assert tokens == stream[len(PROMPT) : len(PROMPT) + N]
    assert len({len(t) for _, _, t in oracle.calls}) > 1  # k did vary
    rows = _committed_taps(model, draft, PROMPT + tokens)
    assert head.sink.rows().view(np.uint32).tobytes() == rows.view(np.uint32).tobytes()
    for context, hidden, _ in oracle.calls:
        fresh = draft.hidden_from_scratch(rows[: len(context) - 1], context[-1], hidden.shape[0])
        assert np.array_equal(fresh.view(np.uint32), hidden.view(np.uint32))


def test_a_draft_the_sink_does_not_end_at_is_refused(loop_setup):
    model, draft, _, stream = loop_setup
    head = DFlashHead(draft)
    # attached after the prompt's prefill: the sink misses the prompt's rows
    tokens, _, stats = _run(model, head, attach=False)
    assert tokens == stream[len(PROMPT) : len(PROMPT) + N]
    assert stats.drafted == 0
    assert [f.reason for f in stats.fallbacks] == [FallbackReason.HEAD_ERROR]
    assert stats.fallbacks[0].message == f"drafting at position {len(PROMPT)} over 1 committed rows"


def test_reset_serves_a_second_job_and_a_stale_cache_is_refused(loop_setup):
    model, draft, _, stream = loop_setup
    head = DFlashHead(draft)
    first = _run(model, head)[0]
    head.sink.clear()  # a new job on a fresh forward without reset(): the cache is stale
    again = _run(model, head, n=4)
    assert again[2].fallbacks and "reset() the head between jobs" in again[2].fallbacks[0].message
    head.reset()
    assert _run(model, head)[0] == first == stream[len(PROMPT) : len(PROMPT) + N]


def test_sampled_run_through_the_loop_keeps_the_sink_committed(loop_setup):
    """With a temperature the drafts carry q and the loop resamples; the bookkeeping holds."""
    model, _, draft2, _ = loop_setup
    head = DFlashHead(draft2, SamplingParams(temperature=1.0, seed=3))
    tokens, f, stats = _run(model, head, sampling=SamplingParams(temperature=1.0, seed=3))
    assert len(tokens) == N and stats.drafted > 0
    assert np.array_equal(head.sink.rows(), _committed_taps(model, draft2, PROMPT + tokens))


@pytest.mark.parametrize("fmt", ["bf16-bf16", "int8-q8"])
def test_a_format_sharing_anothers_data_loads_as_that_one(tmp_path, fmt):
    # bf16-bf16 holds bf16's bits, int8-q8 int8's rows and scales (WeightFormat.storage)
    from npud.kernels.base import WeightFormat

    path = write_random_dflash(tmp_path / "d", Variant.DFLASH2)
    cfg = load_dflash_config(path)
    shared = load_dflash_weights(cfg, path, WeightFormat.parse(fmt)).fc
    plain = load_dflash_weights(cfg, path, WeightFormat.parse(fmt).storage).fc
    assert shared.fmt.value == fmt and shared.data.dtype == plain.data.dtype
    assert np.array_equal(shared.data, plain.data)
    assert (shared.scale is None and plain.scale is None) or np.array_equal(shared.scale, plain.scale)
