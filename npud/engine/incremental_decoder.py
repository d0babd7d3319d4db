"""Streaming detokenization: token ids pushed one at a time turned into text that never splits a character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from npud.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Turns tokens pushed one at a time into text, never splitting a character.

    Each push decodes a short window of recent tokens twice, with and without the new
    ones, and emits the difference. Decoding from a window start that lies on a
    character boundary gives the same text as decoding from the beginning, and text is
    held back while it ends in U+FFFD (bytes of an incomplete character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the token after which text was last complete
        self._read = 0  # tokens before this have been emitted
        self._emitted: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer._backend.decode(ids)

    def push(self, token_id: int) -> str:
        """Returns the text the token completes ("" while a character is still partial)."""
        (token_id,) = self._tokenizer._check_ids([token_id])
        if self._skip and token_id in self._tokenizer.special_token_ids:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT_CHAR) or not after.startswith(before):
            return ""
        text = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted.append(text)
        return text

    def flush(self) -> str:
        """Returns the text still held back (e.g. an incomplete character, as U+FFFD)."""
        emitted = "".join(self._emitted)
        full = self._decode(self._ids)
        if full.startswith(emitted):
            text = full[len(emitted):]
        else:
            # a decoder whose windows do not concatenate: emit what the window adds
            before = self._decode(self._ids[self._prefix:self._read])
            text = self._decode(self._ids[self._prefix:])[len(before):]
        self._prefix = self._read = len(self._ids)
        self._emitted = [emitted + text]
        return text
