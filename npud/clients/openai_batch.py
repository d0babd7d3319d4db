"""OpenAI Batch files for `npuctl submit`: request lines in, response lines out.

An input line `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}` becomes an npud line (npud/clients/batchfile.py), and
with `--format openai` each result is written as the Batch API writes its output:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body
a completion (`text_completion`) or chat completion (`chat.completion`) object. A prompt
the daemon refused is a response with its HTTP status and an OpenAI error body carrying
npud's code; a prompt that never ran (its job was cancelled or failed first) has no
response and an `error`. Shapes only: the daemon judges the values.
"""

from __future__ import annotations

import enum
from typing import Any

LINE_KEYS = ("custom_id", "method", "url", "body")
COMMON_BODY_KEYS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "npud",
                    "response_format")
NPUD_KEYS = ("top_k", "spec", "use_prefix_cache", "priority", "grammar")  # what OpenAI has no field for

# the HTTP status of a prompt the daemon refused, by npud's code; anything else is 500
STATUS = {"bad_request": 400, "prompt_too_long": 400, "not_found": 404, "forbidden": 403, "overloaded": 429,
          "unsupported": 400, "device_quarantined": 503, "shutting_down": 503}


class Endpoint(enum.StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


def is_openai_line(obj: Any) -> bool:
    """Whether a parsed line is in the Batch request shape (it has a custom_id or a body)."""
    return isinstance(obj, dict) and ("custom_id" in obj or "body" in obj)


def _unknown(where: str, value: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{where}unsupported key {unknown[0]!r} (supported: {', '.join(known)})")


def from_openai_line(obj: dict) -> tuple[str, Endpoint, dict]:
    """(custom_id, endpoint, the npud line) of a Batch request line; raises ValueError with a
    message naming the key that is wrong."""
    _unknown("", obj, LINE_KEYS)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError('"custom_id" must be a non-empty string')
    if obj.get("method", "POST") != "POST":
        raise ValueError(f'"method" must be "POST", got {obj.get("method")!r}')
    try:
        endpoint = Endpoint(obj.get("url"))
    except ValueError:
        raise ValueError(f'"url" must be "{Endpoint.COMPLETIONS}" or "{Endpoint.CHAT}", got {obj.get("url")!r}') from None
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError('"body" must be an object')
    text_key = "prompt" if endpoint is Endpoint.COMPLETIONS else "messages"
    extra = () if endpoint is Endpoint.COMPLETIONS else ("max_completion_tokens",)
    _unknown("body: ", body, (text_key, *COMMON_BODY_KEYS, *extra))
    if body.get("n", 1) != 1:
        raise ValueError(f"body: n must be 1 (one completion per request), got {body['n']!r}")
    if body.get("stream", False) is not False:
        raise ValueError("body: stream must be false in a batch")
    if text_key not in body:
        raise ValueError(f'body: "{text_key}" is required for {endpoint.value}')
    line: dict = {text_key: body[text_key]}
    if endpoint is Endpoint.COMPLETIONS and isinstance(body["prompt"], list):
        raise ValueError('body: "prompt" must be one string (one request per line)')
    if endpoint is Endpoint.CHAT and "max_tokens" in body and "max_completion_tokens" in body:
        raise ValueError('body: give "max_tokens" or "max_completion_tokens", not both')
    if "response_format" in body:  # structured output: the daemon judges the format
        line["response_format"] = body["response_format"]
    for key in ("model", "max_tokens", "max_completion_tokens"):
        if key in body:
            line["max_tokens" if key != "model" else key] = body[key]
    sampling = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
    if "stop" in body:
        line["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    ext = body.get("npud", {})
    if not isinstance(ext, dict):
        raise ValueError('body: "npud" must be an object')
    _unknown("body: npud: ", ext, NPUD_KEYS)
    if "top_k" in ext:
        sampling["top_k"] = ext["top_k"]
    line.update({k: ext[k] for k in ("spec", "use_prefix_cache", "priority", "grammar") if k in ext})
    if sampling:
        line["sampling"] = sampling
    return custom_id, endpoint, line


def openai_record(*, custom_id: Any, endpoint: Endpoint, job: int, prompt: int, line: int, model: str | None,
                  created: int, result: dict | None, missing: dict | None) -> dict:
    """The Batch output line of one request: its completion, its refusal, or (result None)
    `missing` as the error of a request that never ran. `npud` in the body carries what
    OpenAI has no field for: the job, the prompt's index in it, the input line, the stats."""
    request_id = f"npud-{job}-{prompt}"
    record: dict = {"id": f"batch_req_{job}_{prompt}", "custom_id": custom_id, "response": None, "error": None}
    if result is None or result.get("finish_reason") == "cancelled":
        record["error"] = missing if result is None else {"code": "cancelled", "message": "the job was cancelled "
                                                                                         "while this prompt ran"}
        return record
    if "error" in result:
        code, message = result["error"].get("code"), result["error"].get("message")
        status = STATUS.get(code, 500)
        record["response"] = {"status_code": status, "request_id": request_id, "body": {"error": {
            "message": message, "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None, "code": code}}}
        return record
    completion_tokens = len(result.get("token_ids") or ())
    if endpoint is Endpoint.COMPLETIONS:
        obj_id, obj_type = f"cmpl-{job}-{prompt}", "text_completion"
        choice: dict = {"index": 0, "text": result.get("text", ""), "logprobs": None}
    else:
        obj_id, obj_type = f"chatcmpl-{job}-{prompt}", "chat.completion"
        choice = {"index": 0, "message": {"role": "assistant", "content": result.get("text", "")}, "logprobs": None}
    choice["finish_reason"] = result.get("finish_reason")
    prompt_tokens = int(result.get("prompt_tokens") or 0)
    body = {"id": obj_id, "object": obj_type, "created": created, "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "npud": {"job": job, "prompt_in_job": prompt, "line": line, "stats": result.get("stats") or {}}}
    record["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return record
