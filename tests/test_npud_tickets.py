"""The npu-hold ticket queue on its own: grant order, yield decisions, guards, cancellation."""

import pytest
import trio.testing
import trio

from npud.tickets import Outcome, Priority, Quarantine, TicketQueue, TicketState, YieldReason

B, I = Priority.BATCH, Priority.INTERACTIVE


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_queue(quantum_tokens=100, quantum_ms=1000.0):
    clock = Clock()
    return TicketQueue(quantum_tokens, quantum_ms, clock=clock, wall=clock), clock


def drain_order(q):
    """Grant and release (done) until the queue is empty; the job ids in grant order."""
    order = []
    while (t := q.grant()) is not None:
        order.append(t.job_id)
        q.release(t, Outcome.DONE)
    return order


def test_fifo_within_a_class():
    q, _ = make_queue()
    for job in (1, 2, 3, 4):
        q.enqueue(job, B)
    assert drain_order(q) == [1, 2, 3, 4]


def test_interactive_before_batch_whatever_the_arrival():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.enqueue(2, I)
    q.enqueue(3, B)
    q.enqueue(4, I)
    assert [t.job_id for t in q.queued()] == [2, 4, 1, 3]
    assert q.position(1) == 2
    assert drain_order(q) == [2, 4, 1, 3]


def test_one_grant_at_a_time():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.enqueue(2, I)
    first = q.grant()
    assert first.job_id == 2 and first.state is TicketState.GRANTED
    assert q.grant() is None  # an interactive ticket waiting does not get a second grant
    q.release(first, Outcome.DONE)
    assert q.grant().job_id == 1


def test_no_grant_while_quarantined_and_nothing_dropped():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.enqueue(2, I)
    q.set_quarantine(Quarantine(since=0.0, reason="test"))
    assert q.grant() is None
    assert [t.job_id for t in q.queued()] == [2, 1]
    q.set_quarantine(None)
    assert drain_order(q) == [2, 1]


def test_no_grant_while_thermal_hold():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.set_thermal(hold=True, abort=False)
    assert q.grant() is None
    q.set_thermal(hold=False, abort=False)
    assert q.grant().job_id == 1


def test_no_grant_while_stopping_and_holder_told_to_yield():
    q, _ = make_queue()
    q.enqueue(1, B)
    t = q.grant()
    q.enqueue(2, B)
    q.stop()
    assert q.should_yield(t) is YieldReason.SHUTDOWN
    q.release(t, Outcome.PREEMPTED, "shutdown")
    assert q.grant() is None


def test_batch_yields_at_once_to_a_waiting_interactive():
    q, clock = make_queue()
    q.enqueue(1, B)
    t = q.grant()
    t.tokens = 1  # far inside its quantum
    assert q.should_yield(t) is None
    q.enqueue(2, I)
    assert q.should_yield(t) is YieldReason.INTERACTIVE_WAITING


def test_interactive_does_not_yield_to_batch_even_past_its_quantum():
    q, clock = make_queue(quantum_tokens=10)
    q.enqueue(1, I)
    t = q.grant()
    q.enqueue(2, B)
    t.tokens = 50
    clock.now = 100.0
    assert q.should_yield(t) is None


def test_quantum_in_tokens_yields_exactly_at_the_quantum():
    q, _ = make_queue(quantum_tokens=10, quantum_ms=1e9)
    q.enqueue(1, B)
    t = q.grant()
    q.enqueue(2, B)
    t.tokens = 9
    assert q.should_yield(t) is None
    t.tokens = 10
    assert q.should_yield(t) is YieldReason.QUANTUM


def test_quantum_in_time_yields_exactly_at_the_quantum():
    q, clock = make_queue(quantum_tokens=10**9, quantum_ms=500.0)
    q.enqueue(1, B)
    t = q.grant()
    q.enqueue(2, B)
    clock.now = 0.499
    assert q.should_yield(t) is None
    clock.now = 0.5
    assert q.should_yield(t) is YieldReason.QUANTUM


def test_quantum_spent_but_nobody_waiting_keeps_the_device():
    q, clock = make_queue(quantum_tokens=10)
    q.enqueue(1, B)
    t = q.grant()
    t.tokens = 1000
    clock.now = 1000.0
    assert q.should_yield(t) is None


def test_no_preemption_for_waiters_while_held_for_heat():
    q, _ = make_queue()
    q.enqueue(1, B)
    t = q.grant()
    q.enqueue(2, I)
    q.set_thermal(hold=True, abort=False)
    assert q.should_yield(t) is None  # nobody could be granted in its place
    q.set_thermal(hold=True, abort=True)
    assert q.should_yield(t) is YieldReason.THERMAL


def test_quantum_requeue_goes_to_the_back_of_its_class():
    q, _ = make_queue(quantum_tokens=5)
    q.enqueue(1, B)
    q.enqueue(2, B)
    t = q.grant()
    t.tokens = 5
    assert q.should_yield(t) is YieldReason.QUANTUM
    q.release(t, Outcome.PREEMPTED, "quantum")
    again = q.requeue(t, keep_place=YieldReason.QUANTUM.keeps_place)
    assert again.job_id == 1 and again.id != t.id and again.state is TicketState.QUEUED
    assert [x.job_id for x in q.queued()] == [2, 1]


def test_interactive_preemption_keeps_the_batch_jobs_place():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.enqueue(2, B)
    t = q.grant()
    q.enqueue(3, I)
    reason = q.should_yield(t)
    q.release(t, Outcome.PREEMPTED, reason.value)
    q.requeue(t, keep_place=reason.keeps_place)
    assert drain_order(q) == [3, 1, 2]


def test_requeue_only_of_a_released_ticket():
    q, _ = make_queue()
    t = q.enqueue(1, B)
    with pytest.raises(ValueError):
        q.requeue(t, keep_place=True)


def test_cancel_a_queued_ticket():
    q, _ = make_queue()
    a = q.enqueue(1, B)
    q.enqueue(2, B)
    q.release(a, Outcome.CANCELLED, "cancelled")
    assert a.state is TicketState.RELEASED and a.outcome is Outcome.CANCELLED and a.granted_at is None
    assert q.queued_ticket(1) is None
    assert drain_order(q) == [2]


def test_a_queued_ticket_can_only_be_cancelled():
    q, _ = make_queue()
    a = q.enqueue(1, B)
    with pytest.raises(ValueError):
        q.release(a, Outcome.DONE)
    assert q.queued_ticket(1) is a


def test_release_twice_is_an_error_and_frees_the_device_once():
    q, _ = make_queue()
    q.enqueue(1, B)
    t = q.grant()
    q.release(t, Outcome.FAULTED, "amdxdna_errors")
    assert q.granted is None
    with pytest.raises(ValueError):
        q.release(t, Outcome.DONE)


def test_ticket_ids_are_unique_and_start_where_asked():
    q = TicketQueue(10, 10.0, first_id=41)
    ids = [q.enqueue(j, B).id for j in range(3)]
    assert ids == [41, 42, 43]


def test_observers_see_every_state_change():
    q, _ = make_queue()
    seen = []
    q.observers.append(lambda t: seen.append((t.job_id, t.state.value)))
    t = q.enqueue(1, B)
    q.grant()
    q.release(t, Outcome.DONE)
    assert seen == [(1, "queued"), (1, "granted"), (1, "released")]


def test_counts_by_class():
    q, _ = make_queue()
    q.enqueue(1, B)
    q.enqueue(2, I)
    q.enqueue(3, B)
    assert q.counts() == {"interactive": 1, "batch": 2}


async def test_wait_grant_wakes_when_a_guard_lifts():
    q = TicketQueue(10, 10.0)
    q.set_thermal(hold=True, abort=False)
    q.enqueue(1, B)
    granted = []

    async def owner():
        granted.append(await q.wait_grant())

    async with trio.open_nursery() as n:
        n.start_soon(owner)
        await trio.testing.wait_all_tasks_blocked()
        assert granted == []
        q.set_thermal(hold=False, abort=False)
    assert granted[0].job_id == 1


async def test_wait_grant_wakes_on_enqueue():
    q = TicketQueue(10, 10.0)
    granted = []

    async def owner():
        granted.append(await q.wait_grant())

    async with trio.open_nursery() as n:
        n.start_soon(owner)
        await trio.testing.wait_all_tasks_blocked()
        q.enqueue(7, I)
    assert granted[0].job_id == 7


# -- owners take turns (issue 17, defect 14) -----------------------------------------------------

def test_owners_take_turns_within_a_class():
    q, _ = make_queue()
    for job in range(1, 6):
        q.enqueue(job, B, owner_uid=1000)  # one user's many jobs
    q.enqueue(10, B, owner_uid=1001)  # then another user's one
    q.enqueue(11, B, owner_uid=1001)
    # before: FIFO, so 1001 waited for all five of 1000's jobs
    assert drain_order(q) == [1, 10, 2, 11, 3, 4, 5]


def test_a_new_owner_goes_before_owners_already_served_and_queued_shows_the_grant_order():
    q, _ = make_queue()
    q.enqueue(1, B, owner_uid=1)
    q.enqueue(2, B, owner_uid=1)
    t = q.grant()
    q.release(t, Outcome.DONE)
    q.enqueue(3, B, owner_uid=2)
    q.enqueue(4, I, owner_uid=1)
    assert [t.job_id for t in q.queued()] == [4, 3, 2] and q.position(3) == 1
    assert drain_order(q) == [4, 3, 2]


def test_a_requeued_ticket_keeps_its_owner():
    q, _ = make_queue()
    q.enqueue(1, B, owner_uid=7)
    t = q.grant()
    q.release(t, Outcome.PREEMPTED)
    assert q.requeue(t, keep_place=True).owner_uid == 7
