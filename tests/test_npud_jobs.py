"""What a job asks for: submit/complete params into a JobSpec, stored, and handed to the engine."""

import pytest

from engine.api import DEFAULT_SPEC_K, EngineCode, EngineError, GenerateRequest, ModelError, PromptTooLong
from npud.config import LimitsConfig
from npud.jobspec import ENGINE_CODES, JobSpec, api_error, parse_spec
from npud.protocol import ApiError, Params

LIMITS = LimitsConfig(max_tokens=100, max_prompts_per_job=3)


def spec(params, single=False):
    p = Params(params)
    out = parse_spec(p, limits=LIMITS, models=("m", "n"), default_model="m", single=single)
    p.finish()
    return out


def test_defaults_and_round_trip():
    s = spec({"prompts": ["a", "b"]})
    # the default of 128 tokens is capped by the limit
    params = s.params
    assert (s.model, s.num_prompts, params.max_tokens, params.sampling.temperature, params.sampling.seed,
            params.spec.method, params.spec.k) == ("m", 2, 100, 0.0, 0, "auto", DEFAULT_SPEC_K)
    full = spec({"model": "n", "chats": [[{"role": "user", "content": "hi"}]], "max_tokens": 7,
                 "sampling": {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3}, "stop": ["\n"],
                 "spec": {"method": "ngram", "k": 2, "fallback_rounds": 0}, "use_prefix_cache": False})
    assert JobSpec.from_json(full.to_json()) == full
    assert full.chats == (({"role": "user", "content": "hi"},),)


@pytest.mark.parametrize("params, fragment", [
    ({}, "exactly one of 'prompts' and 'chats'"),
    ({"prompts": ["a"], "chats": [[{"role": "user", "content": "b"}]]}, "exactly one"),
    ({"prompts": []}, "at least 1"),
    ({"prompts": ["a"] * 4}, "at most 3"),
    ({"prompts": ["a"], "max_tokens": 101}, "params.max_tokens"),
    ({"chats": [[{"role": "user"}]]}, "params.chats[0][0]"),
    ({"chats": [[]]}, "params.chats[0]"),
    ({"prompts": ["a"], "sampling": {"temperature": -1}}, "params.sampling.temperature"),
    ({"prompts": ["a"], "sampling": {"top_p": 0}}, "params.sampling.top_p"),
    ({"prompts": ["a"], "sampling": {"tempreature": 1}}, "params.sampling: unknown"),
    ({"prompts": ["a"], "stop": [""]}, "params.stop[0]"),
    ({"prompts": ["a"], "spec": {"method": "magic"}}, "params.spec.method"),
    ({"prompts": ["a"], "spec": {"k": 0}}, "params.spec.k"),
    ({"prompts": ["a"], "use_prefix_cache": "yes"}, "params.use_prefix_cache"),
])
def test_bad_params_name_themselves(params, fragment):
    with pytest.raises(ApiError) as info:
        spec(params)
    assert info.value.code == "bad_request" and fragment in info.value.message, info.value.message


def test_unknown_model_is_not_found():
    with pytest.raises(ApiError) as info:
        spec({"prompts": ["a"], "model": "x"})
    assert info.value.code == "not_found"


def test_complete_takes_one_prompt_or_one_message_list():
    assert spec({"prompt": "a"}, single=True).prompts == ("a",)
    assert spec({"messages": [{"role": "user", "content": "a"}]}, single=True).num_prompts == 1
    with pytest.raises(ApiError):
        spec({"prompts": ["a"]}, single=True)


def test_engine_request_for_one_prompt():
    s = spec({"prompts": ["a", "b"], "max_tokens": 5, "stop": ["x"], "spec": {"method": "none"}})
    req = s.engine_request(1, 1000)
    assert isinstance(req, GenerateRequest)
    assert req.cache_scope == "uid:1000"  # the owner's prefix-cache entries only
    assert (req.prompt, req.messages, req.params.max_tokens, req.params.stop, req.params.spec.method) == (
        "b", None, 5, ("x",), "none")
    assert req.params.sampling.seed == 0  # absent: the engine's default stream
    chat = spec({"chats": [[{"role": "user", "content": "hi"}]], "sampling": {"temperature": 0.5, "seed": 9}})
    assert chat.engine_request(0, 0).messages == ({"role": "user", "content": "hi"},)
    assert chat.engine_request(0, 0).params.sampling.seed == 9


def test_rows_stored_before_a_field_existed_read_with_its_default():
    # the row format of the daemon before the params were the engine's (no adapt_k, seed null)
    old = {"model": "m", "prompts": ["a"], "chats": None, "max_tokens": 7,
           "sampling": {"temperature": 0.5, "top_k": 0, "top_p": 1.0, "seed": None}, "stop": ["x"],
           "spec": {"method": "ngram", "k": 2, "fallback_rounds": 0}, "use_prefix_cache": False}
    s = JobSpec.from_json(old)
    assert (s.params.max_tokens, s.params.sampling.temperature, s.params.sampling.seed, s.params.stop) == (
        7, 0.5, 0, ("x",))
    assert (s.params.spec.method, s.params.spec.k, s.params.spec.adapt_k, s.params.use_prefix_cache) == (
        "ngram", 2, True, False)


def test_every_engine_code_has_a_protocol_code():
    assert set(ENGINE_CODES) == set(EngineCode)
    assert all(code.value == ENGINE_CODES[code].value for code in EngineCode)  # same names on both sides
    assert api_error(PromptTooLong("too long")).to_wire() == {"code": "prompt_too_long", "message": "too long"}
    assert api_error(ModelError("bad file")).code == "model_error"
    assert api_error(EngineError("bad")).code == "bad_request"
