"""A checkpoint whose embedding is padded past its tokenizer (Qwen: 151,936 rows for 151,669 ids).

The padded base here has 640 logit rows for a tokenizer of 320 ids, and row 320 + j of its LM
head is 3x row j: wherever the best real token has a positive logit, a padded id beats it.
So an unmasked choice emits an id the tokenizer cannot decode almost at once, and a mask
that is missing anywhere (plain, verify, resample) shows up as a differing or failing run.

Mutants run (edit, run this file, revert) and what fails:
  greedy verify unmasked (plain masked)   the boundary unit test, every speculative test
  the first padded id left unmasked       the boundary unit test, every greedy run, sampled[none, ngram]
  the last decodable id masked            test_tokenizer_names..., test_loading_names_the_padding
  no check of prompt ids past the rows    test_a_prompt_id_past_the_embedding_is_a_bad_request
"""

from __future__ import annotations

import numpy as np
import pytest
import structlog

from npud.engine.drafters import HeadWeights, HiddenStateHead, PromptLookupHead
from npud.engine.forward import Forward
from npud.engine.api import GenerateRequest, GenerationParams, RequestError, SamplingParams, SpecParams
from npud.engine.generate import Generation
from npud.engine.sampling import Sampler
from npud.engine.session import LoadedModel as ServedModel
from npud.engine.tokenizer import Tokenizer

TOKENS = 320  # ids the tokenizer decodes
ROWS = 640  # the checkpoint's vocab_size
LAYERS = 5  # as tests/test_dflash.py's base, so a DFlash draft has layers to tap
PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n    total += i * i\n"
N = 40


def _pad_lm_head(directory) -> None:
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    head = tensors["lm_head.weight"]
    assert head.shape[0] == ROWS
    head[TOKENS:] = 3.0 * head[: ROWS - TOKENS]
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(base dir, draft-model dir, {variant: DFlash dir}), all of vocab_size 640, tokenizer 320."""
    from npud.engine.testing.checkpoints import build_tiny_checkpoint
    from test_dflash import Variant, write_random_dflash

    root = tmp_path_factory.mktemp("padded")
    base = build_tiny_checkpoint(root / "base", seed=0, vocab_size=ROWS, num_hidden_layers=LAYERS)
    draft = build_tiny_checkpoint(root / "draft", seed=3, vocab_size=ROWS, num_hidden_layers=1)
    for d in (base, draft):
        _pad_lm_head(d)
    dflash = {v: write_random_dflash(root / v.name, variant=v, top=dict(vocab_size=ROWS)) for v in Variant}
    return base, draft, dflash


@pytest.fixture(scope="module")
def served(padded):
    base, draft, dflash = padded
    return {
        variant: ServedModel.load("padded", base, draft_dir=draft, weight_format="fp32", dflash_dir=d, backend="host")
        for variant, d in dflash.items()
    }


def test_tokenizer_names_the_ids_it_decodes(padded):
    tok = Tokenizer.from_dir(padded[0])
    assert tok.decodable(TOKENS) is None  # nothing to mask
    allowed = tok.decodable(ROWS)
    assert allowed.shape == (ROWS,) and allowed[:TOKENS].all() and not allowed[TOKENS:].any()
    assert tok.decodable(ROWS) is allowed  # computed once a width


def test_sampler_masks_exactly_the_ids_past_the_tokenizer():
    allowed = np.arange(8) < 5
    for greedy in (True, False):
        sampler = Sampler(SamplingParams(temperature=0.0 if greedy else 1.0, seed=1), allowed)
        boundary = np.zeros(8, np.float32)
        boundary[5] = 50.0  # the first padded id: masked
        boundary[2] = 1.0
        last = np.zeros(8, np.float32)
        last[4] = 50.0  # the last decodable id: kept
        if greedy:
            assert sampler.choose(boundary) == 2 and sampler.choose(last) == 4
            assert sampler.judge(2, None, boundary) is None and sampler.judge(5, None, boundary) == 2
            assert sampler.judge(4, None, last) is None
        p = sampler.probs(boundary)
        assert np.all(p[5:] == 0.0) and p[:5].sum() == pytest.approx(1.0)
        assert sampler.probs(last)[4] > 0.99
        draws = {sampler.choose(boundary) for _ in range(200)}
        assert draws <= set(range(5))


def test_without_the_mask_the_padded_base_would_emit_a_padded_id(served):
    """The checkpoint does what the module says, so the tests below can fail."""
    model = served[next(iter(served))]
    f = Forward(model.model)
    ids = model.tokenizer.encode(PROMPT)
    logits = f.prefill(ids)
    assert int(np.argmax(logits)) >= TOKENS
    assert Sampler(SamplingParams(), model.allowed).choose(logits) < TOKENS


def test_loading_names_the_padding(padded):
    with structlog.testing.capture_logs() as logs:
        ServedModel.load("padded", padded[0], weight_format="fp32", backend="host")
    found = [e for e in logs if e["event"] == "vocab_padded"]
    assert len(found) == 1
    assert (found[0]["vocab_size"], found[0]["decodable"], found[0]["masked"], found[0]["first_masked"]) == (
        ROWS, TOKENS, ROWS - TOKENS, TOKENS)


def _generate(served_model, method, sampling=SamplingParams(), k=4):
    params = GenerationParams(max_tokens=N, sampling=sampling, spec=SpecParams(method=method, k=k),
                              use_prefix_cache=False)
    req = GenerateRequest(prompt=PROMPT, params=params)
    session = served_model.start(req)
    while not session.done:
        session.run_round()
    return session.result()


@pytest.mark.parametrize("method", ["draft", "dflash"])
def test_speculative_runs_equal_plain_to_the_end(served, method):
    for variant, model in served.items():
        if method != "dflash" and variant is not next(iter(served)):
            continue  # the draft model runs once; the DFlash drafter in both variants
        plain = _generate(model, "none")
        spec = _generate(model, method)
        assert plain.finish_reason == "length" and len(plain.token_ids) == N
        assert max(plain.token_ids) < TOKENS
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.stats["rounds"] > 0  # the drafter was asked and verified


@pytest.mark.parametrize("kind", ["prompt_lookup", "two_pass", "one_pass_taps"])
def test_other_drafters_equal_plain_to_the_end(served, kind):
    """Prompt lookup (down to one-token matches: this random base repeats no pair), and toy
    hidden-state heads over all 640 rows that prefer padded ids, which the verify must refuse."""
    model = served[next(iter(served))]
    tok = model.tokenizer
    ids = tok.encode(PROMPT)
    cfg = model.model.config

    def run(head_for):
        f = Forward(model.model)
        head = head_for(f)
        gen = Generation(f, tok, ids, GenerationParams(max_tokens=N), head=head)
        return gen.run(), gen.token_ids, gen.stats

    text, plain, _ = run(lambda f: None)
    taps = kind == "one_pass_taps"
    weights = HeadWeights.random(features=cfg.hidden_size * (2 if taps else 1), dim=16, vocab=ROWS, seed=5)
    weights.w_out[TOKENS:] *= 10.0  # the head prefers padded ids
    heads = {
        "prompt_lookup": lambda f: PromptLookupHead(min_n=1),
        "two_pass": lambda f: HiddenStateHead(weights),
        "one_pass_taps": lambda f: HiddenStateHead(weights, taps=(f, [1, 3])),
    }
    spec_text, spec, stats = run(heads[kind])
    assert spec == plain and spec_text == text and max(plain) < TOKENS
    assert stats.drafted > 0


@pytest.mark.parametrize("method", ["none", "ngram", "dflash"])
def test_sampled_runs_never_emit_a_padded_id(served, method):
    model = served[next(iter(served))]
    result = _generate(model, method, SamplingParams(temperature=1.0, seed=7))
    ended = len(result.token_ids) == N or result.token_ids[-1] in model.tokenizer.eos_token_ids
    assert ended and max(result.token_ids) < TOKENS


def test_a_prompt_id_past_the_embedding_is_a_bad_request(tmp_path):
    """The other way round: a tokenizer with more ids (320) than the embedding has rows (300)."""
    from npud.engine.testing.checkpoints import build_tiny_checkpoint, write_tokenizer

    path = build_tiny_checkpoint(tmp_path / "short", seed=1, vocab_size=300, num_hidden_layers=1)
    write_tokenizer(path, vocab_size=TOKENS)
    with structlog.testing.capture_logs() as logs:
        model = ServedModel.load("short", path, weight_format="fp32", backend="host")
    assert [e["tokenizer_ids"] for e in logs if e["event"] == "vocab_short"] == [TOKENS]
    tok = model.tokenizer
    high = next(i for i in range(TOKENS - 1, 300, -1) if tok.encode(tok.decode([i])) == [i])
    with pytest.raises(RequestError, match=f"token id {high}, past the 300 rows") as err:
        model.start(GenerateRequest(prompt=tok.decode([high]), params=GenerationParams(max_tokens=4)))
    assert err.value.code == "bad_request"
    assert model.start(GenerateRequest(prompt="def", params=GenerationParams(max_tokens=4))) is not None
