"""A checkpoint directory's tokenizer files read into an engine Tokenizer: tokenizer.json
through `tokenizers` (imported here only for a directory), tokenizer_config.json (special tokens, chat templates),
chat_template.jinja and additional_chat_templates/, and generation_config.json's eos ids. A
.gguf path goes to npud/engine/gguf/tokenizer_cache.py instead."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from npud.engine.tokenizer import _NAMED_TOKENS, Tokenizer, TokenizerError


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from None


def _token_content(value: Any, field: str, source: Path) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise TokenizerError(f"{source}: {field} must be a string or an object with 'content', got {value!r}")
    return value


def tokenizer_from_dir(checkpoint_dir) -> Tokenizer:
    """Returns the tokenizer of a checkpoint directory (or of a .gguf file, npud/engine/gguf/tokenizer.py).

    Reads tokenizer.json, tokenizer_config.json (special tokens, chat template),
    chat_template.jinja (where transformers 5 saves the template; it wins) and the
    eos ids of generation_config.json. Raises TokenizerError naming the file.
    """
    directory = Path(checkpoint_dir)
    from npud.engine.gguf import is_gguf

    if is_gguf(directory):
        from npud.engine.gguf.tokenizer_cache import load_gguf_tokenizer

        return load_gguf_tokenizer(directory)[0]
    from tokenizers import Tokenizer as _Backend  # not imported for a GGUF file: its backend may be native

    tokenizer_path = directory / "tokenizer.json"
    try:
        raw = tokenizer_path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{tokenizer_path}: cannot read: {exc.strerror or exc}") from None
    try:
        backend = _Backend.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the Rust side raises its own Exception type
        raise TokenizerError(f"{tokenizer_path}: not a valid tokenizer: {exc}") from None

    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_path}: must be a JSON object")
    special_tokens = {}
    for field in _NAMED_TOKENS:
        content = _token_content(config.get(field), field, config_path)
        if content is not None:
            special_tokens[field] = content

    extra_special: set[int] = set()
    decoder_entries = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder_entries, dict):
        raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object")
    for key, entry in decoder_entries.items():
        if isinstance(entry, dict) and entry.get("special"):
            if not key.isdigit():
                raise TokenizerError(f"{config_path}: added_tokens_decoder key {key!r} is not a token id")
            extra_special.add(int(key))
    for field in ("additional_special_tokens", "extra_special_tokens"):
        listed = config.get(field) or []
        if isinstance(listed, dict):  # transformers 5 may map names to tokens
            listed = list(listed.values())
        if not isinstance(listed, list):
            raise TokenizerError(f"{config_path}: {field} must be a list, got {listed!r}")
        for item in listed:
            content = _token_content(item, field, config_path)
            token_id = backend.token_to_id(content)
            if token_id is None:
                raise TokenizerError(f"{config_path}: {field} token {content!r} is not in the vocabulary")
            extra_special.add(token_id)

    templates = _read_templates(directory, config, config_path)

    eos_ids: list[int] = []
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        generation = _read_json(generation_path)
        value = generation.get("eos_token_id") if isinstance(generation, dict) else None
        items = value if isinstance(value, list) else ([] if value is None else [value])
        for item in items:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise TokenizerError(f"{generation_path}: eos_token_id = {value!r}: must be token ids")
            eos_ids.append(item)

    return Tokenizer(
        backend,
        fingerprint=hashlib.sha256(raw).hexdigest(),
        chat_templates=templates,
        special_tokens=special_tokens,
        extra_special_ids=extra_special,
        extra_eos_ids=eos_ids,
        source=str(directory),
    )

def _read_templates(directory: Path, config: dict, config_path: Path) -> dict[str, str]:
    """Named chat templates; a single template is named "default"."""
    templates: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{config_path}: chat_template entry {entry!r} needs a name and a template")
            templates[entry["name"]] = entry["template"]
    elif value is not None:
        raise TokenizerError(f"{config_path}: chat_template must be a string or a list, got {value!r}")
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            templates["default"] = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_path}: cannot read: {exc}") from None
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates
