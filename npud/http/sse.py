"""Server-sent events as OpenAI and llama.cpp stream them: one `data: <json>` line and a
blank line per event; OpenAI's streams end with `data: [DONE]`."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    """One event carrying `payload` as JSON (on one line: JSON escapes every newline)."""
    try:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate in generated or quoted text
        data = json.dumps(payload, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


def comment(text: str) -> bytes:
    """A comment line (`: text`), which every SSE client skips: how a stream says the model is
    still loading without an event an OpenAI client would try to read as a chunk."""
    return b": " + " ".join(text.split()).encode() + b"\n\n"
