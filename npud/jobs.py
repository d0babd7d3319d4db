"""Jobs: accepted work, its durable record, its queue ticket and the clients that follow it.

A job is written to the store before anyone is told it exists; it then holds exactly one
queued or granted ticket until it ends. The device owner (npud/device_owner.py) reports what it
did through the `on_*` methods; clients read and cancel through the rest.
"""

from __future__ import annotations

import enum
import json
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
import trio

from npud.engine.api import Session
from npud.config import DaemonConfig
from npud.jobref import JobRefs, stored_refs
from npud.jobspec import JobSpec
from npud.memtrim import Trimmer
from npud.protocol import ApiError, ErrorCode
from npud.store import Store, StoreCode, StoreError
from npud.tickets import Outcome, Priority, Ticket, TicketQueue, TicketState, YieldReason, owner_view

log = structlog.get_logger(__name__)

T = TypeVar("T")
SUBSCRIBER_BUFFER = 4096  # events a slow client may fall behind before its stream is ended
STORE_RETRY_S = 5.0  # how often the final state of jobs the store could not take is written again
RETENTION_EVERY_S = 3600.0


STORE_CODES = {StoreCode.FULL: ErrorCode.STORE_FULL, StoreCode.READONLY: ErrorCode.STORE_READONLY,
               StoreCode.ERROR: ErrorCode.STORE_ERROR}


STORE_MESSAGES = {
    StoreCode.FULL: "the job store is full (no space left on its disk); nothing was recorded",
    StoreCode.READONLY: "the job store is not writable; nothing was recorded",
    StoreCode.ERROR: "the job store failed; nothing was recorded",
}


def store_api_error(exc: StoreError) -> ApiError:
    """The protocol error a client sees for a store failure: the same code, a plain message
    (the store's own message names its path and SQLite's error: it goes to the log)."""
    log.warning("store_failed", code=exc.code.value, message=exc.message)
    return ApiError(STORE_CODES[exc.code], STORE_MESSAGES[exc.code])


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_OUTCOME_STATE = {Outcome.DONE: JobState.DONE, Outcome.CANCELLED: JobState.CANCELLED, Outcome.FAILED: JobState.FAILED}


@dataclass(slots=True, frozen=True)
class Caller:
    """Who is asking: the peer's uid and whether it is an operator (root or the admin group)."""

    uid: int
    admin: bool

    def may_access(self, owner_uid: int) -> bool:
        return self.admin or self.uid == owner_uid


@dataclass(slots=True, eq=False)
class Subscriber:
    send: trio.MemorySendChannel
    receive: trio.MemoryReceiveChannel
    lagged: bool = False


@dataclass(slots=True, eq=False)
class Sequence:
    """One prompt of a job in generation: its engine session (kept across preemption and
    while set aside to make room in a batch) and the context positions it may fill."""

    job: "Job"
    prompt: int
    session: Session
    positions: int  # prompt tokens + max_tokens, clamped to the model's context


@dataclass(slots=True, eq=False)
class Job:
    id: int
    owner_uid: int
    priority: Priority
    interactive: bool  # a `complete` request: cancelled when its client goes away
    spec: JobSpec
    created_at: float
    state: JobState = JobState.QUEUED
    done_prompts: set[int] = field(default_factory=set)
    started_at: float | None = None
    finished_at: float | None = None
    tokens: int = 0
    num_tickets: int = 0
    error: ApiError | None = None
    cancel_requested: bool = False
    ticket: Ticket | None = None  # its queued ticket, or the granted one it holds or rides
    joined_from: Ticket | None = None  # the queued ticket it left to ride `ticket` (its place in the queue)
    sequences: dict[int, Sequence] = field(default_factory=dict)  # prompt -> its sequence, until its result
    loading_model: str | None = None  # the model being loaded for this job (a cold start), told to new streams
    last_result: dict | None = None  # the result last committed, as the store holds it
    subscribers: list[Subscriber] = field(default_factory=list)
    finished: trio.Event = field(default_factory=trio.Event)

    def next_prompt(self) -> int | None:
        """The first prompt with neither a result nor a sequence, or None when there is none."""
        return next((i for i in range(self.spec.num_prompts)
                     if i not in self.done_prompts and i not in self.sequences), None)

    def status(self) -> dict:
        return {
            "job": self.id, "owner_uid": self.owner_uid, "state": self.state.value, "priority": self.priority.label,
            "interactive": self.interactive, "model": self.spec.model, "num_prompts": self.spec.num_prompts,
            "done_prompts": len(self.done_prompts), "tokens": self.tokens, "tickets": self.num_tickets,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "cancel_requested": self.cancel_requested,
            "error": None if self.error is None else self.error.to_wire(),
            # the ticket it holds, rides or waits with, and the prompts in generation now
            "ticket": None if self.ticket is None else self.ticket.id,
            "running_prompts": sorted(self.sequences),
        }


class JobManager:
    def __init__(self, cfg: DaemonConfig, store: Store, queue: TicketQueue, *, wall: Callable[[], float] = time.time):
        self.cfg = cfg
        self.store = store
        self.queue = queue
        self.wall = wall
        self.active: dict[int, Job] = {}
        # Ended jobs whose final state the store could not take (a full disk): memory answers
        # for them until a retry stores it, so clients never see a stale "running".
        self.unsaved: dict[int, Job] = {}
        self.store_error: ApiError | None = None  # the last failed write; None once a write succeeds
        self.accepting = True
        self.tokens_generated = 0
        self.tokens_by_owner: dict[int, int] = {}  # the same per job owner (a non-admin's stats)
        self.refs = JobRefs()  # HTTP replies' job references; recover() takes the store's key
        self._db_limiter = trio.CapacityLimiter(1)
        self._keyed = trio.Lock()  # the store's connection is used by one thread at a time
        self.trimmer = Trimmer()
        queue.observers.append(self._on_ticket_change)

    async def db(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run a store call in a worker thread (SQLite commits fsync; the event loop must not wait)."""
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._db_limiter)

    # -- start-up ------------------------------------------------------------------------

    async def load_ref_key(self) -> None:
        """The jobs' references' key from the store (npud/jobref.py `stored_refs`)."""
        self.refs = await self.db(stored_refs, self.store)

    async def recover(self) -> int:
        """Requeue every job that was unfinished when the daemon last stopped (an interactive
        one, whose client went with the connection, is cancelled instead); returns how many."""
        await self.load_ref_key()
        closed = await self.db(self.store.recover, self.wall())
        rows = await self.db(self.store.unfinished_jobs)
        for row in rows:
            done = {r["prompt"] for r in await self.db(self.store.results, row["job"])}
            job = Job(row["job"], row["owner_uid"], Priority.parse(row["priority"]), row["interactive"],
                      JobSpec.from_json(row["request"]), row["created_at"], done_prompts=done,
                      started_at=row["started_at"], tokens=row["tokens"], num_tickets=row["tickets"])
            if job.interactive:  # its client's connection ended with the last run: nobody waits for it
                await self.finish(job, JobState.CANCELLED)
                log.info("job_orphan_cancelled", job=job.id)
                continue
            self.active[job.id] = job
            job.ticket = self.queue.enqueue(job.id, job.priority, job.owner_uid)
            log.info("job_requeued", job=job.id, done_prompts=len(done), num_prompts=job.spec.num_prompts)
        if rows or closed:
            log.info("store_recovered", jobs_requeued=len(rows), tickets_closed=closed)
        return len(rows)

    # -- client side ---------------------------------------------------------------------

    async def submit_once(self, caller: Caller, spec: JobSpec, priority: Priority, key: str) -> dict:
        """Accept a job unless the caller already submitted one with idempotency key `key`;
        returns the status of the job the key names (new or earlier). Raises bad_request when
        the key was used for a different request, else as submit()."""
        async with self._keyed:  # one keyed submit at a time: look-up and insert cannot interleave
            found = await self.db(self.store.job_by_key, caller.uid, key)
            if found is None:
                job, _ = await self.submit(caller, spec, priority, key=key)
                return job.status()
            if found["request"] != json.loads(json.dumps(spec.to_json())) or found["priority"] != priority.label:
                raise ApiError(ErrorCode.BAD_REQUEST, f"params.idempotency_key: already used for job {found['job']},"
                                                      " which asked for something else")
            log.info("job_resubmitted", job=found["job"], owner_uid=caller.uid)
            return await self.status(caller, found["job"])

    async def submit(self, caller: Caller, spec: JobSpec, priority: Priority, *, interactive: bool = False,
                     subscribe: bool = False, key: str | None = None) -> tuple[Job, Subscriber | None]:
        """Accept a job: store it, then queue its ticket. Raises overloaded / shutting_down / store_*."""
        if not self.accepting:
            raise ApiError(ErrorCode.SHUTTING_DOWN, "npud is shutting down and accepts no new work")
        limits = self.cfg.limits
        mine = [j for j in self.active.values() if j.owner_uid == caller.uid]
        if len(mine) >= limits.max_queued_jobs_per_user:
            raise ApiError(ErrorCode.OVERLOADED, f"you have {limits.max_queued_jobs_per_user} unfinished jobs, "
                                                 "the limit (limits.max_queued_jobs_per_user)")
        # prompts wait in memory until they have run: their bytes are bounded per user too
        held = sum(j.spec.num_bytes for j in mine)
        if held + spec.num_bytes > limits.max_queued_bytes_per_user:
            raise ApiError(ErrorCode.OVERLOADED,
                           f"your unfinished jobs hold {held} bytes of prompts and this one {spec.num_bytes}, more "
                           f"than limits.max_queued_bytes_per_user = {limits.max_queued_bytes_per_user}")
        created = self.wall()
        # Shielded: once the row is committed, the job must also be queued, whatever the client does.
        with trio.CancelScope(shield=True):
            job_id = await self.db(self.store.insert_job, owner_uid=caller.uid, priority=priority.label,
                                   interactive=interactive, model=spec.model, request=spec.to_json(),
                                   num_prompts=spec.num_prompts, created_at=created, idempotency_key=key)
            job = Job(job_id, caller.uid, priority, interactive, spec, created)
            self.active[job_id] = job
            sub = self.subscribe(job) if subscribe else None
            job.ticket = self.queue.enqueue(job_id, priority, caller.uid)
        # job_ref: the reference an HTTP reply names the job by (npud.job, cmpl-REF), so a reply
        # can be found in the log
        log.info("job_accepted", job=job_id, job_ref=self.refs.ref(job_id), owner_uid=caller.uid,
                 priority=priority.label, model=spec.model, num_prompts=spec.num_prompts, interactive=interactive)
        return job, sub

    async def status(self, caller: Caller, job_id: int) -> dict:
        job = self.active.get(job_id) or self.unsaved.get(job_id)
        if job is not None:
            self._check_access(caller, job.owner_uid, job_id)
            out = job.status()
            if job_id in self.unsaved and self.store_error is not None:
                out["store_error"] = self.store_error.to_wire()  # the store still says otherwise
        else:
            row = await self.db(self.store.job, job_id)
            if row is None:
                raise ApiError(ErrorCode.NOT_FOUND, f"no job {job_id}")
            self._check_access(caller, row["owner_uid"], job_id)
            out = row
        out["queue_position"] = self.queue.position(job_id)
        return out

    @staticmethod
    def _check_access(caller: Caller, owner_uid: int, job_id: int) -> None:
        # the same answer as for a job that does not exist: job ids cannot be probed for
        # other users' work
        if not caller.may_access(owner_uid):
            raise ApiError(ErrorCode.NOT_FOUND, f"no job {job_id}")

    async def results(self, caller: Caller, job_id: int, prompts: list[int] | None) -> dict:
        status = await self.status(caller, job_id)
        results = await self.db(self.store.results, job_id, prompts)
        return {"job": job_id, "state": status["state"], "results": results}

    async def list(self, caller: Caller, *, states: list[str] | None, all_users: bool, limit: int,
                   before: int | None) -> list[dict]:
        if all_users and not caller.admin:
            raise ApiError(ErrorCode.FORBIDDEN, "all_users needs the admin group")
        rows = await self.db(self.store.jobs, owner_uid=None if all_users else caller.uid, states=states,
                             limit=limit, before=before)
        # the store has the durable fields; live counters of active jobs come from memory
        live = {**self.unsaved, **self.active}
        return [live[r["job"]].status() if r["job"] in live else r for r in rows]

    async def cancel(self, caller: Caller, job_id: int) -> dict:
        status = await self.status(caller, job_id)  # raises not_found / forbidden
        job = self.active.get(job_id)
        if job is None:
            return {**status, "cancelled": False}
        await self.cancel_job(job)
        return {**job.status(), "queue_position": None, "cancelled": True}

    async def cancel_job(self, job: Job) -> None:
        """Cancel now if queued; if running, the device owner stops it at the next round boundary."""
        job.cancel_requested = True
        ticket = job.ticket
        with trio.CancelScope(shield=True):
            if ticket is not None and ticket.state is TicketState.QUEUED:
                self.queue.release(ticket, Outcome.CANCELLED, "cancelled while queued")
                await self.finish(job, JobState.CANCELLED, ticket=ticket)
            elif ticket is None and job.state is JobState.QUEUED:  # yielded for shutdown
                await self.finish(job, JobState.CANCELLED)
        log.info("job_cancel_requested", job=job.id, state=job.state.value)

    # -- shutdown ------------------------------------------------------------------------

    def interactive_jobs(self) -> list[Job]:
        """The unfinished jobs of clients that wait for them (`complete`, HTTP)."""
        return [job for job in self.active.values() if job.interactive]

    async def end_interactive(self, error: ApiError) -> int:
        """SIGTERM after the grace period: end every interactive job with `error` (its client's
        final word; the job is stored cancelled and not run again). Returns how many."""
        ended = self.interactive_jobs()
        for job in ended:
            job.error = error
            await self.cancel_job(job)  # a running one stops at the round boundary
        return len(ended)

    def close_subscribers(self) -> None:
        """SIGTERM: end every follower of an unfinished job (`stream` answers with the job's status)."""
        for job in self.active.values():
            for sub in list(job.subscribers):
                if not job.interactive:
                    self.unsubscribe(job, sub)

    # -- events to clients ---------------------------------------------------------------

    def subscribe(self, job: Job) -> Subscriber:
        send, receive = trio.open_memory_channel(SUBSCRIBER_BUFFER)
        sub = Subscriber(send, receive)
        job.subscribers.append(sub)
        return sub

    def unsubscribe(self, job: Job, sub: Subscriber) -> None:
        if sub in job.subscribers:
            job.subscribers.remove(sub)
        sub.send.close()

    def publish(self, job: Job, name: str, data: dict) -> None:
        """Give an event to every follower of the job; one that has fallen too far behind is cut off."""
        for sub in list(job.subscribers):
            try:
                sub.send.send_nowait((name, data))
            except trio.WouldBlock:
                sub.lagged = True
                self.unsubscribe(job, sub)
            except trio.ClosedResourceError:
                self.unsubscribe(job, sub)

    def _on_ticket_change(self, ticket: Ticket) -> None:
        # every job on the ticket hears of it: the one it was queued for and those riding it
        for job_id in ticket.jobs:
            job = self.active.get(job_id)
            if job is not None:
                self.publish(job, "ticket", self._ticket_event(job, ticket))

    @staticmethod
    def _ticket_event(job: Job, ticket: Ticket) -> dict:
        data = {"ticket": ticket.id, "job": job.id, "state": ticket.state.value}
        if ticket.job_id != job.id:
            data["held_by_job"] = ticket.job_id  # the job rides another job's ticket
        if ticket.outcome is not None:
            data["outcome"] = ticket.outcome.value
            data["reason"] = ticket.reason
        return data

    # -- device-owner side ---------------------------------------------------------------

    async def on_granted(self, job: Job, ticket: Ticket) -> None:
        job.state = JobState.RUNNING
        job.num_tickets += 1
        if job.started_at is None:
            job.started_at = ticket.granted_at
        await self._write_state(job, ticket)

    async def on_joined(self, job: Job, holder: Ticket, left: Ticket) -> None:
        """The job left its queued ticket `left` to ride the granted `holder` (npud/batch.py)."""
        job.state = JobState.RUNNING
        job.num_tickets += 1
        job.ticket, job.joined_from = holder, left
        if job.started_at is None:
            job.started_at = self.wall()
        self.publish(job, "ticket", self._ticket_event(job, holder))
        await self._write_state(job, left)

    async def commit_result(self, job: Job, prompt: int, body: dict, tokens: int, ticket: Ticket | None = None) -> None:
        """Record one finished prompt (and the state of the ticket it ran under, which then
        tells what rode it even after a crash); raises StoreError when it could not be written."""
        await self.db(self.store.add_result, job.id, prompt, body, tokens,
                      ticket=None if ticket is None else ticket.to_wire())
        job.last_result = {"prompt": prompt, **body}
        job.done_prompts.add(prompt)
        self.publish(job, "progress", {"prompt": prompt, "finish_reason": body.get("finish_reason"),
                                       "error": body.get("error"), "done_prompts": len(job.done_prompts),
                                       "num_prompts": job.spec.num_prompts})

    def count_tokens(self, job: Job, ticket: Ticket, num_tokens: int) -> None:
        job.tokens += num_tokens
        ticket.tokens += num_tokens
        self.tokens_generated += num_tokens
        self.tokens_by_owner[job.owner_uid] = self.tokens_by_owner.get(job.owner_uid, 0) + num_tokens

    async def on_released(self, job: Job, ticket: Ticket, yielded: YieldReason | None) -> None:
        """Persist a released ticket and move the job on: finished, or queued again."""
        if ticket.outcome in _OUTCOME_STATE:
            await self.finish(job, _OUTCOME_STATE[ticket.outcome], ticket=ticket)
            return
        if job.cancel_requested:  # cancelled while the ticket it rode ended (a shutdown, a fault): not run again
            await self.finish(job, JobState.CANCELLED, ticket=ticket)
            return
        job.state = JobState.QUEUED
        place = job.joined_from or ticket  # a job that rode the ticket keeps the place it had
        job.joined_from = None
        if ticket.outcome is Outcome.FAULTED:
            job.sequences.clear()  # output made during a fault is not trusted
            job.ticket = self.queue.requeue(place, keep_place=True)
        elif yielded is YieldReason.SHUTDOWN:
            job.ticket = None  # the store says queued; the next start runs it
        else:
            job.ticket = self.queue.requeue(place, keep_place=yielded is not None and yielded.keeps_place)
        await self._write_state(job, ticket)

    async def finish(self, job: Job, state: JobState, error: ApiError | None = None, *,
                     ticket: Ticket | None = None) -> None:
        """End a job (and store `ticket`, its last one, in the same commit)."""
        job.state = state
        job.error = error if error is not None else job.error
        job.finished_at = self.wall()
        job.sequences.clear()
        job.ticket = job.joined_from = None
        self.active.pop(job.id, None)
        if not await self._write_state(job, ticket):
            self.unsaved[job.id] = job
        job.finished.set()
        self.trimmer.released(job.spec.num_bytes, idle=not self.active)
        for sub in list(job.subscribers):
            self.unsubscribe(job, sub)
        event = {JobState.DONE: "job_done", JobState.FAILED: "job_failed"}.get(state, "job_cancelled")
        # the console format's one line per request (npud/logsetup.py) is this event
        running_s = None if job.started_at is None else job.finished_at - job.started_at
        log.info(event, job=job.id, job_ref=self.refs.ref(job.id), model=job.spec.model, owner_uid=job.owner_uid,
                 num_prompts=job.spec.num_prompts, tokens=job.tokens, tickets=job.num_tickets,
                 elapsed_ms=round((job.finished_at - job.created_at) * 1000, 1),
                 tokens_per_s=round(job.tokens / running_s, 1) if running_s else None,
                 error=None if job.error is None else job.error.code)

    async def _write_state(self, job: Job, ticket: Ticket | None = None) -> bool:
        """Store the job's state (and the ticket that changed it) in one commit; returns whether
        the store took it. A failure is logged and kept in `store_error` (shown by `stats`)."""
        try:
            await self.db(self.store.set_job_state, job.id, job.state.value, started_at=job.started_at,
                          finished_at=job.finished_at, error=None if job.error is None else job.error.to_wire(),
                          ticket=None if ticket is None else ticket.to_wire())
        except StoreError as exc:
            # The store keeps the last state it could write; a restart redoes the job from that
            # state. Until then memory answers for the job (see `unsaved`).
            log.error("store_write_failed", job=job.id, ticket=None if ticket is None else ticket.id,
                      code=exc.code, message=exc.message)
            self.store_error = store_api_error(exc)
            return False
        self.store_error = None
        return True

    async def save_unsaved(self) -> int:
        """Write the final state of the jobs the store could not take before; returns how many
        are still unsaved."""
        for job in list(self.unsaved.values()):
            if await self._write_state(job):
                self.unsaved.pop(job.id, None)
                log.info("store_write_recovered", job=job.id, state=job.state.value)
            else:
                break  # the store is still failing; try again later
        return len(self.unsaved)

    def store_status(self, owner_uid: int | None = None) -> dict:
        """Whether the last store write succeeded, and the jobs (every user's, or `owner_uid`'s)
        whose final state waits in memory."""
        return {"writable": self.store_error is None,
                "error": None if self.store_error is None else self.store_error.to_wire(),
                "unsaved_jobs": sum(1 for j in self.unsaved.values() if owner_uid in (None, j.owner_uid))}

    # -- queries -------------------------------------------------------------------------

    @staticmethod
    def result(job: Job) -> dict | None:
        """The result last committed for the job ({"prompt": i, ...body} as `results` returns
        it), or None before its first; `complete` answers with it, its job has one prompt."""
        return job.last_result

    async def counts(self, owner_uid: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """(jobs by state, tickets by state) in the store's history: every user's, or `owner_uid`'s."""
        return (await self.db(self.store.job_counts, owner_uid),
                await self.db(self.store.ticket_counts, owner_uid))

    def live_states(self, owner_uid: int | None = None) -> dict[str, int]:
        """Unfinished jobs by state (queued and running always present): every user's, or
        `owner_uid`'s only."""
        states = {"queued": 0, "running": 0}
        for job in self.active.values():
            if owner_uid is not None and job.owner_uid != owner_uid:
                continue
            states[job.state.value] = states.get(job.state.value, 0) + 1
        return states

    async def device_state(self, key: str) -> object:
        """The device state recorded under `key` (a JSON value), or None."""
        return await self.db(self.store.get_state, key)

    async def set_device_state(self, key: str, value: object) -> None:
        """Record device state (None clears it); raises StoreError when it cannot be written."""
        await self.db(self.store.set_state, key, value)

    async def tickets(self, caller: Caller, *, job_id: int | None, state: str | None, outcome: str | None,
                      since: float | None, until: float | None, limit: int) -> list[dict]:
        """Ticket history, newest first: queued tickets from memory, the rest from the store."""
        owner = None if caller.admin else caller.uid
        live = []
        if state in (None, "queued") and outcome is None:
            for t in self.queue.queued():
                job = self.active.get(t.job_id)
                if job is None or (owner is not None and job.owner_uid != owner):
                    continue
                if (job_id is None or t.job_id == job_id) and (since is None or t.queued_at >= since) and (
                    until is None or t.queued_at < until
                ):
                    live.append(t.to_wire())
        stored = []
        if state != "queued":
            stored = await self.db(self.store.tickets, job_id=job_id, owner_uid=owner, state=state, outcome=outcome,
                                   since=since, until=until, limit=limit)
            granted = self.queue.granted
            if granted is not None:  # its stored row is from the grant; memory has the live counters
                stored = [granted.to_wire() if t["ticket"] == granted.id else t for t in stored]
        merged = sorted(live + stored, key=lambda t: -t["ticket"])
        if owner is not None:
            merged = [owner_view(t, owner) for t in merged]
        return merged[:limit]

    async def prune(self, retention_days: float) -> int:
        cutoff = self.wall() - retention_days * 86400.0
        removed = await self.db(self.store.prune, cutoff)
        if removed:
            log.info("history_pruned", jobs=removed)
        return removed

    async def run_retention(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Prune finished history at start-up and then every hour; store the final states that
        a failing store did not take, every STORE_RETRY_S."""
        task_status.started()
        next_prune = trio.current_time()
        while True:
            if trio.current_time() >= next_prune:
                next_prune = trio.current_time() + RETENTION_EVERY_S
                try:
                    await self.prune(self.cfg.store.retention_days)
                except StoreError as exc:
                    log.error("history_prune_failed", code=exc.code, message=exc.message)
            if self.unsaved:
                await self.save_unsaved()
            await trio.sleep(STORE_RETRY_S)
