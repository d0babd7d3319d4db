"""A connection's framing, limits and timeouts, without sockets (npud/connection.py)."""

from __future__ import annotations

import json
import math

from npud.connection import ConnectionState, Limits
from npud.protocol import Request

LIMITS = Limits(max_line_bytes=64, line_timeout_s=5.0, idle_timeout_s=60.0, max_inflight=2)


def line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_requests_are_run_in_order_and_counted_in_flight():
    state = ConnectionState(LIMITS)
    out = state.receive(line({"id": 1, "method": "hello"}) + line({"id": "b", "method": "status", "params": {"job": 3}}))
    assert out == [Request(1, "hello", {}), Request("b", "status", {"job": 3})]
    assert state.inflight == 2
    state.finished()
    assert state.inflight == 1


def test_a_line_arrives_in_pieces():
    state = ConnectionState(LIMITS)
    data = line({"id": 7, "method": "hello"})
    assert state.receive(data[:5]) == [] and state.partial
    assert state.receive(data[5:]) == [Request(7, "hello", {})] and not state.partial


def test_blank_lines_are_skipped_and_bad_lines_answered_with_their_id():
    state = ConnectionState(LIMITS)
    out = state.receive(b"\n  \n" + b'{"id": 4, "method": 5}\n' + b"not json\n")
    assert [m["error"]["code"] for m in out] == ["bad_request", "bad_request"]
    assert [m["id"] for m in out] == [4, None]
    assert state.inflight == 0


def test_a_line_too_long_is_refused_and_the_next_one_served():
    state = ConnectionState(LIMITS)
    out = state.receive(b"x" * 100 + b"\n" + line({"id": 1, "method": "hello"}))
    assert out[0]["error"]["code"] == "line_too_long" and "100 bytes" in out[0]["error"]["message"]
    assert out[1] == Request(1, "hello", {})


def test_requests_beyond_the_in_flight_limit_are_overloaded():
    state = ConnectionState(LIMITS)
    out = state.receive(b"".join(line({"id": i, "method": "hello"}) for i in range(3)))
    assert out[:2] == [Request(0, "hello", {}), Request(1, "hello", {})]
    assert out[2]["id"] == 2 and out[2]["error"]["code"] == "overloaded"
    state.finished()
    assert state.receive(line({"id": 3, "method": "hello"})) == [Request(3, "hello", {})]


def test_read_timeouts_follow_the_connection_state():
    state = ConnectionState(LIMITS)
    assert state.read_timeout() == 60.0  # idle
    state.receive(line({"id": 1, "method": "stream"}))
    assert state.read_timeout() == math.inf  # a request in flight may be silent as long as it likes
    state.receive(b'{"id": 2')
    assert state.read_timeout() == 5.0  # a started line must end
    [reply] = state.timed_out()
    assert reply["error"]["code"] == "bad_request" and "did not end within 5.0 s" in reply["error"]["message"]


def test_an_idle_timeout_closes_without_a_reply():
    assert ConnectionState(LIMITS).timed_out() == []
