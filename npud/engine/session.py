"""What the daemon drives: a loaded model (base, tokenizer, optional draft, prefix cache)
and sessions that generate one request a round at a time.

`LoadedModel` and `ModelSession` implement npud.engine.api's `ServedModel` and `Session`; the
daemon sees only those protocols (and gets a model from npud.engine.loader.load_model). It never
touches a tensor: it calls `start(request)` and then `run_round()` from its device-owner
thread until `done`, checking for cancellation and preemption between rounds. A session
keeps its own state, so a preempted batch job resumes exactly where it stopped.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from typing import TYPE_CHECKING
from pathlib import Path

import numpy as np
import structlog

from npud.engine.api import (
    DEFAULT_CACHE_USERS,
    DEFAULT_PREFILL_BUDGET,
    DeviceFault,
    EngineError,
    GenerateRequest,
    GenerationParams,
    GenerationResult,
    ModelError,
    NotFound,
    PromptTooLong,
    RequestError,
    SamplingParams,
    SpecParams,
    TokenEvent,
)
from npud.engine import progress
from npud.engine.progress import reporting  # noqa: F401  (npud.engine.loader's way to it: a load's progress callback)
from npud.engine.batch import Work, run_round
from npud.engine.chat_templates import ChatTemplateError, choose
from npud.engine.dflash import DFlashDraft, DFlashHead
from npud.engine.drafters import DraftModelHead, PromptLookupHead, check_same_tokenizer
from npud.engine.fim import find_fim_tokens, fim_prompt_ids
from npud.engine.fingerprint import MEMO_FILE, DigestMemo, numerics_key
from npud.engine.forward import Forward
from npud.engine.generate import Generation
from npud.engine.gguf import is_gguf
from npud.engine.gguf.load import GGUF_Q8
from npud.engine.model import Model
from npud.engine.pass_costs import drafter_costs, load_or_calibrate, model_threads
from npud.engine.prefix_cache import PrefixCache, PrefixCacheError
from npud.engine.state import ModelState
from npud.engine.tokenizer import Tokenizer, TokenizerError
from npud.engine.tokenizer_methods import TokenizerMethods
from npud.engine.weights import checkpoint_files
from npud.kernels.base import numerics_identity
from npud.kernels.select import select_backend
from npud.kernels.xrt import XrtUnavailable

if TYPE_CHECKING:  # imported where used: only a Gemma 4 model with an assistant needs it (~0.1 s of a start)
    from npud.engine.assistant import Assistant

log = structlog.get_logger(__name__)

CALIBRATED_ROWS = 16  # the pass costs cover a verify of up to this many rows (Forward's max_batch_rows)


class LoadedModel(TokenizerMethods):
    """A base model with its tokenizer, an optional draft model, and its prefix cache: the
    engine's npud.engine.api.ServedModel."""

    def __init__(
        self,
        name: str,
        model: Model,
        tokenizer: Tokenizer,
        draft: Model | None = None,
        prefix_cache: PrefixCache | None = None,
        draft_tokenizer: Tokenizer | None = None,
        dflash: DFlashDraft | None = None,
        assistant: Assistant | None = None,
    ):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else tokenizer
        self.dflash = dflash
        self.assistant = assistant
        self.prefix_cache = prefix_cache
        self.max_context = model.config.max_position_embeddings
        self.fim_tokens = find_fim_tokens(tokenizer)
        self.backend_reason = "given by the caller"
        self.npu_costs: dict = {}  # the NPU backend's timed shapes, kept when the model moved to the host
        self.threads: int | None = None  # host threads of this model's rounds (None: the default)
        self.draft_costs = self.dflash_costs = None  # the drafters' costs in base steps (npud/engine/pass_costs.py)
        self._vocabulary = None  # npud.engine.grammar.Vocabulary, built at the first constrained request
        # which template renders chats (npud/engine/chat_templates: "checkpoint", "builtin:gemma", ...; None: none)
        self.chat_template: str | None = "checkpoint" if tokenizer.chat_template_names else None
        # the logit ids the tokenizer decodes (None: all); the generation masks the rest
        self.allowed = tokenizer.decodable(model.config.vocab_size)
        if self.allowed is not None:
            masked = np.flatnonzero(~self.allowed)
            log.info("vocab_padded", model=name, vocab_size=model.config.vocab_size,
                     decodable=int(self.allowed.sum()), masked=len(masked), first_masked=int(masked[0]))
        if tokenizer.vocab_size > model.config.vocab_size:
            log.warning("vocab_short", model=name, vocab_size=model.config.vocab_size,
                        tokenizer_ids=tokenizer.vocab_size)

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
        cache_scopes: int = DEFAULT_CACHE_USERS,
        backend: str = "auto",
        xrt_design: str | Path | None = None,
        assistant_dir: str | Path | None = None,
        xrt_timeout_ms: int | None = None,
        context_length: int | None = None,
        threads: int | None = None,
        chat_template: str | None = None,
    ) -> LoadedModel:
        """Load base (and draft) and open the prefix cache (persistent under `cache_dir`, if given;
        `cache_bytes` of memory shared out between `cache_scopes` users and the shared scope).

        Raises ConfigError, WeightsError, TokenizerError or DraftMismatchError (all
        EngineErrors) for model files that are not what they claim, ModelError when backend
        "xrt" cannot run, AssistantMismatchError (a ModelError) for a Gemma 4 assistant made for
        another base, OSError for files that cannot be read.
        """
        progress.report("self_check", 0, 1)
        try:
            kernels, backend_reason = select_backend(backend, None if xrt_design is None else str(xrt_design),
                                                     xrt_timeout_ms=xrt_timeout_ms)
        except XrtUnavailable as exc:  # kernels/ does not know the engine's error types
            raise ModelError(str(exc)) from exc
        progress.report("self_check", 1, 1)
        # the tokenizer first: its temporaries are given back before the weights' arrive, so
        # the two loads' peaks do not add up
        progress.report("tokenizer", 0, 1)
        tokenizer = Tokenizer.from_dir(checkpoint_dir)
        progress.report("tokenizer", 1, 1)
        _give_back_free_heap()
        model = Model.load(checkpoint_dir, weight_format, kernels)
        npu_costs = getattr(kernels, "describe_costs", dict)()
        if backend == "auto" and getattr(kernels, "lost_everywhere", lambda: False)():
            # every shape the NPU could run, the host ran faster: the model is the host's, and says so
            kernels, backend_reason = _host_after_lost_placement(model, kernels, npu_costs)
        # the speculation break-even rule's cost model on this model's own thread count: read from
        # the kernel cache, or measured once
        progress.report("calibration", 0, 1)
        model.pass_costs = load_or_calibrate(model, model_threads(threads), CALIBRATED_ROWS)
        progress.report("calibration", 1, 1)
        # "gguf-q8" names a GGUF file's path: safetensors companions (a draft, a drafter head) take bf16
        companion_format = "bf16" if weight_format == GGUF_Q8 else weight_format
        template_label = _install_chat_template(tokenizer, chat_template)
        draft = draft_tokenizer = None
        if draft_dir is not None:
            with progress.part("draft"):
                draft = Model.load(draft_dir, weight_format if is_gguf(draft_dir) else companion_format, kernels)
                progress.report("tokenizer", 0, 1)
                draft_tokenizer = Tokenizer.from_dir(draft_dir)
                progress.report("tokenizer", 1, 1)
            check_same_tokenizer(tokenizer, draft_tokenizer)
        cache_key = _cache_key(checkpoint_dir, cache_dir, weight_format, kernels)
        cache = PrefixCache(
            cache_key,
            ModelState.for_config(model.config),
            state_dir=cache_dir,
            max_bytes=cache_bytes,
            block_size=cache_block,
            max_scopes=cache_scopes,  # each user has a share of the budgets (npud/engine/prefix_cache.py)
        )
        dflash = assistant = None
        if dflash_dir is not None:
            progress.report("dflash", 0, 1)
            dflash = DFlashDraft.load(dflash_dir, model, companion_format)
            progress.report("dflash", 1, 1)
        if assistant_dir is not None:
            from npud.engine.assistant import Assistant

            progress.report("assistant", 0, 1)
            assistant = Assistant.load(assistant_dir, model, companion_format)
            progress.report("assistant", 1, 1)
        served = cls(name, model, tokenizer, draft, cache, draft_tokenizer, dflash, assistant)
        served.backend_reason = backend_reason
        served.npu_costs = npu_costs
        if context_length is not None:  # never past what the checkpoint was trained for
            served.max_context = max(1, min(served.max_context, context_length))
        served.threads = threads
        served.draft_costs, served.dflash_costs = drafter_costs(model, draft, dflash, model_threads(threads),
                                                                CALIBRATED_ROWS)
        served.chat_template = template_label
        _give_back_free_heap()
        return served

    @property
    def fim(self) -> bool:
        return self.fim_tokens is not None

    @property
    def nbytes(self) -> int:
        extra = sum(m.nbytes for m in (self.draft, self.assistant) if m is not None)
        return self.model.nbytes + extra

    def describe(self) -> dict:
        cfg = self.model.config
        return {
            "name": self.name,
            "model_type": cfg.model_type,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "max_context": self.max_context,
            "fim": self.fim,
            "weights_bytes": self.nbytes,
            "draft": self.draft is not None,
            "dflash": self.dflash is not None,
            "assistant": self.assistant is not None,
            "backend": self.model.backend.name,
            "backend_reason": self.backend_reason,
            "threads": self.threads,  # host threads of its rounds (None: the default)
            "chat_template": self.chat_template,
            # where each GEMM shape runs on an NPU backend: "npu", "npu-rowwise" or why the host
            "gemm_placement": getattr(self.model.backend, "describe_placement", dict)(),
            # the start-up check's tolerance policy of each shape on the NPU (npud/kernels/xrt_check.py)
            "gemm_tolerance": getattr(self.model.backend, "describe_tolerance", dict)(),
            # each timed shape's decode-sized pass on the NPU and on the host (placement by measured cost)
            "gemm_costs": self.npu_costs,
            # where each layer's linears run: "npu", or why the host
            "layer_placement": layer_placement(self.model),
            # the process that holds the NPU for this model (its worker; None on the host): the
            # kernel-log lines that name it are npud's own (npud/guards.py)
            "npu_worker_pid": getattr(self.model.backend, "worker_pid", lambda: None)(),
            "fingerprint": self.model.fingerprint[:16],
            "checkpoint": {**self.model.checkpoint_info, "resident_bytes": self.model.nbytes},
        }

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids (chat messages rendered by the model's template).

        Raises RequestError when the template fails or the prompt encodes to no tokens,
        FimUnsupported for a suffix when the tokenizer has no FIM tokens."""
        try:
            if req.suffix is not None:
                ids = fim_prompt_ids(self.tokenizer, self.fim_tokens, req.prompt, req.suffix, req.fim_extra)
            elif req.messages is not None:
                ids = self.tokenizer.encode_chat(list(req.messages), add_generation_prompt=True)
            else:
                ids = self.tokenizer.encode_text(req.prompt)  # a control token's spelling stays text
        except TokenizerError as exc:  # a template that fails on these messages: the request's fault
            raise RequestError(str(exc)) from exc
        bos = self.tokenizer.bos_token_id
        if req.messages is None and self.tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]  # the vocabulary asks for it (GGUF add_bos_token), as llama.cpp and transformers do
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        rows = self.model.config.vocab_size
        if max(ids) >= rows:
            # a tokenizer with more ids than the embedding has rows: such an id has no embedding
            raise RequestError(f"the prompt holds token id {max(ids)}, past the "
                                              f"{rows} rows of model {self.name!r}'s embedding")
        return ids

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """The prompt's length in tokens; raises RequestError as prompt_ids."""
        return len(self.prompt_ids(request))

    def start(self, request: GenerateRequest) -> "ModelSession":
        """A session for `request`, with max_tokens clamped to what the context has room for;
        raises RequestError when the prompt cannot run on this model (PromptTooLong when the
        prompt alone fills the context)."""
        ids = self.prompt_ids(request)
        room = fitting_max_tokens(len(ids), request.params.max_tokens, self.max_context)
        if request.suffix is not None:
            stop_ids = self.fim_tokens.stop_ids
        else:  # a chat reply ends with its turn, listed among the EOS ids or not
            eot = self.tokenizer.end_of_turn_id if request.messages is not None else None
            stop_ids = () if eot is None else (eot,)
        return ModelSession(self, request, ids, max_tokens=room, stop_token_ids=stop_ids)

    def make_head(self, spec: SpecParams, sampling: SamplingParams):
        """The draft head of `spec.method` (None for "none"); raises RequestError for a method
        this model lacks the parts for."""
        method = spec.method
        if method == "auto":
            # the draft model first: on the bundled pair it keeps more drafts per round than
            # the DFlash drafter (docs/dflash.md has the measurements)
            method = ("draft" if self.draft is not None else "dflash" if self.dflash is not None
                      else "assistant" if self.assistant is not None else "ngram")
        if method == "none":
            return None
        if method == "ngram":
            return PromptLookupHead()
        if method == "dflash":
            if self.dflash is None:
                raise RequestError(f"model {self.name!r} has no DFlash drafter (speculative method 'dflash')")
            return DFlashHead(self.dflash, sampling, pick=self.dflash.proposer(sampling, self.allowed),
                              costs=self.dflash_costs)
        if method == "assistant":
            if self.assistant is None:
                raise RequestError(f"model {self.name!r} has no assistant drafter (speculative method 'assistant')")
            from npud.engine.assistant import AssistantHead

            return AssistantHead(self.assistant)
        if self.draft is None:
            raise RequestError(f"model {self.name!r} has no draft model (speculative method 'draft')")
        return DraftModelHead(Forward(self.draft), self.tokenizer, self.draft_tokenizer, sampling,
                              self.tokenizer.decodable(self.draft.config.vocab_size), costs=self.draft_costs)

    def use_threads(self) -> None:
        """Set the host kernels' thread count to this model's before one of its rounds (the
        engine runs one round at a time, so a process-wide count is this model's while it runs)."""
        from npud.kernels.host import native

        native.set_threads(self.threads or 0)

    def round_cost(self, sequences: int) -> float | None:
        """npud.engine.api.ServedModel.round_cost: an r-row pass's calibrated cost in plain steps
        (npud/engine/pass_costs.py), r = sequences; None without a calibration."""
        if sequences < 1:
            raise ValueError(f"a round has at least one sequence, got {sequences}")
        costs = self.model.pass_costs
        return None if costs is None else float(costs.rows(sequences))

    def run_batch(self, sessions, *, prefill_budget: int | None = DEFAULT_PREFILL_BUDGET):
        """npud.engine.api.ServedModel.run_batch: one round of each session, their base passes packed
        into shared weight streams (npud/engine/batch.py). Returns each session's events, or the
        EngineError that ended its round; DeviceFault propagates. prefill_budget None: no limit."""
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("a session appears twice in one batched round")
        if any(s.served is not self or s.done for s in sessions):
            raise ValueError("run_batch takes sessions of this model that are not done")
        self.use_threads()
        ends = run_round(self.model, [s._work for s in sessions], prefill_budget)
        return [end if isinstance(end, EngineError) else s._end_round(end) for s, end in zip(sessions, ends)]

    # -- the prefix cache, as the daemon's cache.* methods see it ----------------------------

    @property
    def has_prefix_cache(self) -> bool:
        return self.prefix_cache is not None

    def cache_info(self) -> dict:
        """{"stats": {...}, "pins": {name: key}}; raises RuntimeError without a prefix cache."""
        cache = self._cache()
        return {"stats": dataclasses.asdict(cache.stats()), "pins": cache.pins()}

    def cache_pin(self, name: str, *, key: str | None = None, text: str | None = None) -> str:
        """Pin the entry `key`, or the longest cached prefix of `text` after running it through
        a one-token session (its prefill stores the prompt's full blocks). Returns the key.

        Raises NotFound for an unknown key, RequestError for text shorter than one block (or
        that cannot run), ConfigError for a bad name."""
        cache = self._cache()
        if (key is None) == (text is None):
            raise RequestError("give exactly one of key and text")
        if text is not None:
            request = GenerateRequest(prompt=text, params=GenerationParams(max_tokens=1, use_prefix_cache=True))
            session = self.start(request)
            while not session.done:
                session.run_round()
            match = cache.lookup(self.prompt_ids(request))
            if match is None:
                raise RequestError(f"the text is shorter than one cache block ({cache.block_size} tokens), "
                                   "so there is no prefix to pin")
            key = match.key
        try:
            cache.pin(name, key)
        except PrefixCacheError as exc:
            raise NotFound(str(exc)) from None
        return key

    def cache_drop(self, key: str) -> bool:
        """Remove the entry `key` and its pins; returns whether it existed."""
        return self._cache().drop(key)

    def cache_flush(self) -> int:
        """Write in-memory entries to disk; returns how many (0 without a cache)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.flush()

    def _cache(self) -> PrefixCache:
        if self.prefix_cache is None:
            raise RuntimeError(f"model {self.name!r} has no prefix cache")  # callers check has_prefix_cache
        return self.prefix_cache


def _give_back_free_heap() -> None:
    """Return the free pages of the heap to the kernel (glibc's malloc_trim; nothing elsewhere):
    a load frees hundreds of megabytes of temporaries (the tokenizer's Python vocabulary and
    merges on their way into Rust, the weights' unpacked blocks) that glibc would keep."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _cache_key(checkpoint_dir, cache_dir, weight_format: str, backend) -> str:
    """The prefix-cache key of the base (npud/engine/fingerprint.py), its file digests remembered in
    the cache directory. Raises WeightsError or FingerprintError."""
    started = time.perf_counter()
    memo = DigestMemo(None if cache_dir is None else Path(cache_dir) / MEMO_FILE)
    key = numerics_key(checkpoint_files(checkpoint_dir), memo, weight_format=weight_format, backend=backend)
    # a GGUF's blocks are served as they are under any setting but gguf-q8: the log says so (the key keeps the setting)
    served_as = weight_format if weight_format == GGUF_Q8 or not is_gguf(checkpoint_dir) else "gguf"
    log.info("prefix_cache_key", key=key[:16], weight_format=served_as, backend=numerics_identity(backend),
             files_read=memo.files_read, seconds=round(time.perf_counter() - started, 3))
    return key


def fitting_max_tokens(num_prompt_tokens: int, max_tokens: int, max_context: int) -> int:
    """How many new tokens a prompt may generate: max_tokens, or fewer when the context has
    fewer positions left after the prompt (each generated token takes one, the last included).

    Raises PromptTooLong, naming both numbers, when the prompt leaves no position at all."""
    room = max_context - num_prompt_tokens
    if room < 1:
        raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens and the model's context holds "
                            f"{max_context}: no room for a new token")
    return min(max_tokens, room)


class ModelSession:
    """One request's generation; `run_round()` does one bounded unit of engine work (the
    engine's npud.engine.api.Session). `max_tokens` (at most the request's) is what the context has
    room for; `stop_token_ids` end the run as EOS does (a FIM middle's end tokens, a chat turn's end)."""

    def __init__(self, served: LoadedModel, req: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                 stop_token_ids: tuple[int, ...] = ()):
        self.served = served
        self.request = req
        self.prompt_ids = prompt_ids
        self.forward = Forward(served.model)
        self.num_cached_tokens = 0
        params = req.params
        self.max_tokens_clamped_to = max_tokens if max_tokens < params.max_tokens else None
        if self.max_tokens_clamped_to is not None:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        head = served.make_head(params.spec, params.sampling)
        # a DFlash head reads the base's tap rows of every committed position, so it sees the
        # prompt run; a restored prefix would come without those rows (the head would refuse
        # every draft), so such a session prefills its whole prompt (and still offers it)
        self._restore_allowed = not isinstance(head, DFlashHead)
        if hasattr(head, "attach"):  # the heads that read the base's hidden rows (DFlash, the Gemma 4 assistant)
            head.attach(self.forward)
        constraint = None if params.grammar is None else served.constraint(params.grammar)
        self.generation = Generation(self.forward, served.tokenizer, prompt_ids, params, head=head,
                                     stop_token_ids=stop_token_ids, constraint=constraint)
        self._done = False
        self._cache = served.prefix_cache if params.use_prefix_cache else None
        self._work = Work(self.forward, self._rounds())
        self._started = time.perf_counter()
        self._first_token_s: float | None = None

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self.generation.cancel()

    def run_round(self) -> list[TokenEvent]:
        """One round (the first prefills the whole prompt); returns the events it released.
        The same driver as a batched round (npud/engine/batch.py), with this session alone."""
        if self._done:
            return []
        self.served.use_threads()
        (end,) = run_round(self.served.model, [self._work], prefill_budget=None)
        if isinstance(end, EngineError):
            raise end
        return self._end_round(end)

    def _rounds(self):
        """The session's rounds as npud.engine.batch.Work runs them: the prompt's cached prefix
        restored and the prefill up to its last block boundary offered to the cache (when the
        request uses it), then the generation's rounds."""
        if self._cache is not None:
            done = yield from self._cache.prefill_passes(self.forward, self.prompt_ids, rest=False,
                                                         restore=self._restore_allowed, scope=self.request.cache_scope)
            # the decode loop runs the prompt's last token itself, so the state covers prompt[:-1]
            if done.match is not None:
                self.num_cached_tokens = done.match.num_cached_tokens
        yield from self.generation.work()

    def _end_round(self, events: list[TokenEvent] | None) -> list[TokenEvent]:
        """Book a round's end (None: the rounds were over); returns its events."""
        if events is None:
            events = []
            self._done = True
        if events and self._first_token_s is None:
            self._first_token_s = time.perf_counter() - self._started
        if self.generation.finish_reason is not None:
            self._work.drain()  # the final yield releases held-back text
            self._done = True
        return events

    def result(self) -> GenerationResult:
        """The finished generation; raises RuntimeError before `done`."""
        if not self._done:
            raise RuntimeError("the session has not finished")
        g = self.generation
        stats = g.stats.as_dict()
        stats["num_cached_tokens"] = self.num_cached_tokens
        stats["time_to_first_token_s"] = self._first_token_s
        if self.request.messages is not None:  # which template wrote the prompt
            stats["chat_template"] = self.served.chat_template
        if self.request.params.grammar is not None:  # false: max_tokens (or a stop string) cut the output short
            stats["grammar_complete"] = g.ended_at_eos
        return GenerationResult(
            text=g.text,
            token_ids=tuple(g.token_ids),
            prompt_tokens=len(self.prompt_ids),
            finish_reason=g.finish_reason,
            stats=stats,
            max_tokens_clamped_to=self.max_tokens_clamped_to,
            logprobs=None if g.logprobs is None else tuple(g.logprobs),
        )


def _install_chat_template(tokenizer: Tokenizer, setting: str | None) -> str | None:
    """Give `tokenizer` the template npud/engine/chat_templates.choose picks; returns its label.
    Raises ModelError for a chat_template file that cannot be read or does not parse."""
    try:
        text, label = choose(setting, bool(tokenizer.chat_template_names), tokenizer.token_id)
        if text is not None:
            tokenizer.use_chat_template(text, label)
    except (ChatTemplateError, TokenizerError) as exc:
        raise ModelError(str(exc)) from None
    return label


def check_grammar(grammar) -> None:
    """npud.engine.loader.check_grammar: raises ConfigError when `grammar` does not compile."""
    from npud.engine.grammar import check  # llguidance, only when a request has a grammar

    check(grammar)


def _host_after_lost_placement(model, kernels, costs: dict):
    """The model moved to the host backend after the NPU lost every shape it was timed on (its
    weights are the host's layouts already: the NPU backend prepares those for every weight);
    returns (the host backend, the reason describe() gives)."""
    host = kernels.host
    kernels.close()  # its worker goes: nothing will run on it
    model.backend = host
    worst = ", ".join(f"{shape}: NPU {c['npu_ms']} ms, host {c['host_ms']} ms" for shape, c in list(costs.items())[:3])
    reason = (f"host backend: the NPU was slower than the host on every GEMM shape it was timed on "
              f"({len(costs)} shapes; {worst})")
    log.warning("npu_placement_lost", shapes=len(costs), costs=costs)
    return host, reason


def layer_placement(model) -> dict:
    """Where each layer's linears run, {layer index: {linear: "npu" | why the host}}, as the
    model's backend places them (empty for a backend that places nothing)."""
    import dataclasses

    from npud.kernels.base import LinearWeight

    where = getattr(model.backend, "where", None)
    if where is None:
        return {}
    out = {}
    for i, layer in enumerate(model.weights.layers):
        placed = {}
        for part in dataclasses.fields(layer):
            value = getattr(layer, part.name)
            items = [(part.name, value)] if isinstance(value, LinearWeight) else (
                [(f"{part.name}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
                if dataclasses.is_dataclass(value) else [])
            for name, w in items:
                if isinstance(w, LinearWeight):
                    placed[name] = where(w)
        out[str(i)] = placed
    return out


def describe_checkpoint(path) -> dict:
    """npud.engine.loader.describe_checkpoint: a .gguf file's header, or a checkpoint directory's
    config, tokenizer and weight headers, checked and described."""
    if Path(path).is_dir():
        return _describe_directory(Path(path))
    from npud.engine.gguf.describe import describe_gguf

    return describe_gguf(path)


def _describe_directory(directory: Path) -> dict:
    """What a load reads of a checkpoint directory but the tensor data: a config npud cannot
    run, a tokenizer that does not load, or weight files that are missing or malformed fail
    here (the files are memory-mapped, not read)."""
    from npud.engine.config import load_config
    from npud.engine.weights.checkpoint import open_checkpoint

    config = load_config(directory)
    Tokenizer.from_dir(directory)
    tensors = open_checkpoint(directory)
    return {
        "format": "safetensors",
        "model_type": config.model_type,
        "tensors": len(tensors),
        "parameters": sum(int(np.prod(ref.shape)) for ref in tensors.values()),
        "file_bytes": sum(p.stat().st_size for p in checkpoint_files(directory)),
        "context_length": config.max_position_embeddings,
    }
