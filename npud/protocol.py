"""Wire format of the npud socket: newline-delimited JSON, the envelope and the error codes.

Sans-IO and standard library only: the daemon (trio) and the client library (blocking
sockets or trio) share this code. docs/protocol.md is the contract it implements.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what SQLite stores, and the range of every integer param


class ErrorCode(enum.StrEnum):
    """Stable error codes; docs/protocol.md says when each is used."""

    BAD_REQUEST = "bad_request"
    LINE_TOO_LONG = "line_too_long"
    UNKNOWN_METHOD = "unknown_method"
    NOT_FOUND = "not_found"
    FORBIDDEN = "forbidden"
    OVERLOADED = "overloaded"
    PROMPT_TOO_LONG = "prompt_too_long"
    FIM_UNSUPPORTED = "fim_unsupported"
    DEVICE_QUARANTINED = "device_quarantined"
    MODEL_ERROR = "model_error"
    UNSUPPORTED = "unsupported"
    STORE_FULL = "store_full"
    STORE_READONLY = "store_readonly"
    STORE_ERROR = "store_error"
    SHUTTING_DOWN = "shutting_down"
    MODEL_IN_USE = "model_in_use"
    INTERNAL_ERROR = "internal_error"


class ApiError(Exception):
    """An expected error that crosses the socket as `{"code", "message"}`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message}


def encode(message: dict) -> bytes:
    """One message as a line of UTF-8 JSON ending in a newline.

    A string with a lone surrogate (valid JSON, "\\ud800", but not encodable as UTF-8; a
    client may send one as an id or in a param that an error message quotes) is written
    with JSON's \\u escapes instead, so every message can be sent."""
    try:
        return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode() + b"\n"


def reply(req_id: Any, result: Any) -> dict:
    return {"id": req_id, "ok": True, "result": result}


def error_reply(req_id: Any, error: ApiError) -> dict:
    return {"id": req_id, "ok": False, "error": error.to_wire()}


def event(req_id: Any, name: str, data: dict) -> dict:
    return {"id": req_id, "event": name, "data": data}


class LineTooLong:
    """Marker yielded by LineReader in place of a line longer than the limit."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length


class LineReader:
    """Splits a byte stream into lines of at most `max_line_bytes` (newline excluded).

    A longer line is reported once as LineTooLong and its remaining bytes are dropped up to
    the next newline, so memory stays bounded and the stream stays usable after it.
    """

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._discarding = 0  # > 0: bytes of an over-long line dropped so far

    @property
    def partial(self) -> bool:
        """True when a line has started but not ended."""
        return bool(self._buf) or self._discarding > 0

    def feed(self, data: bytes) -> list[bytes | LineTooLong]:
        out: list[bytes | LineTooLong] = []
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            chunk = data[start:end]
            if self._discarding:
                self._discarding += len(chunk)
            elif len(self._buf) + len(chunk) > self.max_line_bytes:
                self._discarding = len(self._buf) + len(chunk)
                self._buf.clear()
            else:
                self._buf += chunk
            if nl < 0:
                break
            if self._discarding:
                out.append(LineTooLong(self._discarding))
                self._discarding = 0
            else:
                out.append(bytes(self._buf))
                self._buf.clear()
            start = nl + 1
        return out


@dataclass(slots=True, frozen=True)
class Request:
    id: int | str
    method: str
    params: dict


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "str", bool: "bool", int: "int", float: "float"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def parse_request(line: bytes) -> Request:
    """Decode one request line; raises ApiError(bad_request) carrying the id when it has one.

    The error's `req_id` attribute is the request's id if it could be read, else None.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, f"the request is not valid UTF-8 ({exc.reason} at byte {exc.start})"))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, f"the request is not valid JSON: {exc.msg} at column {exc.colno}"))
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, "the request has an integer with too many digits"))
    except RecursionError:
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, "the request is nested too deeply"))
    if not isinstance(obj, dict):
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, f"a request is a JSON object, got {_type_name(obj)}"))
    req_id = obj.get("id")
    if isinstance(req_id, bool) or not isinstance(req_id, (int, str)) or (
        isinstance(req_id, str) and len(req_id) > MAX_ID_CHARS) or (
        isinstance(req_id, int) and not INT64_MIN <= req_id <= INT64_MAX
    ):
        raise _with_id(None, ApiError(ErrorCode.BAD_REQUEST, f"id: expected a 64-bit integer or a string of at most "
                                                             f"{MAX_ID_CHARS} characters"))
    unknown = set(obj) - {"id", "method", "params"}
    if unknown:
        raise _with_id(req_id, ApiError(ErrorCode.BAD_REQUEST, f"unknown keys in the request: {sorted(unknown)}"))
    method = obj.get("method")
    if not isinstance(method, str):
        raise _with_id(req_id, ApiError(ErrorCode.BAD_REQUEST, f"method: expected a string, got {_type_name(method)}"))
    params = obj.get("params", {})
    if not isinstance(params, dict):
        raise _with_id(req_id, ApiError(ErrorCode.BAD_REQUEST, f"params: expected an object, got {_type_name(params)}"))
    return Request(req_id, method, params)


def _with_id(req_id: Any, error: ApiError) -> ApiError:
    error.req_id = req_id  # type: ignore[attr-defined]
    return error


_MISSING = object()


def check_text(p: "Params", name: str, value: str) -> None:
    """Raise bad_request naming `name` unless `value` is text: JSON lets a string hold a lone
    surrogate ("\\ud800"), which no tokenizer, file or UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise p.bad(name, f"is not valid text (a lone surrogate at character {exc.start})") from None


class Params:
    """Typed access to a request's params; every check names the parameter.

    Call `finish()` after reading: unknown keys are an error, so a typo is never ignored.
    """

    def __init__(self, params: dict, prefix: str = "params") -> None:
        self._params = params
        self._prefix = prefix
        self._seen: set[str] = set()

    def _get(self, name: str, default: Any) -> Any:
        self._seen.add(name)
        value = self._params.get(name, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.bad(name, "is required")
            return default
        return value

    def bad(self, name: str, what: str) -> ApiError:
        return ApiError(ErrorCode.BAD_REQUEST, f"{self._prefix}.{name}: {what}")

    def has(self, name: str) -> bool:
        return self._params.get(name) is not None

    def int(self, name: str, default: Any = _MISSING, *, min: int = INT64_MIN, max: int = INT64_MAX) -> Any:
        """An integer in [min, max]; the bounds default to 64 bits (what SQLite stores)."""
        value = self._get(name, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(name, f"expected an integer, got {_type_name(value)}")
        if not min <= value <= max:
            shown = value if -10**20 < value < 10**20 else ("a huge number" if value > 0 else "a huge negative number")
            raise self.bad(name, f"{shown} is out of range [{min}, {max}]")
        return value

    def number(self, name: str, default: Any = _MISSING, *, min: float | None = None, max: float | None = None,
               min_exclusive: bool = False) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(name, f"expected a number, got {_type_name(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            raise self.bad(name, "a huge number is out of range (a number must be finite)") from None
        if not math.isfinite(value):  # 1e400 parses as inf
            raise self.bad(name, f"{value} is out of range (a number must be finite)")
        if (min is not None and (value < min or (min_exclusive and value == min))) or (
            max is not None and value > max
        ):
            raise self.bad(name, f"{value} is out of range {'(' if min_exclusive else '['}{min}, {max}]")
        return value

    def bool(self, name: str, default: Any = _MISSING) -> Any:
        value = self._get(name, default)
        if value is not default and not isinstance(value, bool):
            raise self.bad(name, f"expected true or false, got {_type_name(value)}")
        return value

    def str(self, name: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None,
            max_len: int | None = None, nonempty: bool = False) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if not isinstance(value, str):
            raise self.bad(name, f"expected a string, got {_type_name(value)}")
        check_text(self, name, value)
        if choices is not None and value not in choices:
            raise self.bad(name, f"{value!r} is not one of {list(choices)}")
        if max_len is not None and len(value) > max_len:
            raise self.bad(name, f"longer than {max_len} characters")
        if nonempty and not value:
            raise self.bad(name, "must not be empty")
        return value

    def list(self, name: str, default: Any = _MISSING, *, max_items: int | None = None,
             min_items: int = 0) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if not isinstance(value, list):
            raise self.bad(name, f"expected a list, got {_type_name(value)}")
        if len(value) < min_items:
            raise self.bad(name, f"needs at least {min_items} item(s)")
        if max_items is not None and len(value) > max_items:
            raise self.bad(name, f"has {len(value)} items, at most {max_items} allowed")
        return value

    def str_list(self, name: str, default: Any = _MISSING, *, max_items: int | None = None,
                 min_items: int = 0, nonempty_items: bool = False) -> Any:
        value = self.list(name, default, max_items=max_items, min_items=min_items)
        if value is default:
            return value
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.bad(f"{name}[{i}]", f"expected a string, got {_type_name(item)}")
            check_text(self, f"{name}[{i}]", item)
            if nonempty_items and not item:
                raise self.bad(f"{name}[{i}]", "must not be empty")
        return value

    def choices_list(self, name: str, default: Any = _MISSING, *, choices: tuple[str, ...]) -> Any:
        """A string or a list of strings, each one of `choices`; always returned as a list."""
        value = self._get(name, default)
        if value is default:
            return value
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise self.bad(name, f"expected a string or a list of strings, got {_type_name(value)}")
        bad = [v for v in items if v not in choices]
        if bad:
            raise self.bad(name, f"{bad[0]!r} is not one of {list(choices)}")
        return items

    def raw(self, name: str) -> Any:
        """The value as given (None when absent), unchecked: for a value passed on to code
        that checks it (the HTTP front end hands OpenAI's fields to `complete`'s checks)."""
        self._seen.add(name)
        return self._params.get(name)

    def obj(self, name: str) -> "Params":
        """A nested object as Params (empty when absent)."""
        value = self._get(name, {})
        if not isinstance(value, dict):
            raise self.bad(name, f"expected an object, got {_type_name(value)}")
        return Params(value, f"{self._prefix}.{name}")

    def finish(self) -> None:
        unknown = set(self._params) - self._seen
        if unknown:
            raise ApiError(ErrorCode.BAD_REQUEST, f"{self._prefix}: unknown parameter(s) {sorted(unknown)}")
