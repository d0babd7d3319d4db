"""The methods of the protocol (docs/protocol.md): params checked here, work done by the
job manager, the device owner and the registry."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
import trio

from npud.engine.api import EngineError, ServedModel
from npud import __version__
from npud.config import DaemonConfig
from npud.jobs import store_api_error
from npud.jobspec import JobSpec, api_error, parse_spec
from npud.lifecycle import Lifecycle, parse_keep_alive
from npud.metrics import render_prometheus
from npud.protocol import INT64_MAX, PROTOCOL_VERSION, ApiError, ErrorCode, Params, Request
from npud.store import StoreError
from npud.tickets import Outcome, Priority, TicketState

if TYPE_CHECKING:
    from npud.device import DeviceInfo
    from npud.device_owner import DeviceOwner
    from npud.guards import ErrorCountGuard, ThermalGuard
    from npud.jobs import JobManager
    from npud.registry import ModelRegistry
    from npud.server import Peer
    from npud.tickets import TicketQueue

log = structlog.get_logger(__name__)

Emit = Callable[[str, dict], Awaitable[None]]
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
MAX_LIST = 1000
MAX_KEY_CHARS = 128


def _require_admin(peer: "Peer", method: str) -> None:
    if not peer.caller.admin:
        raise ApiError(ErrorCode.FORBIDDEN, f"{method} needs root or the admin group")


def piece_json(piece: bytes) -> str | list[int]:
    """A token's bytes as llama.cpp shows a piece: the text when it is UTF-8, else the bytes."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def token_ids(p: Params, name: str) -> list[int]:
    """A list of token ids (integers >= 0); raises bad_request naming the first that is not."""
    ids = p.list(name, max_items=1 << 20)
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
            raise p.bad(f"{name}[{i}]", f"expected a token id (an integer >= 0), got {value!r}"[:160])
    return ids


class Api:
    """The protocol's methods over the daemon's parts; `cfg` is replaced on reload."""

    def __init__(self, cfg: DaemonConfig, *, jobs: "JobManager", queue: "TicketQueue", registry: "ModelRegistry",
                 owner: "DeviceOwner", device: "DeviceInfo", thermal: "ThermalGuard", errors: "ErrorCountGuard",
                 snapshot: Callable[[], dict], connections: Callable[[], int], started_mono: float,
                 gemm_site: Callable[[], tuple[str, str]], other_holders: Callable[[], list[dict]],
                 cache: dict | None = None, power_mode: Callable[[], dict] = dict) -> None:
        self.cfg = cfg
        self.job_manager = jobs  # not `jobs`: that is a method
        self.queue = queue
        self.registry = registry
        self.owner = owner
        self.device = device
        self.thermal = thermal
        self.errors = errors
        self.snapshot = snapshot  # the metrics snapshot
        self.connections = connections
        self.started_mono = started_mono
        self.gemm_site = gemm_site  # where the loaded models' GEMMs run, and why: ("npu" | "host", reason)
        self.other_holders = other_holders  # other processes with the NPU open, as last checked
        self.cache = cache  # npud's cache directory and whether it is used ({"dir", "trusted", "reason"})
        self.power_mode = power_mode  # the NPU's power mode: wanted, current, and what kept it (npud/device.py)
        self.lifecycle = Lifecycle(registry, owner, jobs, queue)  # models.load / unload, keep-alive
        self.methods: dict[str, Callable[["Peer", Params, Emit], Awaitable[object]]] = {
            "hello": self.hello, "submit": self.submit, "complete": self.complete, "stream": self.stream,
            "result": self.result, "status": self.status, "jobs": self.jobs, "cancel": self.cancel,
            "tickets": self.tickets, "cache.list": self.cache_list, "cache.pin": self.cache_pin,
            "cache.drop": self.cache_drop, "device.status": self.device_status, "device.clear": self.device_clear,
            "models": self.models, "stats": self.stats, "metrics": self.metrics,
            "tokenize": self.tokenize, "detokenize": self.detokenize,
            "models.load": self.models_load, "models.unload": self.models_unload,
        }

    async def __call__(self, peer: "Peer", req: Request, emit: Emit) -> object:
        method = self.methods.get(req.method)
        if method is None:
            raise ApiError(ErrorCode.UNKNOWN_METHOD, f"no method {req.method[:64]!r}; methods: {sorted(self.methods)}")
        try:
            return await method(peer, Params(req.params), emit)
        except StoreError as exc:
            raise store_api_error(exc) from None

    # -- session -------------------------------------------------------------------------

    async def hello(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        client = p.str("client", None, max_len=128)
        p.finish()
        log.info("client_hello", client=client, uid=peer.uid, pid=peer.pid)
        cfg = self.cfg
        limits = cfg.limits
        return {
            "protocol": PROTOCOL_VERSION, "daemon": "npud", "version": __version__, "uid": peer.uid,
            "admin": peer.caller.admin, "models": list(self.registry.names),
            "default_model": cfg.default_model_name,
            "device": {"kind": self.device.kind, "reason": self.device.reason},
            "limits": {"max_line_bytes": limits.max_line_bytes, "max_prompt_tokens": limits.max_prompt_tokens,
                       "max_tokens": limits.max_tokens, "max_prompts_per_job": limits.max_prompts_per_job,
                       "max_queued_jobs_per_user": limits.max_queued_jobs_per_user,
                       "max_queued_bytes_per_user": limits.max_queued_bytes_per_user},
        }

    # -- jobs ----------------------------------------------------------------------------

    def _spec(self, p: Params, *, single: bool):
        cfg = self.cfg
        return parse_spec(p, limits=cfg.limits, models=self.registry.names, default_model=cfg.default_model_name,
                          single=single)

    async def submit(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        spec = self._spec(p, single=False)
        priority = Priority.parse(p.str("priority", "batch", choices=("batch", "interactive")))
        key = p.str("idempotency_key", None, nonempty=True, max_len=MAX_KEY_CHARS)
        keep_alive = parse_keep_alive(p)
        p.finish()
        self.registry.touch(spec.model, keep_alive)
        if key is not None:  # a retry of a submit whose reply was lost gets the job it made
            status = await self.job_manager.submit_once(peer.caller, spec, priority, key)
        else:
            status = (await self.job_manager.submit(peer.caller, spec, priority))[0].status()
        return {**status, "queue_position": self.queue.position(status["job"])}

    def single_spec(self, params: dict) -> JobSpec:
        """The spec of a one-prompt job from `complete`'s params (the HTTP front end's requests
        are translated into these); raises ApiError naming the parameter."""
        p = Params(params)
        spec = self._spec(p, single=True)
        keep_alive = parse_keep_alive(p)
        p.finish()
        self.registry.touch(spec.model, keep_alive)
        return spec

    async def complete(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        spec = self._spec(p, single=True)
        keep_alive = parse_keep_alive(p)
        p.finish()
        self.registry.touch(spec.model, keep_alive)
        return await self.run_single(peer, spec, Priority.INTERACTIVE, emit)

    async def run_single(self, peer: "Peer", spec: JobSpec, priority: Priority, emit: Emit) -> dict:
        """Run a one-prompt job for a client that waits for it (`complete`, and every HTTP
        request): its events go to `emit` as they come; the job is cancelled when the caller is
        cancelled (its client went away) or falls behind. Returns the job's result."""
        if self.queue.quarantine_blocks:
            raise ApiError(ErrorCode.DEVICE_QUARANTINED,
                           f"the device is quarantined ({self.queue.quarantine.reason}); "
                           "an operator clears it with `npuctl device clear`")
        await self._refuse_early(peer, spec)
        jobs = self.job_manager
        job, sub = await jobs.submit(peer.caller, spec, priority, interactive=True, subscribe=True)
        try:
            async for name, data in sub.receive:
                if name != "progress":
                    await emit(name, data)
            if sub.lagged:
                raise ApiError(ErrorCode.OVERLOADED, "the stream fell behind; its job is being cancelled")
        finally:
            if not job.finished.is_set():  # the client went away or fell behind: nobody wants the rest
                await jobs.cancel_job(job)
        if job.error is not None:
            raise job.error
        result = jobs.result(job)
        if result is None:  # cancelled before its first round
            return {"job": job.id, "prompt": 0, "text": "", "token_ids": [], "prompt_tokens": 0,
                    "finish_reason": "cancelled", "stats": {}}
        if "error" in result:
            raise ApiError(result["error"]["code"], result["error"]["message"])
        return {"job": job.id, **result}

    async def _refuse_early(self, peer: "Peer", spec: JobSpec) -> None:
        """Refuse a one-prompt request whose prompt cannot run before it becomes a job (nothing
        stored, no ticket, no device time): a chat its model's template refuses, a prompt that
        encodes to nothing, a suffix for a model without FIM tokens, a prompt longer than
        limits.max_prompt_tokens. Only with the model loaded (tokenizing needs it, and a load
        is a job's work); for a model not loaded yet the job reports these as before.
        Raises ApiError with the engine's code."""
        served = self.registry.resident(spec.model)
        if served is None:
            return
        try:
            num_tokens = await self.owner.engine_call(served.count_prompt_tokens, spec.engine_request(0, peer.caller.uid))
        except EngineError as exc:
            raise api_error(exc) from None
        limit = self.cfg.limits.max_prompt_tokens
        if num_tokens > limit:
            raise ApiError(ErrorCode.PROMPT_TOO_LONG,
                           f"the prompt has {num_tokens} tokens, more than limits.max_prompt_tokens = {limit}")

    def _job_param(self, p: Params, required: bool = True) -> int | None:
        """`job`: a job id, or the opaque reference an HTTP reply named it by (npud/jobref.py)."""
        value = p.raw("job")
        if isinstance(value, str):
            job_id = self.job_manager.refs.job_id(value)
            if job_id is None:
                raise p.bad("job", "expected a job id or a job reference (16 hex digits)")
            if not 0 < job_id <= INT64_MAX:  # 16 hex digits npud did not make: no job, as any other
                raise ApiError(ErrorCode.NOT_FOUND, f"no job {value}")
            return job_id
        return p.int("job", min=1) if required else p.int("job", None, min=1)

    async def stream(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = self._job_param(p)
        tokens = p.bool("tokens", True)
        p.finish()
        jobs = self.job_manager
        status = await jobs.status(peer.caller, job_id)
        job = jobs.active.get(job_id)
        if job is None:  # already ended (or ended while we looked)
            return await jobs.status(peer.caller, job_id) if status["state"] in ("queued", "running") else status
        sub = jobs.subscribe(job)
        # read before any await: a load that starts later reaches sub itself
        loading = job.loading_model
        loading_progress = None if loading is None else self.registry.loading_progress(loading)
        try:
            await emit("progress", {"done_prompts": len(job.done_prompts), "num_prompts": job.spec.num_prompts,
                                    "state": job.state.value})
            if loading is not None:  # a load that began before this stream did
                await emit("model_loading", {"model": loading})
                if loading_progress is not None:  # and how far it is
                    await emit("model_load_progress", {"model": loading, **loading_progress})
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
        job_id = self._job_param(p)
        prompts = p.list("prompts", None, max_items=100_000)
        if prompts is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT64_MAX
                                           for i in prompts):
            raise p.bad("prompts", f"expected a list of integers in [0, {INT64_MAX}]")
        p.finish()
        return await self.job_manager.results(peer.caller, job_id, prompts)

    async def status(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = self._job_param(p)
        p.finish()
        return await self.job_manager.status(peer.caller, job_id)

    async def jobs(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        states = p.choices_list("state", None, choices=JOB_STATES)
        all_users = p.bool("all_users", False)
        limit = p.int("limit", 50, min=1, max=MAX_LIST)
        before = p.int("before", None, min=1)
        p.finish()
        return {"jobs": await self.job_manager.list(peer.caller, states=states, all_users=all_users, limit=limit,
                                               before=before)}

    async def cancel(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = self._job_param(p)
        p.finish()
        return await self.job_manager.cancel(peer.caller, job_id)

    async def tickets(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        job_id = self._job_param(p, required=False)
        state = p.str("state", None, choices=tuple(s.value for s in TicketState))
        outcome = p.str("outcome", None, choices=tuple(o.value for o in Outcome))
        since = p.number("since", None)
        until = p.number("until", None)
        limit = p.int("limit", 100, min=1, max=MAX_LIST)
        p.finish()
        return {"tickets": await self.job_manager.tickets(peer.caller, job_id=job_id, state=state, outcome=outcome,
                                                     since=since, until=until, limit=limit)}

    # -- prefix cache --------------------------------------------------------------------

    @staticmethod
    def _check_cache(name: str, served: ServedModel) -> None:
        if not served.has_prefix_cache:
            raise ApiError(ErrorCode.UNSUPPORTED, f"model {name!r} has no prefix cache")

    async def cache_list(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        model = p.str("model", None)
        p.finish()
        registry = self.registry
        names = [registry.entry(model).name] if model is not None else list(registry.names)
        out = []
        for name in names:
            served = registry.resident(name)
            if served is None or not served.has_prefix_cache:
                continue
            info = await self.owner.engine_call(served.cache_info)
            if not peer.caller.admin:  # counters of every user's lookups: an operator's business
                info = {"pins": info["pins"]}
            out.append({"model": name, **info})
        return {"models": out}

    async def cache_pin(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "cache.pin")
        model = p.str("model", self.cfg.default_model_name)
        name = p.str("name", nonempty=True, max_len=128)
        key = p.str("key", None, nonempty=True, max_len=256)
        text = p.str("text", None, nonempty=True)
        p.finish()
        if (key is None) == (text is None):
            raise ApiError(ErrorCode.BAD_REQUEST, "params: give exactly one of 'key' and 'text'")
        if text is not None and self.queue.quarantine_blocks:
            raise ApiError(ErrorCode.DEVICE_QUARANTINED, "the device is quarantined; clear it first")
        registry, owner = self.registry, self.owner
        registry.entry(model)
        served = await owner.engine_call(registry.get, model, keep=owner.models_in_use())
        self._check_cache(model, served)
        try:
            pinned = await owner.engine_call(functools.partial(served.cache_pin, name, key=key, text=text))
        except EngineError as exc:  # NotFound: no such key; RequestError: the text cannot be pinned
            raise api_error(exc) from None
        log.info("cache_pinned", model=model, name=name, key=pinned)
        return {"model": model, "entry": {"name": name, "key": pinned}}

    async def cache_drop(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "cache.drop")
        model = p.str("model", self.cfg.default_model_name)
        key = p.str("key", nonempty=True, max_len=256)
        p.finish()
        self.registry.entry(model)
        served = self.registry.resident(model)
        if served is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"model {model!r} is not loaded, so its cache has no entry {key!r}")
        self._check_cache(model, served)
        if not await self.owner.engine_call(served.cache_drop, key):
            raise ApiError(ErrorCode.NOT_FOUND, f"no cache entry {key!r} in model {model!r}")
        log.info("cache_dropped", model=model, key=key)
        return {"model": model, "dropped": True}

    # -- the tokenizer ---------------------------------------------------------------------

    async def served(self, name: str | None) -> ServedModel:
        """The loaded model `name` (a configured one), loaded first when it is not resident."""
        return await self.lifecycle.load(name)

    async def tokenize_text(self, model: str | None, text: str, *, add_special: bool, with_pieces: bool) -> dict:
        """{"model", "tokens"}: ids, or {"id", "piece"} with the piece a string when its bytes are
        UTF-8, else the list of its bytes (llama.cpp's shape). The tokenizer runs in a worker
        thread beside any round: a long text does not hold up the event loop."""
        served = await self.served(model)

        def run() -> list:
            ids = served.tokenize(text, add_special=add_special)
            if not with_pieces:
                return ids
            return [{"id": i, "piece": piece_json(served.token_bytes(i))} for i in ids]

        return {"model": served.name, "tokens": await trio.to_thread.run_sync(run)}

    async def detokenize_ids(self, model: str | None, ids: list[int]) -> dict:
        served = await self.served(model)
        try:
            return {"model": served.name, "content": await trio.to_thread.run_sync(served.detokenize, ids)}
        except EngineError as exc:  # an id outside the vocabulary
            raise api_error(exc) from None

    async def tokenize(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        model = p.str("model", self.cfg.default_model_name)
        text = p.str("text")
        add_special = p.bool("add_special", False)
        with_pieces = p.bool("with_pieces", False)
        p.finish()
        return await self.tokenize_text(model, text, add_special=add_special, with_pieces=with_pieces)

    async def detokenize(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        model = p.str("model", self.cfg.default_model_name)
        ids = token_ids(p, "tokens")
        p.finish()
        return await self.detokenize_ids(model, ids)

    # -- device, models, stats -----------------------------------------------------------

    async def device_status(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        p.finish()
        q = self.queue.quarantine
        site, why = self.gemm_site()
        quarantine = None if q is None else q.to_wire()
        if quarantine is not None and not peer.caller.admin:  # the faulted job may be another user's
            job = self.job_manager.active.get(q.job) if q.job is not None else None
            if job is None or job.owner_uid != peer.uid:
                quarantine = {**quarantine, "job": None, "ticket": None}
        errors = self.errors.to_wire()
        if not peer.caller.admin:  # other processes' kernel-log lines: the admins' to read, like dmesg
            errors["foreign_lines"] = []
        return {**self.device.to_wire(), "quarantine": quarantine,
                "thermal": self.thermal.to_wire(), "errors": errors,
                "gemms": {"site": site, "reason": why}, "other_holders": self.other_holders(), "cache": self.cache,
                "power_mode": self.power_mode()}

    async def device_clear(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        _require_admin(peer, "device.clear")
        p.finish()
        cleared = await self.owner.clear_quarantine()
        log.info("device_clear_requested", uid=peer.uid, cleared=cleared)
        return {"cleared": cleared}

    async def models(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        p.finish()
        return {"models": self.registry.describe()}

    def _described(self, name: str) -> dict:
        return next(m for m in self.registry.describe() if m["name"] == name)

    async def models_load(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        """Load a model now (any user: a request of theirs would load it too); `keep_alive` sets
        how long it stays once idle."""
        name = p.str("model", self.cfg.default_model_name)
        keep_alive = parse_keep_alive(p)
        p.finish()
        started = time.perf_counter()
        loaded_before = self.registry.resident(name or "") is not None
        await self.lifecycle.load(name, keep_alive)
        log.info("model_load_requested", model=name, uid=peer.uid, was_loaded=loaded_before)
        return {**self._described(name), "load_ms": None if loaded_before else
                round((time.perf_counter() - started) * 1000, 1)}

    async def models_unload(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        """Unload a model no job is using (admins: it makes every user's next request load it again)."""
        _require_admin(peer, "models.unload")
        name = p.str("model")
        p.finish()
        unloaded = await self.lifecycle.unload(name)
        log.info("model_unload_requested", model=name, uid=peer.uid, unloaded=unloaded)
        return {**self._described(name), "unloaded": unloaded}

    def _visible(self, peer: "Peer", granted: dict | None) -> dict | None:
        """The device holder as `peer` may see it: another user's job and ticket are hidden
        from non-admins (only that the device is held, and at which priority)."""
        if granted is None or peer.caller.admin:
            return granted
        job = self.job_manager.active.get(granted["job"])
        if job is not None and job.owner_uid == peer.uid:
            return granted
        return {"ticket": None, "job": None, "priority": granted["priority"], "state": "granted"}

    def _snapshot(self, peer: "Peer") -> dict:
        # a non-admin's own counters: every user's would tell of others' work (and whether
        # another's prompt hit the prefix cache, of the cache)
        snap = self.snapshot(None if peer.caller.admin else peer.uid)
        return {**snap, "holding": self._visible(peer, snap["holding"])}

    async def stats(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        """Every user's counters to an admin; a non-admin's own jobs' (docs/protocol.md)."""
        p.finish()
        owner = None if peer.caller.admin else peer.uid
        jobs, tickets = await self.job_manager.counts(owner)
        granted = self.queue.granted
        snap = self._snapshot(peer)
        return {
            "uptime_s": round(time.monotonic() - self.started_mono, 3), "version": __version__,
            "connections": snap["connections"], "jobs": jobs, "tickets": tickets,
            "tokens_generated": snap["tokens"]["generated"], "queue": self.queue.counts(owner),
            "granted": self._visible(peer, None if granted is None else granted.to_wire()),
            "quarantined": self.queue.quarantine is not None,
            "store": self.job_manager.store_status(owner),
            "metrics": snap,
        }

    async def metrics(self, peer: "Peer", p: Params, emit: Emit) -> dict:
        fmt = p.str("format", "json", choices=("json", "prometheus"))
        p.finish()
        snap = self._snapshot(peer)
        if fmt == "prometheus":
            return {"format": "prometheus", "text": render_prometheus(snap)}
        return snap
