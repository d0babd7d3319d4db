"""The HTTP endpoints (docs/http.md): each request is routed here, its body translated into
`complete`'s params (npud/http/translate.py) and run through the protocol's Api as a one-prompt
job: the same tickets, store, owner checks, limits and logs as a `complete` on the socket.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from npud.http import errors, sse
from npud.http.translate import (
    HttpJob,
    chat_request,
    chunk,
    completion_reply,
    completion_request,
    infill_reply,
    infill_request,
    npud_reply,
    rename,
    usage,
)
from npud.jobs import store_api_error
from npud.protocol import ApiError, ErrorCode
from npud.store import StoreError

if TYPE_CHECKING:
    from npud.api import Api
    from npud.server import Peer

log = structlog.get_logger(__name__)


class ClientGone(Exception):
    """The client closed its connection or stopped reading (a Responder's sends raise it)."""


@dataclass(slots=True, frozen=True)
class HttpRequest:
    method: str
    path: str  # without the query string
    body: bytes
    bearer: str | None = None  # the token of an `Authorization: Bearer` header


class Responder:
    """How a handler answers: one JSON reply, or a stream of server-sent events. The server
    (npud/http/server.py) implements it over h11; a send to a client that is gone raises
    ClientGone."""

    started: bool  # the status line is sent: later errors can only go into the stream

    async def send_json(self, status: int, payload: dict) -> None: ...
    async def start_stream(self) -> None: ...
    async def send_event(self, data: bytes) -> None: ...
    async def end_stream(self) -> None: ...


async def send_error(responder: Responder, exc: ApiError) -> None:
    """The error as OpenAI's JSON with its status, or as a last event once a stream has begun."""
    if responder.started:  # the error event, then the stream's usual end
        await responder.send_event(sse.event(errors.error_body(exc)))
        await responder.send_event(sse.DONE)
        await responder.end_stream()
    else:
        await responder.send_json(errors.status_of(exc.code), errors.error_body(exc))


def parse_body(body: bytes) -> dict:
    """A request body as a JSON object; raises bad_request."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(ErrorCode.BAD_REQUEST, "the body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(ErrorCode.BAD_REQUEST, f"the body is not valid JSON: {exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError):  # too many digits; nested too deeply
        raise ApiError(ErrorCode.BAD_REQUEST, "the body is not JSON npud can read") from None
    if not isinstance(obj, dict):
        raise ApiError(ErrorCode.BAD_REQUEST, "the body must be a JSON object")
    return obj


class Stream:
    """A streamed reply: the status line waits for the first text, so an error before it
    (a prompt too long, a full queue) is still a plain HTTP error."""

    def __init__(self, responder: Responder, kind: str, model: str) -> None:
        self.responder = responder
        self.kind = kind
        self.model = model
        self.job: int | None = None

    async def emit(self, name: str, data: dict) -> None:
        if name == "ticket" and self.job is None:
            self.job = data["job"]
        elif name == "token" and data["text"]:
            await self._send(chunk(self.kind, self.model, self.job, data["text"], first=not self.responder.started))

    async def _send(self, payload: dict) -> None:
        if not self.responder.started:
            await self.responder.start_stream()
        await self.responder.send_event(sse.event(payload))

    async def finish(self, result: dict, include_usage: bool) -> None:
        self.job = result["job"]
        if self.kind == "infill":  # llama.cpp's last event: the whole reply with an empty text
            await self._send({**infill_reply(self.model, result), "content": ""})
            await self.responder.end_stream()
            return
        last = chunk(self.kind, self.model, self.job, None, result["finish_reason"], first=not self.responder.started)
        last["npud"] = npud_reply(result)
        await self._send(last)
        if include_usage:  # OpenAI's shape: a chunk with no choices and the token counts
            await self._send({**chunk(self.kind, self.model, self.job, None), "choices": [], "usage": usage(result)})
        await self.responder.send_event(sse.DONE)
        await self.responder.end_stream()


class App:
    def __init__(self, api: "Api") -> None:
        self.api = api
        self.routes: dict[str, dict[str, Callable[["Peer", HttpRequest, Responder], Awaitable[None]]]] = {
            "/health": {"GET": self.health}, "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions}, "/v1/chat/completions": {"POST": self.chat},
            "/infill": {"POST": self.infill},
        }

    async def __call__(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """Answer one request; every expected error becomes OpenAI's JSON with its status."""
        try:
            methods = self.routes.get(request.path)
            if methods is None:
                raise ApiError(ErrorCode.NOT_FOUND, f"no endpoint {request.path[:128]!r}; endpoints: "
                                                    f"{sorted(self.routes)}")
            handler = methods.get(request.method)
            if handler is None:
                raise ApiError(errors.METHOD_NOT_ALLOWED, f"{request.path} takes {' or '.join(methods)}")
            await handler(peer, request, responder)
        except StoreError as exc:
            await send_error(responder, store_api_error(exc))
        except ApiError as exc:
            await send_error(responder, exc)
        except ClientGone:
            raise
        except Exception:  # the traceback goes to the log, never to the client
            log.exception("internal_error", method=request.method, path=request.path[:128])
            await send_error(responder, ApiError(ErrorCode.INTERNAL_ERROR,
                                                 "the request failed in the daemon; its log has the details"))

    async def health(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        api = self.api
        if api.queue.quarantine is not None:
            raise ApiError(ErrorCode.DEVICE_QUARANTINED, f"the device is quarantined ({api.queue.quarantine.reason})")
        if not api.job_manager.accepting:
            raise ApiError(ErrorCode.SHUTTING_DOWN, "npud is shutting down")
        await responder.send_json(200, {"status": "ok"})

    async def models(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        data = []
        for m in self.api.registry.describe():  # no paths: a TCP client may be on another host
            facts = {k: m[k] for k in ("resident", "max_context", "context_length", "fim", "weight_format") if k in m}
            data.append({"id": m["name"], "object": "model", "created": 0, "owned_by": "npud", "npud": facts})
        await responder.send_json(200, {"object": "list", "data": data})

    async def completions(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, completion_request(parse_body(request.body)), responder)

    async def chat(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, chat_request(parse_body(request.body)), responder)

    async def infill(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, infill_request(parse_body(request.body)), responder)

    async def _run(self, peer: "Peer", job: HttpJob, responder: Responder) -> None:
        """Run the request as a one-prompt job and answer with its result (or stream it)."""
        try:
            spec = self.api.single_spec(job.params)
        except ApiError as exc:
            raise rename(exc) from None
        stream = Stream(responder, job.kind, spec.model) if job.stream else None
        result = await self.api.run_single(peer, spec, job.priority, stream.emit if stream else _ignore)
        if stream is not None:
            await stream.finish(result, job.include_usage)
        elif job.kind == "infill":
            await responder.send_json(200, infill_reply(spec.model, result))
        else:
            await responder.send_json(200, completion_reply(job.kind, spec.model, result))


async def _ignore(name: str, data: dict) -> None:
    """A non-streaming reply waits for the result; the events are not needed."""
