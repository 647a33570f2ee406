"""APRIL's decisions (april/scheduler.py), by hand: the over-provisioning rule, how many groups
each policy starts, the async admission cap, the staleness budget and the zero-variance filter."""

from __future__ import annotations

import pytest

from april.scheduler import GroupCounts, GroupScheduler, StalenessBudget, ZeroVarianceFilter, groups_in_flight


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
