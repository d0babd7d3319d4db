"""The tokenizer a GGUF file describes (no torch, no transformers).

Described the way transformers' GGUF conversion builds it as a `tokenizers` object
(integrations/gguf), so both give the same ids:
- `tokenizer.ggml.model = llama` (SentencePiece): a BPE with byte fallback over the file's
  vocabulary; the merges are implied by the vocabulary (every split of a token into two
  vocabulary tokens), ranked by the token's score. Gemma files rank by position in the file
  instead (their scores do not follow the merge order), spell all-space tokens with "▁",
  and split text on spaces rather than through a Metaspace pre-tokenizer.
- `tokenizer.ggml.model = gpt2` (byte-level BPE): the file's merges, tokens re-spelled in
  the byte alphabet, and the pre-tokenizer split of `tokenizer.ggml.pre` where it is one of
  the known ones.
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so both are matched whole. A BOS is added in front when add_bos_token is set. Gemma's
all-space tokens are user-defined but not added: merges reach them once spaces are "▁" (below).

What runs it: for `llama` files the C tokenizer of npud/engine/tokenizer_native.py, over the
arrays native_arrays makes (it gives the ids and text the `tokenizers` object assemble_backend
builds gives; tests compare the two); for `gpt2` files that `tokenizers` object.
"""

from __future__ import annotations

import hashlib
import json
import operator
from typing import Any

from npud.engine.gguf.reader import GgufFile
from npud.engine.tokenizer import Tokenizer, TokenizerError

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


def gguf_recipe(g: GgufFile) -> dict:
    """What the tokenizer of the file is built from, in plain values: "kind" ("llama" or
    "gpt2"), "tokens" (the model vocabulary in id order, as the backend spells it), "merges"
    (int32 [n, 2]: the ids of each merge's left and right token, in rank order), "gemma",
    "split" (a gpt2 pre-tokenizer regex or None), "unk" (the unknown token or None), "control"
    and "user" (the tokens added whole, special or not) and "add_bos". The slow part of a
    build (the implied merges) happens here, and npud/engine/gguf/tokenizer_cache.py keeps the
    result. Raises TokenizerError."""
    import numpy as np

    kind = _meta(g, "tokenizer.ggml.model", str)
    tokens = _meta(g, "tokenizer.ggml.tokens", list)
    if kind is None or not tokens:
        raise TokenizerError(f"{g.path}: the file has no tokenizer (tokenizer.ggml.model / tokens)")
    types = _meta(g, "tokenizer.ggml.token_type", list, []) or []
    file_tokens = tokens  # as the file spells them, before gemma's all-space tokens are respelled
    arch = g.architecture
    unk_id = _meta(g, "tokenizer.ggml.unknown_token_id", int)
    gemma, split, unk = False, None, None
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
        if gemma and unk_id is not None and 0 <= unk_id < len(tokens):
            unk = tokens[unk_id]
        pairs = implied_merges(vocab, rank)
        model_tokens, byte_level = tokens, None
    elif kind == "gpt2":
        merges = _meta(g, "tokenizer.ggml.merges", list)
        if merges is None:
            raise TokenizerError(f"{g.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
        spelling = _byte_alphabet()
        byte_level = set(spelling.values())
        model_tokens = [t if set(t) <= byte_level else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(model_tokens)}
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"{g.path}: merge {m!r} is not two tokens separated by a space")
            pairs.append((parts[0], parts[1]))
        split = _SPLITS.get(_meta(g, "tokenizer.ggml.pre", str))
    else:
        raise TokenizerError(f"{g.path}: tokenizer.ggml.model = {kind!r} is not supported; expected 'llama' or 'gpt2'")
    try:
        merge_ids = np.array([(vocab[a], vocab[b]) for a, b in pairs], dtype=np.int32).reshape(-1, 2)
    except KeyError as exc:
        raise TokenizerError(f"{g.path}: a merge names {exc.args[0]!r}, which is not in the vocabulary") from None
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and (byte_level is None or set(t) <= byte_level)]
    known = vocab.keys() | set(control)  # what the backend knows once the control tokens are added
    # Added whole as the file spells them, so gemma's all-space tokens ("  ", respelled "▁▁") are
    # not: added as "▁▁" they would be cut out of the raw text, where a "▁" is a literal one
    # ("x ▁▁▁" gave "x", "▁", "▁▁▁" where SentencePiece, which makes each space a "▁" first,
    # gives "x", "▁▁▁▁"). The merges reach them instead, as in transformers' GGUF conversion.
    user = [t for t, ty in zip(file_tokens, types) if ty == _USER_DEFINED and t in known]
    add_bos = _meta(g, "tokenizer.ggml.add_bos_token", bool, kind == "llama")
    return {"kind": kind, "tokens": model_tokens, "merges": merge_ids, "gemma": gemma, "split": split, "unk": unk,
            "control": control, "user": user, "add_bos": add_bos}


def assemble_backend(recipe: dict):
    """The tokenizers.Tokenizer of a gguf_recipe (built the way transformers' GGUF conversion
    builds it: the module docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    tokens = recipe["tokens"]
    vocab = dict(zip(tokens, range(len(tokens))))  # as {t: i for i, t in enumerate(tokens)}: a repeated spelling keeps its last id
    ids = recipe["merges"]
    if len(ids):  # the pairs' strings are the vocabulary's own objects, looked up in C
        merges = list(zip(operator.itemgetter(*ids[:, 0].tolist())(tokens), operator.itemgetter(*ids[:, 1].tolist())(tokens)))
        if len(ids) == 1:  # itemgetter of one index gives the item, not a tuple
            merges = [(tokens[ids[0, 0]], tokens[ids[0, 1]])]
    else:
        merges = []
    if recipe["kind"] == "llama":
        gemma = recipe["gemma"]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                     unk_token=recipe["unk"]))
        del vocab, merges  # the backend holds its own copies
        decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gemma:
            backend.normalizer = normalizers.Replace(" ", "\u2581")
            backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            decode.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(decode)
    else:
        backend = Backend(models.BPE(vocab=vocab, merges=merges))
        del vocab, merges
        if recipe["split"] is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(recipe["split"]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    if recipe["control"]:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in recipe["control"]])
    if recipe["user"]:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in recipe["user"]])
    return backend


# Bump when gguf_recipe, assemble_backend, native_arrays or the encodings change what they
# make: cached tokenizers (npud/engine/gguf/tokenizer_cache.py) made by another version are rebuilt.
BUILDER_VERSION = 3  # 3: gemma's all-space tokens are no longer added tokens
_SMALL = ("kind", "gemma", "split", "unk", "control", "user", "add_bos")


def encode_recipe(recipe: dict) -> bytes:
    """A recipe as bytes: a JSON line of the small fields, a JSON line of the tokens, then the
    merges as little-endian int32 pairs."""
    import numpy as np

    small = json.dumps({k: recipe[k] for k in _SMALL}, sort_keys=True, ensure_ascii=False)
    tokens = json.dumps(recipe["tokens"], ensure_ascii=False)  # one line: JSON escapes newlines
    return b"".join([small.encode(), b"\n", tokens.encode(), b"\n",
                     np.ascontiguousarray(recipe["merges"], dtype="<i4").tobytes()])


def decode_recipe(payload: bytes) -> dict:
    """encode_recipe's inverse. Raises ValueError (or a JSON/Unicode error, both ValueErrors)
    for bytes it did not write."""
    import numpy as np

    small, _, rest = bytes(payload).partition(b"\n")
    tokens, newline, merges = rest.partition(b"\n")
    recipe = json.loads(small)
    if not newline or not isinstance(recipe, dict) or set(recipe) != set(_SMALL) or len(merges) % 8:
        raise ValueError("not an encoded recipe")
    recipe["tokens"] = json.loads(tokens)
    recipe["merges"] = np.frombuffer(merges, dtype="<i4").reshape(-1, 2)
    n = len(recipe["tokens"])
    if not isinstance(recipe["tokens"], list) or (recipe["merges"].size and not (
            0 <= recipe["merges"].min() and recipe["merges"].max() < n)):
        raise ValueError("merge ids outside the vocabulary")
    return recipe


_NATIVE = ("gemma", "unk", "n_control", "n_user", "n_tokens", "n_merges", "blob_bytes")


def native_arrays(recipe: dict) -> dict:
    """What npud/engine/tokenizer_native.py's NativeBackend is built from, for a recipe of kind
    "llama": "offsets" (int32 [n + 1]) into "blob" (the spellings, UTF-8), "merges" (int32
    [m, 3]: left, right and merged id, in rank order), "control" and "user" (token indices of
    the added tokens), "unk" (the unknown token's index or None), "gemma". Raises TokenizerError."""
    import numpy as np

    tokens = recipe["tokens"]
    encoded = [t.encode("utf-8") for t in tokens]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise TokenizerError("the vocabulary's spellings take more than 2 GiB")
    vocab = dict(zip(tokens, range(len(tokens))))  # a repeated spelling keeps its last id, as the library's
    pairs = recipe["merges"]
    try:
        merged = [vocab[tokens[a] + tokens[b]] for a, b in pairs.tolist()]
    except KeyError as exc:
        raise TokenizerError(f"a merge makes {exc.args[0]!r}, which is not in the vocabulary") from None
    merges = np.empty((len(pairs), 3), dtype=np.int32)
    merges[:, :2] = pairs
    merges[:, 2] = merged
    unk = recipe["unk"]
    return {"offsets": offsets.astype(np.int32), "blob": b"".join(encoded), "merges": merges,
            "control": [vocab[t] for t in recipe["control"]], "user": [vocab[t] for t in recipe["user"]],
            "unk": None if unk is None else vocab[unk], "gemma": bool(recipe["gemma"])}


def encode_native(arrays: dict) -> bytes:
    """native_arrays as bytes: a JSON line of the small fields and sizes, then the control and
    user token indices, the offsets and the merges as little-endian int32, then the spellings."""
    import numpy as np

    small = {"gemma": arrays["gemma"], "unk": arrays["unk"], "n_control": len(arrays["control"]),
             "n_user": len(arrays["user"]), "n_tokens": len(arrays["offsets"]) - 1, "n_merges": len(arrays["merges"]),
             "blob_bytes": len(arrays["blob"])}
    return b"".join([json.dumps(small, sort_keys=True).encode(), b"\n",
                     np.array([*arrays["control"], *arrays["user"]], dtype="<i4").tobytes(),
                     np.ascontiguousarray(arrays["offsets"], dtype="<i4").tobytes(),
                     np.ascontiguousarray(arrays["merges"], dtype="<i4").tobytes(), arrays["blob"]])


def decode_native(payload) -> dict:
    """encode_native's inverse; the arrays are views of `payload` (bytes or a memoryview of
    them). Raises ValueError for bytes it did not write, or whose indices would reach past
    the arrays."""
    import numpy as np

    view = memoryview(payload)
    end = bytes(view[:4096]).find(b"\n")
    small = json.loads(bytes(view[:end])) if end > 0 else None
    if not isinstance(small, dict) or set(small) != set(_NATIVE):
        raise ValueError("not an encoded native tokenizer")
    n, m, size, nc, nu = (small[k] for k in ("n_tokens", "n_merges", "blob_bytes", "n_control", "n_user"))
    if (not all(isinstance(v, int) and v >= 0 for v in (n, m, size, nc, nu))
            or len(view) != end + 1 + 4 * (nc + nu + n + 1) + 12 * m + size):
        raise ValueError("the native tokenizer's sizes do not match its length")
    added = np.frombuffer(view, dtype="<i4", count=nc + nu, offset=end + 1)
    at = end + 1 + 4 * (nc + nu)
    offsets = np.frombuffer(view, dtype="<i4", count=n + 1, offset=at)
    merges = np.frombuffer(view, dtype="<i4", count=3 * m, offset=at + 4 * (n + 1)).reshape(m, 3)
    blob = np.frombuffer(view, dtype=np.uint8, count=size, offset=at + 4 * (n + 1) + 12 * m)
    unk = small["unk"]
    if (offsets[0] != 0 or offsets[-1] != size or (n and np.diff(offsets).min() < 0)
            or (m and not (0 <= merges.min() and merges.max() < n))
            or (nc + nu and not (0 <= added.min() and added.max() < n))
            or not (unk is None or (isinstance(unk, int) and 0 <= unk < n))):
        raise ValueError("the native tokenizer's indices reach outside its arrays")
    return {"offsets": offsets, "blob": blob, "merges": merges, "control": added[:nc].tolist(),
            "user": added[nc:].tolist(), "unk": unk, "gemma": bool(small["gemma"])}


def native_backend(arrays: dict):
    """The npud/engine/tokenizer_native.py backend of native_arrays (or decode_native's views)."""
    from npud.engine.tokenizer_native import NativeBackend

    return NativeBackend(arrays["offsets"], arrays["blob"], arrays["merges"], arrays["control"], arrays["user"],
                         arrays["unk"], arrays["gemma"])


def finish_backend(backend, settings: dict) -> None:
    """Put BOS in front of every encoding when the file says so (settings from gguf_tokenizer_parts)."""
    special = settings["special"]
    backend.add_bos(special["bos_token"] if settings["add_bos"] and "bos_token" in special else None)


def gguf_tokenizer_parts(g: GgufFile, *, library: bool = False):
    """The tokenizer of a GGUF file as (backend, payload, settings): the backend is
    npud/engine/tokenizer_native.py's for a SentencePiece vocabulary (the `tokenizers` library's
    with `library`, or for a byte-level BPE); the payload (native_arrays or the recipe
    encoded) and the settings the engine Tokenizer takes beside it are what
    npud/engine/gguf/tokenizer_cache.py stores; settings["backend"] says which. Raises TokenizerError."""
    from npud.engine.tokenizer_backend import TokenizersBackend

    recipe = gguf_recipe(g)
    recipe_bytes, add_bos = encode_recipe(recipe), recipe["add_bos"]
    if recipe["kind"] == "llama" and not library:
        arrays = native_arrays(recipe)
        kind, payload = "native", encode_native(arrays)
        del recipe
        backend = native_backend(arrays)
    else:
        kind, payload = "tokenizers", recipe_bytes
        backend = TokenizersBackend(assemble_backend(recipe))
    tokens = g.metadata["tokenizer.ggml.tokens"]
    special: dict[str, str] = {}
    for field, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _meta(g, f"tokenizer.ggml.{key}", int)
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise TokenizerError(f"{g.path}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
            special[field] = backend.id_to_token(token_id)
    template = _meta(g, "tokenizer.chat_template", str)
    eot = _meta(g, "tokenizer.ggml.eot_token_id", int)
    # the tokenizer's identity: its recipe (whichever backend runs it), and what is added to it
    digest = hashlib.sha256(recipe_bytes)
    digest.update(json.dumps({"add_bos": add_bos, "special": special, "template": template},
                             sort_keys=True).encode())
    # ids below the vocabulary size that no token decodes to (two tokens of one spelling)
    size = backend.vocab_size
    missing = sorted(set(range(size)) - set(backend.known_ids().tolist()))
    settings = {"fingerprint": digest.hexdigest(), "add_bos": add_bos, "special": special, "template": template,
                "eot": eot, "missing_ids": missing, "backend": kind}
    finish_backend(backend, settings)
    return backend, payload, settings


def tokenizer_from_parts(backend, settings: dict, source: str) -> Tokenizer:
    """The engine Tokenizer of a finished backend and the settings gguf_tokenizer_parts gave with it."""
    template, eot = settings["template"], settings["eot"]
    return Tokenizer(backend, fingerprint=settings["fingerprint"],
                     chat_templates={"default": template} if template else None,
                     special_tokens=settings["special"], extra_eos_ids=[eot] if eot is not None else [],
                     source=source, add_bos_token=settings["add_bos"], missing_ids=settings["missing_ids"])


def gguf_tokenizer(g: GgufFile, *, library: bool = False) -> Tokenizer:
    """The engine Tokenizer of a GGUF file, built now (npud/engine/gguf/tokenizer_cache.py keeps it
    between starts): special tokens from the ggml ids, the chat template from
    tokenizer.chat_template; `library`: through the `tokenizers` library whatever the kind
    (what tests compare the native backend with). Raises TokenizerError."""
    backend, _, settings = gguf_tokenizer_parts(g, library=library)
    return tokenizer_from_parts(backend, settings, str(g.path))
