"""Fill-in-the-middle: the prompt a code model was trained on for "write what goes between
this prefix and this suffix", built from the tokenizer's own FIM tokens.

Two spellings are recognised, each as a whole set: Qwen2.5-Coder / Qwen3 and CodeGemma write
`<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`; StarCoder / StarCoder2 write
`<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`. The order is prefix, suffix, middle (PSM),
the one these models were trained with; the model's answer is the middle, which ends at the
tokenizer's EOS or at a token that would start another document (`<|fim_pad|>`,
`<|file_sep|>`, `<|repo_name|>`, ..., whichever of them the vocabulary has).

The pieces are encoded one by one and joined as ids, so the FIM tokens are exactly where the
format puts them whatever the text next to them encodes to.
"""

from __future__ import annotations

from dataclasses import dataclass

from npud.engine.api import FimUnsupported

# (prefix, suffix, middle) of each spelling, and the tokens that end a middle in that spelling
_SPELLINGS = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>", "<|endoftext|>")),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
     ("<fim_pad>", "<file_sep>", "<repo_name>", "<|endoftext|>")),
)
# the token that starts a file in a repository-level prompt, by spelling
_FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>")
CHUNK_HEADER = "--- {filename} ---\n"  # a fim_extra chunk's header where there is no file separator


@dataclass(slots=True, frozen=True)
class FimTokens:
    """A tokenizer's FIM token ids; `stop_ids` end a middle (besides the tokenizer's EOS ids)."""

    prefix: int
    suffix: int
    middle: int
    file_sep: int | None
    stop_ids: tuple[int, ...]


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM tokens of the first spelling whose three markers are all in the vocabulary."""
    for markers, enders in _SPELLINGS:
        ids = [tokenizer.token_id(m) for m in markers]
        if None in ids:
            continue
        stops = tuple(dict.fromkeys(i for i in (tokenizer.token_id(t) for t in (*markers, *enders)) if i is not None))
        seps = [i for i in (tokenizer.token_id(t) for t in _FILE_SEPARATORS) if i is not None]
        return FimTokens(*ids, file_sep=seps[0] if seps else None, stop_ids=stops)
    return None


def missing_fim_tokens(tokenizer) -> str:
    """What a tokenizer without FIM tokens lacks, for the error message: each spelling's
    markers that are not in its vocabulary."""
    first, *others = (", ".join(m for m in markers if tokenizer.token_id(m) is None) for markers, _ in _SPELLINGS)
    return first + "".join(f" (or {other})" for other in others)


def fim_prompt_ids(tokenizer, fim: FimTokens | None, prefix: str, suffix: str,
                   extra: tuple[tuple[str, str], ...] = ()) -> list[int]:
    """The token ids of a FIM prompt: the `extra` files (see npud.engine.api.GenerateRequest), then
    <prefix-token> prefix <suffix-token> suffix <middle-token>.

    Raises FimUnsupported (naming the missing tokens) when `fim` is None."""
    if fim is None:
        raise FimUnsupported(f"this model has no fill-in-the-middle tokens: its vocabulary lacks "
                             f"{missing_fim_tokens(tokenizer)}")
    ids: list[int] = []
    if fim.file_sep is not None:
        for filename, text in extra:
            ids += [fim.file_sep, *tokenizer.encode_text(f"{filename}\n{text}")]
        if extra:
            ids.append(fim.file_sep)  # the file being edited starts here
        head = ""
    else:
        head = "".join(CHUNK_HEADER.format(filename=f) + text + "\n" for f, text in extra)
    ids.append(fim.prefix)
    ids += tokenizer.encode_text(head + prefix)  # user text: a marker's spelling in it stays text
    ids.append(fim.suffix)
    ids += tokenizer.encode_text(suffix)
    ids.append(fim.middle)
    return ids
