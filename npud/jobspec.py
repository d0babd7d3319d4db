"""What a job asks for: the validated generation request of `submit` and `complete`.

A JobSpec is checked once, at the socket, stored as JSON with the job, and turned into the
engine's GenerateRequest for one prompt at a time inside a ticket.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from npud.config import LimitsConfig
from npud.protocol import ApiError, ErrorCode, Params

SPEC_METHODS = ("auto", "none", "ngram", "draft", "dflash", "assistant")
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 128


@dataclass(slots=True, frozen=True)
class JobSpec:
    model: str
    prompts: tuple[str, ...] | None  # exactly one of prompts / chats
    chats: tuple[tuple[dict, ...], ...] | None
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    spec_method: str = "auto"
    spec_k: int = 4
    spec_fallback_rounds: int = 3
    use_prefix_cache: bool = True

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.prompts is not None else len(self.chats or ())

    def to_json(self) -> dict:
        return {
            "model": self.model, "prompts": None if self.prompts is None else list(self.prompts),
            "chats": None if self.chats is None else [list(c) for c in self.chats],
            "max_tokens": self.max_tokens,
            "sampling": {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                         "seed": self.seed},
            "stop": list(self.stop),
            "spec": {"method": self.spec_method, "k": self.spec_k, "fallback_rounds": self.spec_fallback_rounds},
            "use_prefix_cache": self.use_prefix_cache,
        }

    @classmethod
    def from_json(cls, raw: dict) -> "JobSpec":
        sampling, spec = raw["sampling"], raw["spec"]
        return cls(
            model=raw["model"],
            prompts=None if raw["prompts"] is None else tuple(raw["prompts"]),
            chats=None if raw["chats"] is None else tuple(tuple(c) for c in raw["chats"]),
            max_tokens=raw["max_tokens"], temperature=sampling["temperature"], top_k=sampling["top_k"],
            top_p=sampling["top_p"], seed=sampling["seed"], stop=tuple(raw["stop"]),
            spec_method=spec["method"], spec_k=spec["k"], spec_fallback_rounds=spec["fallback_rounds"],
            use_prefix_cache=raw["use_prefix_cache"],
        )

    def engine_request(self, engine: ModuleType, index: int) -> Any:
        """The engine's GenerateRequest for prompt `index` (engine: the session module).

        Raises ValueError (the engine's ConfigError) for a request the engine rejects."""
        sampling = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        if self.seed is not None:  # absent: the engine's default stream
            sampling["seed"] = self.seed
        return engine.GenerateRequest(
            prompt=None if self.prompts is None else self.prompts[index],
            messages=None if self.chats is None else self.chats[index],
            max_tokens=self.max_tokens,
            sampling=engine.SamplingParams(**sampling),
            stop=self.stop,
            spec=engine.SpecParams(method=self.spec_method, k=self.spec_k, fallback_rounds=self.spec_fallback_rounds),
            use_prefix_cache=self.use_prefix_cache,
        )


def _messages(p: Params, name: str, value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise p.bad(name, "expected a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise p.bad(name, f"has {len(value)} messages, at most {MAX_MESSAGES} allowed")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise p.bad(f"{name}[{i}]", 'expected {"role": string, "content": string}')
    return tuple(value)


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
    max_tokens = p.int("max_tokens", min(DEFAULT_MAX_TOKENS, limits.max_tokens), min=1, max=limits.max_tokens)
    sampling = p.obj("sampling")
    temperature = sampling.number("temperature", 0.0, min=0.0, max=100.0)
    top_k = sampling.int("top_k", 0, min=0, max=1 << 20)
    top_p = sampling.number("top_p", 1.0, min=0.0, max=1.0, min_exclusive=True)
    seed = sampling.int("seed", None, min=0, max=(1 << 63) - 1)
    sampling.finish()
    stop = tuple(p.str_list("stop", [], max_items=MAX_STOP, nonempty_items=True))
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise p.bad("stop", f"a stop string is longer than {MAX_STOP_CHARS} characters")
    spec = p.obj("spec")
    spec_method = spec.str("method", "auto", choices=SPEC_METHODS)
    spec_k = spec.int("k", 4, min=1, max=16)
    fallback = spec.int("fallback_rounds", 3, min=0, max=1 << 20)
    spec.finish()
    return JobSpec(
        model=model, prompts=prompts, chats=chats, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, stop=stop, spec_method=spec_method, spec_k=spec_k, spec_fallback_rounds=fallback,
        use_prefix_cache=p.bool("use_prefix_cache", True),
    )
