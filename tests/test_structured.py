"""Structured output in the engine (npud/engine/grammar.py through the Sampler): JSON schemas,
regexes and Lark grammars on the bundled model (gemma-3-270m's is in test_gguf_real.py, beside
its loaded model), greedy output byte-identical
with and without speculation (prompt lookup's drafts accepted and rejected in the same run),
and a grammar that dead-ends stopping with its own finish reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")

from npud.engine.api import (FinishReason, GenerateRequest, GenerationParams, Grammar, RequestError,  # noqa: E402
                        SamplingParams, SpecParams)
from npud.engine.session import LoadedModel  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "npud" / "models"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
# a prompt that prompt lookup drafts from: some of its drafts fit the grammar, some do not
PROMPT = 'a = {"name": "os.path.join", "ok": true}\nb = {"name": "os.path.join", "ok": false}\nc = '


@pytest.fixture(scope="module")
def served():
    return LoadedModel.load("pycode", MODELS / "pycode-base", draft_dir=MODELS / "pycode-draft",
                            weight_format="fp32", backend="host")


def run(served, grammar: Grammar | None, method: str, *, prompt: str = PROMPT, max_tokens: int = 60,
        sampling: SamplingParams = SamplingParams()):
    params = GenerationParams(max_tokens=max_tokens, spec=SpecParams(method=method), use_prefix_cache=False,
                              grammar=grammar, sampling=sampling)
    session = served.start(GenerateRequest(prompt=prompt, params=params))
    while not session.done:
        session.run_round()
    return session.result()


def test_json_schema_output_validates_and_is_the_same_under_speculation(served):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    plain = run(served, grammar, "none")
    assert plain.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    lookup = run(served, grammar, "ngram")
    assert 0 < lookup.stats["accepted"] < lookup.stats["drafted"]  # drafts kept and drafts rejected
    draft = run(served, grammar, "draft")
    assert draft.stats["drafted"] > 0
    assert lookup.text == draft.text == plain.text and lookup.token_ids == plain.token_ids == draft.token_ids
    free = run(served, None, "none")
    assert not free.text.startswith("{")  # the grammar changed the output: unconstrained, it writes code


def test_regex_and_lark_grammars(served):
    for grammar, check in [(Grammar("regex", r"[a-z_]+\(\d\)"), r"[a-z_]+\(\d\)"),
                           (Grammar("lark", 'start: "def " NAME "():"\nNAME: /[a-z_]{1,12}/'), r"def [a-z_]{1,12}\(\):")]:
        outs = {m: run(served, grammar, m, prompt="def f():\n    return ", max_tokens=24) for m in ("none", "ngram")}
        import re

        assert re.fullmatch(check, outs["none"].text), outs["none"].text
        assert outs["none"].finish_reason == FinishReason.STOP and outs["ngram"].text == outs["none"].text


def test_sampled_output_stays_in_the_grammar(served):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    for seed in (1, 2):
        out = run(served, grammar, "draft", sampling=SamplingParams(temperature=1.0, seed=seed), max_tokens=80)
        if out.finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:  # out of tokens inside a string: still a prefix the grammar allows
            assert out.finish_reason == FinishReason.LENGTH and out.text.startswith('{"name": "')


def test_a_grammar_that_does_not_compile_is_a_request_error(served):
    with pytest.raises(RequestError, match="invalid regex"):
        run(served, Grammar("regex", "a(b"), "none")


class DeadAfter:
    """A constraint that allows every id for `n` tokens and then none (a dead end)."""

    def __init__(self, width: int, n: int) -> None:
        self.width, self.n, self.consumed = width, n, 0

    def allowed(self) -> np.ndarray:
        return np.full(self.width, self.consumed < self.n)

    def consume(self, token: int) -> None:
        assert self.consumed < self.n
        self.consumed += 1


def test_a_dead_end_stops_the_run_with_its_own_finish_reason(served, monkeypatch):
    width = served.model.config.vocab_size
    monkeypatch.setattr(served, "constraint", lambda grammar: DeadAfter(width, 5))
    grammar = Grammar("regex", ".*")
    outs = [run(served, grammar, m, max_tokens=20) for m in ("none", "ngram", "draft")]
    for out in outs:
        assert out.finish_reason == FinishReason.GRAMMAR_DEAD_END and len(out.token_ids) == 5
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].token_ids == run(served, None, "none", max_tokens=5).token_ids
