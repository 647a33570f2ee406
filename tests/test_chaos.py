"""The chaos harness (slime/tools/chaos.py): a short real job whose rollout worker is killed and hangs,
whose learner is killed, whose redis-server is killed and whose reward actor is killed and hangs,
on a seeded schedule; the job recovers by itself each time and the audit finds nothing lost or
duplicated."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

from slime.tools.chaos import FAULTS, plan, run
from tests.helpers import run_slime_chaos

KINDS = list(FAULTS)


def test_the_schedule_is_seeded_spread_and_leaves_room_to_recover():
    a, b = plan(7, KINDS, 30, count=12), plan(7, KINDS, 30, count=12)
    assert [(f.kind, f.after_steps) for f in a] == [(f.kind, f.after_steps) for f in b]
    assert sorted(f.kind for f in a) == sorted(KINDS * 2)  # every kind, evenly
    steps = [f.after_steps for f in a]
    assert steps == sorted(steps) and len(set(steps)) == 12 and steps[0] >= 1 and steps[-1] <= 30 - 2
    with pytest.raises(ValueError, match="6 faults need steps >= 14"):
        plan(0, KINDS, 13)


def test_unknown_faults_and_a_shared_buffer_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown fault\(s\) \['disk_full'\]"):
        run(None, [f"output_dir={tmp_path}"], 0, ["disk_full"])
    with pytest.raises(ValueError, match="leave resume and buffer.url unset"):
        run(None, [f"output_dir={tmp_path}", "resume=auto", "steps=10"], 0, ["worker_kill"])
    with pytest.raises(ValueError, match="need reward.mode=ray_actor"):  # unset, chaos picks it and says so
        run(None, [f"output_dir={tmp_path}", "steps=10", "reward.mode=in_process"], 0, ["reward_hang"])


@pytest.mark.slow
def test_slime_chaos_on_its_defaults_runs_to_a_clean_audit(subprocess_checks: dict[str, Future]) -> None:
    """`slime chaos` with no arguments, as a new user types it: the default job, every fault kind
    once (the reward actor's with reward.mode=ray_actor, picked and said), each recovered by the job
    itself, audited clean (nothing lost or duplicated), exit 0."""
    done, _ = (
        subprocess_checks["chaos"].result() if "chaos" in subprocess_checks else run_slime_chaos()
    )  # run beside the other long subprocess checks (tests/conftest.py)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "running with reward.mode=ray_actor" in done.stdout
    assert "\nclean\n" in done.stdout
    # The audit behind "clean", from the report's JSON line (printed last).
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {f["kind"] for f in report["faults"]} == set(KINDS)
    assert all(f["injected"] and f["recovered"] for f in report["faults"]), report["faults"]
    assert report["restarts"] == 3 and report["redis_restarts"] == 1
    for key in ("steps_missing", "steps_logged_twice", "groups_lost", "groups_trained_twice", "groups_left_claimed"):
        assert report[key] == 0, (key, report)
    assert report["prompts_trained_twice"] == 0, report  # a restart drew again prompts the buffer held
    assert report["trajectories_lost"] == 0 and report["tokens_lost"] == 0 and report["tokens_stored"] > 0
    assert report["groups_trained"] > 0
