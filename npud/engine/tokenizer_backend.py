"""What npud/engine/tokenizer.py's Tokenizer asks of the thing that encodes and decodes, and the
adapter that gives a `tokenizers` object that shape.

Two backends have it: a `tokenizers.Tokenizer` wrapped here (checkpoint directories, GGUF
files with a byte-level BPE) and npud/engine/tokenizer_native.py's NativeBackend (GGUF files with
a SentencePiece vocabulary). The interface, as both implement it:

- `vocab_size` (int): ids below it may be decoded (the library's count with added tokens);
- `byte_level` (bool): pieces are spelled in GPT-2's byte alphabet;
- `encode(text, add_special_tokens=False)`: ids, added tokens written in the text as their ids,
  and the BOS the tokenizer adds when asked;
- `encode_plain(text)`: ids with no added tokens (a control token's spelling as its characters);
- `decode(ids)`: the text of ids below vocab_size (special tokens included);
- `id_to_token(id)`, `token_to_id(text)`: a spelling, an id, or None;
- `added_tokens()`: {id: (spelling, special)} of the tokens matched whole;
- `known_ids()`: int64 array of the ids that have a spelling;
- `add_bos(content)`: encode(..., add_special_tokens=True) puts that token in front.
"""

from __future__ import annotations

import numpy as np

# past this many characters encode() runs where the GIL is released (tokenizers' encode_batch)
_LONG_TEXT = 16384


class TokenizersBackend:
    """A `tokenizers.Tokenizer` (`library`) behind the backend interface."""

    def __init__(self, library) -> None:
        self.library = library
        self.vocab_size: int = library.get_vocab_size(with_added_tokens=True)
        decoder = library.decoder
        self.byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # a long text through encode_batch, which lets other Python threads run meanwhile (a
        # daemon's event loop while a 1 MB prompt is tokenized)
        if len(text) > _LONG_TEXT:
            return self.library.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.library.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        # the normalizer, pre-tokenizer and model run directly, so the vocabulary is not held a
        # second time by a copy of the backend without its added tokens
        lib = self.library
        if lib.normalizer is not None:
            text = lib.normalizer.normalize_str(text)
        pieces = lib.pre_tokenizer.pre_tokenize_str(text) if lib.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in lib.model.tokenize(piece)]

    def decode(self, ids) -> str:
        return self.library.decode(ids, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self.library.id_to_token(token_id)

    def token_to_id(self, content: str) -> int | None:
        return self.library.token_to_id(content)

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        return {i: (tok.content, tok.special) for i, tok in self.library.get_added_tokens_decoder().items()}

    def known_ids(self) -> np.ndarray:
        return np.fromiter(self.library.get_vocab(with_added_tokens=True).values(), dtype=np.int64)

    def add_bos(self, content: str | None) -> None:
        from tokenizers import processors

        if content is None:
            return
        self.library.post_processor = processors.TemplateProcessing(
            single=f"{content} $A", pair=f"{content} $A $B", special_tokens=[(content, self.token_to_id(content))])


def as_backend(backend):
    """`backend` itself when it has the interface, else a `tokenizers.Tokenizer` wrapped."""
    return backend if hasattr(backend, "encode_plain") else TokenizersBackend(backend)
