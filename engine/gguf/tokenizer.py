"""The tokenizer a GGUF file describes, built as a `tokenizers` object (no torch, no transformers).

Built the way transformers' GGUF conversion builds it (integrations/gguf), so both give the
same ids:
- `tokenizer.ggml.model = llama` (SentencePiece): a BPE with byte fallback over the file's
  vocabulary; the merges are implied by the vocabulary (every split of a token into two
  vocabulary tokens), ranked by the token's score. Gemma files rank by position in the file
  instead (their scores do not follow the merge order), spell all-space tokens with "▁",
  and split text on spaces rather than through a Metaspace pre-tokenizer.
- `tokenizer.ggml.model = gpt2` (byte-level BPE): the file's merges, tokens re-spelled in
  the byte alphabet, and the pre-tokenizer split of `tokenizer.ggml.pre` where it is one of
  the known ones.
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole. A BOS is added in front when add_bos_token is set.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from engine.gguf.reader import GgufFile
from engine.tokenizer import Tokenizer, TokenizerError

_CONTROL, _USER_DEFINED = 3, 4
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# tokenizer.ggml.pre -> the split regex its merges were learned with (the common ones)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def implied_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best-ranked token first.

    Ties (the splits of one token) go longer left piece first, then longer right piece, then
    by the pieces' ids — the order transformers' generate_merges gives.
    """
    merges = []
    for token, score in rank.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, left, right) for left, right in local)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def _meta(g: GgufFile, key: str, kind: type, default: Any = None) -> Any:
    value = g.metadata.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise TokenizerError(f"{g.path}: {key} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def build_gguf_backend(g: GgufFile):
    """Returns (tokenizers.Tokenizer, add_bos) for the file's vocabulary; raises TokenizerError."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = _meta(g, "tokenizer.ggml.model", str)
    tokens = _meta(g, "tokenizer.ggml.tokens", list)
    if kind is None or not tokens:
        raise TokenizerError(f"{g.path}: the file has no tokenizer (tokenizer.ggml.model / tokens)")
    types = _meta(g, "tokenizer.ggml.token_type", list, []) or []
    arch = g.architecture
    unk_id = _meta(g, "tokenizer.ggml.unknown_token_id", int)
    if kind == "llama":
        gemma = arch in _GEMMA_ARCHS
        if gemma:
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        if gemma:
            rank = {t: -i for i, t in enumerate(tokens)}
        else:
            scores = _meta(g, "tokenizer.ggml.scores", list)
            if scores is None or len(scores) != len(tokens):
                raise TokenizerError(f"{g.path}: tokenizer.ggml.scores must give one score per token")
            rank = dict(zip(tokens, scores))
        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
        model = models.BPE(vocab=vocab, merges=implied_merges(vocab, rank), fuse_unk=True, byte_fallback=True,
                           unk_token=unk if gemma else None)
        backend = Backend(model)
        decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gemma:
            backend.normalizer = normalizers.Replace(" ", "\u2581")
            backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            decode.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(decode)
        byte_level = None
    elif kind == "gpt2":
        merges = _meta(g, "tokenizer.ggml.merges", list)
        if merges is None:
            raise TokenizerError(f"{g.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
        spelling = _byte_alphabet()
        byte_level = set(spelling.values())
        vocab = {t if set(t) <= byte_level else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"{g.path}: merge {m!r} is not two tokens separated by a space")
            pairs.append((parts[0], parts[1]))
        backend = Backend(models.BPE(vocab=vocab, merges=pairs))
        split = _SPLITS.get(_meta(g, "tokenizer.ggml.pre", str))
        if split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        raise TokenizerError(f"{g.path}: tokenizer.ggml.model = {kind!r} is not supported; expected 'llama' or 'gpt2'")
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == _CONTROL and (byte_level is None or set(t) <= byte_level)]
    if control:
        backend.add_special_tokens(control)
    known = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in known]
    if user:
        backend.add_tokens(user)
    add_bos = _meta(g, "tokenizer.ggml.add_bos_token", bool, kind == "llama")
    return backend, bool(add_bos)


# Bump when build_gguf_backend or gguf_tokenizer_parts changes what they build: cached
# tokenizers (engine/gguf/tokenizer_cache.py) made by another version are then rebuilt.
BUILDER_VERSION = 1


def gguf_tokenizer_parts(g: GgufFile):
    """The tokenizer of a GGUF file as (tokenizers.Tokenizer, its JSON, the settings the engine
    Tokenizer takes beside it): the last two are what engine/gguf/tokenizer_cache.py stores.
    Raises TokenizerError."""
    from tokenizers import processors

    backend, add_bos = build_gguf_backend(g)
    tokens = g.metadata["tokenizer.ggml.tokens"]
    special: dict[str, str] = {}
    for field, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _meta(g, f"tokenizer.ggml.{key}", int)
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise TokenizerError(f"{g.path}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
            special[field] = backend.id_to_token(token_id)
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, backend.token_to_id(bos))])
    template = _meta(g, "tokenizer.chat_template", str)
    eot = _meta(g, "tokenizer.ggml.eot_token_id", int)
    text = backend.to_str()
    digest = hashlib.sha256(text.encode("utf-8"))
    digest.update(json.dumps({"add_bos": add_bos, "special": special, "template": template}, sort_keys=True).encode())
    # ids below the vocabulary size that no token decodes to (two tokens of one spelling)
    size = backend.get_vocab_size(with_added_tokens=True)
    missing = sorted(set(range(size)) - set(backend.get_vocab(with_added_tokens=True).values()))
    return backend, text, {"fingerprint": digest.hexdigest(), "add_bos": add_bos, "special": special, "template": template,
                  "eot": eot, "missing_ids": missing}


def tokenizer_from_parts(backend, settings: dict, source: str) -> Tokenizer:
    """The engine Tokenizer of a backend and the settings gguf_tokenizer_parts gave with it."""
    template, eot = settings["template"], settings["eot"]
    return Tokenizer(backend, fingerprint=settings["fingerprint"],
                     chat_templates={"default": template} if template else None,
                     special_tokens=settings["special"], extra_eos_ids=[eot] if eot is not None else [],
                     source=source, add_bos_token=settings["add_bos"], missing_ids=settings["missing_ids"])


def gguf_tokenizer(g: GgufFile) -> Tokenizer:
    """The engine Tokenizer of a GGUF file, built now (engine/gguf/tokenizer_cache.py keeps it
    between starts): special tokens from the ggml ids, the chat template from
    tokenizer.chat_template. Raises TokenizerError."""
    backend, _, settings = gguf_tokenizer_parts(g)
    return tokenizer_from_parts(backend, settings, str(g.path))
