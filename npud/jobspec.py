"""What a job asks for: the validated generation request of `submit` and `complete`.

The wire params are parsed once, at the socket, into the engine's own request type
(engine.api.GenerationParams) and the job's prompts; a JobSpec is stored as JSON with the job
and hands the engine one GenerateRequest per prompt inside a ticket. Engine errors come back
through `api_error`, the one map from engine codes to protocol codes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.api import (
    DEFAULT_MAX_TOKENS,
    SPEC_METHODS,
    ConfigError,
    EngineCode,
    EngineError,
    GenerateRequest,
    GenerationParams,
    SamplingParams,
    SpecParams,
)
from npud.config import LimitsConfig
from npud.protocol import ApiError, ErrorCode, Params, check_text

MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_SPEC_K = 16
MAX_FIM_EXTRA = 64  # context files of a fill-in-the-middle request
MAX_FILENAME_CHARS = 1024

ENGINE_CODES = {
    EngineCode.BAD_REQUEST: ErrorCode.BAD_REQUEST,
    EngineCode.PROMPT_TOO_LONG: ErrorCode.PROMPT_TOO_LONG,
    EngineCode.MODEL_ERROR: ErrorCode.MODEL_ERROR,
    EngineCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    EngineCode.FIM_UNSUPPORTED: ErrorCode.FIM_UNSUPPORTED,
}


def api_error(exc: EngineError) -> ApiError:
    """The protocol error for an expected engine failure (same code name, same message)."""
    return ApiError(ENGINE_CODES[exc.code], exc.message)


@dataclass(slots=True, frozen=True)
class JobSpec:
    """A job: the model, its prompts (strings, or chats of messages; exactly one of the two)
    and the engine's generation params, shared by every prompt. A job of one prompt may be a
    fill-in-the-middle request: `suffix` (and `fim_extra`) as engine.api.GenerateRequest's."""

    model: str
    prompts: tuple[str, ...] | None  # exactly one of prompts / chats
    chats: tuple[tuple[dict, ...], ...] | None
    params: GenerationParams = dataclasses.field(default_factory=GenerationParams)
    suffix: str | None = None
    fim_extra: tuple[tuple[str, str], ...] = ()

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.prompts is not None else len(self.chats or ())

    @property
    def num_bytes(self) -> int:
        """The UTF-8 bytes of the prompts (or of the chats' roles and contents)."""
        if self.prompts is not None:
            fim = [self.suffix or "", *(part for chunk in self.fim_extra for part in chunk)]
            return sum(len(p.encode()) for p in (*self.prompts, *fim))
        return sum(len(m["role"].encode()) + len(m["content"].encode()) for c in self.chats or () for m in c)

    def to_json(self) -> dict:
        """The spec as stored with the job; `from_json` reads it back (and rows of older daemons)."""
        return {"model": self.model, "prompts": None if self.prompts is None else list(self.prompts),
                "chats": None if self.chats is None else [list(c) for c in self.chats],
                "suffix": self.suffix, "fim_extra": [list(c) for c in self.fim_extra],
                **_to_json(self.params)}

    @classmethod
    def from_json(cls, raw: dict) -> "JobSpec":
        return cls(
            model=raw["model"],
            prompts=None if raw["prompts"] is None else tuple(raw["prompts"]),
            chats=None if raw["chats"] is None else tuple(tuple(c) for c in raw["chats"]),
            params=_from_json(GenerationParams, raw),
            suffix=raw.get("suffix"),
            fim_extra=tuple(tuple(c) for c in raw.get("fim_extra") or ()),
        )

    def engine_request(self, index: int, owner_uid: int) -> GenerateRequest:
        """The engine's request for prompt `index` of a job of `owner_uid`, whose prefix-cache
        entries are that owner's alone (engine.api.GenerateRequest.cache_scope)."""
        return GenerateRequest(prompt=None if self.prompts is None else self.prompts[index],
                               messages=None if self.chats is None else self.chats[index], params=self.params,
                               suffix=self.suffix, fim_extra=self.fim_extra, cache_scope=cache_scope(owner_uid))


def cache_scope(owner_uid: int) -> str:
    """The prefix-cache scope of a user's requests."""
    return f"uid:{owner_uid}"


def _to_json(value: object) -> object:
    """A (nested) params dataclass as JSON: dataclasses become objects, tuples lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(cls: type, raw: dict) -> object:
    """A params dataclass from its JSON; a key that is absent or null keeps its default, so a
    field added later reads rows stored before it existed."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = raw.get(f.name)
        if value is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            value = _from_json(type(default), value)
        elif isinstance(default, tuple):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _given(**values: object) -> dict:
    """The values that are not None (the parameters a request gave)."""
    return {k: v for k, v in values.items() if v is not None}


def _messages(p: Params, name: str, value: object) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise p.bad(name, "expected a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise p.bad(name, f"has {len(value)} messages, at most {MAX_MESSAGES} allowed")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise p.bad(f"{name}[{i}]", 'expected {"role": string, "content": string}')
        for key in ("role", "content"):
            check_text(p, f"{name}[{i}].{key}", msg[key])
    return tuple(value)


def _fim(p: Params, prompts: tuple[str, ...] | None) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """`suffix` and `fim_extra` of a fill-in-the-middle request: one string prompt only."""
    suffix = p.str("suffix", None)
    raw = p.list("fim_extra", [], max_items=MAX_FIM_EXTRA)
    if suffix is None:
        if raw:
            raise p.bad("fim_extra", "needs 'suffix' (it is context for fill-in-the-middle)")
        return None, ()
    if prompts is None or len(prompts) != 1:
        raise p.bad("suffix", "fill-in-the-middle takes exactly one string prompt (not messages or chats)")
    extra = []
    for i, chunk in enumerate(raw):
        if not (isinstance(chunk, dict) and set(chunk) <= {"filename", "text"} and isinstance(chunk.get("text"), str)
                and isinstance(chunk.get("filename", ""), str)):
            raise p.bad(f"fim_extra[{i}]", 'expected {"filename": string, "text": string}')
        filename = chunk.get("filename", "")
        if len(filename) > MAX_FILENAME_CHARS:
            raise p.bad(f"fim_extra[{i}].filename", f"longer than {MAX_FILENAME_CHARS} characters")
        for key, value in (("filename", filename), ("text", chunk["text"])):
            check_text(p, f"fim_extra[{i}].{key}", value)
        extra.append((filename, chunk["text"]))
    return suffix, tuple(extra)


def parse_spec(p: Params, *, limits: LimitsConfig, models: tuple[str, ...], default_model: str | None,
               single: bool) -> JobSpec:
    """Validate the generation params of `submit` (single=False) or `complete` (single=True).

    Raises ApiError(bad_request) naming the parameter, or not_found for an unknown model.
    Does not call finish(): the caller reads its own extra params first.
    """
    model = p.str("model", default_model)
    if model is None:
        raise ApiError(ErrorCode.NOT_FOUND, "no model is configured")
    if model not in models:
        raise ApiError(ErrorCode.NOT_FOUND, f"no model {model!r}; models: {list(models)}")
    one, many = ("prompt", "messages") if single else ("prompts", "chats")
    if p.has(one) == p.has(many):
        raise ApiError(ErrorCode.BAD_REQUEST, f"params: give exactly one of {one!r} and {many!r}")
    prompts = chats = None
    if single:
        if p.has("prompt"):
            prompts = (p.str("prompt"),)
        else:
            chats = (_messages(p, "messages", p.list("messages")),)
    elif p.has("prompts"):
        prompts = tuple(p.str_list("prompts", min_items=1, max_items=limits.max_prompts_per_job))
    else:
        raw = p.list("chats", min_items=1, max_items=limits.max_prompts_per_job)
        chats = tuple(_messages(p, f"chats[{i}]", c) for i, c in enumerate(raw))
    suffix, fim_extra = _fim(p, prompts)
    max_tokens = p.int("max_tokens", min(DEFAULT_MAX_TOKENS, limits.max_tokens), min=1, max=limits.max_tokens)
    # a parameter the request leaves out is left out here too: its default is the engine's
    sampling = p.obj("sampling")
    sampling_kwargs = _given(temperature=sampling.number("temperature", None, min=0.0, max=100.0),
                             top_k=sampling.int("top_k", None, min=0, max=1 << 20),
                             top_p=sampling.number("top_p", None, min=0.0, max=1.0, min_exclusive=True),
                             seed=sampling.int("seed", None, min=0, max=(1 << 63) - 1))
    sampling.finish()
    stop = tuple(p.str_list("stop", [], max_items=MAX_STOP, nonempty_items=True))
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise p.bad("stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")
    spec = p.obj("spec")
    spec_kwargs = _given(method=spec.str("method", None, choices=SPEC_METHODS),
                         k=spec.int("k", None, min=1, max=MAX_SPEC_K),
                         fallback_rounds=spec.int("fallback_rounds", None, min=0, max=1 << 20))
    spec.finish()
    try:
        params = GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(**sampling_kwargs), stop=stop,
                                  spec=SpecParams(**spec_kwargs),
                                  **_given(use_prefix_cache=p.bool("use_prefix_cache", None)))
    except ConfigError as exc:  # the checks above are the wire's; these are the engine's own
        raise ApiError(ErrorCode.BAD_REQUEST, f"params: {exc.message}") from None
    return JobSpec(model=model, prompts=prompts, chats=chats, params=params, suffix=suffix, fim_extra=fim_extra)
