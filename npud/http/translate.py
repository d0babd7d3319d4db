"""OpenAI's and llama.cpp's request bodies as `complete`'s params, and results as their replies.

A body is read once into the params of the socket protocol's `complete` (docs/protocol.md),
which npud/api.py validates as it validates a socket request; errors that name one of those
params are renamed to the body field it came from (`params.sampling.temperature` is the
body's `temperature`). Fields of OpenAI's API that npud cannot honour are accepted only with
their neutral value, so a request is never silently served differently from what it asked.
An unknown field is an error, as OpenAI's own API makes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from npud.engine.api import MAX_TOP_LOGPROBS
from npud.logprobs import chat_logprobs, completion_logprobs
from npud.protocol import ApiError, ErrorCode, Params
from npud.tickets import Priority

# The body's fields that npud takes as they are, and those with their only accepted values.
NEUTRAL = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "echo": (False,),
    "best_of": (1,), "logit_bias": ({},), "parallel_tool_calls": (True, False),
    "tools": ([],), "service_tier": ("auto", "default"),
    "store": (False,), "cache_prompt": (True, False), "n_probs": (0,),
}
IGNORED = ("user", "metadata")  # labels with no effect on the generation

# complete's params as the body names them (the longest prefix first)
RENAMES = (("params.sampling.", "body."), ("params.spec.", "body.npud.spec."), ("params.grammar", "body.npud.grammar"),
           ("params.use_prefix_cache", "body.npud.use_prefix_cache"), ("params.fim_extra", "body.input_extra"),
           ("params.", "body."))


@dataclass(slots=True, frozen=True)
class HttpJob:
    """One HTTP request as a job: complete's params and how to answer."""

    kind: str  # "completion", "chat" or "infill": the reply's shape (OpenAI's or llama.cpp's)
    params: dict  # complete's params (docs/protocol.md)
    priority: Priority
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts


def rename(exc: ApiError, renames: tuple[tuple[str, str], ...] = RENAMES) -> ApiError:
    """`exc` with a param name of complete's replaced by the body field it came from."""
    for old, new in renames:
        if exc.message.startswith(old):
            return ApiError(exc.code, new + exc.message[len(old):])
    return exc


def _neutral(b: Params) -> None:
    for name, allowed in NEUTRAL.items():
        value = b.raw(name)
        if value is not None and value not in allowed:
            raise ApiError(ErrorCode.UNSUPPORTED, f"body.{name}: npud supports only {list(allowed)}, got {value!r}")
    for name in IGNORED:
        b.raw(name)


def _common(b: Params, max_tokens_names: tuple[str, ...]) -> tuple[dict, Priority, bool, bool]:
    """The fields the completion endpoints share: (params, priority, stream, include_usage)."""
    _neutral(b)
    n = b.int("n", 1)
    if n != 1:
        raise ApiError(ErrorCode.UNSUPPORTED, f"body.n: npud makes one choice per request (n=1), got {n}")
    params: dict = {}
    model = b.str("model", None)
    if model is not None:
        params["model"] = model
    # the first one given wins (chat's max_completion_tokens, then its older max_tokens)
    max_tokens = next((v for v in [b.raw(name) for name in max_tokens_names] if v is not None), None)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    sampling = {k: v for k in ("temperature", "top_p", "top_k", "seed") if (v := b.raw(k)) is not None}
    if sampling:
        params["sampling"] = sampling
    stop = b.raw("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    keep_alive = b.raw("keep_alive")  # Ollama's: how long the model stays loaded once idle
    if keep_alive is not None:
        params["keep_alive"] = keep_alive
    stream = b.bool("stream", False)
    options = b.obj("stream_options")
    include_usage = options.bool("include_usage", False)
    options.finish()
    ext = b.obj("npud")
    priority = Priority.parse(ext.str("priority", "interactive", choices=("interactive", "batch")))
    for name in ("spec", "use_prefix_cache", "grammar"):
        if (value := ext.raw(name)) is not None:
            params[name] = value
    ext.finish()
    response_format = b.raw("response_format")  # structured output: complete's own shape is OpenAI's
    if response_format is not None:
        params["response_format"] = response_format
    return params, priority, stream, include_usage


def completion_request(body: dict) -> HttpJob:
    """POST /v1/completions: `prompt` is a string (or a list of one string)."""
    b = Params(body, "body")
    params, priority, stream, include_usage = _common(b, ("max_tokens",))
    prompt = b.raw("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(ErrorCode.UNSUPPORTED, "body.prompt: npud takes one prompt string per request "
                                                  "(a list of one string, never token ids)")
        prompt = prompt[0]
    if prompt is None:
        raise b.bad("prompt", "is required")
    params["prompt"] = prompt
    suffix = b.raw("suffix")  # OpenAI's fill-in-the-middle: the prompt is the text before the gap
    if suffix is not None:
        params["suffix"] = suffix
    logprobs = b.raw("logprobs")  # an integer: the alternatives per token (null: none)
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise b.bad("logprobs", f"expected an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {logprobs!r}"[:160])
        params["logprobs"] = logprobs
    b.finish()
    return HttpJob("completion", params, priority, stream, include_usage)


def _content(i: int, content: object) -> object:
    """A message's content: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(ErrorCode.UNSUPPORTED, f"body.messages[{i}].content[{j}]: npud takes only text parts "
                                                      '({"type": "text", "text": ...})')
            texts.append(part["text"])
        return "".join(texts)
    return content


def chat_request(body: dict) -> HttpJob:
    """POST /v1/chat/completions: `messages` of {role, content}, rendered by the model's template."""
    b = Params(body, "body")
    params, priority, stream, include_usage = _common(b, ("max_completion_tokens", "max_tokens"))
    messages = b.list("messages", min_items=1)
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise b.bad(f"messages[{i}]", 'expected {"role": string, "content": string}')
        out.append({"role": msg.get("role"), "content": _content(i, msg.get("content"))})
    params["messages"] = out
    top = b.int("top_logprobs", None, min=0, max=MAX_TOP_LOGPROBS)
    if b.bool("logprobs", False):
        params["logprobs"] = top or 0
    elif top is not None:
        raise b.bad("top_logprobs", "needs logprobs: true")
    b.finish()
    return HttpJob("chat", params, priority, stream, include_usage)


# llama.cpp's /infill fields that steer its own server (slots, timings, samplers chain, indent
# heuristic, which fields to answer with); npud has no such knobs and takes them as hints
LLAMA_HINTS = ("n_indent", "samplers", "t_max_prompt_ms", "t_max_predict_ms", "response_fields", "id_slot",
               "cache_prompt", "n_probs")


def infill_request(body: dict) -> HttpJob:
    """POST /infill, llama.cpp's shape: the gap between input_prefix (continued by `prompt`,
    which llama.vim fills with the cursor line's start) and input_suffix, with input_extra
    [{filename, text}] as context. n_predict is max_tokens; -1 (llama.cpp's "no limit") and a
    seed of -1 (its "random") mean npud's defaults."""
    b = Params({k: v for k, v in body.items() if not (k in ("n_predict", "seed") and v == -1)}, "body")
    for name in LLAMA_HINTS:
        b.raw(name)
    params, priority, stream, include_usage = _common(b, ("n_predict", "max_tokens"))
    prefix = b.str("input_prefix", "")
    prompt = b.str("prompt", "")
    params["prompt"] = prefix + prompt
    params["suffix"] = b.str("input_suffix", "")
    extra = b.raw("input_extra")
    if extra is not None:
        params["fim_extra"] = extra
    b.finish()
    return HttpJob("infill", params, priority, stream, include_usage)


# -- replies ---------------------------------------------------------------------------------


def usage(result: dict) -> dict:
    completion = len(result["token_ids"])
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": result["prompt_tokens"] + completion}


def npud_reply(result: dict) -> dict:
    """The `npud` object of a reply: the job's reference, the number of new tokens the context had room for
    when that was below max_tokens (else null), the chat template that wrote a chat's prompt
    ("builtin:gemma", "checkpoint", "file:NAME"; null for a plain prompt), whether structured
    output is whole (true: the text parses under its grammar; false: max_tokens or a stop string
    cut it short; null without a response_format or grammar), and the engine's counters
    (speculative rounds, drafted and accepted tokens, prefix-cache hits)."""
    stats = result.get("stats") or {}
    return {"job": result["job"], "max_tokens_clamped_to": result.get("max_tokens_clamped_to"),
            "chat_template": stats.get("chat_template"), "grammar_complete": stats.get("grammar_complete"),
            "stats": result["stats"]}


def reply_id(kind: str, job: str | None) -> str:
    """`cmpl-REF` / `chatcmpl-REF`: REF the job's reference (npud/jobref.py), not its id."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{job}"


def choice_logprobs(kind: str, items: list[dict] | None, text_offset: int = 0) -> dict | None:
    """A choice's `logprobs` in the endpoint's shape (None when the request asked for none)."""
    if items is None:
        return None
    return chat_logprobs(items) if kind == "chat" else completion_logprobs(items, text_offset)


def completion_reply(kind: str, model: str, result: dict) -> dict:
    """The whole reply of a non-streaming request."""
    logprobs = choice_logprobs(kind, result.get("logprobs"))
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]},
                  "finish_reason": result["finish_reason"], "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": logprobs}
    return {"id": reply_id(kind, result["job"]), "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage(result),
            "npud": npud_reply(result)}


def chunk(kind: str, model: str, job: str | None, text: str | None, finish_reason: str | None = None, *,
          first: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed chunk: `text` (None in the last), or the finish reason; `logprobs` those
    of the tokens the chunk carries, in the endpoint's shape."""
    if kind == "infill":  # llama.cpp's: the text, and `stop` true in the last
        return {"content": text or "", "stop": finish_reason is not None}
    if kind == "chat":
        delta: dict = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
    return {"id": reply_id(kind, job), "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def infill_reply(model: str, result: dict) -> dict:
    """llama.cpp's /infill reply (and the last event of its stream, with the whole text)."""
    return {"content": result["text"], "stop": True, "model": model,
            "stop_type": "limit" if result["finish_reason"] == "length" else "eos",
            "finish_reason": result["finish_reason"], "tokens_predicted": len(result["token_ids"]),
            "tokens_evaluated": result["prompt_tokens"], "truncated": False, "npud": npud_reply(result)}
