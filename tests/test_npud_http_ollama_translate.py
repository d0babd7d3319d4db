"""npud/http/ollama_translate.py without a daemon: Ollama's bodies as complete's params, names
with and without their tag, what is refused by name, and the reply shapes."""

from __future__ import annotations

import pytest

from npud.http.ollama_translate import (Timing, chat_request, created_at, final, generate_request, loaded, npud_name,
                                        ollama_name)
from npud.protocol import ApiError

NAMES = ("gemma-3-270m", "pycode-base")


def chat(**body):
    return chat_request({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], **body}, 4096,
                        NAMES, "gemma-3-270m")


def generate(**body):
    return generate_request({"model": "gemma-3-270m", "prompt": "hi", **body}, 4096, NAMES, "gemma-3-270m")


def test_names_with_and_without_their_tag():
    assert ollama_name("pycode-base") == "pycode-base:latest"
    assert npud_name("pycode-base:latest", NAMES) == npud_name("pycode-base", NAMES) == "pycode-base"
    assert npud_name("pycode-base:q8", NAMES) == "pycode-base:q8"  # another tag is another (unknown) model
    assert chat(model="pycode-base:latest").job.params["model"] == "pycode-base"
    assert chat_request({"messages": [{"role": "user", "content": "x"}]}, 64, NAMES, "gemma-3-270m").model \
        == "gemma-3-270m:latest"


def test_options_map_to_completes_params():
    job = chat(options={"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "num_predict": 12, "stop": "\n",
                        "num_ctx": 2048, "repeat_penalty": 1.0, "num_gpu": 99, "num_thread": 2})
    assert job.job.params["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3}
    assert job.job.params["max_tokens"] == 12 and job.job.params["stop"] == ["\n"] and job.num_ctx == 2048
    assert chat().job.params["max_tokens"] == 4096 == chat(options={"num_predict": -1}).job.params["max_tokens"]
    assert "seed" not in chat(options={"seed": -1}).job.params.get("sampling", {})
    assert chat().stream is True and chat(stream=False).stream is False  # Ollama streams by default
    with pytest.raises(ApiError) as info:
        chat(options={"mirostat": 2})
    assert info.value.code == "unsupported" and "body.options.mirostat" in info.value.message
    with pytest.raises(ApiError) as info:
        chat(options={"bogus": 1})
    assert info.value.code == "bad_request" and "bogus" in info.value.message


def test_format_is_the_response_format():
    assert chat(format="json").job.params["response_format"] == {"type": "json_object"}
    schema = {"type": "object"}
    assert chat(format=schema).job.params["response_format"]["json_schema"]["schema"] == schema
    assert "response_format" not in chat(format="").job.params


def test_generate_is_a_chat_turn_raw_or_fill_in_the_middle():
    assert generate(system="Be brief.").job.params["messages"] == [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "hi"}]
    assert generate(raw=True).job.params["prompt"] == "hi"
    fim = generate(suffix="return x").job.params
    assert (fim["prompt"], fim["suffix"]) == ("hi", "return x")
    assert generate(prompt="").job is None and generate(prompt="", keep_alive=0).keep_alive == 0
    assert chat(messages=[]).job is None


@pytest.mark.parametrize("body, field", [
    ({"images": ["aGk="]}, "body.images"), ({"template": "{{ .Prompt }}"}, "body.template"),
    ({"context": [1, 2]}, "body.context"), ({"think": True}, "body.think"), ({"width": 512}, "body.width"),
])
def test_what_npud_has_nothing_for_is_refused_by_name(body, field):
    with pytest.raises(ApiError) as info:
        generate(**body)
    assert info.value.code == "unsupported" and info.value.message.startswith(field)
    assert generate(images=[], context=None, think=False).job is not None  # empty or false is no request


def test_chat_messages_refuse_images_and_tools():
    for message, field in [({"role": "user", "content": "x", "images": ["aGk="]}, "body.messages[0].images"),
                           ({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
                            "body.messages[0].tool_calls")]:
        with pytest.raises(ApiError) as info:
            chat(messages=[message])
        assert info.value.message.startswith(field)
    with pytest.raises(ApiError):
        chat(tools=[{"type": "function"}])
    assert chat(tools=[]).job is not None and chat(messages=[{"role": "assistant"}]).job.params["messages"] == [
        {"role": "assistant", "content": ""}]


def test_reply_shapes():
    result = {"job": "3f09c2d17a5be814", "text": "hi", "token_ids": [1, 2], "prompt_tokens": 5,
              "finish_reason": "length", "stats": {"chat_template": "builtin:gemma"}}
    timing = Timing(started=10.0, load_s=0.5, prefill_from=10.5, first_token=10.7, ended=11.0)
    out = final("chat", "gemma-3-270m:latest", result, timing, text="hi")
    assert out["message"] == {"role": "assistant", "content": "hi"} and out["done"] and out["done_reason"] == "length"
    assert (out["eval_count"], out["prompt_eval_count"]) == (2, 5)
    assert out["total_duration"] == 1_000_000_000 and out["load_duration"] == 500_000_000
    assert abs(out["prompt_eval_duration"] - 200_000_000) < 1000 and abs(out["eval_duration"] - 300_000_000) < 1000
    assert out["npud"]["job"] == "3f09c2d17a5be814" and out["npud"]["chat_template"] == "builtin:gemma"
    assert final("generate", "m", result, timing)["response"] == ""
    assert loaded("generate", "m", unloading=True)["done_reason"] == "unload"
    assert created_at(0.25) == "1970-01-01T00:00:00.250000Z"
