"""npud/http/translate.py and errors.py without a daemon: OpenAI's and llama.cpp's bodies as
`complete`'s params, the replies' shapes, and the status of every error code."""

from __future__ import annotations

import pytest

from npud.http import errors, sse
from npud.http.translate import (
    chat_request,
    chunk,
    completion_reply,
    completion_request,
    infill_reply,
    infill_request,
    rename,
    usage,
)
from npud.protocol import ApiError, ErrorCode
from npud.tickets import Priority


def test_completion_fields_become_complete_params():
    job = completion_request({"model": "m", "prompt": "p", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                              "top_k": 3, "seed": 11, "stop": "\n", "n": 1, "user": "me", "stream": True,
                              "stream_options": {"include_usage": True}, "frequency_penalty": 0,
                              "npud": {"spec": {"method": "ngram", "k": 2}, "priority": "batch",
                                       "use_prefix_cache": False}})
    assert job.params == {"model": "m", "prompt": "p", "max_tokens": 7, "stop": ["\n"],
                          "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 11},
                          "spec": {"method": "ngram", "k": 2}, "use_prefix_cache": False}
    assert (job.kind, job.priority, job.stream, job.include_usage) == ("completion", Priority.BATCH, True, True)


def test_a_minimal_completion_leaves_the_defaults_to_the_daemon():
    job = completion_request({"prompt": ["only one"]})
    assert job.params == {"prompt": "only one"}
    assert (job.priority, job.stream, job.include_usage) == (Priority.INTERACTIVE, False, False)
    assert completion_request({"prompt": "x", "stop": ["a", "b"]}).params["stop"] == ["a", "b"]
    assert completion_request({"prompt": "x", "suffix": "y"}).params["suffix"] == "y"


def test_chat_takes_max_completion_tokens_first_and_joins_text_parts():
    job = chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                     {"role": "assistant", "content": "c", "name": "bot"}],
                        "max_completion_tokens": 3, "max_tokens": 9})
    assert job.params == {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}],
                          "max_tokens": 3}
    assert chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9}).params["max_tokens"] == 9


@pytest.mark.parametrize("make, body, code, words", [
    (completion_request, {"prompt": "x", "n": 2}, "unsupported", "n=1"),
    (completion_request, {"prompt": "x", "n": "2"}, "bad_request", "body.n"),
    (completion_request, {"prompt": "x", "presence_penalty": 1}, "unsupported", "presence_penalty"),
    (completion_request, {"prompt": "x", "logprobs": True}, "bad_request", "body.logprobs"),
    (chat_request, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}, "bad_request",
     "body.top_logprobs"),
    (completion_request, {"prompt": "x", "echo": True}, "unsupported", "echo"),
    (completion_request, {"prompt": "x", "best_of": 3}, "unsupported", "best_of"),
    (completion_request, {"prompt": "x", "whatever": 1}, "bad_request", "whatever"),
    (completion_request, {"prompt": "x", "stream_options": {"x": 1}}, "bad_request", "body.stream_options"),
    (completion_request, {"prompt": "x", "npud": {"k": 1}}, "bad_request", "body.npud"),
    (completion_request, {"prompt": "x", "npud": []}, "bad_request", "body.npud"),
    (completion_request, {}, "bad_request", "body.prompt"),
    (completion_request, {"prompt": []}, "unsupported", "body.prompt"),
    (chat_request, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "unsupported",
     "messages[0].content[0]"),
    (chat_request, {"messages": [3]}, "bad_request", "body.messages[0]"),
    (chat_request, {"messages": "hi"}, "bad_request", "body.messages"),
    (infill_request, {"input_prefix": ["a"]}, "bad_request", "body.input_prefix"),
    (infill_request, {"input_suffix": 1}, "bad_request", "body.input_suffix"),
    (infill_request, {"prompt": 1}, "bad_request", "body.prompt"),
])
def test_bad_bodies_name_the_field(make, body, code, words):
    with pytest.raises(ApiError) as info:
        make(body)
    assert info.value.code == code and words in info.value.message


def test_infill_is_llama_cpp_shaped():
    job = infill_request({"input_prefix": "def f(", "prompt": "x", "input_suffix": "):", "n_predict": 5,
                          "input_extra": [{"filename": "a.py", "text": "t"}], "n_indent": 4, "samplers": ["top_k"],
                          "t_max_predict_ms": 100, "seed": 3, "temperature": 0.2})
    assert job.params == {"prompt": "def f(x", "suffix": "):", "max_tokens": 5,
                          "fim_extra": [{"filename": "a.py", "text": "t"}],
                          "sampling": {"seed": 3, "temperature": 0.2}}
    assert job.kind == "infill"
    unset = infill_request({"n_predict": -1, "seed": -1})  # llama.cpp's "no limit" and "random"
    assert unset.params == {"prompt": "", "suffix": ""}
    assert infill_request({"max_tokens": 4}).params["max_tokens"] == 4


def test_errors_of_complete_params_are_renamed_to_the_body_fields():
    cases = {"params.sampling.temperature: x": "body.temperature: x", "params.spec.k: x": "body.npud.spec.k: x",
             "params.use_prefix_cache: x": "body.npud.use_prefix_cache: x", "params.max_tokens: x": "body.max_tokens: x",
             "params.fim_extra[0]: x": "body.input_extra[0]: x", "no model 'q'": "no model 'q'"}
    for message, renamed in cases.items():
        out = rename(ApiError(ErrorCode.BAD_REQUEST, message))
        assert (out.code, out.message) == ("bad_request", renamed)


RESULT = {"job": 9, "prompt": 0, "text": "hi", "token_ids": [1, 2, 3], "prompt_tokens": 5, "finish_reason": "length",
          "max_tokens_clamped_to": None, "stats": {"drafted": 4, "accepted": 2}}


def test_replies_carry_usage_and_the_npud_object():
    assert usage(RESULT) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    text = completion_reply("completion", "m", RESULT)
    assert text["id"] == "cmpl-9" and text["object"] == "text_completion" and text["model"] == "m"
    assert text["choices"] == [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}]
    assert text["npud"] == {"job": 9, "max_tokens_clamped_to": None, "chat_template": None, "grammar_complete": None,
                            "stats": {"drafted": 4, "accepted": 2}}
    chat = completion_reply("chat", "m", {**RESULT, "stats": {**RESULT["stats"], "chat_template": "builtin:gemma"}})
    assert chat["npud"]["chat_template"] == "builtin:gemma"  # which template wrote the prompt
    assert chat["id"] == "chatcmpl-9" and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["usage"] == usage(RESULT)


def test_chunks():
    first = chunk("chat", "m", 9, "a", first=True)
    assert first["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-9"
    assert chunk("chat", "m", 9, "b")["choices"][0]["delta"] == {"content": "b"}
    last = chunk("chat", "m", 9, None, "stop")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    assert chunk("completion", "m", 9, "t")["choices"][0]["text"] == "t"
    assert chunk("infill", "m", 9, "t") == {"content": "t", "stop": False}
    reply = infill_reply("m", RESULT)
    assert (reply["content"], reply["stop"], reply["stop_type"]) == ("hi", True, "limit")
    assert (reply["tokens_predicted"], reply["tokens_evaluated"]) == (3, 5)
    assert infill_reply("m", {**RESULT, "finish_reason": "stop"})["stop_type"] == "eos"
    assert sse.event({"a": "x\ny"}) == b'data: {"a":"x\\ny"}\n\n'
    assert sse.event({"a": "\ud800"}) == b'data: {"a":"\\ud800"}\n\n'


def test_every_client_error_code_is_a_4xx_or_a_503():
    for code in ErrorCode:
        status = errors.status_of(code)
        if code in (ErrorCode.INTERNAL_ERROR, ErrorCode.MODEL_ERROR):
            assert status == 500
        else:
            assert 400 <= status < 500 or status in (503, 507), code
    body = errors.error_body(ApiError(ErrorCode.OVERLOADED, "busy"))
    assert body == {"error": {"message": "busy", "type": "rate_limit_error", "code": "overloaded"}}
    assert errors.error_body(ApiError(errors.UNAUTHORIZED, "x"))["error"]["type"] == "authentication_error"
    assert errors.status_of(ErrorCode.FIM_UNSUPPORTED) == 400 and errors.status_of(ErrorCode.PROMPT_TOO_LONG) == 400
