"""The daemon–engine boundary: what a request is, what it returns, how it fails, and the
two objects the daemon drives.

Standard library only (no numpy): the daemon imports this module of the engine, and
npud/engine/loader.py, whose `load_model` is the one way in to a real model (it imports the engine
proper when it is called; nothing here imports back into the engine). Everything a request can carry is declared once here, validated where it
is declared, and used by the engine as it is; the daemon parses the wire into these types
and never re-declares their fields.

Errors: an `EngineError` is an expected failure (bad input, a model that does not load, a
prompt that does not fit); its `code` is stable and the daemon maps it to a protocol error
code. Any other exception from the engine is a bug and reaches clients as internal_error.

docs/interfaces.md is generated from this module (tools/gen_interfaces.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Protocol

from npud.kernels import errors as _kernel_errors  # standard library only, like this module

SPEC_METHODS = ("auto", "none", "ngram", "draft", "dflash", "assistant")
"""The speculative methods: auto (the draft model, else the DFlash drafter, else the Gemma 4
assistant, else prompt lookup), none (plain decode), ngram (prompt lookup), draft (a smaller
model), dflash (a block drafter), assistant (a Gemma 4 assistant reading the base's states)."""

DEFAULT_MAX_TOKENS = 128
DEFAULT_SPEC_METHOD = "auto"
DEFAULT_SPEC_K = 4
DEFAULT_LOOKUP_K = 16  # prompt lookup's: its drafts are free, and adapt_k shrinks k after a reject
DEFAULT_FALLBACK_ROUNDS = 3
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs bound)
GRAMMAR_KINDS = ("json_schema", "regex", "lark")
"""What a Grammar's source is: a JSON schema (as JSON text; `{"type": "object"}` is OpenAI's
JSON mode), a regular expression, or a grammar in llguidance's Lark dialect."""


# -- errors --------------------------------------------------------------------------------


class EngineCode(enum.StrEnum):
    """Stable codes of expected engine failures; each is also a protocol error code."""

    BAD_REQUEST = "bad_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    MODEL_ERROR = "model_error"
    NOT_FOUND = "not_found"
    FIM_UNSUPPORTED = "fim_unsupported"


class EngineError(ValueError):
    """An expected engine failure; `code` (an EngineCode) says which, `message` says why."""

    code: EngineCode = EngineCode.BAD_REQUEST

    def __init__(self, message: str, code: EngineCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ConfigError(EngineError):
    """A request parameter or a model configuration value is missing, of the wrong type or
    out of range; the message names the field and the value."""


class RequestError(EngineError):
    """A valid request that this model cannot run (no draft model for method "draft", a prompt
    that encodes to nothing, a chat template that fails)."""


class PromptTooLong(RequestError):
    """The prompt alone leaves no room in the model's context for a generated token (a prompt
    that fits but leaves less than max_tokens has max_tokens clamped instead)."""

    code = EngineCode.PROMPT_TOO_LONG


class FimUnsupported(RequestError):
    """A fill-in-the-middle request (GenerateRequest.suffix) for a model whose tokenizer has no
    FIM tokens; the message names the tokens it lacks."""

    code = EngineCode.FIM_UNSUPPORTED


class ModelError(EngineError):
    """Model files that are not what they claim, or a backend that cannot run them."""

    code = EngineCode.MODEL_ERROR


class NotFound(EngineError):
    """No such prefix-cache entry."""

    code = EngineCode.NOT_FOUND


DeviceFault = _kernel_errors.DeviceFault
"""An accelerator call that did not complete normally (npud.kernels.errors.DeviceFault, a
RuntimeError, not an EngineError: the device failed, not the request). Whatever the round
computed is void; the daemon faults the ticket and quarantines the device."""


# -- checks the validated dataclasses share ------------------------------------------------


def is_int(value: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """True for a finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- the request ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """temperature 0 is greedy (first index of the maximum, as the backends' argmax);
    top_k 0 and top_p 1.0 switch those filters off; seed fixes the job's random stream.

    Raises ConfigError naming the field for a value out of range."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (is_number(self.temperature) and self.temperature >= 0.0):
            raise ConfigError(f"SamplingParams.temperature must be a number >= 0, got {self.temperature!r}")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ConfigError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not (is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"SamplingParams.top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (is_int(self.seed) and self.seed >= 0):
            raise ConfigError(f"SamplingParams.seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class SpecParams:
    """Speculative decoding: `method` (one of SPEC_METHODS) drafts up to k tokens a round (None:
    the method's default, DEFAULT_LOOKUP_K for prompt lookup and DEFAULT_SPEC_K for the others).
    adapt_k: after a round with a reject the next drafts number take + 1 (what the head just
    got right, and one more), after a fully accepted round twice as many, never more than k;
    where the base has calibrated pass costs and the head a cost for its drafts, never more
    than the plan either: the draft count with the most tokens per plain step at the
    acceptance seen so far (npud/engine/break_even.py's best_k).
    Fall back to plain steps once `fallback_rounds` consecutive rounds, taken together, were
    below break-even (0 never falls back); speculate again after `reprobe_after` plain tokens
    (None: stay on plain decode for the rest of the job, except with prompt lookup, whose drafts
    cost nothing: it tries again after 16).

    Raises ConfigError naming the field for a value out of range."""

    method: str = DEFAULT_SPEC_METHOD
    k: int | None = None
    adapt_k: bool = True
    fallback_rounds: int = DEFAULT_FALLBACK_ROUNDS
    reprobe_after: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"SpecParams.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        if self.k is not None and not (is_int(self.k) and self.k >= 1):
            raise ConfigError(f"SpecParams.k must be None or an integer >= 1, got {self.k!r}")
        if not isinstance(self.adapt_k, bool):
            raise ConfigError(f"SpecParams.adapt_k must be a bool, got {self.adapt_k!r}")
        if not (is_int(self.fallback_rounds) and self.fallback_rounds >= 0):
            raise ConfigError(f"SpecParams.fallback_rounds must be an integer >= 0, got {self.fallback_rounds!r}")
        if self.reprobe_after is not None and not (is_int(self.reprobe_after) and self.reprobe_after >= 1):
            raise ConfigError(f"SpecParams.reprobe_after must be None or an integer >= 1, got {self.reprobe_after!r}")


@dataclass(slots=True, frozen=True)
class Grammar:
    """A constraint on the generated text (structured output): `kind` one of GRAMMAR_KINDS and
    its `source`. The engine compiles it with llguidance against the model's own vocabulary
    and masks every logits row the base model scores for a generated token (a plain step's and
    each row of a speculative verify, in order), so greedy output is byte-identical with and
    without speculation: a draft that leaves the grammar is rejected like any other. A
    grammar that leaves no token allowed ends the run with FinishReason.GRAMMAR_DEAD_END.

    Raises ConfigError for an unknown kind or a source that is not a string; `check_grammar`
    says whether it compiles."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError(f"Grammar.kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConfigError(f"Grammar.source must be a string, got {type(self.source).__name__}")


@dataclass(slots=True, frozen=True)
class GenerationParams:
    """Everything a request asks for except its prompt: at most `max_tokens` new tokens, drawn
    under `sampling`, ended early by any of the `stop` strings (not part of the text),
    speculated under `spec`, the prompt's prefix looked up in the prefix cache unless
    `use_prefix_cache` is false. `logprobs` (None: off) asks for each generated token's log
    probability and that many most likely alternatives (0 to MAX_TOP_LOGPROBS), from the
    logits row that chose the token (TokenLogprob). `grammar` (None: free text) constrains
    the text (Grammar).

    Raises ConfigError naming the field for a value out of range."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    spec: SpecParams = field(default_factory=SpecParams)
    use_prefix_cache: bool = True
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ConfigError(f"GenerationParams.grammar must be a Grammar or None, got {type(self.grammar).__name__}")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"GenerationParams.logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                              f"got {self.logprobs!r}")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ConfigError(f"GenerationParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(f"GenerationParams.sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if not (isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop)):
            raise ConfigError(f"GenerationParams.stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.spec, SpecParams):
            raise ConfigError(f"GenerationParams.spec must be SpecParams, got {type(self.spec).__name__}")
        if not isinstance(self.use_prefix_cache, bool):
            raise ConfigError(f"GenerationParams.use_prefix_cache must be a bool, got {self.use_prefix_cache!r}")


@dataclass(slots=True, frozen=True)
class GenerateRequest:
    """One prompt (a string, or chat messages the model's template renders) and its params.

    Fill-in-the-middle when `suffix` is not None: `prompt` is the text before the gap, `suffix`
    the text after it (may be empty), and the model writes the middle. The engine renders
    prefix and suffix between the tokenizer's FIM tokens (prefix, suffix, middle order), and
    stops at its FIM end tokens; a model without FIM tokens raises FimUnsupported. `fim_extra`
    holds (filename, text) chunks of other files for context (llama.cpp's input_extra): with a
    file-separator token (Qwen2.5-Coder's `<|file_sep|>`) each chunk is `<|file_sep|>filename`,
    a newline and its text, and one more `<|file_sep|>` opens the file being edited, as in
    Qwen2.5-Coder's repository-level format; without one, each chunk is plain text
    "--- filename ---", a newline, its text and a newline, put in front of the prefix.

    Raises ConfigError unless exactly one of prompt and messages is given, for a suffix with
    messages, and for fim_extra without a suffix."""

    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    suffix: str | None = None
    fim_extra: tuple[tuple[str, str], ...] = ()
    # Whose prefix-cache entries the request may restore and makes: entries of one scope are
    # never found from another, so a cache hit says nothing about another scope's prompts.
    # None is the shared scope (the entries an operator pins with cache_pin(text=...)); a
    # scoped request also restores those, and only those, of the shared scope.
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ConfigError("GenerateRequest needs exactly one of prompt and messages")
        if self.cache_scope is not None and (not isinstance(self.cache_scope, str) or not self.cache_scope):
            raise ConfigError(f"GenerateRequest.cache_scope must be a non-empty string or None, got {self.cache_scope!r}")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ConfigError(f"GenerateRequest.prompt must be a string, got {type(self.prompt).__name__}")
        if self.messages is not None and not (
            isinstance(self.messages, tuple) and all(isinstance(m, dict) for m in self.messages)
        ):
            raise ConfigError("GenerateRequest.messages must be a tuple of {'role', 'content'} dicts")
        if not isinstance(self.params, GenerationParams):
            raise ConfigError(f"GenerateRequest.params must be GenerationParams, got {type(self.params).__name__}")
        if self.suffix is not None:
            if not isinstance(self.suffix, str):
                raise ConfigError(f"GenerateRequest.suffix must be a string or None, got {type(self.suffix).__name__}")
            if self.messages is not None:
                raise ConfigError("GenerateRequest.suffix (fill-in-the-middle) needs a prompt, not messages")
        if not (isinstance(self.fim_extra, tuple) and all(
                isinstance(c, tuple) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in self.fim_extra)):
            raise ConfigError("GenerateRequest.fim_extra must be a tuple of (filename, text) string pairs")
        if self.fim_extra and self.suffix is None:
            raise ConfigError("GenerateRequest.fim_extra needs a suffix (it is context for fill-in-the-middle)")


# -- the result ----------------------------------------------------------------------------


class FinishReason(enum.StrEnum):
    """Why a generation ended."""

    STOP = "stop"  # an EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    GRAMMAR_DEAD_END = "grammar_dead_end"  # the request's grammar allowed no token (not even EOS)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log probability under the base model's raw distribution at its position: the
    log-softmax, in float64, of the float32 logits row that chose or judged it (before
    temperature, top_k and top_p; ids a padded vocabulary cannot decode excluded), so it is
    the same whether the token was drafted and verified or chosen by a plain step. `token` is
    its bytes on its own; `top` the most likely tokens of that row, most likely first (ties by
    id), as TokenLogprobs without a `top` of their own."""

    token_id: int
    token: bytes
    logprob: float
    top: tuple["TokenLogprob", ...] = ()


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """One step of the text stream: `token_id` None is text released at the end of the run with
    no new token; `text` is what this token released (may be empty, or hold text of earlier
    tokens held back while they could have begun a stop string). `logprob` is the token's when
    the request asked for logprobs."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None


@dataclass(slots=True, frozen=True)
class GenerationResult:
    """A finished generation: the text, its token ids, the prompt's length in tokens, why it
    ended, and the engine's counters (JSON-able: numbers, strings, lists, dicts, None).
    `max_tokens_clamped_to` is the number of new tokens the context had room for when that was
    fewer than max_tokens asked (None otherwise); reaching it ends the run with `length`.
    `logprobs` holds one TokenLogprob per token id when the request asked for them."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: FinishReason
    stats: dict
    max_tokens_clamped_to: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


# -- what the daemon drives ----------------------------------------------------------------


# A batched round's prompt rows (npud.engine.api.ServedModel.run_batch): enough for one prefill
# chunk, so a prompt joining a running batch costs the others at most one chunk per round.
DEFAULT_PREFILL_BUDGET = 64

# The chat templates npud brings for checkpoints that ship none (npud/engine/chat_templates/): a
# model's chat_template setting may name one of these instead of a Jinja file.
BUILTIN_CHAT_TEMPLATES = ("gemma", "chatml", "llama3", "mistral")

class Session(Protocol):
    """One request's generation, run a bounded unit of work at a time (blocking calls; the
    daemon makes them from one thread at a time, and checks for cancellation and preemption
    between two of them)."""

    @property
    def done(self) -> bool:
        """True once the generation has ended (result() may be called)."""

    def cancel(self) -> None:
        """End the generation at the next round with finish reason `cancelled`."""

    def run_round(self) -> list[TokenEvent]:
        """One round of engine work (the first is the prompt's prefill); returns the events it
        released (may be empty). Sets `done` after the last round."""

    def result(self) -> GenerationResult:
        """The finished generation; raises RuntimeError before `done`."""


class ServedModel(Protocol):
    """A loaded model (with its tokenizer, optional draft model and prefix cache) that starts
    sessions. All methods block and run in the daemon's engine thread."""

    name: str
    nbytes: int  # resident bytes of weights (base + draft)
    max_context: int  # positions: prompt plus generated tokens
    fim: bool  # the tokenizer has FIM tokens: a request with a suffix can run

    def describe(self) -> dict:
        """What the model is, as JSON for `models` (type, sizes, backend, ...)."""

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """The request's prompt length in tokens; raises RequestError when it does not encode."""

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """The token ids of `text` (special tokens written in it map to their ids); with
        `add_special`, the ids a `prompt` of that text runs as (the BOS the vocabulary asks for).
        Thread-safe: may run beside a round (the tokenizer is read-only)."""

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of `ids`; raises RequestError for an id outside the vocabulary. Thread-safe."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (exact for part of a character); raises
        RequestError for an id outside the vocabulary. Thread-safe."""

    def props(self) -> dict:
        """The tokenizer's facts as JSON: vocab_size, bos_token, add_bos_token, eos_tokens,
        chat_template (the default's Jinja source, or None), chat_templates (names), fim_tokens."""

    def start(self, request: GenerateRequest) -> Session:
        """A session for the request, its max_tokens clamped to the positions the context has
        left after the prompt; raises RequestError (PromptTooLong when the prompt alone leaves
        no room for a new token, FimUnsupported for a suffix on a model without FIM tokens,
        bad_request for a method the model lacks)."""

    @property
    def has_prefix_cache(self) -> bool:
        """True when the model keeps a prefix cache (the cache_* methods need one)."""

    def cache_info(self) -> dict:
        """The prefix cache as JSON: {"stats": {counter: number}, "pins": {name: key}}."""

    def cache_pin(self, name: str, *, key: str | None = None, text: str | None = None) -> str:
        """Pin an entry under `name`: the entry `key`, or the longest cached prefix of `text`
        (run through a one-token session first). Returns the pinned key; raises NotFound for an
        unknown key, RequestError for text without a full cache block."""

    def cache_drop(self, key: str) -> bool:
        """Forget the entry `key` (and any pin on it); returns False when there was none."""

    def cache_flush(self) -> int:
        """Write in-memory prefix-cache entries to disk; returns how many were written."""

    def round_cost(self, sequences: int) -> float | None:
        """What a round of `sequences` decoding sequences (a row each) costs in one sequence's
        steps, by the model's calibrated pass costs (1.0 for one); None when they are not known."""

    def run_batch(self, sessions: Sequence[Session], *, prefill_budget: int = DEFAULT_PREFILL_BUDGET
                  ) -> list[list[TokenEvent] | EngineError]:
        """One round of each of `sessions` (started by this model, none done, each at most
        once), their base passes packed into shared weight streams: item i is what
        sessions[i].run_round() would have returned, with the same tokens, logits and state bit
        for bit, or the EngineError that ended that session's round (the others go on).
        Sessions still prefilling take at most `prefill_budget` prompt rows between them this
        round (each at least one chunk when alone), so a long prompt joining a running batch
        does not stall the others. Raises DeviceFault when the device fails: the round is void
        for every session."""


# A served model's prefix cache has a budget share for each of this many users (and one for
# the shared scope): npud/engine/prefix_cache.py, docs/operations.md.
DEFAULT_CACHE_USERS = 7


LOAD_STAGES = ("self_check", "tokenizer", "reading", "weights", "calibration", "draft", "dflash", "assistant")
"""The stages of a load, in the order they come: the host kernels' start-up self-check (once
per process), the tokenizer, reading and validating the checkpoint's header, converting the
weights (done/total layers), the speculation cost calibration (read from the kernel cache, or
measured once), then the companions: a draft model (its own stages come as "draft tokenizer",
"draft reading", "draft weights"), a DFlash drafter, a Gemma 4 assistant."""


@dataclass(slots=True, frozen=True)
class LoadProgress:
    """How far a load is: `done` of `total` in `stage` (one of LOAD_STAGES, or "draft " and a
    stage). A stage's first report has done = 0, its last done = total."""

    stage: str
    done: int
    total: int


class LoadProgressCallback(Protocol):
    """Called by the thread that loads, at each step of the load; it must return quickly and
    not raise (a load does not wait for the daemon)."""

    def __call__(self, progress: LoadProgress) -> None: ...


class ModelLoader(Protocol):
    """How the daemon gets a ServedModel (npud.engine.loader.load_model; tests pass fakes).
    `progress`, when given, hears each LoadProgress of the load, in the loading thread."""

    def __call__(self, name: str, checkpoint_dir: str | Path, *, draft_dir: str | Path | None = None,
                 dflash_dir: str | Path | None = None, weight_format: str = "bf16",
                 cache_dir: str | Path | None = None, backend: str = "auto",
                 xrt_design: str | Path | None = None, assistant_dir: str | Path | None = None,
                 xrt_timeout_ms: int | None = None, cache_users: int = DEFAULT_CACHE_USERS,
                 context_length: int | None = None, threads: int | None = None,
                 chat_template: str | None = None,
                 progress: LoadProgressCallback | None = None) -> ServedModel: ...
