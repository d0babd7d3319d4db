"""npud under attack, at the protocol level (issue 17): lines Python cannot decode or encode,
numbers out of every range, and a bounded fuzzer that checks every reply. An in-process daemon
on the fake engine, real sockets."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import trio

import test_npud_support as fakes
from npud.protocol import ErrorCode, LineReader
from test_npud_support import make_config, start

pytestmark = pytest.mark.hog  # run again under a CPU hog by .ci/run

STABLE_CODES = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL_ERROR.value}


@pytest.fixture
def workdir():
    d = fakes.short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Raw:
    """A connection that sends raw bytes and reads messages by id (events and replies)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = LineReader(1 << 30)
        self.pending: list[dict] = []

    @classmethod
    async def open(cls, daemon) -> "Raw":
        return cls(await trio.open_unix_socket(daemon.cfg.server.socket_path))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def message(self, limit_s: float = 10.0) -> dict:
        """The next message; fails if none comes within limit_s or the daemon closes."""
        with trio.fail_after(limit_s):
            while not self.pending:
                chunk = await self.stream.receive_some(65536)
                assert chunk, "the daemon closed the connection"
                self.pending += [json.loads(line) for line in self.reader.feed(chunk)]
        return self.pending.pop(0)

    async def reply(self, req_id, limit_s: float = 10.0) -> dict:
        """The reply to `req_id`, skipping events and other replies (kept for later)."""
        kept, found = [], None
        while found is None:
            msg = await self.message(limit_s)
            if msg.get("id") == req_id and "ok" in msg:
                found = msg
            else:
                kept.append(msg)
        self.pending = kept + self.pending
        return found

    async def call(self, req_id, method: str, params: dict | None = None) -> dict:
        await self.send(json.dumps({"id": req_id, "method": method, "params": params or {}}).encode() + b"\n")
        return await self.reply(req_id)

    async def aclose(self) -> None:
        await self.stream.aclose()


def error_code(reply: dict) -> str | None:
    return None if reply["ok"] else reply["error"]["code"]


async def next_reply(conn: "Raw") -> dict:
    """The next message that is not an event: a cold model's stream may send model_loading
    and model_loaded (and tokens) before the reply a test waits for."""
    while "event" in (msg := await conn.message()):
        pass
    return msg


async def test_undecodable_lines_get_coded_replies_and_the_stream_survives(nursery, workdir):
    # before: an integer of more than 4300 digits killed the reader, a lone-surrogate id the
    # reply encoder; the connection dropped and a running stream with it
    daemon = await start(nursery, make_config(workdir, knobs={"tokens_per_round": 1, "round_sleep_s": 0.01}))
    conn = await Raw.open(daemon)
    job = (await conn.call(1, "submit", {"prompts": ["a b"], "max_tokens": 60}))["result"]["job"]
    await conn.send(json.dumps({"id": 2, "method": "stream", "params": {"job": job}}).encode() + b"\n")
    assert (await conn.message())["event"] == "progress"  # the stream runs
    await conn.send(b'{"id": 3, "method": "status", "params": {"job": ' + b"9" * 5000 + b"}}\n")
    assert error_code(await next_reply(conn)) == "bad_request"  # no id could be read: id null
    await conn.send(b'{"id": ' + b"7" * 5000 + b', "method": "hello"}\n')
    assert error_code(await next_reply(conn)) == "bad_request"
    await conn.send(b'{"id": "\\ud800", "method": "hello"}\n')
    hello = await conn.reply("\ud800")
    assert hello["ok"] is True
    await conn.send(b'{"id": 5, "method": "nope\\udfff"}\n')
    assert error_code(await conn.reply(5)) == "unknown_method"
    assert (await conn.call(6, "hello"))["ok"] is True  # still usable
    final = await conn.reply(2, limit_s=30)
    assert final["ok"] and final["result"]["state"] == "done" and final["result"]["done_prompts"] == 1
    await conn.aclose()
    daemon.request_stop()


@pytest.mark.parametrize("method, params", [
    ("status", {"job": 1 << 63}),
    ("status", {"job": 10 ** 30}),
    ("result", {"job": 1 << 64}),
    ("result", {"job": 1, "prompts": [1 << 63]}),
    ("cancel", {"job": 1 << 63}),
    ("stream", {"job": 1 << 63}),
    ("jobs", {"before": 1 << 63}),
    ("tickets", {"job": 1 << 63}),
    ("tickets", {"since": 1e400}),
    ("tickets", {"until": -1e400}),
    ("tickets", {"since": 10 ** 400}),
    ("submit", {"prompts": ["a"], "sampling": {"temperature": 10 ** 400}}),
    ("submit", {"prompts": ["a", "b\ud800"]}),  # not text: refused at submit, not failed in the engine
])
async def test_numbers_out_of_range_are_bad_requests(nursery, workdir, method, params):
    # before: SQLite's 64-bit INTEGER overflowed and float() of a huge int raised: internal_error
    daemon = await start(nursery, make_config(workdir))
    conn = await Raw.open(daemon)
    line = json.dumps({"id": 1, "method": method, "params": params}).replace("Infinity", "1e400")
    await conn.send(line.encode() + b"\n")
    reply = await conn.reply(1)
    assert error_code(reply) == "bad_request", reply
    assert (await conn.call(2, "hello"))["ok"] is True
    await conn.aclose()
    daemon.request_stop()


# -- the fuzzer ------------------------------------------------------------------------------------

SEEDS = [
    {"method": "hello", "params": {"client": "fuzz"}},
    {"method": "submit", "params": {"prompts": ["a b", "c"], "max_tokens": 4, "sampling": {"temperature": 0.5,
                                    "top_k": 3, "top_p": 0.9, "seed": 1}, "stop": ["w"], "priority": "batch",
                                    "spec": {"method": "none", "k": 2}, "idempotency_key": "k1"}},
    {"method": "submit", "params": {"chats": [[{"role": "user", "content": "hi"}]], "max_tokens": 2}},
    {"method": "complete", "params": {"prompt": "x y", "max_tokens": 3, "use_prefix_cache": False}},
    {"method": "complete", "params": {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}},
    {"method": "stream", "params": {"job": 1, "tokens": False}},
    {"method": "result", "params": {"job": 1, "prompts": [0, 1]}},
    {"method": "status", "params": {"job": 2}},
    {"method": "jobs", "params": {"state": ["done", "queued"], "limit": 5, "before": 10}},
    {"method": "cancel", "params": {"job": 3}},
    {"method": "tickets", "params": {"job": 1, "state": "released", "outcome": "done", "since": 0, "until": 1e12,
                                     "limit": 3}},
    {"method": "cache.list", "params": {"model": "fake"}},
    {"method": "cache.pin", "params": {"name": "n", "text": "t"}},
    {"method": "cache.drop", "params": {"key": "k"}},
    {"method": "device.status", "params": {}},
    {"method": "models", "params": {}},
    {"method": "stats", "params": {}},
    {"method": "metrics", "params": {"format": "prometheus"}},
]

# values a client may put anywhere (as JSON text: Python's json accepts NaN and Infinity)
ODD_VALUES = ["null", "true", "-1", "0", "1e400", "-1e400", "NaN", "Infinity", "9" * 5000, str(1 << 63),
              str(-(1 << 64)), "1.5", '""', '"\\ud800"', '"\\udfff\\ud800"', '"' + "x" * 5000 + '"', "[]", "{}",
              "[[[[[[[[[[]]]]]]]]]]", "[" * 5000 + "]" * 5000, '{"a": {"b": []}}', '"\\u0000"', '"done"',
              '["\\ud800"]', '[{"role": 1}]', '[1, "a", null]']


def mutate(rng: random.Random, seed: dict) -> bytes:
    """One frame: a seed request with one or more odd changes, as a line of bytes."""
    req = {"id": rng.choice([rng.randrange(1 << 31), f"s{rng.randrange(999)}"]), **json.loads(json.dumps(seed))}
    text = json.dumps(req)
    kind = rng.randrange(7)
    if kind == 0:  # a param (or the id, or the method) replaced by an odd value
        params = req["params"]
        target = rng.choice(["id", "method", "params", *params] if params else ["id", "method", "params"])
        value = rng.choice(ODD_VALUES)
        if target in ("id", "method", "params"):
            req[target] = "@@"
            text = json.dumps(req).replace('"@@"', value, 1)
        else:
            params[target] = "@@"
            text = json.dumps(req).replace('"@@"', value, 1)
    elif kind == 1:  # an unknown key, at the top or in the params
        where = req if rng.random() < 0.3 else req["params"]
        where[rng.choice(["x", "prompts ", "Params", "\u00e9", "job"])] = 1
        text = json.dumps(req)
    elif kind == 2:  # bytes flipped
        data = bytearray(text.encode())
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data).replace(b"\n", b" ") + b"\n"
    elif kind == 3:  # cut short
        text = text[: rng.randrange(1, len(text))]
    elif kind == 4:  # a method name that is nearly right
        req["method"] = rng.choice(["Hello", "submit ", "cache.", "cache.list.x", "device", "", "\ud800"])
        text = json.dumps(req)
    elif kind == 5:  # nested numbers and types in the sampling/spec objects
        req["params"]["sampling"] = {rng.choice(["temperature", "top_k", "top_p", "seed"]): "@@"}
        text = json.dumps(req).replace('"@@"', rng.choice(ODD_VALUES), 1)
    else:  # not an object at all
        text = rng.choice(["[]", "1", '"hello"', "null", "{", "}", "{}", '{"id": {}}', "\u00e9", "\ufeff{}"])
    return text.encode("utf-8", "surrogatepass").replace(b"\n", b" ") + b"\n"


async def test_fuzzed_frames_all_get_stable_codes_and_the_connection_stays_usable(nursery, workdir):
    cfg = make_config(workdir, knobs={"tokens_per_round": 4}, limits={"max_tokens": 8, "max_queued_jobs_per_user": 16})
    daemon = await start(nursery, cfg)
    conn = await Raw.open(daemon)
    rng = random.Random(17)
    codes: dict[str, int] = {}
    frames = 4000
    for n in range(frames):
        await conn.send(mutate(rng, rng.choice(SEEDS)))
        probe = f"probe{n}"
        await conn.send(json.dumps({"id": probe, "method": "hello"}).encode() + b"\n")
        while True:  # every reply up to the probe's: the frame's (one per line it held), and events
            msg = await conn.message(limit_s=30)
            if "event" in msg:
                continue
            if msg["id"] == probe:
                assert msg["ok"] is True, msg  # still usable
                break
            code = "ok" if msg["ok"] else msg["error"]["code"]
            assert code == "ok" or code in STABLE_CODES, msg  # never internal_error, never a code-less error
            if not msg["ok"]:
                assert isinstance(msg["error"]["message"], str) and msg["error"]["message"]
            codes[code] = codes.get(code, 0) + 1
    print("fuzz replies by code:", dict(sorted(codes.items())))
    assert codes.get("bad_request", 0) > frames // 3  # the fuzzer did reach the checks
    assert daemon.server.connections == 1
    await conn.aclose()
    daemon.request_stop()
