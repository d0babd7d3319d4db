"""Ollama's request bodies as `complete`'s params, and results as Ollama's replies (docs/http.md,
"Ollama's API").

A body is read once into the params of the socket protocol's `complete`, as the OpenAI routes'
are (npud/http/translate.py), and runs as the same one-prompt job. What maps:
`options.temperature / top_p / top_k / seed` are `sampling`, `options.num_predict` is
`max_tokens`, `options.stop` is `stop`, `format` ("json" or a JSON schema) is OpenAI's
`response_format` (the llguidance path), `keep_alive` and `raw` as Ollama means them,
`logprobs` / `top_logprobs`. `options.num_ctx` caps the request's context (the handler needs the
prompt's length for it: npud/http/ollama.py). What npud cannot honour is refused by name
(`images`, `tools`, a `template`, a `context`, thinking), or accepted only with its neutral value
(the penalties, mirostat), so a request is never served differently from what it asked.
Machine knobs of Ollama's runner (num_gpu, num_thread, use_mmap, ...) do not change a reply
and are taken as hints.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from npud.engine.api import MAX_TOP_LOGPROBS
from npud.http.translate import HttpJob, npud_reply
from npud.protocol import ApiError, ErrorCode, Params
from npud.tickets import Priority

# the Ollama release whose API shapes npud answers in (GET /api/version); npud's own version
# rides beside it
OLLAMA_API_VERSION = "0.12.0"
TAG = "latest"  # Ollama names every model NAME:TAG; npud's models have one version each

# options npud takes only with the value that changes nothing
NEUTRAL_OPTIONS = {
    "repeat_penalty": (1, 1.0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "mirostat": (0,),
    "tfs_z": (1, 1.0), "typical_p": (1, 1.0), "min_p": (0, 0.0),
}
# Ollama's runner knobs (memory, threads, batch, GPU layers, penalty window): no effect on the text
HINT_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
                "mirostat_tau", "mirostat_eta", "penalize_newline")
# complete's params as an Ollama body names them (the longest prefix first)
RENAMES = (("params.sampling.", "body.options."), ("params.max_tokens", "body.options.num_predict"),
           ("params.stop", "body.options.stop"), ("params.response_format.json_schema.schema", "body.format"),
           ("params.response_format", "body.format"),
           ("params.spec", "body.npud.spec"), ("params.use_prefix_cache", "body.npud.use_prefix_cache"),
           ("params.logprobs", "body.top_logprobs"), ("params.", "body."))
# request fields that steer image generation or cloud features npud has none of; absent or null only
IMAGE_FIELDS = ("width", "height", "steps")


@dataclass(slots=True, frozen=True)
class OllamaJob:
    """One /api/generate or /api/chat request: complete's params (None for a request that only
    loads or unloads its model, as Ollama's empty prompt does), the name the client used, and how
    to answer."""

    kind: str  # "generate" or "chat": the reply's shape
    model: str  # as the client named it (NAME or NAME:latest), echoed in replies
    job: HttpJob | None  # None: an empty prompt or no messages (a load, or with keep_alive 0 an unload)
    keep_alive: object  # the body's keep_alive as given (for a load), None when absent
    num_ctx: int | None  # options.num_ctx: the context the prompt and reply must fit in
    stream: bool


def ollama_name(name: str) -> str:
    """A configured model as Ollama lists it: NAME:latest."""
    return f"{name}:{TAG}"


def npud_name(model: str, names: tuple[str, ...]) -> str:
    """The configured model a client's name means: NAME, or NAME:latest as /api/tags lists it.
    An unknown name is returned as it is (the job spec answers not_found listing the models)."""
    if model in names:
        return model
    base, sep, tag = model.partition(":")
    return base if sep and tag == TAG and base in names else model


def created_at(wall: float | None = None) -> str:
    """RFC 3339 in UTC with microseconds, as Ollama writes `created_at` / `modified_at`."""
    wall = time.time() if wall is None else wall
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1e6):06d}Z"


def _format(b: Params) -> dict | None:
    """`format`: "json" (any JSON value Ollama's JSON mode allows: npud asks for an object, as
    OpenAI's JSON mode) or a JSON schema, as complete's response_format; None for free text."""
    value = b.raw("format")
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise b.bad("format", f'expected "json" or a JSON schema (an object), got {value!r}'[:160])


def _options(b: Params, default_max_tokens: int) -> tuple[dict, int | None]:
    """`options` as complete's params, and options.num_ctx (None when absent). num_predict
    absent, -1 (Ollama's "until the model stops") or -2 ("fill the context") is
    `default_max_tokens`: limits.max_tokens, clamped by the engine to the context."""
    o = b.obj("options")
    params: dict = {}
    sampling = {}
    for name in ("temperature", "top_p", "top_k"):
        if (value := o.raw(name)) is not None:
            sampling[name] = value
    seed = o.raw("seed")
    if seed is not None and seed != -1:  # -1: Ollama's "a random seed", npud's default
        sampling["seed"] = seed
    if sampling:
        params["sampling"] = sampling
    num_predict = o.int("num_predict", None, min=-2)
    if num_predict == 0:
        raise o.bad("num_predict", "must be at least 1 (or -1: until the model stops)")
    params["max_tokens"] = default_max_tokens if num_predict is None or num_predict < 0 else num_predict
    stop = o.raw("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    num_ctx = o.int("num_ctx", None, min=1)
    for name, allowed in NEUTRAL_OPTIONS.items():
        value = o.raw(name)
        if value is not None and value not in allowed:
            raise ApiError(ErrorCode.UNSUPPORTED, f"body.options.{name}: npud supports only {list(allowed)}, "
                                                  f"got {value!r}"[:200])
    for name in HINT_OPTIONS:
        o.raw(name)
    o.finish()
    return params, num_ctx


def _refuse_present(b: Params, name: str, why: str) -> None:
    """A field npud has nothing for: absent, null, false or empty only."""
    value = b.raw(name)
    if value not in (None, False, "", [], {}):
        raise ApiError(ErrorCode.UNSUPPORTED, b.bad(name, why).message)


IMAGES = "npud's models read text only: images are not supported"


def _common(b: Params, default_max_tokens: int) -> tuple[dict, int | None, bool, object]:
    """The fields /api/generate and /api/chat share: (params, num_ctx, stream, keep_alive)."""
    params, num_ctx = _options(b, default_max_tokens)
    response_format = _format(b)
    if response_format is not None:
        params["response_format"] = response_format
    keep_alive = b.raw("keep_alive")
    if keep_alive is not None:
        params["keep_alive"] = keep_alive
    stream = b.bool("stream", True)  # Ollama streams unless told not to
    logprobs = b.bool("logprobs", False)
    top = b.int("top_logprobs", None, min=0, max=MAX_TOP_LOGPROBS)
    if logprobs:
        params["logprobs"] = top or 0
    _refuse_present(b, "think", "npud has no thinking mode; leave think out (or false)")
    for name in IMAGE_FIELDS:
        _refuse_present(b, name, "npud generates text, not images")
    ext = b.obj("npud")  # npud's own knobs, as in the OpenAI routes' `npud` object
    for name in ("spec", "use_prefix_cache"):
        if (value := ext.raw(name)) is not None:
            params[name] = value
    ext.finish()
    return params, num_ctx, stream, keep_alive


def generate_request(body: dict, default_max_tokens: int, names: tuple[str, ...],
                     default_model: str | None) -> OllamaJob:
    """POST /api/generate: `prompt` through the model's chat template as a user message (with
    `system` before it), or as it is with `raw`; `suffix` makes it fill-in-the-middle. No prompt
    (and no suffix) loads the model, as Ollama's does."""
    b = Params(body, "body")
    model = b.str("model", "") or ollama_name(default_model or "")
    params, num_ctx, stream, keep_alive = _common(b, default_max_tokens)
    params["model"] = npud_name(model, names)
    prompt = b.str("prompt", "")
    suffix = b.str("suffix", None)
    system = b.str("system", None)
    raw = b.bool("raw", False)
    _refuse_present(b, "images", IMAGES)
    _refuse_present(b, "template", "npud renders prompts with the model's chat template (chat_template in "
                                   "npud.toml); send raw: true with the prompt written out instead")
    _refuse_present(b, "context", "npud keeps no conversation state between requests: send the whole "
                                  "conversation to /api/chat instead")
    b.finish()
    if not prompt and suffix is None:
        return OllamaJob("generate", model, None, keep_alive, num_ctx, stream)
    if suffix is not None:  # fill-in-the-middle: the prompt is the text before the gap
        if system:
            raise b.bad("system", "has no place in a fill-in-the-middle request (suffix)")
        params.update(prompt=prompt, suffix=suffix)
    elif raw:
        if system:
            raise b.bad("system", "has no place in a raw prompt: write it into the prompt")
        params["prompt"] = prompt
    else:
        params["messages"] = [*([{"role": "system", "content": system}] if system else []),
                              {"role": "user", "content": prompt}]
    job = HttpJob("completion", params, Priority.INTERACTIVE, stream, False)
    return OllamaJob("generate", model, job, keep_alive, num_ctx, stream)


def _messages(b: Params) -> list[dict]:
    """Ollama's messages as complete's: role and content (absent content is empty); images,
    tool calls and thinking are refused."""
    out = []
    for i, msg in enumerate(b.list("messages", [])):
        if not isinstance(msg, dict):
            raise b.bad(f"messages[{i}]", 'expected {"role": string, "content": string}')
        m = Params(msg, f"body.messages[{i}]")
        role = m.str("role")
        content = m.str("content", "")
        _refuse_present(m, "images", IMAGES)
        _refuse_present(m, "tool_calls", "npud does not call tools")
        _refuse_present(m, "thinking", "npud has no thinking mode")
        m.str("tool_name", None)
        if role == "tool":
            raise m.bad("role", "npud does not call tools, so there are no tool results to send")
        m.finish()
        out.append({"role": role, "content": content})
    return out


def chat_request(body: dict, default_max_tokens: int, names: tuple[str, ...],
                 default_model: str | None) -> OllamaJob:
    """POST /api/chat: `messages` of {role, content}, rendered by the model's chat template. No
    messages loads the model, as Ollama's does."""
    b = Params(body, "body")
    model = b.str("model", "") or ollama_name(default_model or "")
    params, num_ctx, stream, keep_alive = _common(b, default_max_tokens)
    params["model"] = npud_name(model, names)
    messages = _messages(b)
    _refuse_present(b, "tools", "npud does not call tools")
    b.finish()
    if not messages:
        return OllamaJob("chat", model, None, keep_alive, num_ctx, stream)
    params["messages"] = messages
    return OllamaJob("chat", model, HttpJob("chat", params, Priority.INTERACTIVE, stream, False), keep_alive,
                     num_ctx, stream)


# -- replies ---------------------------------------------------------------------------------


def chunk(kind: str, model: str, text: str, logprobs: list[dict] | None = None) -> dict:
    """One streamed piece of text."""
    out = {"model": model, "created_at": created_at(), **_text(kind, text), "done": False}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def _text(kind: str, text: str) -> dict:
    return {"message": {"role": "assistant", "content": text}} if kind == "chat" else {"response": text}


@dataclass(slots=True)
class Timing:
    """Where a request's time went, on the front end's clock (seconds of time.monotonic()):
    Ollama's durations are derived from these."""

    started: float  # the request arrived
    load_s: float = 0.0  # a cold start's model load
    prefill_from: float | None = None  # the ticket was granted: prompt evaluation began
    first_token: float | None = None
    ended: float | None = None

    def durations(self, result: dict) -> dict:
        """Ollama's counts and durations (nanoseconds) of a finished request."""
        ended = self.ended if self.ended is not None else time.monotonic()
        prefill_from = self.prefill_from if self.prefill_from is not None else self.started + self.load_s
        first = self.first_token if self.first_token is not None else ended
        ns = lambda s: max(0, int(s * 1e9))  # noqa: E731
        return {"total_duration": ns(ended - self.started), "load_duration": ns(self.load_s),
                "prompt_eval_count": result["prompt_tokens"], "prompt_eval_duration": ns(first - prefill_from),
                "eval_count": len(result["token_ids"]), "eval_duration": ns(ended - first)}


def final(kind: str, model: str, result: dict, timing: Timing, *, text: str = "",
          logprobs: list[dict] | None = None) -> dict:
    """The last object of a stream (text "") or the whole reply: done, done_reason (npud's
    finish_reason: stop, length, cancelled or grammar_dead_end), the counts and durations, and
    npud's own object (the job's reference, the chat template, the engine's counters)."""
    out = {"model": model, "created_at": created_at(), **_text(kind, text), "done": True,
           "done_reason": result["finish_reason"], **timing.durations(result)}
    if logprobs is not None:
        out["logprobs"] = logprobs
    out["npud"] = npud_reply(result)
    return out


def loaded(kind: str, model: str, unloading: bool) -> dict:
    """The reply to a request with no prompt: the model is loaded (or, with keep_alive 0,
    unloaded once idle), as Ollama answers."""
    return {"model": model, "created_at": created_at(), **_text(kind, ""), "done": True,
            "done_reason": "unload" if unloading else "load"}


def error_line(message: str, code: str) -> bytes:
    """An error as Ollama writes it ({"error": message}; npud's stable code beside it), one NDJSON line."""
    return ndjson({"error": message, "code": code})


def ndjson(payload: dict) -> bytes:
    """One object as a line of newline-delimited JSON."""
    try:
        return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate in generated or quoted text
        return (json.dumps(payload, separators=(",", ":")) + "\n").encode()
