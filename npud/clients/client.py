"""A small client for npud: blocking (`Client`) and trio (`AsyncClient`) APIs over one framing.

    from npud.clients.client import Client
    with Client() as npud:
        job = npud.submit(prompts=["Hello"], max_tokens=16)["job"]
        for ev in (s := npud.stream(job)):
            print(ev.name, ev.data)
        print(npud.result(job)["results"])

Errors from the daemon are raised as NpudError subclasses chosen by their stable code
(docs/protocol.md); a missing socket raises NotRunning saying how to start npud.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import socket
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from npud.protocol import ErrorCode, LineReader, LineTooLong, encode

DEFAULT_SOCKET = "/run/npud/npud.sock"
USER_FALLBACK_DIR = "/tmp/npud-{uid}"  # a per-user npud's socket directory without $XDG_RUNTIME_DIR
MAX_REPLY_BYTES = 1 << 30  # a result of many prompts is one line
SUBMIT_RETRIES = 2  # a submit whose connection is lost is sent again this often (same idempotency key)


def user_socket_path() -> str | None:
    """Where a per-user npud (`npud --model PATH`) listens, by npud/userdirs.py's rule:
    $XDG_RUNTIME_DIR/npud/npud.sock, else /tmp/npud-<uid>/npud.sock, but only when that
    directory is this user's own and closed to others (anyone can make a directory in /tmp and
    listen there as if it were npud, to read the prompts); None when there is no such place."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return os.path.join(runtime, "npud", "npud.sock")
    directory = USER_FALLBACK_DIR.format(uid=os.getuid())
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        return None
    return os.path.join(directory, "npud.sock")


def default_socket_path() -> str:
    """The socket when none is given: $NPUD_SOCKET; else the system daemon's if it exists;
    else a per-user daemon's if it exists; else the system daemon's path (to say nothing listens there)."""
    if os.environ.get("NPUD_SOCKET"):
        return os.environ["NPUD_SOCKET"]
    if os.path.exists(DEFAULT_SOCKET):
        return DEFAULT_SOCKET
    user = user_socket_path()
    if user is not None and os.path.exists(user):
        return user
    return DEFAULT_SOCKET


# -- errors --------------------------------------------------------------------------------

class NpudError(Exception):
    """An error reply from npud (or a client-side failure with its own code)."""

    code = "error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(NpudError): code = ErrorCode.BAD_REQUEST.value
class LineTooLongError(NpudError): code = ErrorCode.LINE_TOO_LONG.value
class UnknownMethod(NpudError): code = ErrorCode.UNKNOWN_METHOD.value
class NotFound(NpudError): code = ErrorCode.NOT_FOUND.value
class Forbidden(NpudError): code = ErrorCode.FORBIDDEN.value
class Overloaded(NpudError): code = ErrorCode.OVERLOADED.value
class PromptTooLong(NpudError): code = ErrorCode.PROMPT_TOO_LONG.value
class FimUnsupported(NpudError): code = ErrorCode.FIM_UNSUPPORTED.value
class DeviceQuarantined(NpudError): code = ErrorCode.DEVICE_QUARANTINED.value
class ModelError(NpudError): code = ErrorCode.MODEL_ERROR.value
class Unsupported(NpudError): code = ErrorCode.UNSUPPORTED.value
class StoreError(NpudError): code = ErrorCode.STORE_ERROR.value
class StoreFull(StoreError): code = ErrorCode.STORE_FULL.value
class StoreReadOnly(StoreError): code = ErrorCode.STORE_READONLY.value
class ShuttingDown(NpudError): code = ErrorCode.SHUTTING_DOWN.value
class ModelInUse(NpudError): code = ErrorCode.MODEL_IN_USE.value
class InternalError(NpudError): code = ErrorCode.INTERNAL_ERROR.value


class NotRunning(NpudError):
    """No daemon answers at the socket path."""

    code = "not_running"


class NotASocket(NotRunning):
    """The socket path names something else (a file, a directory): a wrong NPUD_SOCKET or
    --socket, not a stopped daemon."""

    code = "not_a_socket"


class PermissionDenied(NpudError):
    code = "permission_denied"


class ConnectionLost(NpudError):
    code = "connection_lost"


ERRORS: dict[str, type[NpudError]] = {
    cls.code: cls for cls in (BadRequest, LineTooLongError, UnknownMethod, NotFound, Forbidden, Overloaded,
                              PromptTooLong, FimUnsupported, DeviceQuarantined, ModelError, Unsupported, StoreError, StoreFull,
                              StoreReadOnly, ShuttingDown, ModelInUse, InternalError)
}


def error_from_wire(error: dict) -> NpudError:
    """The exception for an error object; an unknown code gives a plain NpudError with that code."""
    code = str(error.get("code", "error"))
    message = str(error.get("message", ""))
    cls = ERRORS.get(code)
    return cls(message) if cls is not None else NpudError(message, code)


def _not_a_socket(path: str) -> str | None:
    """What `path` is when it exists and is not a socket ("a regular file", "a directory", ...)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode)
            else "a named pipe" if stat.S_ISFIFO(mode) else "not a file npud makes")


def _connect_error(path: str, exc: OSError) -> NpudError:
    what = _not_a_socket(path) if exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK) else None
    if what is not None:  # connecting to a regular file is ECONNREFUSED, like a socket nobody listens at
        return NotASocket(f"{path} is not a socket ({what}); point NPUD_SOCKET or --socket at the "
                          "socket npud listens on (server.socket_path in its config)")
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
        return NotRunning(
            f"npud is not running (nothing listens at {path}). Start it with `sudo systemctl start npud`, "
            "or serve a model as yourself with `npud --model PATH`; set NPUD_SOCKET if it listens elsewhere.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"cannot connect to {path}: permission denied; the socket is for the group "
                                "that owns it (`ls -l` it) — add yourself to that group and log in again")
    return NpudError(f"cannot connect to {path}: {exc.strerror}", "connection_failed")


# -- the shared framing ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Event:
    name: str
    data: dict


class Framing:
    """Sans-IO half of a connection: request lines out, replies and events in."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._reader = LineReader(MAX_REPLY_BYTES)
        self._ready: list[dict] = []

    def request(self, method: str, params: dict | None) -> tuple[int, bytes]:
        req_id = next(self._ids)
        msg = {"id": req_id, "method": method}
        if params:
            msg["params"] = {k: v for k, v in params.items() if v is not None}
        return req_id, encode(msg)

    def feed(self, data: bytes) -> None:
        for line in self._reader.feed(data):
            if isinstance(line, LineTooLong):
                raise ConnectionLost(f"npud sent a line of {line.length} bytes, more than this client reads")
            self._ready.append(json.loads(line))

    def next_message(self) -> dict | None:
        return self._ready.pop(0) if self._ready else None

    @staticmethod
    def interpret(req_id: int, msg: dict) -> Event | tuple[str, Any]:
        """An Event, or ("result", value) for the final reply; raises the reply's error."""
        if msg.get("id") != req_id:
            if msg.get("id") is None and msg.get("ok") is False:
                raise error_from_wire(msg["error"])
            raise ConnectionLost(f"reply for request {msg.get('id')!r} while waiting for {req_id}")
        if "event" in msg:
            return Event(msg["event"], msg.get("data") or {})
        if msg.get("ok"):
            return ("result", msg.get("result"))
        raise error_from_wire(msg.get("error") or {})


# -- the methods, written once ---------------------------------------------------------------

def _generation(model, max_tokens, sampling, stop, spec, use_prefix_cache, suffix=None, fim_extra=None) -> dict:
    return {"model": model, "max_tokens": max_tokens, "sampling": sampling, "stop": stop, "spec": spec,
            "use_prefix_cache": use_prefix_cache, "suffix": suffix, "fim_extra": fim_extra}


def _key_unknown(exc: BadRequest) -> bool:
    """Whether a submit was refused by an npud that predates `idempotency_key` (its reply
    names the key as an unknown parameter; a key reused for another request is refused with
    another message, and must not be dropped)."""
    return "unknown parameter" in exc.message and "'idempotency_key'" in exc.message


def _without_key(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "idempotency_key"}


class _Methods:
    """Every protocol method as a call; subclasses supply _call (one reply) and _stream."""

    def _call(self, method: str, params: dict | None = None) -> Any:
        raise NotImplementedError

    def _stream(self, method: str, params: dict | None = None) -> Any:
        raise NotImplementedError

    def call(self, method: str, params: dict | None = None) -> Any:
        """Any method by name; returns its result."""
        return self._call(method, params)

    def hello(self, client: str | None = None):
        return self._call("hello", {"client": client})

    def submit(self, prompts: list[str] | None = None, *, chats: list[list[dict]] | None = None,
               model: str | None = None, max_tokens: int | None = None, sampling: dict | None = None,
               stop: list[str] | None = None, spec: dict | None = None, use_prefix_cache: bool | None = None,
               priority: str | None = None, prompt_settings: list[dict | None] | None = None,
               idempotency_key: str | None = None, retries: int = SUBMIT_RETRIES,
               suffix: str | None = None, fim_extra: list[dict] | None = None, logprobs: int | None = None,
               keep_alive: float | str | None = None):
        """Queue a job; returns its status. `logprobs` (alternatives per token) asks for each
        token's log probability; `keep_alive` (seconds, or "5m") how long the model stays
        loaded once idle. `prompt_settings` (one entry per prompt, None for
        the job's) gives prompts settings of their own. `suffix` (with one prompt, the prefix)
        asks for fill-in-the-middle, `fim_extra` adds [{"filename", "text"}] context files. The
        request carries an idempotency key (a new random one unless given), and a connection
        lost before the reply is retried `retries` times on a new connection with the same key:
        the daemon answers with the job the lost attempt made, never a second one. An npud older
        than the key (it refuses the parameter) is asked once more without it, and then a lost
        reply is not retried (it could run twice)."""
        params = {"prompts": prompts, "chats": chats, "priority": priority, "prompt_settings": prompt_settings,
                  "idempotency_key": idempotency_key or uuid.uuid4().hex, "logprobs": logprobs,
                  "keep_alive": keep_alive,
                  **_generation(model, max_tokens, sampling, stop, spec, use_prefix_cache, suffix, fim_extra)}
        return self._submit(params, retries)

    def _submit(self, params: dict, retries: int) -> Any:
        raise NotImplementedError

    def complete(self, prompt: str | None = None, *, messages: list[dict] | None = None, model: str | None = None,
                 max_tokens: int | None = None, sampling: dict | None = None, stop: list[str] | None = None,
                 spec: dict | None = None, use_prefix_cache: bool | None = None, suffix: str | None = None,
                 fim_extra: list[dict] | None = None, logprobs: int | None = None,
                 keep_alive: float | str | None = None):
        """A stream of `ticket` and `token` events; its `.result` is the prompt result.
        `suffix` makes `prompt` the prefix of a fill-in-the-middle request (as submit)."""
        return self._stream("complete", {"prompt": prompt, "messages": messages, "logprobs": logprobs,
                                         "keep_alive": keep_alive,
                                         **_generation(model, max_tokens, sampling, stop, spec, use_prefix_cache,
                                                       suffix, fim_extra)})

    def stream(self, job: int, *, tokens: bool = True):
        """A stream of a job's events; its `.result` is the final job status."""
        return self._stream("stream", {"job": job, "tokens": tokens})

    def result(self, job: int, prompts: list[int] | None = None):
        return self._call("result", {"job": job, "prompts": prompts})

    def status(self, job: int):
        return self._call("status", {"job": job})

    def jobs(self, state: str | list[str] | None = None, *, all_users: bool | None = None, limit: int | None = None,
             before: int | None = None):
        return self._call("jobs", {"state": state, "all_users": all_users, "limit": limit, "before": before})

    def cancel(self, job: int):
        return self._call("cancel", {"job": job})

    def tickets(self, *, job: int | None = None, state: str | None = None, outcome: str | None = None,
                since: float | None = None, until: float | None = None, limit: int | None = None):
        return self._call("tickets", {"job": job, "state": state, "outcome": outcome, "since": since,
                                      "until": until, "limit": limit})

    def cache_list(self, model: str | None = None):
        return self._call("cache.list", {"model": model})

    def cache_pin(self, name: str, text: str | None = None, *, key: str | None = None, model: str | None = None):
        """Pin the prefix of `text` (computed now) or the existing entry `key` under `name`."""
        return self._call("cache.pin", {"model": model, "name": name, "text": text, "key": key})

    def cache_drop(self, key: str, *, model: str | None = None):
        return self._call("cache.drop", {"model": model, "key": key})

    def device_status(self):
        return self._call("device.status")

    def device_clear(self):
        return self._call("device.clear")

    def models_load(self, model: str | None = None, *, keep_alive: float | str | None = None):
        """Load a model now; `keep_alive` (seconds, or "5m") sets how long it stays once idle."""
        return self._call("models.load", {"model": model, "keep_alive": keep_alive})

    def models_unload(self, model: str):
        """Unload a model no job is using (admin)."""
        return self._call("models.unload", {"model": model})

    def models(self):
        return self._call("models")

    def stats(self):
        return self._call("stats")

    def metrics(self, format: str | None = None):
        """Counters and gauges; format="prometheus" gives {"format", "text"} in the text format."""
        return self._call("metrics", {"format": format})


# -- blocking client -------------------------------------------------------------------------

class Stream:
    """Iterate for the events; `result` holds the final reply once iteration ends."""

    def __init__(self, client: "Client", req_id: int) -> None:
        self._client = client
        self._req_id = req_id
        self.result: Any = None
        self.finished = False

    def __iter__(self) -> Iterator[Event]:
        while not self.finished:
            item = Framing.interpret(self._req_id, self._client._receive())
            if isinstance(item, Event):
                yield item
            else:
                self.result = item[1]
                self.finished = True

    def wait(self) -> Any:
        """Drain the remaining events and return the result."""
        for _ in self:
            pass
        return self.result


class Client(_Methods):
    """A blocking connection to npud; one request at a time."""

    def __init__(self, path: str | None = None, *, timeout: float | None = None) -> None:
        self.path = path or default_socket_path()
        self.timeout = timeout
        self._connect()

    def _connect(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(self.timeout)
        try:
            self._sock.connect(self.path)
        except OSError as exc:
            self._sock.close()
            raise _connect_error(self.path, exc) from None
        self._framing = Framing()

    def _submit(self, params: dict, retries: int) -> Any:
        try:
            return self._call_retrying("submit", params, retries)
        except BadRequest as exc:
            if not _key_unknown(exc):
                raise
        return self._call("submit", _without_key(params))

    def _call_retrying(self, method: str, params: dict, retries: int) -> Any:
        for attempt in range(retries + 1):
            try:
                return self._call(method, params)
            except ConnectionLost:
                if attempt == retries:
                    raise
                self._sock.close()
                self._connect()  # NotRunning here ends the retries: nobody to ask

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, method: str, params: dict | None) -> int:
        req_id, data = self._framing.request(method, params)
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost(f"npud closed the connection ({exc.strerror})") from None
        return req_id

    def _receive(self) -> dict:
        while (msg := self._framing.next_message()) is None:
            try:
                data = self._sock.recv(65536)
            except OSError as exc:
                raise ConnectionLost(f"lost the connection to npud ({exc})") from None
            if not data:
                raise ConnectionLost("npud closed the connection")
            self._framing.feed(data)
        return msg

    def _call(self, method: str, params: dict | None = None) -> Any:
        stream = Stream(self, self._send(method, params))
        return stream.wait()

    def _stream(self, method: str, params: dict | None = None) -> Stream:
        return Stream(self, self._send(method, params))


# -- trio client -----------------------------------------------------------------------------

class AsyncStream:
    def __init__(self, client: "AsyncClient", method: str, params: dict | None) -> None:
        self._client = client
        self._method = method
        self._params = params
        self.result: Any = None
        self.finished = False

    async def __aiter__(self):
        async with self._client._lock:
            req_id = await self._client._send(self._method, self._params)
            while not self.finished:
                item = Framing.interpret(req_id, await self._client._receive())
                if isinstance(item, Event):
                    yield item
                else:
                    self.result = item[1]
                    self.finished = True

    async def wait(self) -> Any:
        async for _ in self:
            pass
        return self.result


class AsyncClient(_Methods):
    """A trio connection to npud: `async with await AsyncClient.connect() as c: await c.status(1)`.

    One request at a time per connection (a lock orders them); open more for concurrency.
    """

    def __init__(self, stream: Any, path: str) -> None:
        import trio

        self.path = path
        self._stream_conn = stream
        self._framing = Framing()
        self._lock = trio.Lock()

    @classmethod
    async def connect(cls, path: str | None = None) -> "AsyncClient":
        import trio

        path = path or default_socket_path()
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            raise _connect_error(path, exc) from None
        return cls(stream, path)

    async def aclose(self) -> None:
        await self._stream_conn.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _send(self, method: str, params: dict | None) -> int:
        import trio

        req_id, data = self._framing.request(method, params)
        try:
            await self._stream_conn.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(f"npud closed the connection ({exc})") from None
        return req_id

    async def _receive(self) -> dict:
        import trio

        while (msg := self._framing.next_message()) is None:
            try:
                data = await self._stream_conn.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectionLost(f"lost the connection to npud ({exc})") from None
            if not data:
                raise ConnectionLost("npud closed the connection")
            self._framing.feed(data)
        return msg

    async def _call(self, method: str, params: dict | None = None) -> Any:
        return await AsyncStream(self, method, params).wait()

    async def _submit(self, params: dict, retries: int) -> Any:
        try:
            return await self._call_retrying("submit", params, retries)
        except BadRequest as exc:
            if not _key_unknown(exc):
                raise
        return await self._call("submit", _without_key(params))

    async def _call_retrying(self, method: str, params: dict, retries: int) -> Any:
        import trio

        for attempt in range(retries + 1):
            try:
                return await self._call(method, params)
            except ConnectionLost:
                if attempt == retries:
                    raise
                await trio.aclose_forcefully(self._stream_conn)
                try:
                    self._stream_conn = await trio.open_unix_socket(self.path)
                except OSError as exc:
                    raise _connect_error(self.path, exc) from None
                self._framing = Framing()

    def _stream(self, method: str, params: dict | None = None) -> AsyncStream:
        return AsyncStream(self, method, params)
