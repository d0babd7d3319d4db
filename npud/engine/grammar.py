"""Structured output: a request's Grammar as token masks, with llguidance.

llguidance (the constraint engine of llama.cpp and vLLM) compiles a JSON schema, a regex or a
Lark grammar and, at each step, says which tokens of a vocabulary may come next. Its view of
the vocabulary is built here from the model's own tokenizer (npud/engine/tokenizer.py): each id's
exact bytes (Tokenizer.token_bytes), special tokens marked as llguidance expects (a 0xFF byte
in front, so no text can spell them), ids past the tokenizer (a padded embedding) empty, and
the tokenizer's own encoder for what llguidance re-tokenizes. One `Vocabulary` per loaded
model, built at its first constrained request; one `Constraint` (a matcher) per generation.
"""

from __future__ import annotations

import json

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from npud.engine.api import ConfigError, Grammar, RequestError

MAX_MESSAGE_CHARS = 400  # of llguidance's error text in a reply
# JSON as json.dumps writes it by default: ", " and ": " and no other whitespace. llguidance's
# own default lets whitespace run free, and a small model then fills max_tokens with newlines;
# a schema's "x-guidance" object may still ask for other separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _message(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def ll_grammar(grammar: Grammar) -> str:
    """llguidance's grammar text for `grammar`; raises ConfigError for a schema that is not a
    JSON object."""
    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except ValueError:
            raise ConfigError("the JSON schema is not valid JSON") from None
        if not isinstance(schema, dict):
            raise ConfigError("a JSON schema must be a JSON object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise ConfigError(f"invalid JSON schema: {_message(str(exc))}") from None
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.source)
    return LLMatcher.grammar_from_lark(grammar.source)


_WHAT = {"json_schema": "JSON schema", "regex": "regex", "lark": "Lark grammar"}


def check(grammar: Grammar, vocabulary: "Vocabulary | None" = None) -> None:
    """Raise ConfigError with llguidance's reason when `grammar` does not compile."""
    error = LLMatcher.validate_grammar(ll_grammar(grammar), None if vocabulary is None else vocabulary.ll)
    if error:
        raise ConfigError(f"invalid {_WHAT[grammar.kind]}: {_message(error)}")


class _Vocab:
    """What llguidance's TokenizerWrapper reads: the ids' bytes, EOS and BOS, and an encoder."""

    def __init__(self, tokenizer, width: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        special = tokenizer.special_token_ids
        self.special_token_ids = sorted(i for i in special if i < width)
        self.tokens = [b"" if i >= tokenizer.vocab_size
                       else (b"\xff" + tokenizer.token_bytes(i)) if i in special else tokenizer.token_bytes(i)
                       for i in range(width)]

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text)


class Vocabulary:
    """llguidance's tokenizer over a model's `width` logit ids (blocking: a second or so for a
    vocabulary of 262k ids; build it once per model)."""

    def __init__(self, tokenizer, width: int) -> None:
        self.width = width
        eos = [i for i in tokenizer.eos_token_ids if i < width]
        self.ll = LLTokenizer(TokenizerWrapper(_Vocab(tokenizer, width)), n_vocab=width, eos_token=eos or None)


class Constraint:
    """One generation's grammar state: which ids may come next, and the tokens taken so far.

    Raises RequestError when the grammar does not compile against this vocabulary."""

    def __init__(self, vocabulary: Vocabulary, grammar: Grammar) -> None:
        try:
            check(grammar, vocabulary)
        except ConfigError as exc:
            raise RequestError(exc.message) from None
        self.width = vocabulary.width
        self.matcher = LLMatcher(vocabulary.ll, ll_grammar(grammar), log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"invalid {_WHAT[grammar.kind]}: {_message(self.matcher.get_error())}")
        self._allowed: np.ndarray | None = None  # of the current state, until the next consume
        self.consumed = 0

    def allowed(self) -> np.ndarray:
        """bool [width]: the ids the grammar allows next (none after an error)."""
        if self._allowed is None:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            self._allowed = np.unpackbits(bits, count=self.width, bitorder="little").astype(bool)
        return self._allowed

    def consume(self, token: int) -> None:
        """Advance past `token` (one the mask allowed). Raises RuntimeError for one it did not."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"token {token} was chosen outside the grammar: {self.matcher.get_error()}")
        self._allowed = None
        self.consumed += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed (tokens judged but never committed)."""
        if num_tokens:
            if not self.matcher.rollback(num_tokens):
                raise RuntimeError(f"the grammar cannot roll back {num_tokens} tokens")
            self._allowed = None
            self.consumed -= num_tokens
