"""Tokenizer: encode and decode through a backend, chat templates rendered as transformers does.

The backend (npud/engine/tokenizer_backend.py says what it must do) is a `tokenizers` object for a
checkpoint directory's files (npud/engine/tokenizer_dir.py) and for a GGUF byte-level BPE, and
npud/engine/tokenizer_native.py's C tokenizer for a GGUF SentencePiece vocabulary (both built by
npud/engine/gguf/tokenizer.py, kept between starts by npud/engine/gguf/tokenizer_cache.py); streaming
detokenization is npud/engine/incremental_decoder.py's.

transformers is not imported at runtime; what it does when it renders a chat template
(the Jinja environment, the variables a template sees, how messages are normalised) is
reproduced here, and tests compare the output with transformers' own.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import secrets
from datetime import datetime
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from npud.engine.api import ModelError
from npud.engine.incremental_decoder import IncrementalDecoder  # re-exported: Tokenizer.decoder() makes one
from npud.engine.tokenizer_backend import as_backend


class TokenizerError(ModelError):
    """A tokenizer file is missing or malformed, or a chat cannot be rendered."""


# a control token's spelling: <|im_start|>, <|fim_middle|>, <|file_sep|>, ... (besides those marked special)
_CONTROL_SHAPE = re.compile(r"<\|[^|<>\s]{1,64}\|>")

# the named special tokens transformers passes to chat templates (SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# names a message's reasoning arrives under; templates read the first (Qwen3) or "thinking" (gpt-oss)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")



def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args, **kwargs) -> dict:
    # a plain function, so a template cannot reach the dict type's attributes through it
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() refusing underscore names, so templates cannot reach dunders."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature, so namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _make_dict
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any, where: str) -> Any:
    """A fresh copy made only of JSON types, so the template neither sees nor edits caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TokenizerError(f"{where}: {type(value).__name__} values cannot be passed to a chat template")


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(f"messages must be a non-empty list of objects, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizerError(f"messages[{i}] must be an object, got {message!r}")
        # APIs send content=None or tool_calls=None; templates handle a missing key, not None
        message = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, special token ids."""

    def __init__(
        self,
        backend,
        *,
        fingerprint: str,
        chat_templates: dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_special_ids: Iterable[int] = (),
        extra_eos_ids: Iterable[int] = (),
        source: str = "tokenizer",
        add_bos_token: bool = False,
        missing_ids: Iterable[int] | None = None,
    ) -> None:
        backend = self._backend = as_backend(backend)  # a tokenizers.Tokenizer is wrapped
        # a raw prompt starts with BOS (GGUF vocabularies that say so; a chat template writes its own)
        self.add_bos_token = add_bos_token
        self._source = source
        self.fingerprint = fingerprint
        self.vocab_size: int = backend.vocab_size
        self._special_tokens = dict(special_tokens or {})
        ids = {}
        for field, content in self._special_tokens.items():
            token_id = backend.token_to_id(content)
            if token_id is None:
                raise TokenizerError(f"{source}: {field} {content!r} is not in the vocabulary")
            ids[field] = token_id
        self.bos_token_id: int | None = ids.get("bos_token")
        eos = [ids["eos_token"]] if "eos_token" in ids else []
        for token_id in extra_eos_ids:
            if token_id not in eos:
                eos.append(token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        added_tokens = backend.added_tokens()  # {id: (spelling, special)}
        self._added_ids = frozenset(added_tokens)  # their pieces are their text, not byte-encoded
        added = {i for i, (_, special) in added_tokens.items() if special}
        self.special_token_ids: frozenset[int] = frozenset(added | set(ids.values()) | set(extra_special_ids))
        # spellings that user text may contain but must not turn into (encode_text, encode_chat):
        # the special added tokens and those shaped <|...|> (Qwen's FIM markers are not "special")
        self.control_tokens: tuple[str, ...] = tuple(sorted(
            {content for i, (content, _) in added_tokens.items()
             if i in self.special_token_ids or _CONTROL_SHAPE.fullmatch(content)}, key=lambda t: (-len(t), t)))
        # compiled at the first text that holds a control token's first character (gemma: 6,249
        # spellings, a tenth of a second of a start), so a start pays it only for a prompt that may need it
        self._control_re: re.Pattern | None = None
        self._control_starts = frozenset(t[0] for t in self.control_tokens)
        self._decodable: dict[int, np.ndarray | None] = {}  # width -> Tokenizer.decodable(width)
        self._token_bytes: dict[int, bytes] = {}  # id -> Tokenizer.token_bytes(id), filled as asked
        self._byte_decoder: dict[str, int] | None = None  # GPT-2's alphabet reversed, for byte-level BPE
        self.chat_template_texts: dict[str, str] = dict(chat_templates or {})  # name -> Jinja source
        # ids below vocab_size that no token has, when the caller knows them (a cached GGUF
        # tokenizer): decodable() then need not list the whole vocabulary
        self._missing_ids = None if missing_ids is None else np.array(sorted(missing_ids), dtype=np.int64)
        self._templates: dict[str, jinja2.Template] = {}
        env = _environment()
        for name, text in (chat_templates or {}).items():
            try:
                self._templates[name] = env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerError(
                    f"{source}: chat template {name!r} has a syntax error at line {exc.lineno}: {exc.message}"
                ) from None

    @classmethod
    def from_dir(cls, checkpoint_dir) -> "Tokenizer":
        """Returns the tokenizer of a checkpoint directory (npud/engine/tokenizer_dir.py) or of a .gguf
        file (npud/engine/gguf/tokenizer_cache.py). Raises TokenizerError naming the file."""
        from npud.engine.tokenizer_dir import tokenizer_from_dir

        return tokenizer_from_dir(checkpoint_dir)

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        return tuple(self._templates)

    def use_chat_template(self, text: str, label: str) -> None:
        """Render chats with `text` from now on, in place of the checkpoint's templates (a model's
        chat_template setting, or a built-in for a checkpoint that has none; `label` is what
        replies say was used). Raises TokenizerError for a syntax error."""
        try:
            template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template {label} has a syntax error at line {exc.lineno}: {exc.message}") from None
        self._templates = {"default": template}
        self.__dict__.pop("end_of_turn_id", None)  # found anew for this template

    @functools.cached_property
    def end_of_turn_id(self) -> int | None:
        """The control token the chat template writes right after an assistant's text
        (<|im_end|>, <end_of_turn>, <|eot_id|>, Mistral's </s>): a chat reply ends there, as at
        EOS, even when the checkpoint's EOS list leaves it out (a base model's, say). None when
        there is no template, or it writes no control token there. Found at the first use."""
        mark = "\ue000npud-reply\ue001"  # private-use text no template rewrites
        try:
            text = self.apply_chat_template([{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": mark}], add_generation_prompt=False)
        except TokenizerError:  # no template, or one that will not end on an assistant turn
            return None
        at = text.rfind(mark)
        rest = text[at + len(mark):].lstrip() if at >= 0 else ""
        # control_tokens are sorted longest first, so <|im_end|> wins over any shorter prefix
        spelling = next((t for t in self.control_tokens if rest.startswith(t)), None)
        return None if spelling is None else self.token_id(spelling)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Returns the token ids of `text`; special tokens written in the text map to their ids
        (markup: a rendered template's own; for what a user wrote, encode_text)."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        return _ids(self._backend, text, add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Returns the token ids of user text: a control token's spelling in it (<|im_end|>,
        <|fim_middle|>, ...) is encoded as the characters it is made of, never as the token."""
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        nonce = secrets.token_hex(8)
        return self._encode_marked(self._mark(text, nonce), nonce)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Returns the token ids of the messages rendered by the chat template (as
        apply_chat_template): the template's markup becomes control tokens, what the messages
        say is encoded as text (encode_text), so a message cannot close its own turn."""
        nonce = secrets.token_hex(8)
        marked = self._mark(messages, nonce)
        return self._encode_marked(self.apply_chat_template(marked, add_generation_prompt, **kwargs), nonce)

    def _mark(self, value: Any, nonce: str) -> Any:
        """`value` with each control token's spelling in its strings replaced by a marker no
        client can write (private-use delimiters around a fresh nonce and the token's index)."""
        if isinstance(value, str):
            if not self._control_starts or self._control_starts.isdisjoint(value):
                return value
            if self._control_re is None:
                self._control_re = re.compile("|".join(map(re.escape, self.control_tokens)))
            if self._control_re.search(value) is None:
                return value
            index = {t: i for i, t in enumerate(self.control_tokens)}
            return self._control_re.sub(lambda m: f"\ue000{nonce}{index[m.group(0)]}\ue001", value)
        if isinstance(value, dict):
            return {k: self._mark(v, nonce) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark(v, nonce) for v in value]
        return value

    def _encode_marked(self, text: str, nonce: str) -> list[int]:
        """Encode `text`, its markers (see _mark) as their token's spelling in plain text."""
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", text)
        if len(parts) == 1:
            return _ids(self._backend, text)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._plain_ids(self.control_tokens[int(part)])
            elif part:
                ids += _ids(self._backend, part)
        return ids

    def _plain_ids(self, text: str) -> list[int]:
        """The ids of `text` as the backend gives them with no added tokens (a control token's
        spelling as the characters it is made of), from the same backend: the vocabulary is
        not held a second time."""
        return self._backend.encode_plain(text)

    def token_id(self, content: str) -> int | None:
        """The id of the token whose text is exactly `content` (a special token's, say), or None."""
        return self._backend.token_to_id(content)

    def decodable(self, width: int) -> np.ndarray | None:
        """Which of a model's `width` logit ids this tokenizer can decode: bool [width], or None
        when it can decode them all. A checkpoint that pads its embedding past the tokenizer
        (Qwen: 151,936 rows for 151,669 ids) has ids that must never be sampled."""
        if width not in self._decodable:
            limit = min(width, self.vocab_size)
            if self._missing_ids is not None:
                known = np.zeros(width, dtype=bool)
                known[:limit] = True
                known[self._missing_ids[self._missing_ids < limit]] = False
            else:
                ids = self._backend.known_ids()
                known = np.zeros(width, dtype=bool)
                # decode() refuses ids at or past vocab_size (a count), so those stay masked too
                known[ids[ids < limit]] = True
            known.flags.writeable = False
            self._decodable[width] = None if known.all() else known
        return self._decodable[width]

    def _check_ids(self, ids) -> list[int]:
        out = []
        for value in ids:
            try:
                token_id = operator.index(value)  # ints and numpy integers, not floats
            except TypeError:
                raise TokenizerError(f"token id {value!r} is not an int") from None
            if isinstance(value, bool):
                raise TokenizerError(f"token id {value!r} is not an int")
            if not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            out.append(token_id)
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Returns the text of `ids` (without transformers' optional space clean-up).

        Raises TokenizerError for an id outside the vocabulary.
        """
        ids = self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        return self._backend.decode(ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        """Returns the rendered prompt text, as transformers' apply_chat_template(tokenize=False).

        `chat_template` picks a named template; extra kwargs (e.g. enable_thinking) reach
        the template. Raises TokenizerError when there is no template, the messages are
        malformed, or the template raises.
        """
        if not self._templates:
            # no path here: the message reaches the client
            raise TokenizerError("this model has no chat template; set chat_template for it in npud.toml "
                                 "(a Jinja file, or one of gemma, chatml, llama3, mistral)")
        if chat_template is not None:
            if chat_template not in self._templates:
                raise TokenizerError(
                    f"chat_template {chat_template!r} not found; available: {sorted(self._templates)}"
                )
            template = self._templates[chat_template]
        elif len(self._templates) == 1:
            template = next(iter(self._templates.values()))
        elif tools is not None and "tool_use" in self._templates:
            template = self._templates["tool_use"]
        elif "default" in self._templates:
            template = self._templates["default"]
        else:
            raise TokenizerError(
                f"{self._source}: several chat templates and no default; pick one of {sorted(self._templates)}"
            )
        variables = {**self._special_tokens, **_plain(kwargs, "kwargs")}
        try:
            return template.render(
                messages=_normalize_messages(messages),
                tools=_plain(tools, "tools"),
                documents=_plain(documents, "documents"),
                add_generation_prompt=bool(add_generation_prompt),
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc.message or exc}") from None
        except Exception as exc:  # a template is code from the checkpoint; its bugs are the caller's error
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for on its own, exact even for part of a character:
        a byte-level BPE piece through GPT-2's byte alphabet, a byte-fallback piece (<0xNN>) as
        its byte, a SentencePiece piece with its word marker as a space, an added token as its
        text. Raises TokenizerError for an id outside the vocabulary."""
        (token_id,) = self._check_ids([token_id])
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._piece_bytes(token_id)
        return cached

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_token_ids:
            return piece.encode("utf-8")
        if self._byte_decoder is None:
            if self._backend.byte_level:
                from npud.engine.gguf.tokenizer import _byte_alphabet

                self._byte_decoder = {c: b for b, c in _byte_alphabet().items()}
            else:
                self._byte_decoder = {}
        if self._byte_decoder and token_id in self._added_ids:
            return piece.encode("utf-8")  # added tokens are stored as their text
        if self._byte_decoder and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        """Returns a fresh streaming decoder."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


def _ids(backend, text: str, add_special_tokens: bool = False) -> list[int]:
    """The backend's ids for `text` (each backend lets other Python threads run while it
    encodes a long text: a daemon's event loop while a 1 MB prompt is tokenized)."""
    return backend.encode(text, add_special_tokens=add_special_tokens)
