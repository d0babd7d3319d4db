"""Speculation plans its own k from the calibrated row costs (npud/engine/break_even.py's best_k
and Acceptance, used by npud/engine/speculative.py when adapt_k is on and the base and the head
have cost models): the most tokens per plain step, never more than the request's k, and greedy
output the same bytes whatever k it picks.

Mutants run by hand, each failing a test here:
    best_k keeps the first k it sees (rate >= best_rate never updated)   steep_and_flat, monotone
    a one-pass round costed as rows(k) instead of rows(k + 1)             one_pass_pays_for_t1s_row
    Acceptance counts a failure on a fully accepted round                 acceptance_counts
    the loop ignores the plan (k_next not capped)                         loop_drafts_no_more
"""

from __future__ import annotations

import pytest

from npud.engine.break_even import Acceptance, best_k
from npud.engine.pass_costs import FREE, PassCosts
from npud.engine.speculative import RoundKind
from test_pass_costs import CostedBase
from test_speculative import OracleHead, run_plain, run_spec

# an r-row pass in plain steps: the exact float path's steep curve (8 rows ~2.7 steps, as issue
# 40 measured) and gguf-q8's flatter one
STEEP = tuple(1.0 + 0.245 * (r - 1) for r in range(1, 17))
FLAT = tuple(1.0 + 0.03 * (r - 1) for r in range(1, 17))


def curve(table):
    return PassCosts(table, "injected").rows  # past the table: scaled, as the loop sees it


def free(k: int) -> float:
    return 0.0


def test_steep_rows_take_few_drafts_and_flat_rows_many():
    assert best_k(curve(STEEP), free, 0.9, 16, two_pass=False) <= 6
    assert best_k(curve(FLAT), free, 0.9, 16, two_pass=False) >= 12
    assert best_k(curve(FLAT), free, 0.999, 15, two_pass=False) == 15
    assert best_k(curve(STEEP), free, 0.1, 16, two_pass=False) == 1
    # a drafter that costs something per draft takes fewer
    assert best_k(curve(FLAT), lambda k: 0.2 * k, 0.9, 16, False) < best_k(curve(FLAT), free, 0.9, 16, False)


def test_more_acceptance_never_plans_fewer_drafts():
    for costs in (STEEP, FLAT):
        ks = [best_k(curve(costs), free, a / 100, 15, two_pass=False) for a in range(1, 100)]
        assert ks == sorted(ks) and ks[0] == 1 and ks[-1] > 1


def test_one_pass_pays_for_t1s_row():
    # two rows cost one step, each row past them a whole step more: one draft (2 rows: t1 and
    # d1) is free, a second (3 rows, 2 steps) does not pay at 0.95
    rows = lambda r: 1.0 if r <= 2 else r - 1.0  # noqa: E731
    assert best_k(rows, free, 0.95, 8, two_pass=False) == 1
    # the two-pass round: a step, then the batch of k drafts only when d1 is kept
    assert best_k(rows, free, 0.95, 8, two_pass=True) == 2


def test_acceptance_counts():
    a = Acceptance()
    assert a.rate == 0.5
    a.observe(4, 4)  # all accepted: four successes, no failure
    assert (a.successes, a.failures) == (5, 1)
    a.observe(1, 4)  # one accepted, then a reject
    assert (a.successes, a.failures) == (6, 2)
    a.observe(0, 3)
    assert a.rate == 6 / 9


class PlannedOracle(OracleHead):
    """The oracle head with free drafts and a plan, as prompt lookup has."""

    costs = FREE

    def draft_cost(self):
        return 0.0

    def planned_cost(self, k):
        return 0.0


@pytest.fixture(scope="module")
def reference():
    return run_plain(n=64)[0]


@pytest.mark.parametrize("quality, most", [("perfect", 7), ("half", 2)])
def test_loop_drafts_no_more_than_the_plan_and_keeps_the_bytes(reference, quality, most):
    """On the steep curve: perfect drafts drive the acceptance up and the plan to the request's k
    (starting from the plan at 0.5, not from k); half-right drafts keep the rounds small, where
    the same head without a plan doubles to k after every fully kept round."""
    out, _, stats, events = run_spec(PlannedOracle(reference, quality), n=48, k=7, base=CostedBase(STEEP[:8]),
                                     adapt_k=True)
    assert out == reference[:48]
    drafted = [e.drafted for e in events if e.kind is not RoundKind.STEP]
    assert max(drafted) == most, drafted
    assert drafted[0] == best_k(curve(STEEP[:8]), free, 0.5, 7, two_pass=False) < 7
    unplanned = [e.drafted for e in run_spec(OracleHead(reference, quality), n=48, k=7, base=CostedBase(STEEP[:8]),
                                             adapt_k=True)[3] if e.kind is not RoundKind.STEP]
    assert unplanned[0] == 7 and (quality == "perfect" or max(unplanned) > most), unplanned


def test_a_costless_base_or_fixed_k_runs_as_before(reference):
    # no cost model: the plan is off, k doubles to the request's as adapt_k always did
    from test_speculative import ToyBase

    out, _, _, events = run_spec(PlannedOracle(reference, "perfect"), n=48, k=7, base=ToyBase(), adapt_k=True)
    assert out == reference[:48] and max(e.drafted for e in events if e.kind is not RoundKind.STEP) == 7
    # adapt_k off: every round drafts the request's k
    out, _, _, events = run_spec(PlannedOracle(reference, "perfect"), n=48, k=5, base=CostedBase(STEEP[:8]))
    assert out == reference[:48] and {e.drafted for e in events if e.kind is not RoundKind.STEP} <= {5, 4, 3, 2, 1}


def test_costs_table_is_the_one_pass_costs_reads():
    costs = PassCosts(STEEP[:8], "injected")
    assert best_k(costs.rows, free, 0.9, 16, two_pass=False) == best_k(lambda r: costs.rows(r), free, 0.9, 16, False)
