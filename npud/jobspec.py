"""What a job asks for: the validated generation request of `submit` and `complete`.

The wire params are parsed once, at the socket, into the engine's own request type
(npud.engine.api.GenerationParams) and the job's prompts; a JobSpec is stored as JSON with the job
and hands the engine one GenerateRequest per prompt inside a ticket. A `submit` may set some
prompts' settings apart (`prompt_settings`), so one batch file with varied max_tokens or
seeds is one job, not one job per distinct setting. Engine errors come back
through `api_error`, the one map from engine codes to protocol codes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from npud.engine.api import (
    DEFAULT_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    SPEC_METHODS,
    ConfigError,
    EngineCode,
    EngineError,
    GenerateRequest,
    Grammar,
    GenerationParams,
    SamplingParams,
    SpecParams,
)
from npud.engine.loader import check_grammar
from npud.config import LimitsConfig
from npud.protocol import ApiError, ErrorCode, Params, check_text

MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_SPEC_K = 16
MAX_FIM_EXTRA = 64  # context files of a fill-in-the-middle request
MAX_FILENAME_CHARS = 1024
MAX_GRAMMAR_CHARS = 1 << 20  # a regex or Lark grammar (a JSON schema is bounded by the line)

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
    and the engine's generation params: `params` for every prompt, unless `prompt_params`
    (one entry per prompt, None for "the job's") gives a prompt its own. A job of one prompt
    may be a fill-in-the-middle request: `suffix` (and `fim_extra`) as
    npud.engine.api.GenerateRequest's."""

    model: str
    prompts: tuple[str, ...] | None  # exactly one of prompts / chats
    chats: tuple[tuple[dict, ...], ...] | None
    params: GenerationParams = dataclasses.field(default_factory=GenerationParams)
    prompt_params: tuple[GenerationParams | None, ...] | None = None  # None: every prompt has `params`
    suffix: str | None = None
    fim_extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_params is not None and len(self.prompt_params) != self.num_prompts:
            raise ValueError(f"JobSpec: {len(self.prompt_params)} prompt_params for {self.num_prompts} prompts")

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

    def params_for(self, index: int) -> GenerationParams:
        """The generation params of prompt `index`: its own, else the job's."""
        own = None if self.prompt_params is None else self.prompt_params[index]
        return self.params if own is None else own

    def to_json(self) -> dict:
        """The spec as stored with the job; `from_json` reads it back (and rows of older daemons).
        `prompt_params` is written only when a prompt has settings of its own, so a job without
        them is stored as before it existed."""
        out = {"model": self.model, "prompts": None if self.prompts is None else list(self.prompts),
               "chats": None if self.chats is None else [list(c) for c in self.chats],
               "suffix": self.suffix, "fim_extra": [list(c) for c in self.fim_extra],
               **_to_json(self.params)}
        if self.prompt_params is not None:
            out["prompt_params"] = [None if q is None else _to_json(q) for q in self.prompt_params]
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "JobSpec":
        own = raw.get("prompt_params")  # absent in rows stored before per-prompt settings
        return cls(
            model=raw["model"],
            prompts=None if raw["prompts"] is None else tuple(raw["prompts"]),
            chats=None if raw["chats"] is None else tuple(tuple(c) for c in raw["chats"]),
            params=_from_json(GenerationParams, raw),
            prompt_params=None if own is None else tuple(None if q is None else _from_json(GenerationParams, q)
                                                         for q in own),
            suffix=raw.get("suffix"),
            fim_extra=tuple(tuple(c) for c in raw.get("fim_extra") or ()),
        )

    def engine_request(self, index: int, owner_uid: int) -> GenerateRequest:
        """The engine's request for prompt `index` of a job of `owner_uid`, whose prefix-cache
        entries are that owner's alone (npud.engine.api.GenerateRequest.cache_scope)."""
        return GenerateRequest(prompt=None if self.prompts is None else self.prompts[index],
                               messages=None if self.chats is None else self.chats[index],
                               params=self.params_for(index), suffix=self.suffix, fim_extra=self.fim_extra,
                               cache_scope=cache_scope(owner_uid))


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
        if f.name == "grammar":  # a dataclass whose default is None
            kwargs[f.name] = Grammar(**value)
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
    params = _generation_params(p, limits, None, "params")
    prompt_params = None if single else _prompt_params(p, limits, params, len(prompts or chats))
    return JobSpec(model=model, prompts=prompts, chats=chats, params=params, prompt_params=prompt_params,
                   suffix=suffix, fim_extra=fim_extra)


def _prompt_params(p: Params, limits: LimitsConfig, job: GenerationParams,
                   num_prompts: int) -> tuple[GenerationParams | None, ...] | None:
    """`prompt_settings`: one entry per prompt, null or an object of max_tokens, sampling,
    stop, spec, use_prefix_cache, logprobs, response_format and grammar that overrides the job's (`sampling` and `spec` key by
    key). None when no prompt differs."""
    raw = p.list("prompt_settings", None)
    if raw is None:
        return None
    if len(raw) != num_prompts:
        raise p.bad("prompt_settings", f"has {len(raw)} entries for {num_prompts} prompts (give one per prompt, "
                                       "null for the job's settings)")
    own: list[GenerationParams | None] = []
    for i, entry in enumerate(raw):
        if entry is not None and not isinstance(entry, dict):
            raise p.bad(f"prompt_settings[{i}]", "expected an object or null")
        params = None
        if entry:
            q = Params(entry, f"params.prompt_settings[{i}]")
            params = _generation_params(q, limits, job, f"params.prompt_settings[{i}]")
            q.finish()
        own.append(None if params == job else params)
    return None if all(q is None for q in own) else tuple(own)


def _grammar(p: Params, where: str) -> Grammar | None:
    """`response_format` (OpenAI's: {"type": "text"}, {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}) or `grammar`
    ({"regex": pattern} or {"lark": grammar}), checked to compile; None for free text."""
    fmt = p.obj("response_format")
    kind = fmt.str("type", None, choices=("text", "json_object", "json_schema"))
    out = None
    if kind == "json_object":  # OpenAI's JSON mode: any JSON object
        out, named = Grammar("json_schema", '{"type": "object"}'), f"{where}.response_format"
    elif kind == "json_schema":
        spec = fmt.obj("json_schema")
        spec.str("name", None, max_len=256)
        spec.str("description", None)
        spec.bool("strict", None)
        schema = spec.raw("schema")
        if not isinstance(schema, dict):
            raise spec.bad("schema", "expected a JSON schema (an object)")
        spec.finish()
        out, named = Grammar("json_schema", json.dumps(schema)), f"{where}.response_format.json_schema.schema"
    fmt.finish()
    g = p.obj("grammar")
    regex, lark = g.str("regex", None, max_len=MAX_GRAMMAR_CHARS), g.str("lark", None, max_len=MAX_GRAMMAR_CHARS)
    g.finish()
    if regex is not None or lark is not None:
        if (regex is None) == (lark is None) or out is not None:
            raise p.bad("grammar", "give one of 'regex' and 'lark', and no response_format beside it")
        kind = "regex" if regex is not None else "lark"
        out, named = Grammar(kind, regex if regex is not None else lark), f"{where}.grammar.{kind}"
    if out is not None:
        try:
            check_grammar(out)
        except ConfigError as exc:
            raise ApiError(ErrorCode.BAD_REQUEST, f"{named}: {exc.message}") from None
    return out


def _generation_params(p: Params, limits: LimitsConfig, base: GenerationParams | None,
                       where: str) -> GenerationParams:
    """The generation params in `p`; what `p` leaves out is `base`'s (a prompt's settings over
    its job's), or without a base the engine's default."""
    default_max = min(DEFAULT_MAX_TOKENS, limits.max_tokens) if base is None else base.max_tokens
    max_tokens = p.int("max_tokens", default_max, min=1, max=limits.max_tokens)
    # a parameter the request leaves out is left out here too: its default is the engine's
    sampling = p.obj("sampling")
    sampling_kwargs = _given(temperature=sampling.number("temperature", None, min=0.0, max=100.0),
                             top_k=sampling.int("top_k", None, min=0, max=1 << 20),
                             top_p=sampling.number("top_p", None, min=0.0, max=1.0, min_exclusive=True),
                             seed=sampling.int("seed", None, min=0, max=(1 << 63) - 1))
    sampling.finish()
    stop = p.str_list("stop", None, max_items=MAX_STOP, nonempty_items=True)
    if stop is not None and any(len(s) > MAX_STOP_CHARS for s in stop):
        raise p.bad("stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")
    spec = p.obj("spec")
    spec_kwargs = _given(method=spec.str("method", None, choices=SPEC_METHODS),
                         k=spec.int("k", None, min=1, max=MAX_SPEC_K),
                         fallback_rounds=spec.int("fallback_rounds", None, min=0, max=1 << 20))
    spec.finish()
    use_prefix_cache = p.bool("use_prefix_cache", None)
    logprobs = p.int("logprobs", None, min=0, max=MAX_TOP_LOGPROBS)
    grammar = _grammar(p, where)
    base = base if base is not None else GenerationParams()
    try:
        return GenerationParams(max_tokens=max_tokens, sampling=dataclasses.replace(base.sampling, **sampling_kwargs),
                                stop=base.stop if stop is None else tuple(stop),
                                spec=dataclasses.replace(base.spec, **spec_kwargs),
                                use_prefix_cache=base.use_prefix_cache if use_prefix_cache is None else use_prefix_cache,
                                logprobs=base.logprobs if logprobs is None else logprobs,
                                grammar=base.grammar if grammar is None else grammar)
    except ConfigError as exc:  # the checks above are the wire's; these are the engine's own
        raise ApiError(ErrorCode.BAD_REQUEST, f"{where}: {exc.message}") from None
