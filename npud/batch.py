"""The running batch: the sequences of one model that the granted ticket advances together, one
batched engine round at a time, and who may join it at a round boundary.

One ticket holds the device; the jobs whose sequences ride it are its riders (the ticket's own
job first). At a round boundary the device owner fills the batch from the best candidates, in
this order:

  1. interactive before batch (a joining interactive request may set aside running batch
     sequences to make room: their sessions are kept, and they run again when there is room);
  2. within a class: sequences already started (set aside, or kept across a preemption), then
     the riders' next prompts in the order the riders joined, then queued tickets of the same
     model in the queue's grant order (their jobs join the batch: npud/tickets.py `join`).

A batch holds at most `max_batch` sequences and, summed over them, `max_batch_positions`
context positions (prompt tokens + max_tokens); one sequence alone always runs. While an
interactive sequence runs, batch sequences ride beside it only while a round of all of them
costs at most `interactive_round_cost` of one sequence's steps (the model's calibrated
`round_cost`): an interactive request's steps stay near its solo step, and the batch sequences
set aside for it run again when it ends. With
max_batch = 1 nothing joins: a ticket runs one prompt of one job at a time. Jobs of another
model wait for the ticket to end or yield (npud/tickets.py should_yield: an interactive request
waiting preempts batch work, quanta rotate the rest).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from npud.config import BatchingConfig
from npud.jobs import Job, JobState, Sequence
from npud.tickets import Priority, Ticket


RoundCost = Callable[[int], "float | None"]  # ServedModel.round_cost: a round of n sequences in solo steps


class Kind(enum.IntEnum):
    """A candidate's kind; in a class, lower goes first."""

    KEPT = 0  # a started sequence that is not running: set aside, or kept across a preemption
    NEXT = 1  # a rider's next prompt: a new session
    JOIN = 2  # a queued ticket of the batch's model: its job joins the batch


@dataclass(slots=True, frozen=True)
class Candidate:
    kind: Kind
    job: Job
    order: int  # the rider's place (join order) or the queued ticket's place in grant order
    sequence: Sequence | None = None  # KEPT
    prompt: int | None = None  # NEXT
    ticket: Ticket | None = None  # JOIN

    def key(self) -> tuple[Priority, Kind, int]:
        return self.job.priority, self.kind, self.order


class RunningBatch:
    """The riders of one granted ticket and the sequences that run in its next round."""

    def __init__(self, ticket: Ticket, lead: Job) -> None:
        self.ticket = ticket
        self.model = lead.spec.model
        self.jobs: list[Job] = [lead]  # riders still in it, lead first, in join order
        self.running: list[Sequence] = []  # the next round's sequences, in the order they started running
        # (job, prompt) -> positions, or why the prompt cannot run: measured once
        self.sizes: dict[tuple[int, int], int | Exception] = {}
        self.ended: list[tuple[Job, JobState]] = []  # the jobs whose end ended the ticket, finished with it

    def priority(self) -> Priority:
        """The class of the work running now (the ticket's own when nothing runs)."""
        return min((s.job.priority for s in self.running), default=self.ticket.priority)

    def positions(self) -> int:
        return sum(s.positions for s in self.running)

    def fits(self, positions: int, limits: BatchingConfig, priority: Priority = Priority.BATCH,
             cost: RoundCost | None = None) -> bool:
        """Whether a sequence of `positions` and `priority` may run now beside the running ones;
        `cost` (ServedModel.round_cost) prices a round of n sequences."""
        if not self.running:
            return True
        return (len(self.running) < limits.max_batch and self.positions() + positions <= limits.max_batch_positions
                and self._cost_fits([s.job.priority for s in self.running] + [priority], limits, cost))

    @staticmethod
    def _cost_fits(priorities: list[Priority], limits: BatchingConfig, cost: RoundCost | None) -> bool:
        """A round of sequences of these priorities keeps to interactive_round_cost: it has no
        interactive sequence, or no batch one, or costs at most that (unknown costs: no limit)."""
        if Priority.INTERACTIVE not in priorities or Priority.BATCH not in priorities or cost is None:
            return True
        price = cost(len(priorities))
        return price is None or price <= limits.interactive_round_cost

    # -- changes -------------------------------------------------------------------------

    def add_job(self, job: Job) -> None:
        if job not in self.jobs:
            self.jobs.append(job)

    def run(self, seq: Sequence) -> None:
        """Put a sequence in the next round (and on the ticket's record of what rode it)."""
        if seq in self.running:
            raise ValueError(f"prompt {seq.prompt} of job {seq.job.id} is already running")
        self.running.append(seq)
        entry = (seq.job.id, seq.prompt, seq.job.owner_uid)
        if entry not in self.ticket.sequences:
            self.ticket.sequences.append(entry)

    def remove(self, seq: Sequence) -> None:
        """A sequence that has its result (or failed) leaves the batch and its job."""
        if seq in self.running:
            self.running.remove(seq)
        seq.job.sequences.pop(seq.prompt, None)

    def drop_job(self, job: Job) -> None:
        """A job that failed: all its sequences leave."""
        for seq in list(job.sequences.values()):
            self.remove(seq)

    def set_aside_for(self, positions: int, limits: BatchingConfig, cost: RoundCost | None = None) -> list[Sequence]:
        """Set aside running batch-class sequences (the last to start first) until an
        interactive one of `positions` fits; none when even all of them would not make room.
        Their sessions stay with their jobs. Returns those set aside."""
        victims = [s for s in reversed(self.running) if s.job.priority is Priority.BATCH]
        rest = [s for s in self.running if s not in victims]
        if rest and (len(rest) >= limits.max_batch
                     or sum(s.positions for s in rest) + positions > limits.max_batch_positions):
            return []
        out = []
        for seq in victims:
            if self.fits(positions, limits, Priority.INTERACTIVE, cost):
                break
            self.running.remove(seq)
            out.append(seq)
        return out

    def take_ended(self) -> list[tuple[Job, JobState]]:
        """Riders with nothing left to run leave the batch: each with the state it ends in."""
        ended = []
        for job in list(self.jobs):
            if job.sequences:
                continue
            if job.error is not None:
                state = JobState.FAILED
            elif job.cancel_requested and (len(job.done_prompts) < job.spec.num_prompts or (
                    job.last_result or {}).get("finish_reason") == "cancelled"):
                state = JobState.CANCELLED
            elif job.next_prompt() is None:
                state = JobState.DONE
            else:
                continue
            self.jobs.remove(job)
            ended.append((job, state))
        return ended

    # -- who goes next -------------------------------------------------------------------

    def candidates(self, queued: list[Ticket], active: dict[int, Job], limits: BatchingConfig,
                   *, may_join: bool) -> list[Candidate]:
        """Everything that could run next, best first (see the module's docstring)."""
        out = []
        for order, job in enumerate(self.jobs):
            if job.error is not None:
                continue
            for seq in job.sequences.values():
                if seq not in self.running:
                    out.append(Candidate(Kind.KEPT, job, order, sequence=seq))
            prompt = None if job.cancel_requested else job.next_prompt()
            if prompt is not None:
                out.append(Candidate(Kind.NEXT, job, order, prompt=prompt))
        if may_join and limits.max_batch > 1:
            for order, ticket in enumerate(queued):
                job = active.get(ticket.job_id)
                if job is not None and job.spec.model == self.model and not job.cancel_requested:
                    out.append(Candidate(Kind.JOIN, job, order, ticket=ticket))
        return sorted(out, key=Candidate.key)
