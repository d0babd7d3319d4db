"""Ollama's API on the HTTP front end (npud/http/ollama.py) against a real npud process on the
tiny model, driven by the official `ollama` Python client over TCP and over the Unix socket (the
client takes an httpx transport), and by raw HTTP in the shapes Open WebUI sends.

Each generation is checked against the same request over /v1 (and `complete` on the main
socket): greedy and seeded sampling are deterministic, so the texts must be byte-equal.
"""

from __future__ import annotations

import json
import socket

import pytest

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")  # the ollama client's HTTP library
httpx2 = pytest.importorskip("httpx2")  # the openai client's
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from npud_fixture import FIM_MODEL, MODEL, NOBODY_UID, fim_checkpoint, start_or_clean, stop_daemon  # noqa: E402
from npud_fixture import tiny_checkpoint  # noqa: E402
from test_npud_support import DaemonProc, short_tempdir, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # a real daemon on a real (tiny) model

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("ollama")
    models = [{"name": MODEL, "checkpoint_dir": str(tiny_checkpoint(base)), "weight_format": "fp32"},
              {"name": FIM_MODEL, "checkpoint_dir": str(fim_checkpoint(base)), "weight_format": "fp32"}]
    d = start_or_clean(DaemonProc(short_tempdir(), models,
                                  server={"admin_group": "npud-test-no-such-group"},
                                  limits={"max_prompt_tokens": 512, "max_tokens": 64},
                                  http={"tcp_address": "127.0.0.1:0", "tcp_owner_uid": NOBODY_UID}))
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def sock(daemon) -> str:
    return str(daemon.dir / "http.sock")


@pytest.fixture(scope="module")
def tcp(daemon) -> str:
    (event,) = [e for e in daemon.logs() if e.get("event") == "http_listening"]
    return event["tcp"]


@pytest.fixture(scope="module", params=["tcp", "unix"])
def ol(request, tcp, sock):
    """The official client, over the loopback TCP listener and over the Unix socket."""
    if request.param == "tcp":
        c = ollama.Client(host=f"http://{tcp}", timeout=120)
    else:
        c = ollama.Client(host="http://npud", transport=httpx.HTTPTransport(uds=sock), timeout=120)
    with c:
        yield c


@pytest.fixture(scope="module")
def raw(sock):
    with httpx2.Client(transport=httpx2.HTTPTransport(uds=sock), base_url="http://npud", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oa(sock):
    http_client = httpx2.Client(transport=httpx2.HTTPTransport(uds=sock), timeout=120)
    with openai.OpenAI(base_url="http://npud/v1", api_key="none", http_client=http_client, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def client(daemon):
    with daemon.client() as c:
        yield c


def ndjson(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


# -- what is served ----------------------------------------------------------------------------


def test_list_names_every_model_with_its_tag(ol):
    models = {m.model: m for m in ol.list().models}
    assert set(models) == {f"{MODEL}:latest", f"{FIM_MODEL}:latest"}
    assert all(len(m.digest) == 64 for m in models.values())


def test_show_tells_family_context_template_and_capabilities(ol, oa):
    oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # loaded: its template is known
    shown = ol.show(f"{MODEL}:latest")
    assert shown.details.family == "qwen3" and shown.details.format == "safetensors"
    assert shown.modelinfo["general.architecture"] == "qwen3" and shown.modelinfo["qwen3.context_length"] > 0
    assert "im_start" in shown.template  # the checkpoint's chat template (Jinja)
    assert shown.capabilities == ["completion"]
    assert ol.show(FIM_MODEL).details.family == "qwen3"  # not loaded: its files' headers, no load
    assert "temperature 0" in shown.parameters
    with pytest.raises(ollama.ResponseError) as info:
        ol.show("llama3.2")
    assert info.value.status_code == 404 and MODEL in info.value.error


def test_ps_lists_the_loaded_models_and_version_answers(ol, raw, oa):
    oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    running = {m.model: m for m in ol.ps().models}
    assert f"{MODEL}:latest" in running and running[f"{MODEL}:latest"].context_length > 0
    assert running[f"{MODEL}:latest"].size > 0
    version = raw.get("/api/version").json()
    assert version["version"].count(".") == 2 and version["npud"]["version"]
    assert raw.get("/").status_code == 200 and raw.head("/").status_code == 200


# -- generation: the same bytes as /v1 -------------------------------------------------------------


def test_chat_is_byte_equal_to_v1_streamed_or_not(ol, oa):
    ref = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12).choices[0].message.content
    whole = ol.chat(MODEL, messages=MESSAGES, stream=False, options={"num_predict": 12})
    assert whole.message.content.encode() == ref.encode() and ref
    assert whole.message.role == "assistant" and whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count <= 12 and whole.prompt_eval_count > 8 and whole.total_duration > 0
    parts = list(ol.chat(f"{MODEL}:latest", messages=MESSAGES, stream=True, options={"num_predict": 12}))
    assert "".join(p.message.content for p in parts).encode() == ref.encode()
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count


def test_generate_is_the_chat_template_or_raw(ol, oa):
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": PROMPT}], max_tokens=10)
    templated = ol.generate(MODEL, PROMPT, system="Be brief.", options={"num_predict": 10})
    assert templated.response == chat.choices[0].message.content
    plain = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10).choices[0].text
    raw = ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": 10})
    assert raw.response.encode() == plain.encode() and raw.response != templated.response
    streamed = "".join(p.response for p in ol.generate(MODEL, PROMPT, raw=True, stream=True,
                                                       options={"num_predict": 10}))
    assert streamed == plain


def test_format_schema_goes_through_the_grammar(ol, oa):
    reply = ol.chat(MODEL, messages=MESSAGES, format=SCHEMA, options={"num_predict": 40})
    value = json.loads(reply.message.content)
    jsonschema.validate(value, SCHEMA)
    assert reply.done_reason == "stop"
    ref = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}).choices[0].message.content
    assert reply.message.content == ref
    streamed = "".join(p.message.content for p in ol.chat(MODEL, messages=MESSAGES, format=SCHEMA, stream=True,
                                                          options={"num_predict": 40}))
    assert streamed == ref
    assert isinstance(json.loads(ol.generate(MODEL, PROMPT, format="json", options={"num_predict": 40}).response),
                      dict)


def test_options_are_the_sampling_stop_and_length(ol, client):
    sampled = ol.generate(MODEL, PROMPT, raw=True, options={"temperature": 1.3, "top_p": 0.9, "top_k": 50, "seed": 7,
                                                            "num_predict": 10})
    ref = client.complete(prompt=PROMPT, max_tokens=10,
                          sampling={"temperature": 1.3, "top_p": 0.9, "top_k": 50, "seed": 7}).wait()
    assert sampled.response == ref["text"]
    greedy = client.complete(prompt=PROMPT, max_tokens=20).wait()["text"]
    stop = greedy.split()[2]
    stopped = ol.generate(MODEL, PROMPT, raw=True, options={"stop": [stop], "num_predict": 20})
    assert stopped.done_reason == "stop" and stop not in stopped.response and greedy.startswith(stopped.response)
    # no num_predict (or -1): until the model stops, at most limits.max_tokens (64 here)
    assert ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": -1}).eval_count <= 64
    # neutral penalties are taken; others are refused by name
    ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": 2, "repeat_penalty": 1.0, "num_thread": 2})
    with pytest.raises(ollama.ResponseError) as info:
        ol.generate(MODEL, PROMPT, options={"repeat_penalty": 1.1})
    assert info.value.status_code == 400 and "options.repeat_penalty" in info.value.error


def test_num_ctx_bounds_the_prompt_and_the_reply(ol):
    full = ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": 30})
    capped = ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": 30, "num_ctx": full.prompt_eval_count + 5})
    assert capped.eval_count == 5 and capped.done_reason == "length" and full.response.startswith(capped.response)
    assert ol.generate(MODEL, PROMPT, raw=True, options={"num_predict": 3, "num_ctx": 100000}).eval_count == 3
    with pytest.raises(ollama.ResponseError) as info:
        ol.generate(MODEL, PROMPT, raw=True, options={"num_ctx": 2})
    assert info.value.status_code == 400 and "num_ctx" in info.value.error


def test_logprobs_are_the_v1_chat_logprobs(raw, oa):
    ref = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2)
    body = {"model": MODEL, "messages": MESSAGES, "stream": False, "logprobs": True, "top_logprobs": 2,
            "options": {"num_predict": 4}}
    got = raw.post("/api/chat", json=body).json()["logprobs"]
    assert [g["token"] for g in got] == [c.token for c in ref.choices[0].logprobs.content]
    assert [g["logprob"] for g in got] == [c.logprob for c in ref.choices[0].logprobs.content]
    assert all(len(g["top_logprobs"]) == 2 for g in got)


def test_an_empty_prompt_loads_and_keep_alive_zero_unloads(ol):
    loaded = ol.generate(FIM_MODEL, "", keep_alive="5m")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert f"{FIM_MODEL}:latest" in {m.model for m in ol.ps().models}
    gone = ol.chat(FIM_MODEL, messages=[], keep_alive=0)
    assert gone.done_reason == "unload"
    wait_for(lambda: f"{FIM_MODEL}:latest" not in {m.model for m in ol.ps().models}, 60,
             what="the idle model to be unloaded")


# -- what npud does not do, said clearly ---------------------------------------------------------


def test_images_tools_embeddings_and_model_management_are_refused_by_name(ol, raw):
    with pytest.raises(ollama.ResponseError) as info:
        ol.generate(MODEL, "what is this?", images=[b"\x89PNG\r\n\x1a\n"])
    assert info.value.status_code == 400 and "images" in info.value.error and "text only" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ol.chat(MODEL, messages=[{"role": "user", "content": "x", "images": [b"\x89PNG\r\n"]}])
    assert "messages[0].images" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ol.embed(MODEL, "a sentence")
    assert info.value.status_code == 400 and "embeddings" in info.value.error
    r = raw.post("/api/embeddings", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 400 and r.json()["code"] == "unsupported"
    with pytest.raises(ollama.ResponseError) as info:
        ol.pull("llama3.2")
    assert "npud.toml" in info.value.error
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    r = raw.post("/api/chat", json={"model": MODEL, "messages": MESSAGES, "tools": tools, "stream": False})
    assert r.status_code == 400 and "tools" in r.json()["error"]
    r = raw.post("/api/generate", json={"model": MODEL, "prompt": "x", "raw": True, "system": "s", "stream": False})
    assert r.status_code == 400 and r.json() == {"error": r.json()["error"], "code": "bad_request"}
    r = raw.post("/api/chat", json={"model": MODEL, "messages": MESSAGES, "options": {"bogus": 1}})
    assert r.status_code == 400 and "bogus" in r.json()["error"]


# -- Open WebUI's request shapes -------------------------------------------------------------------


def test_open_webui_request_shapes(raw):
    """What Open WebUI sends in Ollama mode: the version and model list at start, /api/show with
    `name`, then chats streamed with its options, keep_alive and empty image lists."""
    assert raw.get("/api/version").status_code == 200
    names = [m["name"] for m in raw.get("/api/tags").json()["models"]]
    assert f"{MODEL}:latest" in names
    assert raw.post("/api/show", json={"name": f"{MODEL}:latest"}).status_code == 200
    body = {"model": f"{MODEL}:latest", "stream": True, "keep_alive": "5m",
            "options": {"temperature": 0.0, "num_ctx": 2048, "num_predict": 8},
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "Hello", "images": []}]}
    with raw.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = ndjson(r)
    assert lines[-1]["done"] is True and all(not line["done"] for line in lines[:-1])
    assert all(line["model"] == f"{MODEL}:latest" for line in lines)
    # its title and tag generation: the same chat, not streamed, with format json
    title = raw.post("/api/chat", json={**body, "stream": False, "format": "json"}).json()
    assert title["done"] and isinstance(json.loads(title["message"]["content"]), dict)


# -- the same jobs, tickets and peers as the OpenAI routes -------------------------------------------


def test_requests_are_jobs_of_the_peer(tcp, sock, client):
    body = {"model": MODEL, "prompt": PROMPT, "raw": True, "stream": False, "options": {"num_predict": 3}}
    over_tcp = httpx2.post(f"http://{tcp}/api/generate", json=body, timeout=120).json()  # the npud object too
    with httpx2.Client(transport=httpx2.HTTPTransport(uds=sock), base_url="http://npud", timeout=120) as c:
        over_unix = c.post("/api/generate", json=body).json()
    tcp_job = client.status(over_tcp["npud"]["job"])
    unix_job = client.status(over_unix["npud"]["job"])
    assert tcp_job["owner_uid"] == NOBODY_UID and unix_job["owner_uid"] == 0
    assert tcp_job["interactive"] and tcp_job["state"] == unix_job["state"] == "done"
    assert client.tickets(job=over_unix["npud"]["job"])["tickets"]  # it held a ticket like any job


def test_closing_a_stream_cancels_its_job(raw, client):
    body = {"model": MODEL, "prompt": PROMPT, "raw": True, "options": {"num_predict": 64, "stop": ["\x00"]}}
    before = {j["job"] for j in client.jobs(limit=1000)["jobs"]}
    with raw.stream("POST", "/api/generate", json=body) as r:
        next(line for line in r.iter_lines() if line)
        job = (({j["job"] for j in client.jobs(limit=1000)["jobs"]} - before) or {None}).pop()
    assert job is not None
    state = wait_for(lambda: (s := client.status(job)["state"]) in ("done", "cancelled") and s, 60, what="the job")
    assert state in ("done", "cancelled")  # 64 tiny tokens may all be out before the close lands


def test_unknown_models_and_bad_bodies_are_ollama_errors(raw):
    r = raw.post("/api/chat", json={"model": "llama3.2", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["code"] == "not_found" and MODEL in r.json()["error"]
    r = raw.post("/api/generate", content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == "bad_request"
    r = raw.get("/api/chat")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_no_request_above_made_an_internal_error(daemon):
    bad = [e for e in daemon.logs() if e.get("event") in ("internal_error", "connection_error")
           or e.get("level") == "error"]
    assert not bad, bad[:3]


def test_a_raw_http_request_over_the_unix_socket(sock):
    """Without any client library: one request, one NDJSON reply, on the Unix socket."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "raw": True, "options": {"num_predict": 2}}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(sock)
        s.sendall(b"POST /api/generate HTTP/1.1\r\nHost: npud\r\nConnection: close\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"application/x-ndjson" in head
    assert b'"done":true' in rest
