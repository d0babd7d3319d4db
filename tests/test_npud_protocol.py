"""Framing and request parsing: what reaches a method, and the code of what does not."""

import json

import pytest

from npud.protocol import ApiError, LineReader, LineTooLong, Params, encode, parse_request


def test_line_reader_splits_across_chunks():
    r = LineReader(100)
    assert r.feed(b'{"a"') == []
    assert r.partial
    assert r.feed(b': 1}\n{"b": 2}\n{"c"') == [b'{"a": 1}', b'{"b": 2}']
    assert r.feed(b": 3}\n") == [b'{"c": 3}']
    assert not r.partial


def test_line_reader_drops_an_over_long_line_and_carries_on():
    r = LineReader(10)
    out = r.feed(b"0123456789")  # exactly the limit: fine once it ends
    assert out == [] and r.partial
    out = r.feed(b"\n" + b"x" * 25)
    assert out == [b"0123456789"]
    out = r.feed(b"yyyy\nok\n")
    assert isinstance(out[0], LineTooLong) and out[0].length == 29
    assert out[1:] == [b"ok"]


def test_line_reader_memory_stays_bounded():
    r = LineReader(1000)
    for _ in range(100):
        r.feed(b"z" * 10_000)
    assert len(r._buf) == 0 and r.partial


@pytest.mark.parametrize("line, req_id, fragment", [
    (b"\xff{}", None, "UTF-8"),
    (b"{not json}", None, "JSON"),
    (b"[]", None, "object"),
    (b'{"method": "hello"}', None, "id"),
    (b'{"id": [1], "method": "hello"}', None, "id"),
    (b'{"id": "' + b"x" * 65 + b'", "method": "hello"}', None, "id"),
    (b'{"id": 3}', 3, "method"),
    (b'{"id": 3, "method": 7}', 3, "method"),
    (b'{"id": 3, "method": "x", "params": []}', 3, "params"),
    (b'{"id": 3, "method": "x", "extra": 1}', 3, "extra"),
    (b"[" * 100000 + b"]" * 100000, None, "nested"),
])
def test_parse_request_rejects_with_bad_request(line, req_id, fragment):
    with pytest.raises(ApiError) as info:
        parse_request(line)
    assert info.value.code == "bad_request" and fragment in info.value.message
    assert info.value.req_id == req_id


def test_parse_request_accepts_string_ids_and_missing_params():
    req = parse_request(b'{"id": "a-1", "method": "hello"}')
    assert (req.id, req.method, req.params) == ("a-1", "hello", {})


def test_encode_is_one_line_of_utf8():
    data = encode({"id": 1, "text": "東京\nline"})
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert json.loads(data) == {"id": 1, "text": "東京\nline"}


def test_params_types_ranges_and_unknown_keys():
    p = Params({"job": 3, "flag": True, "name": "x", "xs": ["a"], "n": 0.5, "sub": {"k": 1}})
    assert p.int("job", min=1) == 3 and p.bool("flag") is True and p.str("name") == "x"
    assert p.str_list("xs") == ["a"] and p.number("n", min=0.0, max=1.0) == 0.5
    sub = p.obj("sub")
    assert sub.int("k") == 1
    sub.finish()
    p.finish()
    for params, call, fragment in [
        ({"job": True}, lambda q: q.int("job"), "params.job: expected an integer, got bool"),
        ({"job": 0}, lambda q: q.int("job", min=1), "out of range"),
        ({}, lambda q: q.int("job"), "params.job: is required"),
        ({"t": "1"}, lambda q: q.number("t"), "expected a number"),
        ({"t": float("nan")}, lambda q: q.number("t"), "out of range"),
        ({"top_p": 0.0}, lambda q: q.number("top_p", min=0.0, max=1.0, min_exclusive=True), "out of range"),
        ({"xs": ["a", 1]}, lambda q: q.str_list("xs"), "params.xs[1]"),
        ({"s": "maybe"}, lambda q: q.str("s", choices=("yes", "no")), "not one of"),
        ({"o": []}, lambda q: q.obj("o"), "expected an object"),
        ({"state": ["done", "x"]}, lambda q: q.choices_list("state", choices=("done",)), "'x'"),
    ]:
        with pytest.raises(ApiError) as info:
            call(Params(params))
        assert info.value.code == "bad_request" and fragment in info.value.message, info.value.message
    q = Params({"job": 1, "jbo": 2})
    q.int("job")
    with pytest.raises(ApiError, match="jbo"):
        q.finish()


def test_params_defaults_and_null_mean_absent():
    p = Params({"seed": None})
    assert p.int("seed", None) is None and p.int("other", 5) == 5
    assert p.choices_list("state", None, choices=("a",)) is None
    assert Params({"state": "a"}).choices_list("state", choices=("a",)) == ["a"]
