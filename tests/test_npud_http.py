"""The HTTP front end against a real npud process on the tiny model, driven by the official
`openai` SDK (over the Unix socket through httpx2's `HTTPTransport(uds=...)`, and over the
loopback TCP listener), by raw sockets for what the SDK cannot send, and by `curl --unix-socket`.

Each HTTP answer is checked against the same request made with `complete` on the main socket:
greedy and seeded sampling are deterministic, so the texts must be equal.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # openai's HTTP client library

from npud_fixture import (FIM_CONTEXT, FIM_MODEL, MODEL, NOBODY_UID, fim_checkpoint, start_or_clean,  # noqa: E402
                          stop_daemon, tiny_checkpoint)
from test_npud_support import DaemonProc, short_tempdir, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # a real daemon on a real (tiny) model

TOKEN = "a-test-bearer-token-0123456789"
PROMPT = "def add(a, b):"


def start(tmp_path_factory, server: dict | None = None, **http) -> DaemonProc:
    """npud on the tiny model and its FIM twin (Qwen's FIM tokens, FIM_CONTEXT positions)."""
    base = tmp_path_factory.mktemp("http")
    workdir = short_tempdir()
    models = [{"name": MODEL, "checkpoint_dir": str(tiny_checkpoint(base)), "weight_format": "fp32"},
              {"name": FIM_MODEL, "checkpoint_dir": str(fim_checkpoint(base)), "weight_format": "fp32"}]
    return start_or_clean(DaemonProc(
        workdir, models,
        server={"admin_group": "npud-test-no-such-group", "max_connections_per_uid": 4, **(server or {})},
        limits={"max_prompt_tokens": 512, "max_tokens": 3500}, http=http))


stop = stop_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start(tmp_path_factory, tcp_address="127.0.0.1:0", tcp_owner_uid=NOBODY_UID)
    yield d
    stop(d)


@pytest.fixture(scope="module")
def sock(daemon) -> str:
    return str(daemon.dir / "http.sock")


@pytest.fixture(scope="module")
def tcp(daemon) -> str:
    (event,) = [e for e in daemon.logs() if e.get("event") == "http_listening"]
    return event["tcp"]


@pytest.fixture(scope="module")
def oa(sock):
    http_client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=120)
    with openai.OpenAI(base_url="http://npud/v1", api_key="none", http_client=http_client, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def raw(sock):
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://npud", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(daemon):
    with daemon.client() as c:
        yield c


def socket_complete(client, **params) -> dict:
    """The same request through `complete` on the main socket."""
    return client.complete(**params).wait()


def test_completion_is_the_socket_complete(oa, client):
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = socket_complete(client, prompt=PROMPT, max_tokens=12)
    (choice,) = out.choices
    assert choice.text == ref["text"] and choice.text
    assert choice.finish_reason == ref["finish_reason"]
    assert out.usage.prompt_tokens == ref["prompt_tokens"]
    assert out.usage.completion_tokens == len(ref["token_ids"]) <= 12
    assert out.usage.total_tokens == ref["prompt_tokens"] + len(ref["token_ids"])
    assert out.id == f"cmpl-{out.model_extra['npud']['job']}" and out.model == MODEL
    status = client.status(out.model_extra["npud"]["job"])
    assert status["priority"] == "interactive" and status["interactive"] and status["state"] == "done"


def test_seeded_sampling_is_passed_on(oa, client):
    kw = dict(max_tokens=10, temperature=1.3, top_p=0.9, seed=7)
    a = oa.completions.create(model=MODEL, prompt=PROMPT, **kw).choices[0].text
    ref = socket_complete(client, prompt=PROMPT, max_tokens=10, sampling={"temperature": 1.3, "top_p": 0.9, "seed": 7})
    other = socket_complete(client, prompt=PROMPT, max_tokens=10, sampling={"temperature": 1.3, "top_p": 0.9, "seed": 8})
    assert a == ref["text"]
    assert other["text"] != a  # the seed reached the sampler: another seed draws another text


def test_chat_renders_the_template_as_the_socket_does(oa, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    out = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    ref = socket_complete(client, messages=messages, max_tokens=8)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == ref["prompt_tokens"] > 8
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    # content as OpenAI's list of text parts is the same text
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             messages[1]]
    assert oa.chat.completions.create(model=MODEL, messages=parts, max_tokens=8).choices[0].message.content == ref["text"]


def test_max_completion_tokens_wins_over_max_tokens(oa):
    out = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                     max_completion_tokens=3, max_tokens=20)
    assert out.usage.completion_tokens <= 3


def test_stream_is_the_same_text_in_chunks(oa, client):
    ref = socket_complete(client, prompt=PROMPT, max_tokens=20)
    chunks = list(oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                        stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref["text"]
    assert len([t for t in texts if t]) > 1  # more than one chunk of text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == ref["finish_reason"] and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_chat_stream_starts_with_the_role_and_ends_with_done(raw, client):
    messages = [{"role": "user", "content": "Say hi"}]
    ref = socket_complete(client, messages=messages, max_tokens=10)
    with raw.stream("POST", "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 10, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == ref["text"]
    assert events[-1]["choices"][0]["finish_reason"] == ref["finish_reason"]
    assert events[-1]["npud"]["job"] == events[0]["id"].split("-", 1)[1]
    assert "usage" not in events[-1]  # only with stream_options.include_usage


def test_stop_strings_end_the_text_before_them(oa, client):
    full = socket_complete(client, prompt=PROMPT, max_tokens=24)["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip()
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop)
    ref = socket_complete(client, prompt=PROMPT, max_tokens=24, stop=[stop])
    assert out.choices[0].text == ref["text"] == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    listed = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=["@@never@@", stop])
    assert listed.choices[0].text == ref["text"]


def test_npud_extension_speculation_and_priority(oa, client):
    out = oa.completions.create(model=MODEL, prompt=PROMPT * 3, max_tokens=16,
                                extra_body={"npud": {"spec": {"method": "none"}, "priority": "batch"}})
    ext = out.model_extra["npud"]
    assert {"drafted", "accepted", "acceptance_rate", "rounds"} <= set(ext["stats"])
    assert ext["stats"]["drafted"] == 0  # plain decode drafts nothing
    assert client.status(ext["job"])["priority"] == "batch"
    # the method reaches the engine: this model has no draft model
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"npud": {"spec": {"method": "draft"}}})
    assert info.value.code == "bad_request" and "draft" in info.value.message


def test_structured_output_cut_short_is_flagged(oa):
    """A json_schema reply that max_tokens cuts is a prefix of a valid document, and the reply
    says so in npud.grammar_complete besides finish_reason "length" (issue 42: it was invalid JSON
    with no flag); a whole one says true, a request without a grammar null."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    messages = [{"role": "user", "content": "Say hi"}]
    cut = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, response_format=fmt)
    assert cut.choices[0].finish_reason == "length" and cut.model_extra["npud"]["grammar_complete"] is False
    whole = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, response_format=fmt)
    assert whole.choices[0].finish_reason == "stop" and whole.model_extra["npud"]["grammar_complete"] is True
    assert set(json.loads(whole.choices[0].message.content)) == {"ok", "n"}
    free = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert free.model_extra["npud"]["grammar_complete"] is None


def test_models_and_health(oa, raw):
    models = oa.models.list()
    assert [m.id for m in models.data] == [MODEL, FIM_MODEL]
    assert models.data[0].owned_by == "npud"
    r = raw.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_curl_over_the_unix_socket(sock):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl")
    run = subprocess.run([curl, "-sS", "--unix-socket", sock, "http://localhost/v1/completions",
                          "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": PROMPT, "max_tokens": 4})],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    reply = json.loads(run.stdout)
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] <= 4
    health = subprocess.run([curl, "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", sock,
                             "http://localhost/health"], capture_output=True, text=True, timeout=60)
    assert health.stdout == "200"


# -- errors ----------------------------------------------------------------------------------


def error_of(response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    return response.status_code, body["error"]["code"], body["error"]["message"]


def test_n_other_than_one_is_a_clear_400(oa):
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt=PROMPT, n=2)
    assert info.value.status_code == 400 and info.value.code == "unsupported"
    assert "n=1" in info.value.message


def test_unknown_model_is_404(oa):
    with pytest.raises(openai.NotFoundError) as info:
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "not_found" and "gpt-4o" in info.value.message


def test_prompt_too_long_is_400_with_its_code(oa):
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert info.value.code == "prompt_too_long"


@pytest.mark.parametrize("body, status, code, words", [
    (b"{bad json", 400, "bad_request", "not valid JSON"),
    (b"[1, 2]", 400, "bad_request", "JSON object"),
    (b"\xff\xfe", 400, "bad_request", "UTF-8"),
    (json.dumps({"prompt": PROMPT, "max_tokens": 10**6}).encode(), 400, "bad_request", "body.max_tokens"),
    (json.dumps({"prompt": PROMPT, "temperature": "hot"}).encode(), 400, "bad_request", "body.temperature"),
    (json.dumps({"prompt": PROMPT, "top_p": 0}).encode(), 400, "bad_request", "body.top_p"),
    (json.dumps({"prompt": PROMPT, "seed": -1}).encode(), 400, "bad_request", "body.seed"),
    (json.dumps({"prompt": PROMPT, "stop": [""]}).encode(), 400, "bad_request", "body.stop[0]"),
    (json.dumps({"prompt": PROMPT, "frobnicate": 1}).encode(), 400, "bad_request", "frobnicate"),
    (json.dumps({"prompt": PROMPT, "frequency_penalty": 0.5}).encode(), 400, "unsupported", "frequency_penalty"),
    (json.dumps({"prompt": [PROMPT, PROMPT]}).encode(), 400, "unsupported", "body.prompt"),
    (json.dumps({"prompt": [1, 2, 3]}).encode(), 400, "unsupported", "token ids"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "bad_request", "body.prompt"),
    (json.dumps({"prompt": PROMPT, "npud": {"priority": "now"}}).encode(), 400, "bad_request", "body.npud.priority"),
    (json.dumps({"prompt": PROMPT, "npud": {"spec": {"method": "magic"}}}).encode(), 400, "bad_request",
     "body.npud.spec.method"),
    (json.dumps({"prompt": PROMPT, "stream": "yes"}).encode(), 400, "bad_request", "body.stream"),
])
def test_bad_completion_bodies(raw, body, status, code, words):
    got_status, got_code, message = error_of(raw.post("/v1/completions", content=body))
    assert (got_status, got_code) == (status, code)
    assert words in message


@pytest.mark.parametrize("messages, words", [
    ([], "body.messages"),
    ([{"role": "user"}], "body.messages[0]"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text parts"),
    (["hi"], "body.messages[0]"),
])
def test_bad_chat_bodies(raw, messages, words):
    status, code, message = error_of(raw.post("/v1/chat/completions", json={"messages": messages}))
    assert status == 400 and code in ("bad_request", "unsupported") and words in message


def test_routes_methods_and_sizes(raw, daemon):
    assert error_of(raw.get("/v1/nothing"))[:2] == (404, "not_found")
    assert error_of(raw.get("/v1/completions"))[:2] == (405, "method_not_allowed")
    assert error_of(raw.post("/health"))[:2] == (405, "method_not_allowed")
    big = json.dumps({"prompt": "x" * 70000}).encode()  # over limits.max_line_bytes = 65536
    assert error_of(raw.post("/v1/completions", content=big))[:2] == (413, "request_too_large")


def test_garbage_is_a_400_and_the_daemon_carries_on(sock, raw):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):  # the daemon closes the connection after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert b'"code":"bad_request"' in reply
    assert raw.get("/health").status_code == 200


def test_expect_100_continue_is_answered_before_the_body(sock):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nExpect: 100-continue\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 100 ")
        s.sendall(body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and b'"completion_tokens":' in reply


# -- fill-in-the-middle -----------------------------------------------------------------------

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


def test_infill_is_the_socket_fim_request(raw, client):
    r = raw.post("/infill", json={"model": FIM_MODEL, "input_prefix": PREFIX, "prompt": "ret",
                                  "input_suffix": SUFFIX, "input_extra": EXTRA, "n_predict": 10})
    assert r.status_code == 200, r.text
    reply = r.json()
    ref = socket_complete(client, model=FIM_MODEL, prompt=PREFIX + "ret", suffix=SUFFIX, fim_extra=EXTRA,
                          max_tokens=10)
    assert reply["content"] == ref["text"] and reply["stop"] is True
    assert reply["tokens_predicted"] == len(ref["token_ids"]) <= 10
    assert reply["tokens_evaluated"] == ref["prompt_tokens"]
    assert reply["npud"]["job"] and reply["model"] == FIM_MODEL
    # without input_extra the prompt differs, and so does its length
    bare = raw.post("/infill", json={"model": FIM_MODEL, "input_prefix": PREFIX, "prompt": "ret",
                                     "input_suffix": SUFFIX, "n_predict": 10}).json()
    assert bare["tokens_evaluated"] < reply["tokens_evaluated"]


def test_infill_takes_llama_vim_hints_and_its_unset_values(raw, client):
    body = {"model": FIM_MODEL, "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "", "n_predict": 6,
            "seed": -1, "top_k": 40, "top_p": 0.99, "n_indent": 4, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "stream": False,
            "response_fields": ["content", "timings"], "stop": []}
    reply = raw.post("/infill", json=body).json()
    ref = socket_complete(client, model=FIM_MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=6,
                          sampling={"top_k": 40, "top_p": 0.99})
    assert reply["content"] == ref["text"]
    unlimited = raw.post("/infill", json={**body, "n_predict": -1, "n_indent": None}).json()
    assert unlimited["stop"] is True and unlimited["npud"]["job"] != reply["npud"]["job"]


def test_infill_stream_is_llama_cpp_events(raw):
    body = {"model": FIM_MODEL, "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12}
    whole = raw.post("/infill", json=body).json()
    with raw.stream("POST", "/infill", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_openai_suffix_is_fill_in_the_middle(oa, raw):
    out = oa.completions.create(model=FIM_MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8)
    infill = raw.post("/infill", json={"model": FIM_MODEL, "input_prefix": PREFIX, "input_suffix": SUFFIX,
                                       "n_predict": 8}).json()
    assert out.choices[0].text == infill["content"]


def test_infill_on_a_model_without_fim_tokens_names_them(raw):
    status, code, message = error_of(raw.post("/infill", json={"model": MODEL, "input_prefix": PREFIX,
                                                               "input_suffix": SUFFIX}))
    assert (status, code) == (400, "fim_unsupported")
    assert "<|fim_prefix|>" in message


@pytest.mark.parametrize("body, words", [
    ({"input_prefix": 3}, "body.input_prefix"),
    ({"input_extra": [{"filename": "a.py"}]}, "body.input_extra[0]"),
    ({"input_extra": "x"}, "body.input_extra"),
    ({"n_predict": 0}, "body.max_tokens"),
    ({"slot": 1}, "slot"),
])
def test_bad_infill_bodies(raw, body, words):
    status, code, message = error_of(raw.post("/infill", json={"model": FIM_MODEL, **body}))
    assert status == 400 and code == "bad_request" and words in message


def test_a_prompt_that_leaves_little_room_has_max_tokens_clamped(oa):
    prompt = "word " * 40
    num_tokens = oa.completions.create(model=FIM_MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert FIM_CONTEXT // 2 < num_tokens < FIM_CONTEXT
    out = oa.completions.create(model=FIM_MODEL, prompt=prompt, max_tokens=3000,
                                extra_body={"npud": {"spec": {"method": "none"}}})
    clamped = out.model_extra["npud"]["max_tokens_clamped_to"]
    assert clamped is not None and clamped < 3000
    assert out.usage.prompt_tokens + clamped == FIM_CONTEXT
    assert out.usage.completion_tokens <= clamped
    if out.usage.completion_tokens == clamped:
        assert out.choices[0].finish_reason == "length"


# -- a client that goes away -----------------------------------------------------------------


def wait_state(client, job: int, states=("cancelled", "done", "failed")) -> str:
    return wait_for(lambda: client.status(job)["state"] in states and client.status(job)["state"], 60,
                    what=f"job {job} to end")


def test_closing_a_stream_cancels_its_job(raw, client):
    with raw.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3000, "stream": True}) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line)[6:])
        job = first["id"].split("-", 1)[1]  # the job's reference: status takes it as it takes an id
        assert client.status(job)["state"] == "running"
    # leaving the block closes the connection mid-stream
    assert wait_state(client, job) == "cancelled"
    assert client.status(job)["tokens"] < 3000


def test_closing_a_waiting_request_cancels_its_job(sock, client, daemon):
    before = {j["job"] for j in client.jobs(limit=1000)["jobs"]}
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        job = wait_for(lambda: ({j["job"] for j in client.jobs(limit=1000)["jobs"]} - before) or None, 60,
                       what="the job").pop()
        wait_for(lambda: client.status(job)["tokens"] > 0, 60, what="tokens")
    assert wait_state(client, job) == "cancelled"
    assert any(e.get("event") == "http_request" and e.get("client_gone") for e in daemon.logs())


def test_a_client_that_stops_reading_is_dropped(tmp_path_factory):
    """A blocked send ends the request after server.idle_timeout_s as `client_gone`, never as
    an internal error. (Its job goes on generating into the subscriber's buffer meanwhile, so
    it may be done by then; if not, it is cancelled.)"""
    d = start(tmp_path_factory, server={"idle_timeout_s": 0.5})  # also the bound on one send
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "stream": True}).encode()

        def call(method: str, **params):  # a connection per call: an idle one is closed after 0.5 s
            with d.client() as c:
                return c.call(method, params)

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(d.dir / "http.sock"))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)  # and never read the reply
            job = wait_for(lambda: call("jobs")["jobs"], 60, what="the job")[0]["job"]
            requests = wait_for(lambda: [e for e in d.logs() if e.get("event") == "http_request"], 60,
                                what="the request to end")
            assert requests[-1]["client_gone"] is True and requests[-1]["status"] == 200
            status = wait_for(lambda: (st := call("status", job=job))["state"] in ("done", "cancelled") and st, 60,
                              what="the job to end")
            assert status["state"] == "done" or status["tokens"] < 3000
        assert not [e for e in d.logs() if e.get("event") in ("internal_error", "connection_error")]
    finally:
        stop(d)


# -- TCP -------------------------------------------------------------------------------------


def test_tcp_loopback_runs_as_the_configured_owner(tcp, client):
    with openai.OpenAI(base_url=f"http://{tcp}/v1", api_key="none", max_retries=0, timeout=120) as oa:
        out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
        stream = "".join(c.choices[0].text for c in oa.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, stream=True))
    assert out.choices[0].text == stream == socket_complete(client, prompt=PROMPT, max_tokens=6)["text"]
    assert client.status(out.model_extra["npud"]["job"])["owner_uid"] == NOBODY_UID


def test_tcp_with_a_bearer_token(tmp_path_factory):
    d = start(tmp_path_factory, tcp_address="127.0.0.1:0", tcp_owner_uid=NOBODY_UID, bearer_token=TOKEN)
    try:
        (event,) = [e for e in d.logs() if e.get("event") == "http_listening"]
        base = f"http://{event['tcp']}/v1"
        with openai.OpenAI(base_url=base, api_key="wrong-token", max_retries=0, timeout=120) as oa:
            with pytest.raises(openai.AuthenticationError) as info:
                oa.models.list()
            assert info.value.status_code == 401 and info.value.code == "unauthorized"
        with openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=120) as oa:
            assert [m.id for m in oa.models.list().data] == [MODEL, FIM_MODEL]
            assert oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens <= 3
        # the Unix socket has peer credentials and needs no token
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.dir / "http.sock")), timeout=60) as c:
            assert c.get("http://npud/v1/models").status_code == 200
        # health needs no token either: it is what a supervisor polls
        with httpx.Client(timeout=60) as c:
            assert c.get(f"http://{event['tcp']}/health").status_code == 200
            assert c.get(base + "/models").status_code == 401
    finally:
        stop(d)
    assert not (d.dir / "http.sock").exists()


def test_tcp_connections_count_against_the_owners_limit(tcp, client):
    host, port = tcp.rsplit(":", 1)

    def get_health(s: socket.socket) -> bytes:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        return reply

    def keep_alive(s: socket.socket) -> socket.socket:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: npud\r\n\r\n")  # a request (no token here) makes it the owner's
        reply = b""
        while not reply.endswith(b'{"status":"ok"}\n'):
            reply += s.recv(65536)
        return s

    baseline = client.stats()["connections"]  # the socket client, and the pooled HTTP clients of other tests
    held = [keep_alive(socket.create_connection((host, int(port)), timeout=30))
            for _ in range(4)]  # max_connections_per_uid
    try:
        wait_for(lambda: client.stats()["connections"] >= baseline + 4, 30, what="the connections to be counted")
        with socket.create_connection((host, int(port)), timeout=30) as fifth:
            reply = get_health(fifth)
        assert reply.startswith(b"HTTP/1.1 429 ") and b'"code":"overloaded"' in reply
    finally:
        for s in held:
            s.close()
    # closed connections are uncounted: one after another, more than the limit
    for _ in range(6):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            assert get_health(s).startswith(b"HTTP/1.1 200 ")
    assert wait_for(lambda: client.stats()["connections"] <= baseline, 30, what="the closed ones to be uncounted")


# -- last: the log of everything above -------------------------------------------------------


def test_no_request_above_made_an_internal_error(daemon):
    """Bad bodies, garbage, closed connections: all expected, none an internal_error or a
    connection_error (a send to a client that is gone is not an error)."""
    bad = [e for e in daemon.logs() if e.get("event") in ("internal_error", "connection_error")
           or e.get("level") == "error"]
    assert not bad, bad[:3]


def test_a_refused_prompt_is_not_a_job(oa, raw, client):
    """A 400 on the prompt itself (too long, no FIM tokens) comes before the job: nothing stored,
    no ticket, no device time (issue 27)."""
    oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # loaded: its tokenizer can check
    jobs, tickets = client.jobs(limit=1000)["jobs"], client.tickets(limit=1000)["tickets"]
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=4)
    assert info.value.code == "prompt_too_long"
    assert error_of(raw.post("/infill", json={"model": MODEL, "input_prefix": PREFIX, "input_suffix": SUFFIX}))[:2] \
        == (400, "fim_unsupported")
    assert client.jobs(limit=1000)["jobs"] == jobs and client.tickets(limit=1000)["tickets"] == tickets
