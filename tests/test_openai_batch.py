"""npud/clients/openai_batch.py: OpenAI Batch request lines into npud lines, results into Batch
output lines (the daemon round trip is in test_npuctl.py)."""

from __future__ import annotations

import pytest

from npud.clients.openai_batch import Endpoint, from_openai_line, is_openai_line, openai_record


def test_a_completion_request_becomes_an_npud_line():
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "def f():", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                     "seed": 4, "stop": "\n", "n": 1, "stream": False,
                     "npud": {"top_k": 3, "spec": {"method": "ngram"}, "use_prefix_cache": False,
                              "priority": "interactive"}}}
    assert is_openai_line(line) and not is_openai_line({"prompt": "x"}) and not is_openai_line("x")
    assert from_openai_line(line) == ("r1", Endpoint.COMPLETIONS, {
        "prompt": "def f():", "model": "tiny", "max_tokens": 9, "stop": ["\n"],
        "sampling": {"temperature": 0.5, "top_p": 0.9, "seed": 4, "top_k": 3}, "spec": {"method": "ngram"},
        "use_prefix_cache": False, "priority": "interactive"})


def test_a_chat_request_takes_max_completion_tokens():
    messages = [{"role": "user", "content": "hi"}]
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages, "max_completion_tokens": 5, "stop": ["a", "b"]}}
    assert from_openai_line(line) == ("c", Endpoint.CHAT, {"messages": messages, "max_tokens": 5, "stop": ["a", "b"]})
    line["body"]["max_tokens"] = 6
    with pytest.raises(ValueError, match="not both"):
        from_openai_line(line)


def test_a_result_becomes_a_batch_output_line():
    result = {"text": " return 1", "token_ids": [5, 6, 7], "prompt_tokens": 4, "finish_reason": "length",
              "stats": {"drafted": 2, "accepted": 1}}
    record = openai_record(custom_id="r1", endpoint=Endpoint.COMPLETIONS, job=42, prompt=3, line=7, model="tiny",
                           created=1767000000, result=result, missing=None)
    assert record == {"id": "batch_req_42_3", "custom_id": "r1", "error": None, "response": {
        "status_code": 200, "request_id": "npud-42-3", "body": {
            "id": "cmpl-42-3", "object": "text_completion", "created": 1767000000, "model": "tiny",
            "choices": [{"index": 0, "text": " return 1", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
            "npud": {"job": 42, "prompt_in_job": 3, "line": 7, "stats": {"drafted": 2, "accepted": 1}}}}}
    chat = openai_record(custom_id="c", endpoint=Endpoint.CHAT, job=1, prompt=0, line=1, model="tiny", created=0,
                         result=result, missing=None)["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["id"] == "chatcmpl-1-0"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " return 1"}


@pytest.mark.parametrize("code, status, kind", [("prompt_too_long", 400, "invalid_request_error"),
                                                ("bad_request", 400, "invalid_request_error"),
                                                ("internal_error", 500, "server_error"),
                                                ("model_error", 500, "server_error")])
def test_a_refused_prompt_is_a_response_with_its_status(code, status, kind):
    record = openai_record(custom_id="x", endpoint=Endpoint.COMPLETIONS, job=2, prompt=1, line=2, model="m",
                           created=0, result={"prompt": 1, "error": {"code": code, "message": "m"}}, missing=None)
    assert record["error"] is None
    assert record["response"] == {"status_code": status, "request_id": "npud-2-1", "body": {
        "error": {"message": "m", "type": kind, "param": None, "code": code}}}


def test_a_prompt_that_never_ran_has_an_error_and_no_response():
    missing = {"code": "cancelled", "message": "job 2 was cancelled before this prompt ran"}
    record = openai_record(custom_id="x", endpoint=Endpoint.CHAT, job=2, prompt=1, line=2, model="m", created=0,
                           result=None, missing=missing)
    assert record["response"] is None and record["error"] == missing
    cancelled = openai_record(custom_id="x", endpoint=Endpoint.CHAT, job=2, prompt=1, line=2, model="m", created=0,
                              result={"text": "part", "token_ids": [1], "finish_reason": "cancelled"}, missing=None)
    assert cancelled["response"] is None and cancelled["error"]["code"] == "cancelled"


def test_structured_output_fields_reach_the_npud_line():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    _, _, line = from_openai_line({"custom_id": "a", "url": "/v1/chat/completions",
                                   "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}})
    assert line["response_format"] == fmt
    _, _, line = from_openai_line({"custom_id": "b", "url": "/v1/completions",
                                   "body": {"prompt": "x", "npud": {"grammar": {"regex": "[0-9]+"}}}})
    assert line["grammar"] == {"regex": "[0-9]+"}
