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
    state = ConnectionState(LIMITS, 0.0)
    out = state.receive(line({"id": 1, "method": "hello"}) + line({"id": "b", "method": "status", "params": {"job": 3}}), 0.0)
    assert out == [Request(1, "hello", {}), Request("b", "status", {"job": 3})]
    assert state.inflight == 2
    state.finished(0.0)
    assert state.inflight == 1


def test_a_line_arrives_in_pieces():
    state = ConnectionState(LIMITS, 0.0)
    data = line({"id": 7, "method": "hello"})
    assert state.receive(data[:5], 0.0) == [] and state.partial
    assert state.receive(data[5:], 0.0) == [Request(7, "hello", {})] and not state.partial


def test_blank_lines_are_skipped_and_bad_lines_answered_with_their_id():
    state = ConnectionState(LIMITS, 0.0)
    out = state.receive(b"\n  \n" + b'{"id": 4, "method": 5}\n' + b"not json\n", 0.0)
    assert [m["error"]["code"] for m in out] == ["bad_request", "bad_request"]
    assert [m["id"] for m in out] == [4, None]
    assert state.inflight == 0


def test_a_line_too_long_is_refused_and_the_next_one_served():
    state = ConnectionState(LIMITS, 0.0)
    out = state.receive(b"x" * 100 + b"\n" + line({"id": 1, "method": "hello"}), 0.0)
    assert out[0]["error"]["code"] == "line_too_long" and "100 bytes" in out[0]["error"]["message"]
    assert out[1] == Request(1, "hello", {})


def test_requests_beyond_the_in_flight_limit_are_overloaded():
    state = ConnectionState(LIMITS, 0.0)
    out = state.receive(b"".join(line({"id": i, "method": "hello"}) for i in range(3)), 0.0)
    assert out[:2] == [Request(0, "hello", {}), Request(1, "hello", {})]
    assert out[2]["id"] == 2 and out[2]["error"]["code"] == "overloaded"
    state.finished(0.0)
    assert state.receive(line({"id": 3, "method": "hello"}), 0.0) == [Request(3, "hello", {})]


def test_deadlines_follow_the_connection_state():
    state = ConnectionState(LIMITS, 100.0)
    assert state.deadline() == 160.0  # idle since it opened
    state.receive(line({"id": 1, "method": "stream"}), 110.0)
    assert state.deadline() == math.inf  # a request in flight may be silent as long as it likes
    state.receive(b'{"id": 2', 120.0)
    assert state.deadline() == 125.0  # a started line must end
    [reply] = state.timed_out()
    assert reply["error"]["code"] == "bad_request" and "did not end within 5.0 s" in reply["error"]["message"]


def test_the_idle_deadline_is_rearmed_by_each_last_reply():
    state = ConnectionState(LIMITS, 0.0)
    state.receive(line({"id": 1, "method": "hello"}) + line({"id": 2, "method": "hello"}), 10.0)
    state.finished(20.0)
    assert state.deadline() == math.inf  # one still in flight
    state.finished(30.0)
    assert state.deadline() == 90.0  # idle from the last reply, not from the connection's start
    state.receive(line({"id": 3, "method": "hello"}), 40.0)
    state.finished(50.0)
    assert state.deadline() == 110.0


def test_a_line_times_out_from_its_first_byte_however_slowly_it_drips():
    state = ConnectionState(LIMITS, 0.0)
    data = line({"id": 7, "method": "hello"})
    for i, byte in enumerate(data[:-1]):
        state.receive(bytes([byte]), 1.0 + i * 1.5)  # one byte every 1.5 s: each chunk is "in time"
        assert state.deadline() == 6.0  # but the line started at 1.0
    assert state.receive(data[-1:], 100.0) == [Request(7, "hello", {})]
    assert state.deadline() == math.inf


def test_the_next_line_begun_in_the_same_chunk_starts_its_own_clock():
    state = ConnectionState(LIMITS, 0.0)
    state.receive(b'{"id": 1, "met', 1.0)
    state.receive(b'hod": "hello"}\n{"id": 2', 4.0)
    assert state.deadline() == 9.0


def test_an_idle_timeout_closes_without_a_reply():
    assert ConnectionState(LIMITS, 0.0).timed_out() == []
