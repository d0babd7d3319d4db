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
    from engine.tokenizer import Tokenizer

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
    assert props["eos_token"] == "<|endoftext|>" and props["npud"]["fim"] is False
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
    from engine.session import LoadedModel

    return LoadedModel.load("pycode", MODELS / "pycode-base", weight_format="fp32", backend="host")


def reference_rows(served, prompt_ids: list[int], token_ids: list[int]) -> list:
    """The float64 log-softmax of the engine's logits row before each generated token."""
    import numpy as np

    from engine.forward import Forward

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
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
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
