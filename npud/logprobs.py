"""Per-token logprobs on the wire (docs/protocol.md) and in OpenAI's two reply shapes.

The engine hands a TokenLogprob per generated token (npud.engine.api: the log-softmax of the
logits row that chose it, with the row's most likely alternatives). The socket's form is
OpenAI's chat form, `{"token", "bytes", "logprob", "top_logprobs"}`, so the chat reply takes
it as it is; the completions reply (OpenAI's older shape) is derived from it here.
"""

from __future__ import annotations

from collections.abc import Iterable

from npud.engine.api import TokenLogprob


def _one(lp: TokenLogprob) -> dict:
    # a piece that is part of a character is not text: `token` shows it with U+FFFD, `bytes` exactly
    return {"token": lp.token.decode("utf-8", "replace"), "bytes": list(lp.token), "logprob": lp.logprob}


def to_wire(lp: TokenLogprob) -> dict:
    """One token's logprob as the socket and OpenAI's chat reply carry it."""
    return {**_one(lp), "top_logprobs": [_one(t) for t in lp.top]}


def wire_list(logprobs: Iterable[TokenLogprob | None]) -> list[dict]:
    return [to_wire(lp) for lp in logprobs if lp is not None]


def chat_logprobs(items: list[dict]) -> dict:
    """OpenAI's chat `choice.logprobs`."""
    return {"content": items, "refusal": None}


def completion_logprobs(items: list[dict], text_offset: int = 0) -> dict:
    """OpenAI's completions `choice.logprobs`: tokens, token_logprobs, top_logprobs (a map per
    token, of the alternatives' texts; alternatives whose texts coincide keep the likelier)
    and text_offset (each token's start in the reply's text, counted in characters)."""
    offsets, at = [], text_offset
    for item in items:
        offsets.append(at)
        at += len(item["token"])
    tops = []
    for item in items:
        top: dict[str, float] = {}
        for alt in item["top_logprobs"]:
            top.setdefault(alt["token"], alt["logprob"])
        tops.append(top)
    return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": tops, "text_offset": offsets}
