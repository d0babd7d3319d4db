"""What the daemon drives: a served model (base, tokenizer, optional draft, prefix cache)
and sessions that generate one request a round at a time.

The daemon never touches a tensor: it loads a `ServedModel`, calls `start(request)` and
then `Session.run_round()` from its device-owner thread until `done`, checking for
cancellation and preemption between rounds. A session keeps its own state, so a
preempted batch job resumes exactly where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import ConfigError
from engine.dflash import DFlashDraft, DFlashHead
from engine.drafters import DraftModelHead, PromptLookupHead, check_same_tokenizer
from engine.forward import Forward
from engine.generate import Generation, GenerationConfig, TokenEvent
from engine.model import Model
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingConfig
from engine.speculative import SpeculativeConfig
from engine.state import ModelState
from engine.tokenizer import Tokenizer
from kernels.errors import DeviceFault  # noqa: F401  (the daemon catches it here: a failed device call)
from kernels.select import select_backend

SamplingParams = SamplingConfig

SPEC_METHODS = ("auto", "none", "ngram", "draft", "dflash")


class RequestError(ValueError):
    """A request this model cannot run; `code` is the stable protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, frozen=True)
class SpecParams:
    method: str = "auto"  # auto: the draft model, else the DFlash drafter, else prompt lookup
    k: int = 4
    fallback_rounds: int = 3
    reprobe_after: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"SpecParams.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        SpeculativeConfig(k=self.k, fallback_rounds=self.fallback_rounds, reprobe_after=self.reprobe_after)  # validates the numbers


@dataclass(slots=True, frozen=True)
class GenerateRequest:
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    spec: SpecParams = field(default_factory=SpecParams)
    use_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ConfigError("GenerateRequest needs exactly one of prompt and messages")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ConfigError(f"GenerateRequest.prompt must be a string, got {type(self.prompt).__name__}")
        GenerationConfig(self.max_tokens, self.sampling, tuple(self.stop))  # validates


@dataclass(slots=True, frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str
    stats: dict


class ServedModel:
    """A base model with its tokenizer, an optional draft model, and its prefix cache."""

    def __init__(
        self,
        name: str,
        model: Model,
        tokenizer: Tokenizer,
        draft: Model | None = None,
        prefix_cache: PrefixCache | None = None,
        draft_tokenizer: Tokenizer | None = None,
        dflash: DFlashDraft | None = None,
    ):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else tokenizer
        self.dflash = dflash
        self.prefix_cache = prefix_cache
        self.max_context = model.config.max_position_embeddings
        self.backend_reason = "given by the caller"

    @classmethod
    def load(
        cls,
        name: str,
        checkpoint_dir: str | Path,
        draft_dir: str | Path | None = None,
        weight_format: str = "bf16",
        dflash_dir: str | Path | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int = 1 << 30,
        cache_block: int = 32,
        backend: str = "auto",
        xrt_design: str | Path | None = None,
        xrt_timeout_ms: int | None = None,
    ) -> "ServedModel":
        """Load base (and draft) and open the prefix cache (persistent under `cache_dir`, if given).

        Raises ConfigError, WeightsError, TokenizerError or DraftMismatchError for model
        files that are not what they claim, and XrtUnavailable when backend "xrt" cannot run.
        """
        kernels, backend_reason = select_backend(backend, None if xrt_design is None else str(xrt_design),
                                                 xrt_timeout_ms=xrt_timeout_ms)
        model = Model.load(checkpoint_dir, weight_format, kernels)
        tokenizer = Tokenizer.from_dir(checkpoint_dir)
        draft = draft_tokenizer = None
        if draft_dir is not None:
            draft = Model.load(draft_dir, weight_format, kernels)
            draft_tokenizer = Tokenizer.from_dir(draft_dir)
            check_same_tokenizer(tokenizer, draft_tokenizer)
        cache = PrefixCache(
            model.fingerprint,
            ModelState.for_config(model.config),
            state_dir=cache_dir,
            max_bytes=cache_bytes,
            block_size=cache_block,
        )
        dflash = DFlashDraft.load(dflash_dir, model, weight_format) if dflash_dir is not None else None
        served = cls(name, model, tokenizer, draft, cache, draft_tokenizer, dflash)
        served.backend_reason = backend_reason
        return served

    @property
    def nbytes(self) -> int:
        return self.model.nbytes + (self.draft.nbytes if self.draft is not None else 0)

    def describe(self) -> dict:
        cfg = self.model.config
        return {
            "name": self.name,
            "model_type": cfg.model_type,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "max_context": self.max_context,
            "weights_bytes": self.nbytes,
            "draft": self.draft is not None,
            "dflash": self.dflash is not None,
            "backend": self.model.backend.name,
            "backend_reason": self.backend_reason,
            # where each GEMM shape runs on an NPU backend: "npu", "npu-rowwise" or why the host
            "gemm_placement": getattr(self.model.backend, "describe_placement", dict)(),
            "fingerprint": self.model.fingerprint[:16],
        }

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids (chat messages rendered by the model's template)."""
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True)
        else:
            text = req.prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("bad_request", "the prompt encodes to no tokens")
        return ids

    def count_prompt_tokens(self, req: GenerateRequest) -> int:
        return len(self.prompt_ids(req))

    def start(self, req: GenerateRequest) -> "Session":
        """A session for `req`; raises RequestError when the prompt cannot run on this model."""
        try:
            ids = self.prompt_ids(req)
        except ValueError as e:  # TokenizerError from a chat template, for one
            if isinstance(e, RequestError):
                raise
            raise RequestError("bad_request", str(e)) from e
        if len(ids) + req.max_tokens > self.max_context:
            raise RequestError(
                "prompt_too_long",
                f"prompt of {len(ids)} tokens plus max_tokens {req.max_tokens} exceeds the context of {self.max_context}",
            )
        return Session(self, req, ids)

    def make_head(self, spec: SpecParams, sampling: SamplingConfig):
        method = spec.method
        if method == "auto":
            # the draft model first: on the bundled pair it keeps more drafts per round than
            # the DFlash drafter (docs/dflash.md has the measurements)
            method = "draft" if self.draft is not None else "dflash" if self.dflash is not None else "ngram"
        if method == "none":
            return None
        if method == "ngram":
            return PromptLookupHead()
        if method == "dflash":
            if self.dflash is None:
                raise RequestError("bad_request", f"model {self.name!r} has no DFlash drafter (speculative method 'dflash')")
            return DFlashHead(self.dflash, sampling)
        if self.draft is None:
            raise RequestError("bad_request", f"model {self.name!r} has no draft model (speculative method 'draft')")
        return DraftModelHead(Forward(self.draft), self.tokenizer, self.draft_tokenizer, sampling)


class Session:
    """One request's generation; `run_round()` does one bounded unit of engine work."""

    def __init__(self, served: ServedModel, req: GenerateRequest, prompt_ids: list[int]):
        self.served = served
        self.request = req
        self.prompt_ids = prompt_ids
        self.forward = Forward(served.model)
        self.num_cached_tokens = 0
        spec = req.spec
        head = served.make_head(spec, req.sampling)
        # a DFlash head reads the base's tap rows of every committed position, so it sees the
        # prompt run; a restored prefix would come without those rows (the head would refuse
        # every draft), so such a session prefills its whole prompt (and still offers it)
        self._restore_allowed = not isinstance(head, DFlashHead)
        if isinstance(head, DFlashHead):
            head.attach(self.forward)
        self.generation = Generation(
            self.forward,
            served.tokenizer,
            prompt_ids,
            GenerationConfig(req.max_tokens, req.sampling, tuple(req.stop)),
            head=head,
            spec=SpeculativeConfig(k=spec.k, fallback_rounds=spec.fallback_rounds, reprobe_after=spec.reprobe_after),
        )
        self._rounds = self.generation.rounds()
        self._done = False
        self._cache = served.prefix_cache if req.use_prefix_cache else None
        self._prefilled = False
        self._started = time.perf_counter()
        self._first_token_s: float | None = None

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self.generation.cancel()

    def run_round(self) -> list[TokenEvent]:
        if self._done:
            return []
        if not self._prefilled:
            self._prefilled = True
            if self._cache is not None:
                self._prefill_through_cache()
        try:
            events = next(self._rounds)
        except StopIteration:
            events = []
            self._done = True
        if events and self._first_token_s is None:
            self._first_token_s = time.perf_counter() - self._started
        if self.generation.finish_reason is not None:
            for _ in self._rounds:  # the final yield releases held-back text
                pass
            self._done = True
        return events

    def _prefill_through_cache(self) -> None:
        """Restore the longest cached prefix of the prompt, prefill to the last block boundary
        and offer that state to the cache; the generation prefills the rest.

        The decode loop runs the prompt's last token itself, so the state covers prompt[:-1].
        """
        done = self._cache.prefill(self.forward, self.prompt_ids, rest=False, restore=self._restore_allowed)
        if done.match is not None:
            self.num_cached_tokens = done.match.num_cached_tokens

    def result(self) -> GenerationResult:
        if not self._done:
            raise RuntimeError("the session has not finished")
        g = self.generation
        stats = g.stats.as_dict()
        stats["num_cached_tokens"] = self.num_cached_tokens
        stats["time_to_first_token_s"] = self._first_token_s
        return GenerationResult(
            text=g.text,
            token_ids=tuple(g.token_ids),
            prompt_tokens=len(self.prompt_ids),
            finish_reason=g.finish_reason.value,
            stats=stats,
        )
