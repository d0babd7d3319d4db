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
import trio

from npud.engine.api import DEFAULT_MAX_TOKENS
from npud import __version__
from npud.api import token_ids
from npud.http import errors, sse
from npud.http.translate import (
    HttpJob,
    chat_request,
    choice_logprobs,
    chunk,
    completion_reply,
    completion_request,
    infill_reply,
    infill_request,
    npud_reply,
    rename,
    usage,
    RENAMES,
)
from npud.jobref import JobRefs
from npud.jobs import store_api_error
from npud.jobspec import JobSpec
from npud.metrics import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from npud.metrics import render_prometheus
from npud.protocol import ApiError, ErrorCode, Params
from npud.store import StoreError
from npud.tickets import Priority

if TYPE_CHECKING:
    from npud.api import Api, Emit
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
    async def send_text(self, status: int, content_type: str, body: bytes) -> None: ...
    async def start_stream(self, content_type: str = "text/event-stream") -> None: ...
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

    def __init__(self, responder: Responder, kind: str, model: str, refs: JobRefs) -> None:
        self.responder = responder
        self.kind = kind
        self.model = model
        self.refs = refs
        self.job: str | None = None  # the job's reference (npud/jobref.py), never its id
        self.logprobs: list[dict] | None = None  # of tokens whose text has not been sent yet
        self.offset = 0  # characters of the tokens' own texts sent so far (completions' text_offset)
        self.first = True  # no chunk sent yet (comments may have begun the stream)

    def _take_logprobs(self) -> dict | None:
        items, self.logprobs = self.logprobs, None
        if items is None:
            return None
        out = choice_logprobs(self.kind, items, self.offset)
        self.offset += sum(len(i["token"]) for i in items)
        return out

    async def emit(self, name: str, data: dict) -> None:
        if name == "ticket" and self.job is None:
            self.job = self.refs.ref(data["job"])
        elif name in ("model_loading", "model_load_progress", "model_loaded"):
            # a cold start: the stream begins and says so in comments, which clients skip
            await self._start()
            await self.responder.send_event(sse.comment(f"{name} {json.dumps(data, separators=(',', ':'))}"))
        elif name == "token":
            if "logprobs" in data:  # a token whose text is held back sends its logprobs with that text
                self.logprobs = (self.logprobs or []) + data["logprobs"]
            if data["text"]:
                await self._send(chunk(self.kind, self.model, self.job, data["text"], first=self.first,
                                       logprobs=self._take_logprobs()))

    async def _start(self) -> None:
        if not self.responder.started:
            await self.responder.start_stream()

    async def _send(self, payload: dict) -> None:
        await self._start()
        await self.responder.send_event(sse.event(payload))
        self.first = False

    async def finish(self, result: dict, include_usage: bool) -> None:
        """`result` as run_single returns it, its `job` the job's reference."""
        self.job = result["job"]
        if self.kind == "infill":  # llama.cpp's last event: the whole reply with an empty text
            await self._send({**infill_reply(self.model, result), "content": ""})
            await self.responder.end_stream()
            return
        last = chunk(self.kind, self.model, self.job, None, result["finish_reason"], first=self.first,
                     logprobs=self._take_logprobs())
        last["npud"] = npud_reply(result)
        await self._send(last)
        if include_usage:  # OpenAI's shape: a chunk with no choices and the token counts
            await self._send({**chunk(self.kind, self.model, self.job, None), "choices": [], "usage": usage(result)})
        await self.responder.send_event(sse.DONE)
        await self.responder.end_stream()


class App:
    def __init__(self, api: "Api") -> None:
        from npud.http.ollama import OllamaRoutes  # beside the OpenAI routes, on the same job path

        self.api = api
        self.routes: dict[str, dict[str, Callable[["Peer", HttpRequest, Responder], Awaitable[None]]]] = {
            "/health": {"GET": self.health}, "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions}, "/v1/chat/completions": {"POST": self.chat},
            "/infill": {"POST": self.infill}, "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize}, "/props": {"GET": self.props}, "/metrics": {"GET": self.metrics},
        }
        self.ollama = OllamaRoutes(self)
        self.routes.update(self.ollama.routes)

    async def __call__(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """Answer one request; every expected error becomes OpenAI's JSON with its status (Ollama's
        shape under /api/)."""
        send = self.ollama.send_error if self.ollama.owns(request.path) else send_error
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
            await send(responder, store_api_error(exc))
        except ApiError as exc:
            await send(responder, exc)
        except ClientGone:
            raise
        except Exception:  # the traceback goes to the log, never to the client
            log.exception("internal_error", method=request.method, path=request.path[:128])
            await send(responder, ApiError(ErrorCode.INTERNAL_ERROR,
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
            facts = {k: m[k] for k in ("state", "resident", "memory_bytes", "keep_alive_s", "idle_unload_in_s",
                                       "max_context", "context_length", "fim", "weight_format", "load_error", "loading") if k in m}
            data.append({"id": m["name"], "object": "model", "created": 0, "owned_by": "npud", "npud": facts})
        await responder.send_json(200, {"object": "list", "data": data})

    async def tokenize(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """llama.cpp's /tokenize: {"content", "add_special", "parse_special", "with_pieces"}
        (and npud's "model") -> {"tokens": [...]}."""
        b = Params(parse_body(request.body), "body")
        model = b.str("model", self.api.cfg.default_model_name)
        text = b.str("content")
        add_special = b.bool("add_special", False)
        if not b.bool("parse_special", True):
            raise b.bad("parse_special", "npud always reads special tokens written in the text (only true)")
        with_pieces = b.bool("with_pieces", False)
        b.finish()
        out = await self.api.tokenize_text(model, text, add_special=add_special, with_pieces=with_pieces)
        await responder.send_json(200, {"tokens": out["tokens"]})

    async def detokenize(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """llama.cpp's /detokenize: {"tokens": [ids]} (and npud's "model") -> {"content": text}."""
        b = Params(parse_body(request.body), "body")
        model = b.str("model", self.api.cfg.default_model_name)
        ids = token_ids(b, "tokens")
        b.finish()
        out = await self.api.detokenize_ids(model, ids)
        await responder.send_json(200, {"content": out["content"]})

    async def props(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """llama.cpp's /props for the default model (loaded first if it is not): its context,
        chat template, special and FIM tokens; no paths."""
        cfg = self.api.cfg
        served = await self.api.served(cfg.default_model_name)
        facts = await trio.to_thread.run_sync(served.props)
        n_predict = min(DEFAULT_MAX_TOKENS, cfg.limits.max_tokens)
        await responder.send_json(200, {
            "default_generation_settings": {"n_ctx": served.max_context,
                                            "params": {"n_predict": n_predict, "temperature": 0.0}},
            "total_slots": 1, "model_alias": served.name, "chat_template": facts["chat_template"] or "",
            "bos_token": facts["bos_token"] or "", "eos_token": (facts["eos_tokens"] or [""])[0],
            "modalities": {"vision": False, "audio": False}, "build_info": f"npud {__version__}",
            "npud": {"model": served.name, "context_length": served.max_context, "fim": served.fim,
                     "models": list(self.api.registry.names), **facts},
        })

    async def metrics(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """The Prometheus text of every counter and gauge: as `stats`' full view, an admin's
        (root or the admin group on the Unix socket; never a TCP client)."""
        if not peer.caller.admin:
            raise ApiError(ErrorCode.FORBIDDEN, "/metrics needs root or the admin group (the Unix socket)")
        text = render_prometheus(self.api.snapshot(None))
        await responder.send_text(200, PROMETHEUS_CONTENT_TYPE, text.encode("utf-8"))

    async def completions(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, completion_request(parse_body(request.body)), responder)

    async def chat(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, chat_request(parse_body(request.body)), responder)

    async def infill(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, infill_request(parse_body(request.body)), responder)

    def spec(self, job: HttpJob, renames: tuple[tuple[str, str], ...] = RENAMES) -> JobSpec:
        """The job spec of a request's params (complete's), checked as the socket checks them;
        raises ApiError naming the body field (`renames`: complete's param prefixes and the body's)."""
        try:
            return self.api.single_spec(job.params)
        except ApiError as exc:
            raise rename(exc, renames) from None

    async def run(self, peer: "Peer", spec: JobSpec, priority: Priority, emit: "Emit") -> dict:
        """Run `spec` as a one-prompt job of `peer` (the path of every generating endpoint, OpenAI's
        and Ollama's): its events go to `emit`; returns its result, the job named by reference."""
        result = await self.api.run_single(peer, spec, priority, emit)
        # a reply names its job by reference: ids count every user's jobs (npud/jobref.py)
        return {**result, "job": self.api.job_manager.refs.ref(result["job"])}

    async def _run(self, peer: "Peer", job: HttpJob, responder: Responder) -> None:
        """Run the request as a one-prompt job and answer with its result (or stream it)."""
        spec = self.spec(job)
        stream = Stream(responder, job.kind, spec.model, self.api.job_manager.refs) if job.stream else None
        result = await self.run(peer, spec, job.priority, stream.emit if stream else ignore_events)
        if stream is not None:
            await stream.finish(result, job.include_usage)
        elif job.kind == "infill":
            await responder.send_json(200, infill_reply(spec.model, result))
        else:
            await responder.send_json(200, completion_reply(job.kind, spec.model, result))


async def ignore_events(name: str, data: dict) -> None:
    """A non-streaming reply waits for the result; the events are not needed."""
