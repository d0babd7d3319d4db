"""Ollama's API on the HTTP front end (docs/http.md, "Ollama's API"), so clients in Ollama mode
(the `ollama` Python library, Open WebUI, Continue's Ollama provider, editor plugins) talk to npud.

/api/generate and /api/chat run on the OpenAI routes' path (npud/http/app.py's App.spec and
App.run): one job of one prompt, the same validation, store, tickets, batching, limits, owner
checks and logs, and the same peer credentials (the Unix socket's SO_PEERCRED, tcp_owner_uid on
TCP). Only the shapes differ: bodies are translated in npud/http/ollama_translate.py, streams are
newline-delimited JSON, errors are Ollama's `{"error": message}` (with npud's stable `code`).
/api/tags, /api/ps and /api/show describe the configured models from the registry (no paths);
/api/embed and the model-management endpoints (pull, create, ...) are refused by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
import trio

from npud import __version__
from npud.engine.api import EngineError
from npud.engine.loader import describe_checkpoint
from npud.http import errors
from npud.http.app import HttpRequest, Responder, parse_body
from npud.http.ollama_translate import (
    OLLAMA_API_VERSION,
    RENAMES,
    OllamaJob,
    Timing,
    chat_request,
    chunk,
    created_at,
    error_line,
    final,
    generate_request,
    loaded,
    ndjson,
    npud_name,
    ollama_name,
)
from npud.jobspec import JobSpec, api_error
from npud.lifecycle import parse_keep_alive
from npud.protocol import ApiError, ErrorCode, Params

if TYPE_CHECKING:
    from npud.http.app import App
    from npud.server import Peer

log = structlog.get_logger(__name__)

NDJSON = "application/x-ndjson"
# Ollama's endpoints that manage a model store npud does not have: its models are its configuration's
MANAGEMENT = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")
NO_EMBEDDINGS = ("npud serves generative models only and computes no embeddings; "
                 "use an embedding server beside it")


class NdjsonStream:
    """A streamed Ollama reply: one object per piece of text, then the last with `done: true`.
    The status line waits for the first text, so an error before it (a prompt too long, a full
    queue) is still a plain HTTP error."""

    def __init__(self, responder: Responder, kind: str, model: str, timing: Timing) -> None:
        self.responder = responder
        self.kind = kind
        self.model = model
        self.timing = timing
        self.logprobs: list[dict] | None = None  # of tokens whose text has not been sent yet

    def _take_logprobs(self) -> list[dict] | None:
        items, self.logprobs = self.logprobs, None
        return items

    async def emit(self, name: str, data: dict) -> None:
        await record(self.timing, name, data)
        if name == "token":
            if "logprobs" in data:  # a token whose text is held back sends its logprobs with that text
                self.logprobs = (self.logprobs or []) + data["logprobs"]
            if data["text"]:
                await self._send(chunk(self.kind, self.model, data["text"], self._take_logprobs()))

    async def _send(self, payload: dict) -> None:
        if not self.responder.started:
            await self.responder.start_stream(NDJSON)
        await self.responder.send_event(ndjson(payload))

    async def finish(self, result: dict) -> None:
        await self._send(final(self.kind, self.model, result, self.timing, logprobs=self._take_logprobs()))
        await self.responder.end_stream()


async def record(timing: Timing, name: str, data: dict) -> None:
    """Note when a request's phases began (for Ollama's durations) from its job's events."""
    now = time.monotonic()
    if name == "model_loaded":
        timing.load_s += float(data.get("load_ms") or 0) / 1000
    elif name == "ticket" and data.get("state") == "granted" and timing.prefill_from is None:
        timing.prefill_from = now
    elif name == "token" and timing.first_token is None:
        timing.first_token = now


class OllamaRoutes:
    """The /api/ endpoints, on the App's job path."""

    def __init__(self, app: "App") -> None:
        self.app = app
        self.api = app.api
        self._described: dict[tuple[str, int, int], dict] = {}  # describe_checkpoint by (path, mtime, size)
        refuse = {"POST": self.management, "GET": self.management, "DELETE": self.management}
        self.routes: dict[str, dict[str, Callable[["Peer", HttpRequest, Responder], Awaitable[None]]]] = {
            "/": {"GET": self.root, "HEAD": self.root},
            "/api/version": {"GET": self.version}, "/api/tags": {"GET": self.tags}, "/api/ps": {"GET": self.ps},
            "/api/show": {"POST": self.show}, "/api/generate": {"POST": self.generate},
            "/api/chat": {"POST": self.chat}, "/api/embed": {"POST": self.embed},
            "/api/embeddings": {"POST": self.embed}, **{path: refuse for path in MANAGEMENT},
        }

    def owns(self, path: str) -> bool:
        """Whether `path` is Ollama's (its errors take Ollama's shape)."""
        return path == "/" or path.startswith("/api/")

    @staticmethod
    async def send_error(responder: Responder, exc: ApiError) -> None:
        """Ollama's error: `{"error": message}` with the status, or a last line once a stream has begun."""
        if responder.started:
            await responder.send_event(error_line(exc.message, exc.code))
            await responder.end_stream()
        else:
            await responder.send_json(errors.status_of(exc.code), {"error": exc.message, "code": exc.code})

    # -- what is served ----------------------------------------------------------------------

    async def root(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """Ollama's liveness answer (`ollama` and Open WebUI ask `/` before anything else)."""
        await responder.send_text(200, "text/plain; charset=utf-8", b"npud is running (Ollama's API at /api/)")

    async def version(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await responder.send_json(200, {"version": OLLAMA_API_VERSION, "npud": {"version": __version__}})

    def _details(self, m: dict, info: dict | None) -> dict:
        """Ollama's `details` of a model: its file format, family, size and quantization, from
        the loaded model's checkpoint facts (or the files' headers); empty where unknown."""
        info = info or {}
        params = info.get("parameters")
        mix = info.get("quant_mix") or {}
        quant = max(mix, key=lambda k: (mix[k], k)) if mix else ("" if info.get("format") == "gguf" else
                                                                   m["weight_format"].upper())
        family = info.get("model_type") or ""
        return {"parent_model": "", "format": info.get("format") or "", "family": family,
                "families": [family] if family else None, "parameter_size": _count(params) if params else "",
                "quantization_level": quant}

    def _resident_info(self, m: dict) -> dict | None:
        """The loaded model's checkpoint facts (a GGUF's header; a directory's type), or None."""
        described = m.get("describe") if m["resident"] else None
        if not described:
            return None
        return {"model_type": described.get("model_type"), **(described.get("checkpoint") or {})}

    def _size(self, m: dict) -> int:
        return int(m.get("memory_bytes") or m.get("estimated_bytes") or 0)

    def _entry(self, m: dict, info: dict | None) -> dict:
        name = ollama_name(m["name"])
        return {"name": name, "model": name, "modified_at": created_at(self._mtime(m["name"])),
                "size": self._size(m), "digest": _digest(m), "details": self._details(m, info)}

    def _mtime(self, name: str) -> float:
        try:
            return os.stat(self.api.registry.entry(name).checkpoint_dir).st_mtime
        except (OSError, ApiError):
            return 0.0

    async def tags(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """Every configured model, loaded or not, as NAME:latest (no paths)."""
        models = [self._entry(m, await self._facts(m)) for m in self.api.registry.describe()]
        await responder.send_json(200, {"models": models})

    async def ps(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """The loaded models: their memory, context and when they unload if left idle."""
        out = []
        for m in self.api.registry.describe():
            if not m["resident"]:
                continue
            unload_in = m.get("idle_unload_in_s")
            # Ollama's "never" is far in the future; npud keeps such a model until memory is needed
            expires = created_at(time.time() + (unload_in if unload_in is not None else 10 * 365 * 86400))
            out.append({**self._entry(m, await self._facts(m)), "expires_at": expires, "size_vram": 0,
                        "context_length": m.get("context_length")})
        await responder.send_json(200, {"models": out})

    async def _facts(self, m: dict) -> dict:
        """A described model's checkpoint facts: its files' headers, and the loaded model's own."""
        return {**await self._checkpoint_facts(m["name"]), **(self._resident_info(m) or {})}

    async def _checkpoint_facts(self, name: str) -> dict:
        """What the files' headers say of a configured model (format, family, parameters, quant
        mix, context), read once per file version in a worker thread; {} when they cannot be read."""
        path = self.api.registry.entry(name).checkpoint_dir
        try:
            st = os.stat(path)
        except OSError:
            return {}
        key = (path, int(st.st_mtime_ns), st.st_size)
        if key not in self._described:
            try:
                self._described[key] = await trio.to_thread.run_sync(describe_checkpoint, path)
            except (ValueError, OSError):  # the load will say what is wrong; show tells what it can
                return {}
        return self._described[key]

    async def show(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        """One model's facts, without loading it: details and model_info from the files' headers
        (the loaded model's when it is resident), its chat template (known once it is loaded),
        its capabilities and the generation defaults npud applies."""
        b = Params(parse_body(request.body), "body")
        given = b.str("model", None) or b.str("name", None)  # `name` in older clients
        b.bool("verbose", False)
        b.finish()
        if given is None:
            raise b.bad("model", "is required")
        registry = self.api.registry
        name = npud_name(given, registry.names)
        registry.entry(name)  # not_found naming the models
        m = next(d for d in registry.describe() if d["name"] == name)
        info = await self._facts(m)
        served = registry.resident(name)
        props = await trio.to_thread.run_sync(served.props) if served is not None else {}
        family = info.get("model_type") or ""
        context = m.get("context_length") or info.get("context_length")
        model_info = {"general.architecture": family, "general.parameter_count": info.get("parameters"),
                      f"{family or 'model'}.context_length": context}
        capabilities = ["completion"] + (["insert"] if m.get("fim") else [])
        limits = self.api.cfg.limits
        # the defaults a request gets (Ollama's Modelfile PARAMETER lines): greedy, up to limits.max_tokens
        parameters = f"temperature 0\nnum_predict {limits.max_tokens}" + (f"\nnum_ctx {context}" if context else "")
        await responder.send_json(200, {
            "modelfile": f"# npud serves {given} from its configuration (npud.toml or --model)\nFROM {name}\n",
            "parameters": parameters, "template": props.get("chat_template") or "",
            "details": self._details(m, info), "model_info": model_info, "capabilities": capabilities,
            "modified_at": created_at(self._mtime(name)),
            "npud": {"state": m["state"], "chat_template": (m.get("describe") or {}).get("chat_template"),
                     "weight_format": m["weight_format"], "context_length": m.get("context_length")},
        })

    # -- generation --------------------------------------------------------------------------

    async def generate(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, generate_request(parse_body(request.body), *self._defaults()), responder)

    async def chat(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        await self._run(peer, chat_request(parse_body(request.body), *self._defaults()), responder)

    def _defaults(self) -> tuple[int, tuple[str, ...], str | None]:
        cfg = self.api.cfg
        return cfg.limits.max_tokens, self.api.registry.names, cfg.default_model_name

    async def _run(self, peer: "Peer", job: OllamaJob, responder: Responder) -> None:
        if job.job is None:  # no prompt: Ollama's way to load (or with keep_alive 0, unload) a model
            await self._load(job, responder)
            return
        timing = Timing(time.monotonic())
        spec = self.app.spec(job.job, RENAMES)
        if job.num_ctx is not None:
            spec = await self._fit_context(peer, spec, job.num_ctx)
        stream = NdjsonStream(responder, job.kind, job.model, timing) if job.stream else None

        async def note(name: str, data: dict) -> None:
            await record(timing, name, data)

        result = await self.app.run(peer, spec, job.job.priority, stream.emit if stream is not None else note)
        timing.ended = time.monotonic()
        if stream is not None:
            await stream.finish(result)
        else:
            await responder.send_json(200, final(job.kind, job.model, result, timing, text=result["text"],
                                                 logprobs=result.get("logprobs")))

    async def _fit_context(self, peer: "Peer", spec: JobSpec, num_ctx: int) -> JobSpec:
        """options.num_ctx: the prompt and the reply must fit in num_ctx positions. The model keeps
        the context it was loaded with (a larger num_ctx changes nothing); a smaller one caps
        max_tokens at what the prompt leaves of it, and a prompt that fills it is refused
        (prompt_too_long; npud never drops part of a prompt). Loads the model to count the prompt."""
        served = await self.api.served(spec.model)
        if num_ctx >= served.max_context:
            return spec
        try:
            num_tokens = await self.api.owner.engine_call(served.count_prompt_tokens,
                                                          spec.engine_request(0, peer.caller.uid))
        except EngineError as exc:
            raise api_error(exc) from None
        room = num_ctx - num_tokens
        if room < 1:
            raise ApiError(ErrorCode.PROMPT_TOO_LONG, f"the prompt has {num_tokens} tokens and options.num_ctx is "
                                                      f"{num_ctx}: no room for a reply")
        if room >= spec.params.max_tokens:
            return spec
        return dataclasses.replace(spec, params=dataclasses.replace(spec.params, max_tokens=room))

    async def _load(self, job: OllamaJob, responder: Responder) -> None:
        """Load the model (and set its keep_alive), as Ollama's empty prompt does; keep_alive 0
        lets it go as soon as nothing uses it (`done_reason: "unload"`)."""
        p = Params({"keep_alive": job.keep_alive} if job.keep_alive is not None else {}, "body")
        keep_alive = parse_keep_alive(p)
        name = npud_name(job.model, self.api.registry.names)
        self.api.registry.entry(name)  # not_found naming the models
        if keep_alive == 0:
            self.api.registry.touch(name, 0.0)
        else:
            await self.api.lifecycle.load(name, keep_alive)
        await responder.send_json(200, loaded(job.kind, job.model, unloading=keep_alive == 0))

    async def embed(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        raise ApiError(ErrorCode.UNSUPPORTED, f"{request.path}: {NO_EMBEDDINGS}")

    async def management(self, peer: "Peer", request: HttpRequest, responder: Responder) -> None:
        raise ApiError(ErrorCode.UNSUPPORTED, f"{request.path}: npud serves the models of its configuration and has "
                                              "no model store to change; add a model to npud.toml (or --model) "
                                              "and reload")


def _count(n: int) -> str:
    """A parameter count as Ollama shows it: 268.1M, 1.5B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _digest(m: dict) -> str:
    """A stand-in for Ollama's manifest digest: 64 hex digits naming the model's entry (npud has
    no manifests; clients use the digest only to tell models apart)."""
    return hashlib.sha256(f"npud:{m['name']}:{m['weight_format']}".encode()).hexdigest()

