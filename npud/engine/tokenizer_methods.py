"""What a loaded model answers about its vocabulary without running: tokenize and detokenize
(llama.cpp's /tokenize and /detokenize), a token's bytes, the tokenizer's facts (/props), and
a request's grammar as a constraint over the vocabulary (npud/engine/grammar.py). A mixin of
npud.engine.session.LoadedModel, which has `tokenizer`, `model` and `fim_tokens`."""

from __future__ import annotations

from npud.engine.api import RequestError
from npud.engine.tokenizer import TokenizerError


class TokenizerMethods:
    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """The ids of `text` (special tokens written in it map to their ids); with `add_special`,
        the ids a `prompt` of that text runs as (the BOS its vocabulary asks for in front)."""
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        if add_special and self.tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def detokenize(self, ids) -> str:
        """The text of `ids`; raises RequestError for an id outside the vocabulary."""
        try:
            return self.tokenizer.decode(ids)
        except TokenizerError as exc:
            raise RequestError(str(exc)) from None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token on its own; raises RequestError for an id outside the vocabulary."""
        try:
            return self.tokenizer.token_bytes(token_id)
        except TokenizerError as exc:
            raise RequestError(str(exc)) from None

    def props(self) -> dict:
        """The tokenizer's facts for llama.cpp's /props: special tokens, chat templates, FIM tokens."""
        tok = self.tokenizer
        texts = tok.chat_template_texts
        default = texts.get("default", next(iter(texts.values()))) if len(texts) == 1 or "default" in texts else None
        piece = lambda i: None if i is None else tok.token_bytes(i).decode("utf-8", "replace")  # noqa: E731
        fim = self.fim_tokens
        return {"vocab_size": tok.vocab_size, "bos_token": piece(tok.bos_token_id), "add_bos_token": tok.add_bos_token,
                "eos_tokens": [piece(i) for i in tok.eos_token_ids], "chat_template": default,
                "chat_templates": sorted(texts),
                "fim_tokens": None if fim is None else {"prefix": piece(fim.prefix), "suffix": piece(fim.suffix),
                                                        "middle": piece(fim.middle), "file_sep": piece(fim.file_sep)}}

    def constraint(self, grammar):
        """A fresh npud.engine.grammar.Constraint of `grammar` over this model's vocabulary (built
        once, at the first grammar); raises RequestError when the grammar does not compile."""
        from npud.engine.grammar import Constraint, Vocabulary  # llguidance, only when a request has a grammar

        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.model.config.vocab_size)
        return Constraint(self._vocabulary, grammar)

