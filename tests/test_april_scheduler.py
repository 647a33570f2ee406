"""APRIL's decisions (april/scheduler.py), by hand: the over-provisioning rule, how many groups
each policy starts, the async admission cap, the staleness budget and the zero-variance filter."""

from __future__ import annotations

import pytest

from april.scheduler import (
    BudgetHold,
    GroupCounts,
    GroupScheduler,
    StalenessBudget,
    ZeroVarianceFilter,
    groups_in_flight,
)


def test_the_oversample_rule():
    assert groups_in_flight(16) == 16  # no APRIL: the batch
    assert groups_in_flight(16, 2.0) == 32
    assert groups_in_flight(10, 1.25) == 13  # ceil(12.5)
    assert groups_in_flight(16, oversample_groups=20) == 20
    assert groups_in_flight(16, 1.0) == 16
    assert groups_in_flight(16, oversample_groups=8) == 16  # never below the batch


def test_sync_starts_a_batch_and_replaces_only_what_the_filter_drops():
    s = GroupScheduler("sync", batch_size=4)
    assert s.groups_to_start(GroupCounts(unfinished=0, ready=0, started=0)) == 4
    assert s.groups_to_start(GroupCounts(unfinished=3, ready=1, started=4)) == 0
    assert s.groups_to_start(GroupCounts(unfinished=2, ready=1, started=4)) == 1  # one was dropped
    assert not s.aborts_at_batch_boundary and s.batch_full(4) and not s.batch_full(3)


def test_april_replaces_each_finished_group_at_once():
    s = GroupScheduler("april", batch_size=4, oversample=2.0)
    assert s.target == 8 and s.aborts_at_batch_boundary
    assert s.groups_to_start(GroupCounts(unfinished=0, ready=0, started=0)) == 8
    # three finished: three new ones keep 8 unfinished in flight, whatever is ready
    assert s.groups_to_start(GroupCounts(unfinished=5, ready=3, started=8)) == 3
    s.oversample = 3.0  # the dashboard's override
    assert s.groups_to_start(GroupCounts(unfinished=8, ready=0, started=8)) == 4


def test_async_admission_never_starts_a_group_trained_too_late():
    s = GroupScheduler("async", batch_size=4, max_staleness=1)
    # version 0, budget 1: groups 0..7 (batches 0 and 1) may start; the in-flight target (4) binds first
    assert s.groups_to_start(GroupCounts(unfinished=0, ready=0, started=0), engine_version=0) == 4
    assert s.groups_to_start(GroupCounts(unfinished=1, ready=3, started=4), engine_version=0) == 3
    assert s.groups_to_start(GroupCounts(unfinished=2, ready=5, started=7), engine_version=0) == 1
    assert s.groups_to_start(GroupCounts(unfinished=2, ready=6, started=8), engine_version=0) == 0  # cap
    assert s.groups_to_start(GroupCounts(unfinished=2, ready=2, started=8), engine_version=1) == 2


def test_async_admission_says_how_many_groups_the_staleness_budget_holds_back():
    s = GroupScheduler("async", batch_size=4, max_staleness=1)
    # the in-flight target binds (or nothing is wanted): the budget holds nothing back
    assert s.held_by_staleness(GroupCounts(unfinished=0, ready=0, started=0), engine_version=0) == 0
    assert s.held_by_staleness(GroupCounts(unfinished=4, ready=0, started=4), engine_version=0) == 0
    # 2 wanted (target 4, 2 in flight), 1 left under the cap of 8 started: 1 held back; at the cap, both
    assert s.held_by_staleness(GroupCounts(unfinished=2, ready=5, started=7), engine_version=0) == 1
    assert s.held_by_staleness(GroupCounts(unfinished=2, ready=6, started=8), engine_version=0) == 2
    # the engines' next version lifts the cap by a batch
    assert s.held_by_staleness(GroupCounts(unfinished=2, ready=6, started=8), engine_version=1) == 0
    # a looser budget holds back less
    s.max_staleness = 2
    assert s.held_by_staleness(GroupCounts(unfinished=2, ready=6, started=8), engine_version=0) == 0
    for policy in ("sync", "april", "streaming"):  # only async's admission has a staleness budget
        other = GroupScheduler(policy, batch_size=4, max_staleness=1)
        assert other.held_by_staleness(GroupCounts(unfinished=0, ready=6, started=100), engine_version=0) == 0


def test_budget_hold_times_the_polls_the_budget_held_back_and_counts_the_tokens_it_threw_away():
    hold = BudgetHold()
    assert hold.take_time(10.0) == 0.0  # nothing polled yet
    hold.note(10.0, held=False)
    hold.note(12.0, held=True)  # 10-12 free
    hold.note(15.0, held=False)  # 12-15 held
    assert hold.take_time(20.0) == pytest.approx(3.0 / 10.0)  # 15-20 free
    hold.note(21.0, held=True)  # 20-21 free (the state at the last take)
    assert hold.take_time(25.0) == pytest.approx(4.0 / 5.0)  # 21-25 held: counted by the state at its start
    # APRIL: running totals of (restarted, generated) tokens; each take covers what came since the last
    tokens = BudgetHold(totals_seen=(100.0, 1000.0))  # a resumed job: totals from before are not this step's
    assert tokens.take_tokens(150.0, 1500.0) == pytest.approx(50.0 / 500.0)
    assert tokens.take_tokens(150.0, 1500.0) == 0.0  # nothing generated since
    assert tokens.take_tokens(150.0, 1900.0) == 0.0


@pytest.mark.parametrize(
    ("oldest", "engine", "verdict"),
    [
        (None, 5, "resume"),
        (3, 5, "resume"),
        (2, 5, "resume"),
        (1, 5, "restart"),
    ],
)
def test_staleness_budget(oldest, engine, verdict):
    assert StalenessBudget(3, "restart").verdict(oldest, engine) == verdict
    assert StalenessBudget(None).verdict(0, 100) == "resume"
    assert StalenessBudget(0, "drop").verdict(4, 5) == "drop"


def test_zero_variance_filter_drops_until_its_fallback():
    f = ZeroVarianceFilter(limit=1)
    assert f.check("a", [0.5, 1.0]) == "keep"
    assert f.check("b", [1.0, 1.0]) == "drop"
    f.dropped()
    assert f.check("c", []) == "keep" and f.kept_by_fallback == 1  # the limit is reached: keep
    assert f.seen == {"a", "b", "c"}
    f.new_step()
    assert f.check("d", [0.0, 0.0]) == "drop" and f.seen == {"d"} and f.kept_by_fallback == 0
