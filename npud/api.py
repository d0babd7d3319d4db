"""The methods of the protocol (docs/protocol.md): params checked here, work done by the
job manager, the device owner and the registry."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from npud import __version__
from npud.jobspec import parse_spec
from npud.metrics import render_prometheus
from npud.protocol import PROTOCOL_VERSION, ApiError, ErrorCode, Params, Request
from npud.tickets import Outcome, Priority, TicketState

if TYPE_CHECKING:
    from npud.daemon import Daemon
    from npud.server import Peer

log = structlog.get_logger(__name__)

Emit = Callable[[str, dict], Awaitable[None]]
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
MAX_LIST = 1000


def _require_admin(peer: "Peer", method: str) -> None:
    if not peer.caller.admin:
        raise ApiError(ErrorCode.FORBIDDEN, f"{method} needs root or the admin group")


class Api:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        self.methods: dict[str, Callable[["Peer", Params, Emit], Awaitable[Any]]] = {
            "hello": self.hello, "submit": self.submit, "complete": self.complete, "stream": self.stream,
            "result": self.result, "status": self.status, "jobs": self.jobs, "cancel": self.cancel,
            "tickets": self.tickets, "cache.list": self.cache_list, "cache.pin": self.cache_pin,
            "cache.drop": self.cache_drop, "device.status": self.device_status, "device.clear": self.device_clear,
            "models": self.models, "stats": self.stats, "metrics": self.metrics,
        }

    async def __call__(self, peer: "Peer", req: Request, emit: Emit) -> Any:
        method = self.methods.get(req.method)
        if method is None:
            raise ApiError(ErrorCode.UNKNOWN_METHOD, f"no method {req.method[:64]!r}; methods: {sorted(self.methods)}")
        return await method(peer, Params(req.params), emit)

    # -- session -------------------------------------------------------------------------

    async def hello(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        client = p.str("client", None, max_len=128)
        p.finish()
        log.info("client_hello", client=client, uid=peer.uid, pid=peer.pid)
        cfg = self.d.cfg
        limits = cfg.limits
        return {
            "protocol": PROTOCOL_VERSION, "daemon": "npud", "version": __version__, "uid": peer.uid,
            "admin": peer.caller.admin, "models": list(self.d.registry.names),
            "default_model": cfg.default_model_name,
            "device": {"kind": self.d.device.kind, "reason": self.d.device.reason},
            "limits": {"max_line_bytes": limits.max_line_bytes, "max_prompt_tokens": limits.max_prompt_tokens,
                       "max_tokens": limits.max_tokens, "max_prompts_per_job": limits.max_prompts_per_job,
                       "max_queued_jobs_per_user": limits.max_queued_jobs_per_user},
        }

    # -- jobs ----------------------------------------------------------------------------

    def _spec(self, p: Params, *, single: bool):
        cfg = self.d.cfg
        return parse_spec(p, limits=cfg.limits, models=self.d.registry.names, default_model=cfg.default_model_name,
                          single=single)

    async def submit(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        spec = self._spec(p, single=False)
        priority = Priority.parse(p.str("priority", "batch", choices=("batch", "interactive")))
        p.finish()
        job, _ = await self.d.jobs.submit(peer.caller, spec, priority)
        return {**job.status(), "queue_position": self.d.queue.position(job.id)}

    async def complete(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        spec = self._spec(p, single=True)
        p.finish()
        if self.d.queue.quarantine is not None:
            raise ApiError(ErrorCode.DEVICE_QUARANTINED,
                           f"the device is quarantined ({self.d.queue.quarantine.reason}); "
                           "an operator clears it with `npuctl device clear`")
        jobs = self.d.jobs
        job, sub = await jobs.submit(peer.caller, spec, Priority.INTERACTIVE, interactive=True, subscribe=True)
        try:
            async for name, data in sub.receive:
                if name != "progress":
                    await emit(name, data)
            if sub.lagged:
                raise ApiError(ErrorCode.OVERLOADED, f"the stream fell behind; job {job.id} is being cancelled")
        finally:
            if not job.finished.is_set():  # the client went away or fell behind: nobody wants the rest
                await jobs.cancel_job(job)
        if job.error is not None:
            raise job.error
        results = await jobs.db(jobs.store.results, job.id)
        if not results:  # cancelled before its first round
            return {"job": job.id, "prompt": 0, "text": "", "token_ids": [], "prompt_tokens": 0,
                    "finish_reason": "cancelled", "stats": {}}
        if "error" in results[0]:
            raise ApiError(results[0]["error"]["code"], results[0]["error"]["message"])
        return {"job": job.id, **results[0]}

    async def stream(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = p.int("job", min=1)
        tokens = p.bool("tokens", True)
        p.finish()
        jobs = self.d.jobs
        status = await jobs.status(peer.caller, job_id)
        job = jobs.active.get(job_id)
        if job is None:  # already ended (or ended while we looked)
            return await jobs.status(peer.caller, job_id) if status["state"] in ("queued", "running") else status
        sub = jobs.subscribe(job)
        try:
            await emit("progress", {"done_prompts": len(job.done_prompts), "num_prompts": job.spec.num_prompts,
                                    "state": job.state.value})
            async for name, data in sub.receive:
                if name != "token" or tokens:
                    await emit(name, data)
            if sub.lagged:
                raise ApiError(ErrorCode.OVERLOADED, f"the stream fell behind; job {job_id} carries on, "
                                                     "read its results with `result`")
        finally:
            jobs.unsubscribe(job, sub)
        return await jobs.status(peer.caller, job_id)

    async def result(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = p.int("job", min=1)
        prompts = p.list("prompts", None, max_items=100_000)
        if prompts is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in prompts):
            raise p.bad("prompts", "expected a list of integers")
        p.finish()
        return await self.d.jobs.results(peer.caller, job_id, prompts)

    async def status(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = p.int("job", min=1)
        p.finish()
        return await self.d.jobs.status(peer.caller, job_id)

    async def jobs(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        states = p.choices_list("state", None, choices=JOB_STATES)
        all_users = p.bool("all_users", False)
        limit = p.int("limit", 50, min=1, max=MAX_LIST)
        before = p.int("before", None, min=1)
        p.finish()
        return {"jobs": await self.d.jobs.list(peer.caller, states=states, all_users=all_users, limit=limit,
                                               before=before)}

    async def cancel(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = p.int("job", min=1)
        p.finish()
        return await self.d.jobs.cancel(peer.caller, job_id)

    async def tickets(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = p.int("job", None, min=1)
        state = p.str("state", None, choices=tuple(s.value for s in TicketState))
        outcome = p.str("outcome", None, choices=tuple(o.value for o in Outcome))
        since = p.number("since", None)
        until = p.number("until", None)
        limit = p.int("limit", 100, min=1, max=MAX_LIST)
        p.finish()
        return {"tickets": await self.d.jobs.tickets(peer.caller, job_id=job_id, state=state, outcome=outcome,
                                                     since=since, until=until, limit=limit)}

    # -- prefix cache --------------------------------------------------------------------

    def _prefix_cache(self, name: str, served: Any) -> Any:
        cache = getattr(served, "prefix_cache", None)
        if cache is None:
            raise ApiError(ErrorCode.UNSUPPORTED, f"model {name!r} has no prefix cache")
        return cache

    async def cache_list(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        model = p.str("model", None)
        p.finish()
        registry = self.d.registry
        names = [registry.entry(model).name] if model is not None else list(registry.names)
        out = []
        for name in names:
            served = registry.resident(name)
            if served is None or getattr(served, "prefix_cache", None) is None:
                continue
            out.append({"model": name, **await self.d.owner.engine_call(_describe_cache, served.prefix_cache)})
        return {"models": out}

    async def cache_pin(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "cache.pin")
        model = p.str("model", self.d.cfg.default_model_name)
        name = p.str("name", nonempty=True, max_len=128)
        key = p.str("key", None, nonempty=True, max_len=256)
        text = p.str("text", None, nonempty=True)
        p.finish()
        if (key is None) == (text is None):
            raise ApiError(ErrorCode.BAD_REQUEST, "params: give exactly one of 'key' and 'text'")
        if text is not None and self.d.queue.quarantine is not None:
            raise ApiError(ErrorCode.DEVICE_QUARANTINED, "the device is quarantined; clear it first")
        registry, owner = self.d.registry, self.d.owner
        registry.entry(model)
        served = await owner.engine_call(registry.get, model, keep=owner.models_in_use())
        cache = self._prefix_cache(model, served)
        try:
            entry = await owner.engine_call(_pin, registry.engine(), served, cache, name, key, text)
        except ValueError as exc:  # PrefixCacheError: no such key; RequestError / ConfigError for the text
            code = getattr(exc, "code", ErrorCode.NOT_FOUND if key is not None else ErrorCode.BAD_REQUEST)
            raise ApiError(code, str(exc)) from None
        log.info("cache_pinned", model=model, name=name, key=entry["key"])
        return {"model": model, "entry": entry}

    async def cache_drop(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "cache.drop")
        model = p.str("model", self.d.cfg.default_model_name)
        key = p.str("key", nonempty=True, max_len=256)
        p.finish()
        self.d.registry.entry(model)
        served = self.d.registry.resident(model)
        if served is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"model {model!r} is not loaded, so its cache has no entry {key!r}")
        cache = self._prefix_cache(model, served)
        if not await self.d.owner.engine_call(cache.drop, key):
            raise ApiError(ErrorCode.NOT_FOUND, f"no cache entry {key!r} in model {model!r}")
        log.info("cache_dropped", model=model, key=key)
        return {"model": model, "dropped": True}

    # -- device, models, stats -----------------------------------------------------------

    async def device_status(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        p.finish()
        q = self.d.queue.quarantine
        site, why = self.d.gemm_site()
        return {**self.d.device.to_wire(), "quarantine": None if q is None else q.to_wire(),
                "thermal": self.d.thermal.to_wire(), "errors": self.d.errors.to_wire(),
                "gemms": {"site": site, "reason": why}, "other_holders": self.d.other_holders}

    async def device_clear(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "device.clear")
        p.finish()
        cleared = await self.d.owner.clear_quarantine()
        log.info("device_clear_requested", uid=peer.uid, cleared=cleared)
        return {"cleared": cleared}

    async def models(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        p.finish()
        return {"models": self.d.registry.describe()}

    async def stats(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        p.finish()
        d = self.d
        jobs = await d.jobs.db(d.jobs.store.job_counts)
        tickets = await d.jobs.db(d.jobs.store.ticket_counts)
        granted = d.queue.granted
        return {
            "uptime_s": round(time.monotonic() - d.started_mono, 3), "version": __version__,
            "connections": d.server.connections, "jobs": jobs, "tickets": tickets,
            "tokens_generated": d.jobs.tokens_generated, "queue": d.queue.counts(),
            "granted": None if granted is None else granted.to_wire(),
            "quarantined": d.queue.quarantine is not None,
            "metrics": d.metrics_snapshot(),
        }

    async def metrics(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        fmt = p.str("format", "json", choices=("json", "prometheus"))
        p.finish()
        snap = self.d.metrics_snapshot()
        if fmt == "prometheus":
            return {"format": "prometheus", "text": render_prometheus(snap)}
        return snap


def _describe_cache(cache: Any) -> dict:
    """Stats, pins and (where the cache lists them) entries; blocking, in the engine thread."""
    stats = cache.stats()
    out = {"stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats),
           "pins": cache.pins() if hasattr(cache, "pins") else {}}
    if hasattr(cache, "entries"):
        out["entries"] = cache.entries()
    return out


def _pin(engine: Any, served: Any, cache: Any, name: str, key: str | None, text: str | None) -> dict:
    """Pin an existing entry, or compute the prefix of `text` through a one-token session and pin
    that. Blocking, in the engine thread; raises ValueError subclasses for what cannot be pinned."""
    if text is not None:
        request = engine.GenerateRequest(prompt=text, max_tokens=1, use_prefix_cache=True)
        session = served.start(request)  # its prefill stores the prompt's full blocks in the cache
        while not session.done:
            session.run_round()
        match = cache.lookup(served.prompt_ids(request))
        if match is None:
            raise ValueError(f"the text is shorter than one cache block ({getattr(cache, 'block_size', '?')} "
                             "tokens), so there is no prefix to pin")
        key = match.key
    cache.pin(name, key)
    return {"name": name, "key": key}
