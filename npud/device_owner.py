"""The device owner: the one task that drives the engine, a round at a time, inside tickets.

For each granted ticket it runs the job's prompts through `Session.run_round` in a worker
thread, and between two rounds (a round boundary) it asks the queue whether to yield, and
the job whether it was cancelled. The amdxdna error count is read at grant, before each
result is committed, and at release; a count that grew faults the ticket, quarantines the
device and requeues the job with nothing of the faulted work kept. A device call that
fails inside a round (the engine's DeviceFault: an NPU run that timed out, aborted or
raised, an NPU worker that died or hung) takes the same path, and the models loaded for the
NPU are unloaded: with backend "auto" they load again on the host and the queue goes on
granting (the quarantine says `host_fallback`), so the job finishes on the host; with "xrt"
they wait for the clear. Under "auto" an error count that grew (driver lines that name npud's
own processes, npud/guards.py) while a model ran on the NPU falls back to the host the same
way. Clearing the quarantine unloads them again, for the NPU.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import trio

from npud.engine.api import DeviceFault, EngineError, GenerationResult, ServedModel
from npud.batch import Kind, RunningBatch
from npud.config import DaemonConfig
from npud.guards import ErrorCountGuard, ThermalGuard
from npud.jobs import Job, JobManager, JobState, Sequence, store_api_error
from npud.jobspec import api_error
from npud.logprobs import wire_list
from npud.metrics import Metrics
from npud.protocol import ApiError, ErrorCode
from npud.registry import ModelRegistry
from npud.store import StoreError
from npud.tickets import Outcome, Priority, Quarantine, Ticket, TicketQueue, YieldReason

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


_ENDED = {JobState.DONE: Outcome.DONE, JobState.CANCELLED: Outcome.CANCELLED, JobState.FAILED: Outcome.FAILED}


def ended_outcome(ticket: Ticket, ended: list[tuple[Job, JobState]]) -> tuple[Outcome, str | None, None]:
    """A ticket that ends because nothing rides it any more ends as its own job did when that
    job ended it, else as the first job that did (done when none did now)."""
    if not ended:
        return Outcome.DONE, None, None
    job, state = next(((j, s) for j, s in ended if j.id == ticket.job_id), ended[0])
    reason = job.error.code if state is JobState.FAILED and job.error is not None else None
    return _ENDED[state], reason, None


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
        lead = self.jobs.active[ticket.job_id]
        batch = RunningBatch(ticket, lead)
        ticket.errors_at_grant = self.errors.poll()
        ticket.thermal_c = self.thermal.reading_c
        ticket.fw_version = self.fw_version
        with structlog.contextvars.bound_contextvars(job=lead.id, ticket=ticket.id):
            log.info("ticket_granted", priority=ticket.priority.label, thermal_c=ticket.thermal_c,
                     waited_ms=round((ticket.granted_at - ticket.queued_at) * 1000, 1))
            outcome, reason, yielded = Outcome.FAILED, None, None
            try:
                await self.jobs.on_granted(lead, ticket)
                outcome, reason, yielded = await self._work(batch)
            except (ApiError, StoreError) as exc:  # the model did not load, or the store failed
                error = exc if isinstance(exc, ApiError) else store_api_error(exc)
                for job in batch.jobs:
                    job.error = error
                outcome, reason = Outcome.FAILED, error.code
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
                    for job in batch.jobs:
                        job.error = ApiError(ErrorCode.INTERNAL_ERROR,
                                             "the job failed in the daemon; its log has the details")
                    outcome, reason = Outcome.FAILED, ErrorCode.INTERNAL_ERROR.value
            finally:
                with trio.CancelScope(shield=True):
                    await self._release(batch, outcome, reason, yielded)

    async def _release(self, batch: RunningBatch, outcome: Outcome, reason: str | None,
                       yielded: YieldReason | None) -> None:
        """End the hold: a grown error count faults it; every rider still in the batch is
        requeued (or finished with the ticket's outcome), the jobs that ended it are finished."""
        ticket = batch.ticket
        ticket.errors_at_release = self.errors.poll()
        if ticket.errors_at_release > ticket.errors_at_grant:
            if outcome is not Outcome.FAULTED:
                reason = "amdxdna_errors"
            outcome, yielded = Outcome.FAULTED, None
            ticket.fault_lines += tuple(self.errors.lines_since(ticket.errors_at_grant))
        if outcome is Outcome.FAULTED:
            for job in batch.jobs:
                job.error = None  # whatever failed, the job runs again once the device is cleared
            await self.quarantine(ticket, reason)
        self.queue.release(ticket, outcome, reason)
        log.info("ticket_released", outcome=outcome.value, reason=reason, tokens=ticket.tokens,
                 jobs=len(ticket.jobs), sequences=len(ticket.sequences),
                 held_ms=round((ticket.released_at - ticket.granted_at) * 1000, 1))
        for job, state in batch.ended:
            await self.jobs.finish(job, state, ticket=ticket)
        for job in batch.jobs:
            await self.jobs.on_released(job, ticket, yielded)

    async def _work(self, batch: RunningBatch) -> tuple[Outcome, str | None, YieldReason | None]:
        """Run rounds of the batch until nothing rides it or it must yield; returns (outcome,
        reason, yielded). Each round boundary: the error count, cancellations, joins, the jobs
        that ended, the queue's question (yield?), then one batched engine round."""
        ticket = batch.ticket
        served = await self._model(batch.jobs[0])
        while True:  # the error count was read at grant and after each round (_round)
            for job in batch.jobs:
                if job.cancel_requested:
                    for seq in job.sequences.values():
                        seq.session.cancel()  # its next round ends it with finish_reason "cancelled"
            if not (self.queue.stopping or self.queue.thermal_abort):
                if not await self._fill(batch, served):
                    return Outcome.FAULTED, "amdxdna_errors", None
            ended = batch.take_ended()
            if not batch.jobs:  # nothing rides the ticket any more: it ends with the jobs that ended now
                batch.ended = ended
                return ended_outcome(ticket, ended)
            for job, state in ended:  # the batch goes on without them
                await self.jobs.finish(job, state)
            yielded = self.queue.should_yield(ticket, batch.priority())
            if yielded is YieldReason.INTERACTIVE_WAITING:
                # queued while the ended jobs were finished (an await after the fill): it joins
                # now if it can, as it would have at the fill, rather than preempt the batch
                if not await self._fill(batch, served):
                    return Outcome.FAULTED, "amdxdna_errors", None
                yielded = self.queue.should_yield(ticket, batch.priority())
            if yielded is not None:
                return Outcome.PREEMPTED, yielded.value, yielded
            if not batch.running:
                raise RuntimeError(f"jobs {[j.id for j in batch.jobs]} ride ticket {ticket.id} with nothing to run")
            if not await self._round(batch, served):
                return Outcome.FAULTED, "amdxdna_errors", None

    def _errors_grew(self, ticket: Ticket) -> bool:
        return self.errors.poll() > ticket.errors_at_grant

    async def _fill(self, batch: RunningBatch, served: ServedModel) -> bool:
        """Fill the batch from the best candidates while they fit (npud/batch.py); returns False
        when the device erred meanwhile (the ticket faults)."""
        limits = self.cfg.batching
        may_join = not self.queue.thermal_hold
        while candidates := batch.candidates(self.queue.queued(), self.jobs.active, limits, may_join=may_join):
            cand = candidates[0]
            job = cand.job
            if cand.kind is Kind.KEPT:
                positions = cand.sequence.positions
            else:
                prompt = cand.prompt if cand.kind is Kind.NEXT else min(job.sequences, default=job.next_prompt())
                positions = 0 if prompt is None else await self._positions(batch, served, job, prompt,
                                                                           committing=cand.kind is Kind.NEXT)
                if positions is None:  # the prompt failed: its error is its result
                    if self._errors_grew(batch.ticket):
                        return False
                    continue
            if not batch.fits(positions, limits, job.priority, served.round_cost):
                if job.priority is Priority.INTERACTIVE:
                    for seq in batch.set_aside_for(positions, limits, served.round_cost):
                        log.info("sequence_set_aside", set_aside_job=seq.job.id, prompt=seq.prompt, for_job=job.id)
                if not batch.fits(positions, limits, job.priority, served.round_cost):
                    return True
            if cand.kind is Kind.JOIN:
                self.queue.join(cand.ticket, batch.ticket)
                batch.add_job(job)
                log.info("job_joined_batch", joined_job=job.id, left_ticket=cand.ticket.id,
                         running=len(batch.running))
                await self.jobs.on_joined(job, batch.ticket, cand.ticket)
            elif cand.kind is Kind.KEPT:
                batch.run(cand.sequence)
            else:
                try:
                    session = await self.engine_call(served.start, job.spec.engine_request(prompt, job.owner_uid))
                except DeviceFault:
                    raise
                except Exception as exc:  # this prompt cannot run; the others still can
                    if self._errors_grew(batch.ticket):
                        return False
                    await self._commit(batch, job, prompt, {"error": prompt_error(exc).to_wire()}, 0)
                    continue
                seq = Sequence(job, prompt, session, positions)
                job.sequences[prompt] = seq
                batch.run(seq)
        return True

    async def _positions(self, batch: RunningBatch, served: ServedModel, job: Job, prompt: int, *,
                         committing: bool) -> int | None:
        """The context positions a prompt may fill (measured once per batch). A prompt that
        cannot run gets its error as its result when `committing` (None is returned); a joining
        job's is committed once it rides, so it counts as fitting anything (0)."""
        if prompt in job.sequences:
            return job.sequences[prompt].positions
        key = (job.id, prompt)
        if key not in batch.sizes:  # measured once: tokenizing a long prompt takes a while
            try:
                batch.sizes[key] = await self.engine_call(self._measure, served, job, prompt)
            except DeviceFault:
                raise
            except Exception as exc:
                batch.sizes[key] = exc
        size = batch.sizes[key]
        if not isinstance(size, Exception):
            return size
        if not committing:
            return 0
        await self._commit(batch, job, prompt, {"error": prompt_error(size).to_wire()}, 0)
        return None

    async def _round(self, batch: RunningBatch, served: ServedModel) -> bool:
        """One batched engine round of the running sequences; their events go to their jobs'
        followers and finished ones are committed. Returns False when the device erred during
        it: nothing of the round is published or committed (the ticket faults)."""
        seqs = list(batch.running)
        try:
            results = await self.engine_call(served.run_batch, [s.session for s in seqs],
                                             prefill_budget=self.cfg.batching.prefill_budget)
        except DeviceFault:  # the device failed, not the prompts: the round is void and the ticket faults
            raise
        except Exception as exc:  # an engine bug: the round's sessions are in no known state
            if self._errors_grew(batch.ticket):
                return False
            for seq in seqs:
                batch.remove(seq)
                await self._commit(batch, seq.job, seq.prompt, {"error": prompt_error(exc).to_wire()}, 0)
            return True
        if self._errors_grew(batch.ticket):
            return False  # not committed: made while the device erred
        for seq, events in zip(seqs, results):
            job = seq.job
            if isinstance(events, Exception):  # this prompt's round failed; the others went on
                batch.remove(seq)
                await self._commit(batch, job, seq.prompt, {"error": prompt_error(events).to_wire()}, 0)
                continue
            if events:
                # an event without a token id releases held-back text at the end of a run
                token_ids = [int(e.token_id) for e in events if e.token_id is not None]
                self.jobs.count_tokens(job, batch.ticket, len(token_ids))
                data = {"prompt": seq.prompt, "text": "".join(e.text for e in events), "token_ids": token_ids}
                if any(e.logprob is not None for e in events):  # the request asked for them
                    data["logprobs"] = wire_list(e.logprob for e in events)
                self.jobs.publish(job, "token", data)
            if seq.session.done:
                batch.remove(seq)
                body = result_body(seq.session.result())
                self._account(job, batch.ticket, seq.prompt, body["stats"])
                await self._commit(batch, job, seq.prompt, body, len(body["token_ids"]))
        return True

    async def _commit(self, batch: RunningBatch, job: Job, prompt: int, body: dict, tokens: int) -> None:
        """Commit one prompt's result; a store that fails it fails the job (its sequences leave)."""
        if job.error is not None:
            return
        try:
            await self.jobs.commit_result(job, prompt, body, tokens, batch.ticket)
        except StoreError as exc:
            job.error = store_api_error(exc)
            batch.drop_job(job)

    async def _model(self, job: Job) -> ServedModel:
        """The job's model, loaded if it is not resident. A load is told to the job's followers
        (`model_loading`, then `model_loaded` with its time) so that clients show it as such,
        not as slow generation."""
        name = job.spec.model
        if self.registry.resident(name) is not None:
            return await self.engine_call(self.registry.get, name, keep=self.models_in_use())
        self.jobs.publish(job, "model_loading", {"model": name})
        job.loading_model, started = name, time.perf_counter()
        token = trio.lowlevel.current_trio_token()

        def progress(report: dict) -> None:  # in the loading thread: hand the event to trio's
            try:
                token.run_sync_soon(self._load_progress, job, report)
            except trio.RunFinishedError:  # the daemon has stopped; the load goes on unheard
                pass

        try:
            served = await self.engine_call(self.registry.get, name, keep=self.models_in_use(), progress=progress)
        finally:
            job.loading_model = None
        self.jobs.publish(job, "model_loaded", {"model": name,
                                                "load_ms": round((time.perf_counter() - started) * 1000, 1)})
        return served

    def _load_progress(self, job: Job, report: dict) -> None:
        if job.loading_model == report["model"]:  # not a report that arrives after the load ended
            self.jobs.publish(job, "model_load_progress", report)

    def _measure(self, served: ServedModel, job: Job, prompt: int) -> int:
        """The context positions the prompt may fill: its tokens plus max_tokens, at most the
        model's context (blocking; in the engine thread).

        Raises ApiError(prompt_too_long), EngineError, or whatever an engine bug raises."""
        limit = self.cfg.limits.max_prompt_tokens
        request = job.spec.engine_request(prompt, job.owner_uid)
        num_tokens = served.count_prompt_tokens(request)
        if num_tokens > limit:
            raise ApiError(ErrorCode.PROMPT_TOO_LONG,
                           f"the prompt has {num_tokens} tokens, more than limits.max_prompt_tokens = {limit}")
        return min(num_tokens + request.params.max_tokens, served.max_context)

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
        return {j.spec.model for j in self.jobs.active.values() if j.sequences}

    # -- quarantine ----------------------------------------------------------------------

    async def quarantine(self, ticket: Ticket, reason: str | None = None) -> None:
        grown = ticket.errors_at_release - ticket.errors_at_grant
        why = [f"{grown} amdxdna error line(s)"] if grown else []
        if reason == NPU_RUN_FAILED:
            why.insert(0, f"an NPU run failed ({ticket.fault_lines[0]})")
        # under "auto" a fault of the NPU the models run on (a failed run, or a driver line naming
        # npud's own process) moves them to the host and the grants go on; the NPU itself waits
        # for an operator
        host_fallback = self.cfg.device.backend == "auto" and (reason == NPU_RUN_FAILED or self._models_on_npu())
        q = Quarantine(since=self.jobs.wall(), reason=f"{' and '.join(why)} during ticket {ticket.id}",
                       ticket=ticket.id, job=ticket.job_id, lines=ticket.fault_lines, host_fallback=host_fallback)
        log.error("guard_device_fault", errors_at_grant=ticket.errors_at_grant,
                  errors_at_release=ticket.errors_at_release, lines=list(ticket.fault_lines))
        self.queue.set_quarantine(q)
        log.error("device_quarantined", reason=q.reason, host_fallback=host_fallback)
        if host_fallback:
            await self.engine_call(self._reload_models, "host")
        elif reason == NPU_RUN_FAILED:  # the models' NPU backend is lost: load them afresh after the clear
            await self.engine_call(self._reload_models, self.cfg.device.backend)
        try:
            await self._save_quarantine(q.to_wire())
        except StoreError as exc:  # the quarantine holds in memory; only a restart would forget it
            log.error("store_write_failed", code=exc.code, message=exc.message)

    async def clear_quarantine(self) -> bool:
        if self.queue.quarantine is None:
            return False
        await self._save_quarantine(None)  # first: a clear that is not recorded would come back on restart
        fell_back = self.queue.quarantine.host_fallback
        self.queue.set_quarantine(None)
        if fell_back:  # back to the NPU: the host-loaded models go
            await self.engine_call(self._reload_models, self.cfg.device.backend)
        log.warning("device_cleared")
        return True

    def _models_on_npu(self) -> bool:
        """Whether a loaded model runs its GEMMs through an NPU backend."""
        return any(str((m.get("describe") or {}).get("backend", "")).startswith("xrt")
                   for m in self.registry.describe())

    def _reload_models(self, backend: str) -> None:
        """Unload every model; the next use loads it for `backend` (blocking, in the engine thread)."""
        self.registry.backend = backend
        self.registry.unload_all()
        log.warning("models_reloaded_for", backend=backend)

    async def _save_quarantine(self, value: dict | None) -> None:
        await self.jobs.set_device_state(QUARANTINE_KEY, value)

    async def restore_quarantine(self) -> None:
        value = await self.jobs.device_state(QUARANTINE_KEY)
        if value is not None:
            host_fallback = bool(value.get("host_fallback", False))
            self.queue.set_quarantine(Quarantine(value["since"], value["reason"], value["ticket"], value["job"],
                                                 tuple(value["lines"]), host_fallback))
            if host_fallback:
                self.registry.backend = "host"
            log.error("device_quarantined", reason=value["reason"], restored=True, host_fallback=host_fallback)
