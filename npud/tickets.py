"""The npu-hold ticket queue: who may drive the device next, and when the holder must yield.

A ticket is a hold of the device for one unit of work of one job. Tickets are granted one
at a time, interactive before batch and first come first served within a class, never while
the device is quarantined, held for heat, or the daemon is stopping. The holder asks
`should_yield` at every round boundary; a preempted job continues in a new ticket.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import trio

log = structlog.get_logger(__name__)


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, label: str) -> "Priority":
        return cls[label.upper()]


class TicketState(enum.Enum):
    QUEUED = "queued"
    GRANTED = "granted"
    RELEASED = "released"


class Outcome(enum.Enum):
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"
    FAULTED = "faulted"
    PREEMPTED = "preempted"
    JOINED = "joined"  # a queued ticket whose job joined the running batch of the granted one


class YieldReason(enum.Enum):
    INTERACTIVE_WAITING = "interactive_waiting"  # keeps its place at the head of its class
    QUANTUM = "quantum"  # goes to the back of its class
    THERMAL = "thermal"  # keeps its place
    SHUTDOWN = "shutdown"  # not requeued in memory: the store has the job, the next start runs it

    @property
    def keeps_place(self) -> bool:
        return self in (YieldReason.INTERACTIVE_WAITING, YieldReason.THERMAL)


@dataclass(slots=True, eq=False)
class Ticket:
    id: int
    job_id: int
    priority: Priority
    seq: int  # FIFO position within its class; a requeue that keeps its place keeps its seq
    queued_at: float
    state: TicketState = TicketState.QUEUED
    outcome: Outcome | None = None
    reason: str | None = None
    granted_at: float | None = None
    released_at: float | None = None
    granted_mono: float | None = None
    thermal_c: float | None = None
    errors_at_grant: int | None = None
    errors_at_release: int | None = None
    fault_lines: tuple[str, ...] = ()
    fw_version: str | None = None  # the NPU firmware while this ticket was held (sysfs fw_version)
    tokens: int = 0  # tokens generated while this ticket was held
    drafted: int = 0
    accepted: int = 0
    owner_uid: int = 0  # the job's owner: grants rotate between owners within a class
    # every sequence that ran while this ticket held the device, in the order each first ran:
    # (job, prompt, owner uid); jobs other than job_id rode it in a batch (npud/batch.py)
    sequences: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def jobs(self) -> list[int]:
        """The jobs that held or rode this ticket: its own first, then the others as they joined."""
        out = [self.job_id]
        for job, _, _ in self.sequences:
            if job not in out:
                out.append(job)
        return out

    def to_wire(self) -> dict:
        return {
            "ticket": self.id, "job": self.job_id, "priority": self.priority.label, "state": self.state.value,
            "outcome": None if self.outcome is None else self.outcome.value, "reason": self.reason,
            "queued_at": self.queued_at, "granted_at": self.granted_at, "released_at": self.released_at,
            "thermal_c": self.thermal_c, "errors_at_grant": self.errors_at_grant,
            "errors_at_release": self.errors_at_release, "fault_lines": list(self.fault_lines),
            "fw_version": self.fw_version, "tokens": self.tokens, "drafted": self.drafted, "accepted": self.accepted,
            "owner_uid": self.owner_uid, "jobs": self.jobs,
            "sequences": [{"job": j, "prompt": p, "owner_uid": u} for j, p, u in self.sequences],
        }


@dataclass(slots=True, frozen=True)
class Quarantine:
    since: float
    reason: str
    ticket: int | None = None
    job: int | None = None
    lines: tuple[str, ...] = ()
    # the NPU failed and the models run on the host meanwhile (backend "auto"): grants go on
    host_fallback: bool = False

    def to_wire(self) -> dict:
        return {"since": self.since, "reason": self.reason, "ticket": self.ticket, "job": self.job,
                "lines": list(self.lines), "host_fallback": self.host_fallback}


@dataclass(slots=True)
class TicketQueue:
    quantum_tokens: int
    quantum_ms: float
    first_id: int = 1
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    granted: Ticket | None = None
    quarantine: Quarantine | None = None
    thermal_hold: bool = False
    thermal_abort: bool = False
    stopping: bool = False
    observers: list[Callable[[Ticket], None]] = field(default_factory=list)
    _queued: list[Ticket] = field(default_factory=list)
    _last_grant: dict[int, int] = field(default_factory=dict)  # owner uid -> number of the grant it last had
    _grants: itertools.count = field(default_factory=itertools.count)
    _ids: itertools.count = field(init=False)
    _seqs: itertools.count = field(default_factory=itertools.count)
    _changed: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self._ids = itertools.count(self.first_id)

    # -- state changes -------------------------------------------------------------------

    def _notify(self, ticket: Ticket | None = None) -> None:
        self._changed.set()
        self._changed = trio.Event()
        if ticket is not None:
            for observer in self.observers:
                observer(ticket)

    def enqueue(self, job_id: int, priority: Priority, owner_uid: int = 0) -> Ticket:
        """Queue a new ticket at the back of its class."""
        ticket = Ticket(next(self._ids), job_id, priority, next(self._seqs), self.wall(), owner_uid=owner_uid)
        self._queued.append(ticket)
        log.info("ticket_queued", ticket=ticket.id, job=job_id, priority=priority.label)
        self._notify(ticket)
        return ticket

    def requeue(self, ticket: Ticket, *, keep_place: bool) -> Ticket:
        """A new ticket for the job of a released one: at its old place in its class or at the back."""
        if ticket.state is not TicketState.RELEASED:
            raise ValueError(f"ticket {ticket.id} is {ticket.state.value}, not released")
        seq = ticket.seq if keep_place else next(self._seqs)
        new = Ticket(next(self._ids), ticket.job_id, ticket.priority, seq, self.wall(), owner_uid=ticket.owner_uid)
        self._queued.append(new)
        log.info("ticket_queued", ticket=new.id, job=new.job_id, priority=new.priority.label,
                 requeued_from=ticket.id, keep_place=keep_place)
        self._notify(new)
        return new

    def can_grant(self) -> bool:
        return (
            self.granted is None
            and not self.quarantine_blocks
            and not self.thermal_hold
            and not self.stopping
            and bool(self._queued)
        )

    def _grant_order(self, t: Ticket) -> tuple[Priority, int, int]:
        # the highest class first; in it, the owner whose last grant is oldest (never: first),
        # so that one user's many jobs cannot starve another user's one; FIFO within an owner
        return t.priority, self._last_grant.get(t.owner_uid, -1), t.seq

    def grant(self) -> Ticket | None:
        """Grant the next ticket (see queued()), or None when nothing may be granted."""
        if not self.can_grant():
            return None
        ticket = min(self._queued, key=self._grant_order)
        self._last_grant[ticket.owner_uid] = next(self._grants)
        self._queued.remove(ticket)
        ticket.state = TicketState.GRANTED
        ticket.granted_at = self.wall()
        ticket.granted_mono = self.clock()
        self.granted = ticket
        self._notify(ticket)
        return ticket

    async def wait_grant(self) -> Ticket:
        """Wait until a ticket can be granted and grant it."""
        while True:
            ticket = self.grant()
            if ticket is not None:
                return ticket
            await self._changed.wait()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def release(self, ticket: Ticket, outcome: Outcome, reason: str | None = None) -> None:
        """End a granted ticket (any outcome) or a queued one (cancelled)."""
        if ticket.state is TicketState.GRANTED:
            if ticket is not self.granted:
                raise ValueError(f"ticket {ticket.id} is not the granted ticket")
            self.granted = None
        elif ticket.state is TicketState.QUEUED:
            if outcome not in (Outcome.CANCELLED, Outcome.JOINED):
                raise ValueError(f"a queued ticket can only be cancelled or joined, not {outcome.value}")
            self._queued.remove(ticket)
        else:
            raise ValueError(f"ticket {ticket.id} is already released")
        ticket.state = TicketState.RELEASED
        ticket.outcome = outcome
        ticket.reason = reason
        ticket.released_at = self.wall()
        self._notify(ticket)

    def join(self, queued: Ticket, holder: Ticket) -> None:
        """End a queued ticket whose job joins the running batch of the granted `holder`."""
        if holder is not self.granted:
            raise ValueError(f"ticket {holder.id} is not the granted ticket")
        self.release(queued, Outcome.JOINED, f"joined ticket {holder.id}")

    # -- the holder's questions ----------------------------------------------------------

    def should_yield(self, ticket: Ticket, priority: Priority | None = None) -> YieldReason | None:
        """Asked by the holder at a round boundary: must it release the device now, and why.
        `priority`: the class the holder's work has now (a batch ticket that an interactive
        request rides holds interactive work); the ticket's own by default."""
        priority = ticket.priority if priority is None else priority
        if self.stopping:
            return YieldReason.SHUTDOWN
        if self.thermal_abort:
            return YieldReason.THERMAL
        if self.thermal_hold or not self._queued:
            return None  # nobody could be granted in its place
        if priority is Priority.BATCH and any(t.priority is Priority.INTERACTIVE for t in self._queued):
            return YieldReason.INTERACTIVE_WAITING
        used_ms = (self.clock() - (ticket.granted_mono or 0.0)) * 1000.0
        if ticket.tokens >= self.quantum_tokens or used_ms >= self.quantum_ms:
            if any(t.priority <= priority for t in self._queued):
                return YieldReason.QUANTUM
        return None

    # -- guards and operators ------------------------------------------------------------

    @property
    def quarantine_blocks(self) -> bool:
        """A quarantine stops grants unless the models serve on the host meanwhile."""
        return self.quarantine is not None and not self.quarantine.host_fallback

    def set_quarantine(self, quarantine: Quarantine | None) -> None:
        self.quarantine = quarantine
        self._notify()

    def set_thermal(self, *, hold: bool, abort: bool) -> None:
        self.thermal_hold = hold
        self.thermal_abort = abort
        self._notify()

    def stop(self) -> None:
        """No more grants; the holder yields at its next round boundary."""
        self.stopping = True
        self._notify()

    def set_quantum(self, quantum_tokens: int, quantum_ms: float) -> None:
        self.quantum_tokens = quantum_tokens
        self.quantum_ms = quantum_ms

    # -- queries -------------------------------------------------------------------------

    def queued(self) -> list[Ticket]:
        """Queued tickets in the order they would be granted now: interactive before batch; in
        a class, owners in the order of their last grants (oldest first), each owner's FIFO."""
        return sorted(self._queued, key=self._grant_order)

    def queued_ticket(self, job_id: int) -> Ticket | None:
        return next((t for t in self._queued if t.job_id == job_id), None)

    def position(self, job_id: int) -> int | None:
        """0-based place of the job's queued ticket in grant order, or None."""
        for i, t in enumerate(self.queued()):
            if t.job_id == job_id:
                return i
        return None

    def counts(self, owner_uid: int | None = None) -> dict[str, int]:
        """Queued tickets by class: every user's, or `owner_uid`'s only."""
        out = {p.label: 0 for p in Priority}
        for t in self._queued:
            if owner_uid is None or t.owner_uid == owner_uid:
                out[t.priority.label] += 1
        return out


def owner_view(ticket: dict, owner: int) -> dict:
    """A ticket's wire form as a user who is not an admin sees it: other users' jobs on it
    (a batch they shared) are counted, not named, so job ids of other users cannot be probed for."""
    sequences = ticket.get("sequences", [])
    mine = [s for s in sequences if s["owner_uid"] == owner]
    lead_mine = ticket.get("owner_uid") == owner
    out = {**ticket, "sequences": mine, "other_sequences": len(sequences) - len(mine),
           "jobs": [j for j in ticket.get("jobs", []) if (j == ticket["job"] and lead_mine)
                    or any(s["job"] == j for s in mine)]}
    if not lead_mine:
        out["job"] = out["owner_uid"] = None
    return out
