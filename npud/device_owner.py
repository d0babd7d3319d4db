"""The device owner: the one task that drives the engine, a round at a time, inside tickets.

For each granted ticket it runs the job's prompts through `Session.run_round` in a worker
thread, and between two rounds (a round boundary) it asks the queue whether to yield, and
the job whether it was cancelled. The amdxdna error count is read at grant, before each
result is committed, and at release; a count that grew faults the ticket, quarantines the
device and requeues the job with nothing of the faulted work kept. A device call that
fails inside a round (the engine's DeviceFault: an NPU run that timed out, aborted or
raised) takes the same path.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import trio

from engine.api import DeviceFault, EngineError, FinishReason, GenerationResult, ServedModel, Session
from npud.config import DaemonConfig
from npud.guards import ErrorCountGuard, ThermalGuard
from npud.jobs import Job, JobManager, store_api_error
from npud.jobspec import api_error
from npud.logprobs import wire_list
from npud.metrics import Metrics
from npud.protocol import ApiError, ErrorCode
from npud.registry import ModelRegistry
from npud.store import StoreError
from npud.tickets import Outcome, Quarantine, Ticket, TicketQueue, YieldReason

log = structlog.get_logger(__name__)

QUARANTINE_KEY = "quarantine"
NPU_RUN_FAILED = "npu_run_failed"  # a ticket's fault reason: a device call failed inside a round
T = TypeVar("T")


def jsonable(value: object) -> object:
    """Engine stats as JSON: numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, str)) or value is None:
        return value
    if hasattr(value, "item") and not isinstance(value, (int, float)):  # a numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    return str(value)


def result_body(result: GenerationResult) -> dict:
    """A finished prompt as its stored and sent result."""
    return {"text": result.text, "token_ids": [int(t) for t in result.token_ids],
            "prompt_tokens": int(result.prompt_tokens), "finish_reason": str(result.finish_reason),
            "max_tokens_clamped_to": result.max_tokens_clamped_to, "stats": jsonable(dict(result.stats)),
            **({} if result.logprobs is None else {"logprobs": wire_list(result.logprobs)})}


def prompt_error(exc: Exception) -> ApiError:
    """The error recorded for one prompt that failed with `exc`: an ApiError or an engine error
    as it is; anything else is an engine bug, logged with its traceback and shown to the client
    as internal_error with a plain message (no exception text, no paths)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        return api_error(exc)
    log.error("prompt_failed", exc_info=exc)
    return ApiError(ErrorCode.INTERNAL_ERROR, "the engine failed on this prompt; the daemon log has the details")


class DeviceOwner:
    def __init__(self, cfg: DaemonConfig, queue: TicketQueue, jobs: JobManager, registry: ModelRegistry,
                 thermal: ThermalGuard, errors: ErrorCountGuard, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.queue = queue
        self.jobs = jobs
        self.registry = registry
        self.thermal = thermal
        self.errors = errors
        self.device_lock = trio.Lock()  # all engine work: rounds, loads, prefix-cache operations
        self.holding: Ticket | None = None
        self.fw_version: str | None = None  # the NPU firmware (sysfs fw_version), in every ticket's record
        self._idle = trio.Event()
        self._idle.set()

    async def engine_call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run blocking engine work in a thread, one piece at a time."""
        async with self.device_lock:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), abandon_on_cancel=True)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            ticket = await self.queue.wait_grant()
            self.holding = ticket
            self._idle = trio.Event()
            try:
                await self.hold(ticket)
            finally:
                self.holding = None
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def hold(self, ticket: Ticket) -> None:
        job = self.jobs.active[ticket.job_id]
        ticket.errors_at_grant = self.errors.poll()
        ticket.thermal_c = self.thermal.reading_c
        ticket.fw_version = self.fw_version
        with structlog.contextvars.bound_contextvars(job=job.id, ticket=ticket.id):
            log.info("ticket_granted", priority=ticket.priority.label, thermal_c=ticket.thermal_c,
                     waited_ms=round((ticket.granted_at - ticket.queued_at) * 1000, 1))
            outcome, reason, yielded = Outcome.FAILED, None, None
            try:
                await self.jobs.on_granted(job, ticket)
                outcome, reason, yielded = await self._work(job, ticket)
            except ApiError as exc:
                job.error, outcome, reason = exc, Outcome.FAILED, exc.code
            except StoreError as exc:  # a result that could not be committed
                job.error = store_api_error(exc)
                outcome, reason = Outcome.FAILED, job.error.code
            except trio.Cancelled:
                outcome, reason, yielded = Outcome.PREEMPTED, YieldReason.SHUTDOWN.value, YieldReason.SHUTDOWN
                raise
            except Exception as exc:
                if isinstance(exc, DeviceFault):  # the round is void: nothing of it was committed
                    log.error("device_run_failed", error=str(exc))
                    outcome, reason, yielded = Outcome.FAULTED, NPU_RUN_FAILED, None
                    ticket.fault_lines = (f"{type(exc).__name__}: {exc}",)
                else:
                    log.exception("device_owner_error")
                    job.error = ApiError(ErrorCode.INTERNAL_ERROR, "the job failed in the daemon; its log has the details")
                    outcome, reason = Outcome.FAILED, ErrorCode.INTERNAL_ERROR.value
            finally:
                with trio.CancelScope(shield=True):
                    ticket.errors_at_release = self.errors.poll()
                    if ticket.errors_at_release > ticket.errors_at_grant:
                        if outcome is not Outcome.FAULTED:
                            reason = "amdxdna_errors"
                        outcome, yielded = Outcome.FAULTED, None
                        ticket.fault_lines += tuple(self.errors.lines_since(ticket.errors_at_grant))
                    if outcome is Outcome.FAULTED:
                        job.error = None  # whatever failed, the job runs again once the device is cleared
                        await self.quarantine(job, ticket, reason)
                    self.queue.release(ticket, outcome, reason)
                    log.info("ticket_released", outcome=outcome.value, reason=reason, tokens=ticket.tokens,
                             held_ms=round((ticket.released_at - ticket.granted_at) * 1000, 1))
                    await self.jobs.on_released(job, ticket, yielded)

    async def _work(self, job: Job, ticket: Ticket) -> tuple[Outcome, str | None, YieldReason | None]:
        """Run the job's prompts until it is done or must yield; returns (outcome, reason, yielded).

        A prompt that fails (an engine error, or an exception the engine should not have raised)
        gets that failure as its result and the next prompt runs."""
        served = await self._model(job)
        while (prompt := job.next_prompt()) is not None:
            session = job.session if job.session_prompt == prompt else None
            if session is None and job.cancel_requested:
                return Outcome.CANCELLED, None, None
            try:
                if session is None:
                    session = await self.engine_call(self._start, served, job, prompt)
                    job.session, job.session_prompt = session, prompt
                while not session.done:
                    if job.cancel_requested:
                        session.cancel()  # the next round ends the session with finish_reason "cancelled"
                    else:
                        yielded = self.queue.should_yield(ticket)
                        if yielded is not None:
                            return Outcome.PREEMPTED, yielded.value, yielded
                    events = await self.engine_call(session.run_round)
                    if events:
                        # an event without a token id releases held-back text at the end of a run
                        token_ids = [int(e.token_id) for e in events if e.token_id is not None]
                        self.jobs.count_tokens(job, ticket, len(token_ids))
                        data = {"prompt": prompt, "text": "".join(e.text for e in events), "token_ids": token_ids}
                        if any(e.logprob is not None for e in events):  # the request asked for them
                            data["logprobs"] = wire_list(e.logprob for e in events)
                        self.jobs.publish(job, "token", data)
                result = session.result()
            except DeviceFault:  # the device failed, not the prompt: the round is void and the ticket faults
                job.session = job.session_prompt = None
                raise
            except Exception as exc:  # this prompt cannot run; the others still can
                job.session = job.session_prompt = None
                if self.errors.poll() > ticket.errors_at_grant:
                    return Outcome.FAULTED, "amdxdna_errors", None  # the device erred: the prompt runs again
                await self.jobs.commit_result(job, prompt, {"error": prompt_error(exc).to_wire()}, 0)
                continue
            job.session = job.session_prompt = None
            if self.errors.poll() > ticket.errors_at_grant:
                return Outcome.FAULTED, "amdxdna_errors", None  # not committed: made while the device erred
            body = result_body(result)
            self._account(job, ticket, prompt, body["stats"])
            await self.jobs.commit_result(job, prompt, body, len(body["token_ids"]))
            if result.finish_reason == FinishReason.CANCELLED:
                return Outcome.CANCELLED, None, None
        return Outcome.DONE, None, None

    async def _model(self, job: Job) -> ServedModel:
        """The job's model, loaded if it is not resident. A load is told to the job's followers
        (`model_loading`, then `model_loaded` with its time) so that clients show it as such,
        not as slow generation."""
        name = job.spec.model
        if self.registry.resident(name) is not None:
            return await self.engine_call(self.registry.get, name, keep=self.models_in_use())
        self.jobs.publish(job, "model_loading", {"model": name})
        job.loading_model, started = name, time.perf_counter()
        try:
            served = await self.engine_call(self.registry.get, name, keep=self.models_in_use())
        finally:
            job.loading_model = None
        self.jobs.publish(job, "model_loaded", {"model": name,
                                                "load_ms": round((time.perf_counter() - started) * 1000, 1)})
        return served

    def _start(self, served: ServedModel, job: Job, prompt: int) -> Session:
        """Check the prompt's length and start its session (blocking; in the engine thread).

        Raises ApiError(prompt_too_long), EngineError, or whatever an engine bug raises."""
        limit = self.cfg.limits.max_prompt_tokens
        request = job.spec.engine_request(prompt, job.owner_uid)
        num_tokens = served.count_prompt_tokens(request)
        if num_tokens > limit:
            raise ApiError(ErrorCode.PROMPT_TOO_LONG,
                           f"the prompt has {num_tokens} tokens, more than limits.max_prompt_tokens = {limit}")
        return served.start(request)

    def _account(self, job: Job, ticket: Ticket, prompt: int, stats: dict) -> None:
        ticket.drafted += int(stats.get("drafted") or 0)
        ticket.accepted += int(stats.get("accepted") or 0)
        if self.metrics is not None:
            self.metrics.on_prompt(stats, job.owner_uid)
        if stats.get("fell_back"):
            log.info("spec_fallback", prompt=prompt, fallbacks=stats.get("fallbacks"))
        cached = stats.get("num_cached_tokens")
        if cached is not None:
            log.info("cache_hit" if cached else "cache_miss", prompt=prompt, num_cached_tokens=cached)

    def models_in_use(self) -> set[str]:
        """Models that must stay loaded: those with a session kept across preemption."""
        return {j.spec.model for j in self.jobs.active.values() if j.session is not None}

    # -- quarantine ----------------------------------------------------------------------

    async def quarantine(self, job: Job, ticket: Ticket, reason: str | None = None) -> None:
        grown = ticket.errors_at_release - ticket.errors_at_grant
        why = [f"{grown} amdxdna error line(s)"] if grown else []
        if reason == NPU_RUN_FAILED:
            why.insert(0, f"an NPU run failed ({ticket.fault_lines[0]})")
        q = Quarantine(since=self.jobs.wall(), reason=f"{' and '.join(why)} during ticket {ticket.id}",
                       ticket=ticket.id, job=job.id, lines=ticket.fault_lines)
        log.error("guard_device_fault", errors_at_grant=ticket.errors_at_grant,
                  errors_at_release=ticket.errors_at_release, lines=list(ticket.fault_lines))
        self.queue.set_quarantine(q)
        log.error("device_quarantined", reason=q.reason)
        try:
            await self._save_quarantine(q.to_wire())
        except StoreError as exc:  # the quarantine holds in memory; only a restart would forget it
            log.error("store_write_failed", code=exc.code, message=exc.message)

    async def clear_quarantine(self) -> bool:
        if self.queue.quarantine is None:
            return False
        await self._save_quarantine(None)  # first: a clear that is not recorded would come back on restart
        self.queue.set_quarantine(None)
        log.warning("device_cleared")
        return True

    async def _save_quarantine(self, value: dict | None) -> None:
        await self.jobs.set_device_state(QUARANTINE_KEY, value)

    async def restore_quarantine(self) -> None:
        value = await self.jobs.device_state(QUARANTINE_KEY)
        if value is not None:
            self.queue.set_quarantine(Quarantine(value["since"], value["reason"], value["ticket"], value["job"],
                                                 tuple(value["lines"])))
            log.error("device_quarantined", reason=value["reason"], restored=True)
