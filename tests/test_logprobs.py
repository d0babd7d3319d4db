"""Per-token logprobs on the bundled model pair: each equals the log-softmax (float64) of the
logits row a plain forward pass gives at the token's position, and speculation (prompt lookup,
the draft model) reports the same numbers bit for bit as plain decode, greedy or sampled."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from npud.engine.api import GenerateRequest, GenerationParams, SamplingParams, SpecParams
from npud.engine.forward import Forward
from npud.engine.session import LoadedModel

MODELS = Path(__file__).resolve().parent.parent / "npud" / "models"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def served():
    return LoadedModel.load("pycode", MODELS / "pycode-base", draft_dir=MODELS / "pycode-draft",
                            weight_format="fp32", backend="host")


def run(served, method: str, *, logprobs: int | None = 3, sampling: SamplingParams = SamplingParams(),
        max_tokens: int = 24):
    params = GenerationParams(max_tokens=max_tokens, sampling=sampling, spec=SpecParams(method=method),
                              use_prefix_cache=False, logprobs=logprobs)
    session = served.start(GenerateRequest(prompt=PROMPT, params=params))
    events = []
    while not session.done:
        events += session.run_round()
    return session.result(), events


def reference(served, token_ids) -> list[np.ndarray]:
    """The log-softmax of the row before each generated token, one plain step at a time."""
    prompt = served.tokenizer.encode(PROMPT)
    f = Forward(served.model)
    f.prefill(prompt[:-1])
    rows = []
    logits = f.step(prompt[-1], len(prompt) - 1)
    for i, token in enumerate(token_ids):
        z = np.asarray(logits, dtype=np.float32).astype(np.float64)
        rows.append(z - np.logaddexp.reduce(z))
        logits = f.step(token, len(prompt) + i)
    return rows


def check_against_reference(served, result, top: int) -> None:
    rows = reference(served, result.token_ids)
    assert len(result.logprobs) == len(result.token_ids) == len(rows)
    for lp, token, row in zip(result.logprobs, result.token_ids, rows):
        assert lp.token_id == token and lp.token == served.tokenizer.token_bytes(token)
        assert math.isclose(lp.logprob, row[token], rel_tol=0, abs_tol=1e-9)
        assert len(lp.top) == top
        want = sorted(range(row.size), key=lambda i: (-row[i], i))[:top]
        assert [t.token_id for t in lp.top] == want
        assert all(math.isclose(t.logprob, row[t.token_id], abs_tol=1e-9) for t in lp.top)


def test_greedy_logprobs_are_the_rows_log_softmax_and_equal_under_speculation(served):
    plain, events = run(served, "none")
    check_against_reference(served, plain, 3)
    assert plain.logprobs[0].top[0].token_id == plain.token_ids[0]  # greedy: the chosen is the likeliest
    # every event of a token carries that token's logprob
    assert [e.logprob for e in events if e.token_id is not None] == list(plain.logprobs)
    for method in ("ngram", "draft"):
        spec, _ = run(served, method)
        assert spec.stats["drafted"] > 0, method  # the drafts were judged, not skipped
        assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs, method


def test_sampled_logprobs_are_those_of_the_raw_distribution(served):
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=11)
    for method in ("none", "draft"):
        result, _ = run(served, method, sampling=sampling, logprobs=0, max_tokens=16)
        assert result.stats["drafted"] > 0 or method == "none"
        check_against_reference(served, result, 0)


def test_no_logprobs_unless_asked(served):
    result, events = run(served, "draft", logprobs=None, max_tokens=8)
    assert result.logprobs is None and all(e.logprob is None for e in events)
