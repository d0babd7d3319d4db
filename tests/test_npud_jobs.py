"""What a job asks for: submit/complete params into a JobSpec, stored, and handed to the engine."""

import pytest

from npud.engine.api import EngineCode, EngineError, GenerateRequest, ModelError, PromptTooLong
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
            params.spec.method, params.spec.k) == ("m", 2, 100, 0.0, 0, "auto", None)  # None: the method's k
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


# -- per-prompt settings (prompt_settings) -------------------------------------------------------

def test_prompt_settings_override_the_jobs_per_prompt():
    s = spec({"prompts": ["a", "b", "c"], "max_tokens": 9, "stop": ["x"],
              "sampling": {"temperature": 0.5, "seed": 1}, "spec": {"method": "ngram", "k": 3},
              "prompt_settings": [{"max_tokens": 2, "sampling": {"seed": 7}}, None,
                                  {"stop": [], "spec": {"k": 1}, "use_prefix_cache": False}]})
    reqs = [s.engine_request(i, 5).params for i in range(3)]
    assert [r.max_tokens for r in reqs] == [2, 9, 9]
    # sampling and spec merge key by key over the job's
    assert [(r.sampling.temperature, r.sampling.seed) for r in reqs] == [(0.5, 7), (0.5, 1), (0.5, 1)]
    assert [r.stop for r in reqs] == [("x",), ("x",), ()]
    assert [(r.spec.method, r.spec.k) for r in reqs] == [("ngram", 3), ("ngram", 3), ("ngram", 1)]
    assert [r.use_prefix_cache for r in reqs] == [True, True, False]
    assert reqs[1] is s.params  # a prompt without settings of its own runs with the job's
    assert JobSpec.from_json(s.to_json()) == s


def test_prompt_settings_equal_to_the_jobs_are_not_stored():
    s = spec({"prompts": ["a", "b"], "max_tokens": 4, "prompt_settings": [{"max_tokens": 4}, {}]})
    assert s.prompt_params is None and "prompt_params" not in s.to_json()
    assert s.to_json() == spec({"prompts": ["a", "b"], "max_tokens": 4}).to_json()
    t = spec({"chats": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
              "prompt_settings": [None, {"max_tokens": 3}]})
    assert t.prompt_params == (None, t.params_for(1)) and t.params_for(1).max_tokens == 3
    assert t.params_for(0).max_tokens == 100  # the job's default, capped by the limit


@pytest.mark.parametrize("settings, fragment", [
    ([{"max_tokens": 2}], "params.prompt_settings: has 1 entries for 2 prompts"),
    ([{"max_tokens": 2}] * 3, "params.prompt_settings: has 3 entries for 2 prompts"),
    ({"max_tokens": 2}, "params.prompt_settings: expected a list"),
    ([None, 5], "params.prompt_settings[1]: expected an object or null"),
    ([None, {"max_tokens": 101}], "params.prompt_settings[1].max_tokens"),
    ([{"sampling": {"temp": 1}}, None], "params.prompt_settings[0].sampling: unknown"),
    ([{"spec": {"method": "magic"}}, None], "params.prompt_settings[0].spec.method"),
    ([{"stop": [""]}, None], "params.prompt_settings[0].stop[0]"),
    ([{"model": "n"}, None], "params.prompt_settings[0]: unknown parameter(s) ['model']"),
    ([{"priority": "batch"}, None], "params.prompt_settings[0]: unknown parameter(s) ['priority']"),
])
def test_bad_prompt_settings_name_the_prompt(settings, fragment):
    with pytest.raises(ApiError) as info:
        spec({"prompts": ["a", "b"], "prompt_settings": settings})
    assert info.value.code == "bad_request" and fragment in info.value.message, info.value.message


def test_complete_has_no_prompt_settings():
    with pytest.raises(ApiError) as info:
        spec({"prompt": "a", "prompt_settings": [{"max_tokens": 1}]}, single=True)
    assert "unknown parameter(s) ['prompt_settings']" in info.value.message


def test_a_stored_job_without_prompt_params_reads_as_one_set_of_params():
    stored = spec({"prompts": ["a", "b"], "max_tokens": 6}).to_json()
    assert "prompt_params" not in stored  # the row format of schema 3 daemons
    s = JobSpec.from_json(stored)
    assert s.prompt_params is None and [s.params_for(i).max_tokens for i in (0, 1)] == [6, 6]
