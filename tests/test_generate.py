"""Generation as the user sees it: text deltas, stop strings, EOS, cancellation, sessions."""

from __future__ import annotations

import numpy as np
import pytest

from npud.engine.api import (
    ConfigError,
    FinishReason,
    GenerateRequest,
    GenerationParams,
    ModelError,
    RequestError,
    SamplingParams,
    SpecParams,
)
from npud.engine.loader import load_model
from decoding import plain_tokens
from npud.engine.forward import Forward
from npud.engine.generate import Generation, _longest_stop_prefix_suffix
from npud.engine.model import Model
from npud.engine.prefix_cache import PrefixCache
from npud.engine.session import LoadedModel
from npud.engine.state import ModelState
from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.engine.tokenizer import Tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def model(ckpt):
    return Model.load(ckpt, "fp32")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def run(gen):
    events = [e for batch in gen.rounds() for e in batch]
    return events


def test_greedy_generation_equals_plain_argmax_loop(model, tok):
    ids = tok.encode(PROMPT)
    gen = Generation(Forward(model), tok, ids, GenerationParams(max_tokens=24))
    events = run(gen)
    assert gen.token_ids == plain_tokens(model, ids, 24)
    assert gen.finish_reason is FinishReason.LENGTH
    assert "".join(e.text for e in events) == gen.text == tok.decode(gen.token_ids)
    assert [e.token_id for e in events if e.token_id is not None] == gen.token_ids


def test_stop_string_cuts_text_and_ends_run(model, tok):
    ids = tok.encode(PROMPT)
    full = Generation(Forward(model), tok, ids, GenerationParams(max_tokens=24))
    full.run()
    # a stop string from the middle of the free-running text
    stop = full.text[5:8]
    assert stop and full.text.find(stop) == 5
    gen = Generation(Forward(model), tok, ids, GenerationParams(max_tokens=24, stop=(stop,)))
    events = run(gen)
    assert gen.text == full.text[:5]
    assert "".join(e.text for e in events) == gen.text
    assert gen.finish_reason is FinishReason.STOP
    assert gen.token_ids == full.token_ids[: len(gen.token_ids)]
    assert gen.forward.positions_held == len(ids) + len(gen.token_ids) - 0  # every emitted token was run


def test_text_that_may_start_a_stop_string_is_held_back():
    assert _longest_stop_prefix_suffix("abc<|e", ("<|end|>",)) == 3
    assert _longest_stop_prefix_suffix("abc", ("<|end|>",)) == 0
    assert _longest_stop_prefix_suffix("x#", ("##", "#!")) == 1


def test_eos_token_ends_run_without_text(model, tok):
    ids = tok.encode(PROMPT)
    free = plain_tokens(model, ids, 12)
    eos = free[6]
    gen = Generation(Forward(model), tok, ids, GenerationParams(max_tokens=12), stop_token_ids=(eos,))
    run(gen)
    assert gen.token_ids == free[:7]
    assert gen.finish_reason is FinishReason.STOP
    assert gen.text == tok.decode(free[:6])


def test_cancel_between_rounds(model, tok):
    ids = tok.encode(PROMPT)
    gen = Generation(Forward(model), tok, ids, GenerationParams(max_tokens=50))
    rounds = gen.rounds()
    next(rounds)  # prefill
    next(rounds)
    gen.cancel()
    for _ in rounds:
        pass
    assert gen.finish_reason is FinishReason.CANCELLED
    assert len(gen.token_ids) < 50


def test_bad_generation_config():
    with pytest.raises(ConfigError, match="max_tokens"):
        GenerationParams(max_tokens=0)
    with pytest.raises(ConfigError, match="stop"):
        GenerationParams(stop=("",))


@pytest.fixture(scope="module")
def served(ckpt):
    return LoadedModel.load("tiny", ckpt, draft_dir=ckpt, weight_format="fp32")


def test_a_served_model_gives_each_user_a_share_of_its_prefix_cache(served):
    # one user's inserts must not evict another's entries (issue 17; npud/engine/prefix_cache.py)
    assert served.prefix_cache.max_scopes == 7


def test_a_single_user_daemon_keeps_one_prefix_cache_budget(ckpt):
    served = load_model("tiny", ckpt, weight_format="fp32", cache_users=0)
    assert served.prefix_cache.max_scopes == 0


def drive(session):
    events = []
    while not session.done:
        events += session.run_round()
    return events, session.result()


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_session_output_is_the_same_for_every_speculative_method(served, model, tok, method):
    req = GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=30, spec=SpecParams(method=method, k=4)))
    events, result = drive(served.start(req))
    assert list(result.token_ids) == plain_tokens(model, tok.encode(PROMPT), 30)
    assert "".join(e.text for e in events) == result.text
    assert result.finish_reason == "length"
    assert result.prompt_tokens == len(tok.encode(PROMPT))


def test_session_chat_messages_use_the_template(served, tok):
    msgs = ({"role": "user", "content": "hi"},)
    _, result = drive(served.start(GenerateRequest(messages=msgs, params=GenerationParams(max_tokens=3))))
    assert result.prompt_tokens == len(tok.encode(tok.apply_chat_template(list(msgs))))


def test_session_rejects_what_the_model_cannot_run(served):
    with pytest.raises(RequestError) as e:  # the prompt alone is longer than the context of 512
        served.start(GenerateRequest(prompt="x " * 600, params=GenerationParams(max_tokens=1)))
    assert e.value.code == "prompt_too_long"
    with pytest.raises(ConfigError):
        GenerateRequest(prompt="a", messages=({"role": "user", "content": "b"},))
    with pytest.raises(ConfigError):
        SpecParams(method="magic")


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_sampled_session_is_reproducible_under_a_seed(served, method):
    # With speculation the break-even fallback is decided on measured timings, and a round
    # that speculates draws its randomness differently from a plain step: sampled output is
    # distributed as plain sampling's either way, but its exact tokens repeat only when the
    # fallback cannot fire (fallback_rounds=0) or nothing speculates.
    spec = SpecParams(method=method, fallback_rounds=0)
    req = GenerateRequest(
        prompt=PROMPT, params=GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=0.8, seed=3), spec=spec))
    a = drive(served.start(req))[1]
    b = drive(served.start(req))[1]  # the second restores its prefix from the cache
    assert a.token_ids == b.token_ids
    other = drive(served.start(GenerateRequest(
        prompt=PROMPT, params=GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=0.8, seed=4), spec=spec))))[1]
    assert other.token_ids != a.token_ids


def test_session_through_prefix_cache_equals_cold(ckpt, model, tok):
    cache = PrefixCache(model.fingerprint, ModelState.for_config(model.config), block_size=8, max_bytes=1 << 24)
    served = LoadedModel(name="tiny", model=model, tokenizer=tok, prefix_cache=cache)
    req = GenerateRequest(prompt=PROMPT * 2, params=GenerationParams(max_tokens=16, spec=SpecParams(method="none")))
    _, cold = drive(served.start(req))
    s = served.start(req)
    _, warm = drive(s)
    assert warm.token_ids == cold.token_ids
    assert warm.stats["num_cached_tokens"] > 0
    assert warm.stats["num_cached_tokens"] % 8 == 0
    assert cache.stats().hits == 1


def test_served_model_names_its_backend_and_refuses_an_npu_it_cannot_have(ckpt):
    served = LoadedModel.load("tiny", ckpt, weight_format="fp32")
    d = served.describe()
    assert d["backend"] == "host" and d["backend_reason"].startswith("host backend:")
    with pytest.raises(ModelError, match="no NPU device node"):
        LoadedModel.load("tiny", ckpt, weight_format="fp32", backend="xrt")


BUNDLED = __import__("pathlib").Path(__file__).resolve().parent.parent / "npud" / "models"


@pytest.fixture(scope="module")
def bundled():
    return LoadedModel.load(
        "pycode", BUNDLED / "pycode-base", draft_dir=BUNDLED / "pycode-draft",
        dflash_dir=BUNDLED / "pycode-dflash", weight_format="bf16",
    )


@pytest.mark.parametrize("method", ["draft", "dflash", "ngram"])
def test_bundled_pair_every_drafter_gives_plain_greedy_text(bundled, method):
    prompt = "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n    with open(path) as f:"
    plain = drive(bundled.start(GenerateRequest(
        prompt=prompt, params=GenerationParams(max_tokens=40, spec=SpecParams(method="none")))))[1]
    spec = GenerateRequest(
        prompt=prompt, params=GenerationParams(max_tokens=40, spec=SpecParams(method=method, k=7, fallback_rounds=0)))
    result = drive(bundled.start(spec))[1]
    assert result.text == plain.text and result.token_ids == plain.token_ids
    assert result.stats["drafted"] > 0 and result.stats["accepted"] > 0
    assert result.stats["fallbacks"] == []  # the head never refused a draft


def test_dflash_session_prefills_past_the_prefix_cache(bundled):
    # a restored prefix has no tap rows for the DFlash head, so its sessions do not restore
    prompt = "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):" * 3
    req = GenerateRequest(
        prompt=prompt, params=GenerationParams(max_tokens=8, spec=SpecParams(method="dflash", fallback_rounds=0)))
    drive(bundled.start(req))
    second = drive(bundled.start(req))[1]
    assert second.stats["num_cached_tokens"] == 0 and second.stats["fallbacks"] == []
    plain = drive(bundled.start(GenerateRequest(
        prompt=prompt, params=GenerationParams(max_tokens=8, spec=SpecParams(method="none")))))[1]
    assert plain.stats["num_cached_tokens"] > 0  # the same prompt does restore for other methods
    assert second.token_ids == plain.token_ids


def test_dflash_needs_a_drafter(served):
    with pytest.raises(RequestError, match="no DFlash drafter"):
        served.start(GenerateRequest(prompt="x", params=GenerationParams(max_tokens=2, spec=SpecParams(method="dflash"))))
