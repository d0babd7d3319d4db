"""Built-in chat templates, for checkpoints that ship none (a base model's GGUF, say), and the
rule that picks the template a model renders chat messages with.

The built-ins are npud's own Jinja text, written to render exactly what each family's official
template renders (tests/test_chat_templates.py compares the token ids with transformers'
rendering of the official templates): gemma (Gemma 3), chatml (Qwen2.5), llama3 (Llama 3
Instruct) and mistral (Mistral 7B Instruct v0.3). They write messages of text; tool
definitions and tool calls need the model's own template.

Which template renders a chat (`choose`):
1. a model's `chat_template` setting: a built-in's name, or a Jinja file;
2. else the checkpoint's own (tokenizer_config.json, chat_template.jinja, a GGUF's
   tokenizer.chat_template);
3. else the built-in whose turn marker is a token of the vocabulary (<start_of_turn>,
   <|im_start|>, <|start_header_id|>, [INST]);
4. else none: a chat request is refused, saying how to set one.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from npud.engine.api import BUILTIN_CHAT_TEMPLATES

# the token that marks each family's turns, tried in this order
_MARKERS = {"gemma": "<start_of_turn>", "chatml": "<|im_start|>", "llama3": "<|start_header_id|>", "mistral": "[INST]"}
assert tuple(_MARKERS) == BUILTIN_CHAT_TEMPLATES


class ChatTemplateError(ValueError):
    """A chat_template setting names no built-in and no readable file."""


def builtin_text(name: str) -> str:
    """The Jinja text of built-in template `name`; raises KeyError for another name."""
    if name not in _MARKERS:
        raise KeyError(name)
    return files(__name__).joinpath(f"{name}.jinja").read_text(encoding="utf-8")


def detect(token_id) -> str | None:
    """The built-in whose turn marker `token_id(text) -> id | None` finds in the vocabulary, or None."""
    return next((name for name, marker in _MARKERS.items() if token_id(marker) is not None), None)


def choose(setting: str | None, own: bool, token_id) -> tuple[str | None, str | None]:
    """(Jinja text to install or None to keep the checkpoint's, the label replies carry).

    `setting` is the model's chat_template (a built-in's name or a file's path), `own` whether
    the checkpoint has a template. Labels: "builtin:<name>", "file:<file name>", "checkpoint",
    or None when there is no template. Raises ChatTemplateError for a file that cannot be read."""
    if setting is not None:
        if setting in _MARKERS:
            return builtin_text(setting), f"builtin:{setting}"
        path = Path(setting)
        try:
            return path.read_text(encoding="utf-8"), f"file:{path.name}"
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ChatTemplateError(f"chat_template {setting}: cannot read ({why}); a Jinja file "
                                    f"or one of {list(_MARKERS)}") from None
    if own:
        return None, "checkpoint"
    name = detect(token_id)
    return (None, None) if name is None else (builtin_text(name), f"builtin:{name}")
