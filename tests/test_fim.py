"""Fill-in-the-middle prompts (npud/engine/fim.py) and the context clamp of LoadedModel.start, on tiny
checkpoints whose tokenizers carry the FIM tokens of npud.engine.testing.checkpoints.FIM_TOKENS."""

from __future__ import annotations

import pytest

from decoding import plain_tokens

from npud.engine.api import (
    ConfigError,
    FimUnsupported,
    FinishReason,
    GenerateRequest,
    GenerationParams,
    PromptTooLong,
    SpecParams,
)
from npud.engine.fim import find_fim_tokens, fim_prompt_ids
from npud.engine.session import LoadedModel, fitting_max_tokens
from npud.engine.testing.checkpoints import build_tiny_checkpoint

# ids after the 320 trained ones, in FIM_TOKENS order
QWEN = {"prefix": 320, "middle": 321, "suffix": 322, "pad": 323, "repo": 324, "file_sep": 325}
STARCODER = {"prefix": 320, "middle": 321, "suffix": 322, "pad": 323}
EOS = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fim")
    return {name: LoadedModel.load(name, build_tiny_checkpoint(root / name, "qwen3", fim=fim), weight_format="fp32")
            for name, fim in (("qwen", "qwen"), ("starcoder", "starcoder"), ("plain", None))}


def drive(session):
    while not session.done:
        session.run_round()
    return session.result()


def test_qwen_fim_prompt_ids_are_prefix_suffix_middle(models):
    served = models["qwen"]
    tok = served.tokenizer
    fim = find_fim_tokens(tok)
    assert (fim.prefix, fim.suffix, fim.middle, fim.file_sep) == (QWEN["prefix"], QWEN["suffix"], QWEN["middle"],
                                                                  QWEN["file_sep"])
    assert set(fim.stop_ids) == {QWEN["prefix"], QWEN["suffix"], QWEN["middle"], QWEN["pad"], QWEN["repo"],
                                 QWEN["file_sep"], EOS}
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    expected = [320, *tok.encode(prefix), 322, *tok.encode(suffix), 321]
    assert fim_prompt_ids(tok, fim, prefix, suffix) == expected
    req = GenerateRequest(prompt=prefix, suffix=suffix)
    assert served.prompt_ids(req) == expected and served.count_prompt_tokens(req) == len(expected)
    assert fim_prompt_ids(tok, fim, "x", "") == [320, *tok.encode("x"), 322, 321]  # an empty suffix


def test_qwen_fim_extra_files_are_repository_level(models):
    tok = models["qwen"].tokenizer
    fim = find_fim_tokens(tok)
    extra = (("util.py", "def one():\n    return 1\n"), ("b.py", "x = 2"))
    assert fim_prompt_ids(tok, fim, "def f(", ")", extra) == [
        325, *tok.encode("util.py\ndef one():\n    return 1\n"), 325, *tok.encode("b.py\nx = 2"),
        325, 320, *tok.encode("def f("), 322, *tok.encode(")"), 321]


def test_starcoder_spelling_and_extra_files_as_plain_text(models):
    served = models["starcoder"]
    tok = served.tokenizer
    fim = find_fim_tokens(tok)
    assert fim.file_sep is None and set(fim.stop_ids) == {320, 321, 322, 323, EOS}
    req = GenerateRequest(prompt="def f(", suffix=")", fim_extra=(("a.py", "x = 1"),))
    assert served.prompt_ids(req) == [320, *tok.encode("--- a.py ---\nx = 1\ndef f("), 322, *tok.encode(")"), 321]


def test_a_model_without_fim_tokens_refuses_a_suffix_naming_them(models):
    served = models["plain"]
    assert not served.fim and models["qwen"].fim and served.describe()["fim"] is False
    with pytest.raises(FimUnsupported) as info:
        served.start(GenerateRequest(prompt="def f(", suffix=")"))
    assert info.value.code == "fim_unsupported"
    assert info.value.message == ("this model has no fill-in-the-middle tokens: its vocabulary lacks <|fim_prefix|>, "
                                  "<|fim_suffix|>, <|fim_middle|> (or <fim_prefix>, <fim_suffix>, <fim_middle>)")
    drive(served.start(GenerateRequest(prompt="def f(", params=GenerationParams(max_tokens=2))))  # plain still runs


def test_fim_requests_are_checked_where_declared():
    with pytest.raises(ConfigError, match="needs a prompt, not messages"):
        GenerateRequest(messages=({"role": "user", "content": "a"},), suffix="b")
    with pytest.raises(ConfigError, match="fim_extra needs a suffix"):
        GenerateRequest(prompt="a", fim_extra=(("f", "t"),))
    with pytest.raises(ConfigError, match="suffix must be a string"):
        GenerateRequest(prompt="a", suffix=b"b")
    with pytest.raises(ConfigError, match="fim_extra must be"):
        GenerateRequest(prompt="a", suffix="", fim_extra=(("only a name",),))


def test_fim_session_generates_from_the_rendered_prompt_and_stops_at_fim_end_tokens(models):
    served = models["qwen"]
    req = GenerateRequest(prompt="def add(a, b):\n    return ", suffix="\n",
                          params=GenerationParams(max_tokens=12, spec=SpecParams(method="none")))
    session = served.start(req)
    ids = served.prompt_ids(req)
    assert set(find_fim_tokens(served.tokenizer).stop_ids) <= session.generation._eos
    result = drive(session)
    free = plain_tokens(served.model, ids, 12)
    stop = next((i for i, t in enumerate(free) if t in find_fim_tokens(served.tokenizer).stop_ids), None)
    assert list(result.token_ids) == (free if stop is None else free[:stop + 1])
    assert result.prompt_tokens == len(ids)
    plain = served.start(GenerateRequest(prompt="def add(a, b):\n    return ", params=GenerationParams(max_tokens=2)))
    assert not set(find_fim_tokens(served.tokenizer).stop_ids) - {EOS} & plain.generation._eos


@pytest.mark.parametrize(("prompt", "asked", "context", "room"), [
    (5, 3, 10, 3),  # fits
    (7, 3, 10, 3),  # exactly fits: prompt plus max_tokens is the context
    (7, 4, 10, 3),  # one over
    (9, 50, 10, 1),  # the last position
])
def test_fitting_max_tokens(prompt, asked, context, room):
    assert fitting_max_tokens(prompt, asked, context) == room


@pytest.mark.parametrize("prompt", [10, 11])
def test_a_prompt_that_fills_the_context_is_refused_naming_both_numbers(prompt):
    with pytest.raises(PromptTooLong) as info:
        fitting_max_tokens(prompt, 1, 10)
    assert f"{prompt} tokens" in info.value.message and "holds 10" in info.value.message


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_a_session_past_the_context_is_clamped_and_ends_with_length(models, method):
    served = models["plain"]
    prompt = "def add(a, b):\n    return a + b\n" * 25
    n = served.count_prompt_tokens(GenerateRequest(prompt=prompt))
    room = served.max_context - n
    assert 0 < room < 200
    spec = SpecParams(method=method)
    result = drive(served.start(GenerateRequest(prompt=prompt, params=GenerationParams(max_tokens=room + 40,
                                                                                      spec=spec))))
    assert result.finish_reason is FinishReason.LENGTH and result.max_tokens_clamped_to == room
    assert len(result.token_ids) == room
    assert list(result.token_ids) == plain_tokens(served.model, served.tokenizer.encode(prompt), room)
    exact = drive(served.start(GenerateRequest(prompt=prompt, params=GenerationParams(max_tokens=room, spec=spec))))
    assert exact.max_tokens_clamped_to is None and exact.token_ids == result.token_ids
    with pytest.raises(PromptTooLong):
        served.start(GenerateRequest(prompt=prompt * 3))


def test_fill_in_the_middle_through_a_real_daemon(tmp_path_factory):
    from npud.clients.client import Client, FimUnsupported as ClientFimUnsupported, PromptTooLong as ClientPromptTooLong
    from npud_fixture import FIM_CONTEXT, FIM_MODEL, MODEL, fim_checkpoint, start_daemon, stop_daemon

    root = tmp_path_factory.mktemp("fimd")
    daemon = start_daemon(root, fim=True)
    try:
        with Client(daemon.socket) as c:
            extra = [{"filename": "util.py", "text": "def one():\n    return 1\n"}]
            got = c.complete("def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n", fim_extra=extra,
                             model=FIM_MODEL, max_tokens=8, spec={"method": "none"}).wait()
            with pytest.raises(ClientFimUnsupported):
                c.complete("def add(", suffix=")", model=MODEL, max_tokens=2).wait()
            models = {m["name"]: m for m in c.call("models")["models"]}
            assert (models[FIM_MODEL]["fim"], models[MODEL]["fim"]) == (True, False)
            assert models[FIM_MODEL]["context_length"] == FIM_CONTEXT
            long = c.complete("def add(a, b):\n", model=FIM_MODEL, max_tokens=400, spec={"method": "none"}).wait()
            room = FIM_CONTEXT - long["prompt_tokens"]
            assert long["max_tokens_clamped_to"] == room and long["finish_reason"] == "length"
            assert len(long["token_ids"]) == room
            with pytest.raises(ClientPromptTooLong) as info:
                c.complete("v = 1\n" * FIM_CONTEXT, model=FIM_MODEL, max_tokens=1).wait()
            assert f"holds {FIM_CONTEXT}" in info.value.message
    finally:
        stop_daemon(daemon)
    served = LoadedModel.load("x", fim_checkpoint(root), weight_format="fp32")
    want = drive(served.start(GenerateRequest(
        prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
        fim_extra=(("util.py", "def one():\n    return 1\n"),),
        params=GenerationParams(max_tokens=8, spec=SpecParams(method="none")))))
    assert got["token_ids"] == list(want.token_ids) and got["text"] == want.text
    assert got["prompt_tokens"] == want.prompt_tokens == len(served.prompt_ids(GenerateRequest(
        prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n",
        fim_extra=(("util.py", "def one():\n    return 1\n"),))))


def test_fim_markers_spelled_in_user_text_stay_text(models):
    # before: "<|fim_middle|>" in a prefix, or "<|file_sep|>" in an extra file, became the marker
    tok = models["qwen"].tokenizer
    fim = find_fim_tokens(tok)
    prefix, suffix = "s = '<|fim_middle|>'\n", "t = '<|fim_suffix|><|endoftext|>'\n"
    extra = (("a.py", "<|file_sep|>b.py\nevil = 1\n"),)
    ids = fim_prompt_ids(tok, fim, prefix, suffix, extra)
    assert ids.count(QWEN["middle"]) == 1 and ids[-1] == QWEN["middle"]  # the prompt's own, last
    assert ids.count(QWEN["suffix"]) == 1 and ids.count(QWEN["file_sep"]) == 2  # one per file, then the edited one
    assert EOS not in ids
    assert tok.decode(ids) == ("<|file_sep|>a.py\n<|file_sep|>b.py\nevil = 1\n<|file_sep|><|fim_prefix|>" + prefix
                               + "<|fim_suffix|>" + suffix + "<|fim_middle|>")
