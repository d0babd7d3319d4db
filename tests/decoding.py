"""Greedy decoding over a Forward, plain or speculative, for tests that compare the two."""

from __future__ import annotations

import numpy as np

from npud.engine.forward import Forward
from npud.engine.sampling import Sampler
from npud.engine.api import SpecParams
from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode


def greedy_run(forward, prompt, n, head=None, k=4):
    """Prefill prompt[:-1] on `forward`, then decode n tokens greedily (speculating with `head`
    at up to k drafts, fallback off). Returns (tokens, stats)."""
    forward.prefill(prompt[:-1])
    out, stats = [], DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
    if head is None:
        loop = plain_decode(forward, prompt, **common)
    else:
        loop = speculative_decode(forward, head, prompt, config=SpecParams(k=k, fallback_rounds=0), **common)
    for _ in loop:
        pass
    return out, stats


def plain_tokens(model, ids, n):
    """`n` greedy tokens after prompt `ids`: one prefill, then one step a token (the reference)."""
    f = Forward(model)
    logits = f.prefill(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = f.step(out[-1], f.positions_held)
    return out
