"""The HTTP API beyond completions, against a real npud on the bundled model pair
(npud/models): llama.cpp's /tokenize, /detokenize and /props, Prometheus /metrics (an
admin's: root on the Unix socket, never a TCP client), and per-token logprobs that equal the
engine's own log-softmax with and without speculation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # openai's HTTP client library
from prometheus_client import parser  # noqa: E402

from npud_fixture import NOBODY_UID, start_or_clean, stop_daemon  # noqa: E402
from test_npud_support import DaemonProc, short_tempdir  # noqa: E402

pytestmark = pytest.mark.slow  # a real daemon on a real (small) model

MODELS = Path(__file__).resolve().parent.parent / "npud" / "models"
MODEL = "pycode"
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def daemon():
    models = [{"name": MODEL, "checkpoint_dir": str(MODELS / "pycode-base"), "draft_dir": str(MODELS / "pycode-draft"),
               "weight_format": "fp32"}]
    d = start_or_clean(DaemonProc(short_tempdir(), models, limits={"max_prompt_tokens": 512, "max_tokens": 256},
                                  http={"tcp_address": "127.0.0.1:0", "tcp_owner_uid": NOBODY_UID}))
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def raw(daemon):
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.dir / "http.sock")), base_url="http://npud",
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tcp(daemon):
    (event,) = [e for e in daemon.logs() if e.get("event") == "http_listening"]
    with httpx.Client(base_url=f"http://{event['tcp']}", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oa(daemon):
    http_client = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.dir / "http.sock")), timeout=120)
    with openai.OpenAI(base_url="http://npud/v1", api_key="none", http_client=http_client, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from npud.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(MODELS / "pycode-base")


# -- /tokenize, /detokenize, /props --------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip_with_the_models_tokenizer(raw, tokenizer):
    text = "x = 'héllo 日本'  # <|endoftext|>"
    r = raw.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == tokenizer.encode(text) and tokenizer.eos_token_ids[0] in ids  # special tokens parsed
    assert raw.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    # pieces: a string when its bytes are UTF-8, else the bytes (half of "é" is no text)
    pieces = raw.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces)


def test_add_special_gives_the_ids_a_prompt_runs_as(raw, daemon):
    # the bundled vocabulary asks for no BOS: add_special changes nothing, as a prompt shows
    a = raw.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    b = raw.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    with daemon.client() as c:
        ref = c.complete(prompt=PROMPT, max_tokens=1).wait()
    assert a == b and len(a) == ref["prompt_tokens"]


def test_tokenize_errors_name_the_field(raw):
    cases = [("/tokenize", {}, "body.content: is required"),
             ("/tokenize", {"content": "x", "with_pieces": 1}, "body.with_pieces"),
             ("/tokenize", {"content": "x", "parse_special": False}, "body.parse_special"),
             ("/tokenize", {"content": "x", "bogus": 1}, "bogus"),
             ("/detokenize", {"tokens": [1, "a"]}, "body.tokens[1]"),
             ("/detokenize", {"tokens": [10 ** 6]}, "outside the vocabulary")]
    for path, body, named in cases:
        r = raw.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert named in r.json()["error"]["message"], r.json()
    r = raw.post("/tokenize", json={"content": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_props_tell_the_context_template_and_tokens(raw, tokenizer):
    r = raw.get("/props")
    assert r.status_code == 200
    props = r.json()
    assert props["default_generation_settings"]["n_ctx"] == props["npud"]["context_length"] > 0
    assert props["model_alias"] == MODEL and props["npud"]["models"] == [MODEL]
    assert props["chat_template"] == tokenizer.chat_template_texts["default"]
    assert props["eos_token"] == "<|endoftext|>" and props["npud"]["fim"] is True  # Qwen2.5-Coder's FIM tokens
    assert props["npud"]["vocab_size"] == tokenizer.vocab_size
    assert str(MODELS) not in r.text  # no paths


# -- /metrics --------------------------------------------------------------------------------------

def test_metrics_is_prometheus_text_for_an_admin(raw, oa):
    oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    r = raw.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in parser.text_string_to_metric_families(r.text)}
    assert fams["npud_ticket_wait_seconds"].type == "histogram"
    assert fams["npud_first_token_seconds"].type == "histogram"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("npud_tokens_generated_total", ())] >= 4
    assert samples[("npud_first_token_seconds_count", ())] >= 1
    assert samples[("npud_ticket_wait_seconds_bucket", (("class", "interactive"), ("le", "+Inf")))] >= 1


def test_metrics_refuses_a_peer_that_is_not_an_admin(tcp):
    r = tcp.get("/metrics")  # a TCP client is never an admin
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "npud_" not in r.text


def test_the_socket_methods_tokenize_as_http_does(daemon, raw):
    with daemon.client() as c:
        out = c.call("tokenize", {"text": PROMPT, "with_pieces": True})
        assert out["model"] == MODEL
        ids = [p["id"] for p in out["tokens"]]
        assert ids == raw.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
        assert c.call("detokenize", {"tokens": ids}) == {"model": MODEL, "content": PROMPT}


# -- logprobs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_model():
    from npud.engine.session import LoadedModel

    return LoadedModel.load("pycode", MODELS / "pycode-base", weight_format="fp32", backend="host")


def reference_rows(served, prompt_ids: list[int], token_ids: list[int]) -> list:
    """The float64 log-softmax of the engine's logits row before each generated token."""
    import numpy as np

    from npud.engine.forward import Forward

    f = Forward(served.model)
    f.prefill(prompt_ids[:-1])
    logits, rows = f.step(prompt_ids[-1], len(prompt_ids) - 1), []
    for i, token in enumerate(token_ids):
        z = np.asarray(logits, dtype=np.float32).astype(np.float64)
        rows.append(z - np.logaddexp.reduce(z))
        logits = f.step(token, len(prompt_ids) + i)
    return rows


def spec(method: str) -> dict:
    return {"npud": {"spec": {"method": method}}}


def test_completion_logprobs_are_the_engines_log_softmax(oa, raw, daemon, engine_model):
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=3, extra_body=spec("none"))
    (choice,) = out.choices
    lp = choice.logprobs
    ids = raw.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    with daemon.client() as c:  # the job's stored result has the token ids
        (stored,) = c.result(out.model_extra["npud"]["job"])["results"]
    token_ids = stored["token_ids"]
    assert [i["logprob"] for i in stored["logprobs"]] == lp.token_logprobs  # the socket's form, the same numbers
    rows = reference_rows(engine_model, ids, token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(rows) == out.usage.completion_tokens
    for token, logprob, top, row in zip(token_ids, lp.token_logprobs, lp.top_logprobs, rows):
        assert math.isclose(logprob, row[token], abs_tol=1e-9)
        assert len(top) <= 3 and max(top.values()) == logprob  # greedy: the chosen is the likeliest
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def chat_logprobs(oa, method: str, stream: bool) -> tuple[str, list[dict]]:
    messages = [{"role": "user", "content": "import os"}]  # code: a reply the bundled base does not end at once
    kw = dict(model=MODEL, messages=messages, max_tokens=24, logprobs=True, top_logprobs=4, extra_body=spec(method))
    if not stream:
        out = oa.chat.completions.create(**kw)
        return out.choices[0].message.content, [c.model_dump() for c in out.choices[0].logprobs.content]
    text, items = "", []
    for ch in oa.chat.completions.create(stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            if ch.choices[0].logprobs is not None:
                items += [c.model_dump() for c in ch.choices[0].logprobs.content]
    return text, items


def test_chat_logprobs_are_the_same_with_and_without_speculation_streamed_or_not(oa):
    text, items = chat_logprobs(oa, "none", stream=False)
    assert text and items and all(len(i["top_logprobs"]) == 4 for i in items)
    assert b"".join(bytes(i["bytes"]) for i in items).decode("utf-8", "replace").startswith(text)
    assert all(i["top_logprobs"][0]["logprob"] == i["logprob"] for i in items)  # greedy
    for method in ("ngram", "draft"):
        for stream in (False, True):
            assert chat_logprobs(oa, method, stream) == (text, items), (method, stream)


def test_logprob_fields_are_checked(raw):
    cases = [("/v1/chat/completions", {"top_logprobs": 2}, "body.top_logprobs: needs logprobs: true"),
             ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "body.top_logprobs"),
             ("/v1/chat/completions", {"logprobs": 3}, "body.logprobs"),
             ("/v1/completions", {"logprobs": True}, "body.logprobs"),
             ("/v1/completions", {"logprobs": -1}, "body.logprobs")]
    for path, extra, named in cases:
        body = {"model": MODEL, "max_tokens": 2, **extra}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"})
        r = raw.post(path, json=body)
        assert r.status_code == 400 and named in r.json()["error"]["message"], (extra, r.text)
    plain = raw.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_socket_logprobs_per_prompt_of_a_batch(daemon):
    with daemon.client() as c:
        streamed = c.complete(prompt=PROMPT, max_tokens=6, logprobs=2)
        events = [e for e in streamed if e.name == "token"]
        done = streamed.wait()
        assert len(done["logprobs"]) == len(done["token_ids"]) == 6
        assert [i for e in events for i in e.data.get("logprobs", [])] == done["logprobs"]
        job = c.submit([PROMPT, PROMPT], max_tokens=4, prompt_settings=[{"logprobs": 1}, None])["job"]
        c.stream(job).wait()
        first, second = c.result(job)["results"]
        assert [i["logprob"] for i in first["logprobs"]] == [i["logprob"] for i in done["logprobs"][:4]]
        assert all(len(i["top_logprobs"]) == 1 for i in first["logprobs"]) and "logprobs" not in second


# -- structured output -------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
JSON_PROMPT = 'a = {"name": "os.path.join", "ok": true}\nb = {"name": "os.path.join", "ok": false}\nc = '
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def structured(oa, method: str, stream: bool, chat: bool) -> tuple[str, str]:
    kw = dict(model=MODEL, max_tokens=60)
    if chat:
        make = oa.chat.completions.create
        kw.update(messages=[{"role": "user", "content": JSON_PROMPT}], response_format=SCHEMA_FORMAT,
                  extra_body=spec(method))
    else:  # the SDK's completions have no response_format: llama-server's and npud's extension
        make = oa.completions.create
        kw.update(prompt=JSON_PROMPT, extra_body={**spec(method), "response_format": SCHEMA_FORMAT})
    if not stream:
        out = make(**kw).choices[0]
        return (out.message.content if chat else out.text), out.finish_reason
    text, reason = "", None
    for ch in make(stream=True, **kw):
        if ch.choices:
            text += (ch.choices[0].delta.content or "") if chat else ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
    return text, reason


def test_json_schema_replies_validate_streamed_or_not_with_and_without_prompt_lookup(oa):
    jsonschema = pytest.importorskip("jsonschema")
    for chat in (False, True):
        text, reason = structured(oa, "none", False, chat)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        for method in ("ngram", "draft"):
            for stream in (False, True):
                assert structured(oa, method, stream, chat) == (text, reason), (chat, method, stream)


def test_json_mode_and_a_grammar_in_the_npud_object(oa, raw):
    out = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": JSON_PROMPT}], max_tokens=40,
                                     response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a small model may still be inside a string when max_tokens runs out
        assert out.choices[0].message.content.startswith("{")
    r = raw.post("/v1/completions", json={"model": MODEL, "prompt": "def f():\n    return ", "max_tokens": 20,
                                          "npud": {"grammar": {"regex": "[a-z]+\\(\\d\\)"}}})
    assert r.status_code == 200
    import re

    assert re.fullmatch(r"[a-z]+\(\d\)", r.json()["choices"][0]["text"])


def test_bad_schemas_grammars_and_fields_are_400s_naming_them(raw):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "body.response_format.json_schema.schema: invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
         "body.response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type"),
        ({"response_format": {"type": "json_object", "extra": 1}}, "body.response_format: unknown parameter"),
        ({"npud": {"grammar": {"regex": "a(b"}}}, "body.npud.grammar.regex: invalid regex"),
        ({"npud": {"grammar": {"lark": "start: foo"}}}, "body.npud.grammar.lark: invalid Lark grammar"),
        ({"npud": {"grammar": {"yacc": "x"}}}, "body.npud.grammar: unknown parameter(s) ['yacc']"),
        ({"npud": {"grammar": {"regex": "a"}}, "response_format": {"type": "json_object"}}, "body.npud.grammar"),
        ({"keep_alive": "soon"}, "body.keep_alive"),
    ]
    for extra, named in cases:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = raw.post(path, json={"model": MODEL, "max_tokens": 2, **body, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert named in r.json()["error"]["message"], (named, r.json())
            assert r.json()["error"]["code"] == "bad_request"


def test_npuctl_submit_takes_a_response_format_per_line(daemon, tmp_path):
    import subprocess
    import sys

    from npud_fixture import REPO, python_env

    jsonschema = pytest.importorskip("jsonschema")
    lines = [{"prompt": JSON_PROMPT, "max_tokens": 60, "response_format": SCHEMA_FORMAT},
             {"prompt": JSON_PROMPT, "max_tokens": 8},
             {"prompt": "def f():\n    return ", "max_tokens": 20, "grammar": {"regex": "[a-z]+\\(\\d\\)"}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "submit", str(src), "--wait"], cwd=REPO,
                         env=python_env(daemon.socket), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    first, second, third = [json.loads(line) for line in run.stdout.splitlines()]
    assert first["job"] == second["job"] == third["job"]  # one job, each prompt with its own format
    jsonschema.validate(json.loads(first["text"]), SCHEMA)
    assert not second["text"].startswith("{")
    import re

    assert re.fullmatch(r"[a-z]+\(\d\)", third["text"])
