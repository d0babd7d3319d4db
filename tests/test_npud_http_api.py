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
