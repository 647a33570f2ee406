"""Rollout workers as real Ray actors against a real Redis buffer: killing one mid-generation
loses no trajectory, and the tokens it had stored are continued, not regenerated."""

from __future__ import annotations

import time

import numpy as np
import pytest

from slime.buffer import JobTelemetry, TrajectoryStore
from slime.config import load_config
from slime.data import PromptRecord
from slime.fleet import RolloutFleet, WorkerHung
from slime.launch.ray_cluster import RayLauncher
from slime.sample import FINAL_STATUSES, Status
from slime.sampling import PromptSampler
from tests.helpers import wait_for

pytestmark = pytest.mark.slow


def test_killed_worker_loses_no_trajectory(ray_session, tiny_model_dir, redis_url, tmp_path):
    import ray

    from slime.rollout import RolloutWorker

    job = "kill-test"
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "buffer.lease_seconds=2",
            "rollout.max_new_tokens=80",
            "rollout.chunk_tokens=2",
            "rollout.max_running_requests=8",
            "rollout.temperature=1.0",
            # Never stop early, so every trajectory is long enough to be caught mid-generation.
            "rollout.ignore_eos=true",
        ],
    )
    buffer = TrajectoryStore.open(redis_url, job, lease_seconds=2)
    buffer.delete_job()
    prompt = [6, 7, 77, 61, 86]
    groups = [buffer.add_group(prompt, 2, 80, {"label": "ababab", "prompt_text": "ab*3="}) for _ in range(6)]
    Worker = ray.remote(num_cpus=0)(RolloutWorker)

    w0 = Worker.remote(cfg, str(tiny_model_dir), redis_url, "w0")
    running = wait_for(
        lambda: [s for s in buffer.iter_samples(Status.RUNNING) if s.response_length >= 4],
        120,
        "w0 to store partial tokens",
    )
    ray.kill(w0, no_restart=True)
    partial = {s.id: buffer.get_sample(s.id).response_ids.copy() for s in running}
    assert partial

    w1 = Worker.remote(cfg, str(tiny_model_dir), redis_url, "w1")
    wait_for(lambda: buffer.counts()["groups_ready"] == len(groups), 180, "every group to complete after the kill")

    samples = [s for gid in groups for s in buffer.get_group(gid)]
    assert len(samples) == 12 and all(s.status in FINAL_STATUSES for s in samples)
    for sid, prefix in partial.items():
        final = buffer.get_sample(sid)
        # Resumed from its stored token ids: the killed worker's tokens are kept, not regenerated.
        assert np.array_equal(final.response_ids[: len(prefix)], prefix), sid
        assert final.response_length > len(prefix)
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
        assert s.reward is not None or s.status == Status.FAILED
    # Every stored token was generated once: the buffer's counter equals the sum of lengths.
    assert buffer.stats()["generated_tokens"] == sum(s.response_length for s in samples)
    ray.get(w1.stop.remote())
    ray.kill(w1)
    buffer.delete_job()


def test_a_worker_that_makes_no_progress_with_work_queued_is_killed(ray_session, redis_url, tmp_path):
    import ray  # late: Ray reads its auth settings when imported (conftest's ray_session sets them)

    # Defined here: Ray pickles it by value (the test module is not importable in a Ray worker).
    class _StuckWorker:
        """A worker whose engine has requests queued and never makes a decode step (a stuck kernel,
        a deadlock): it still answers its health check."""

        def health(self) -> dict:
            return {
                "alive": True,
                "error": None,
                "running": 2,
                "waiting": 1,
                "engine_tokens_generated": 7,
                "decode_steps": 3,
            }

    cfg = load_config(None, ["job_name=hung-worker", f"output_dir={tmp_path}", "rollout.hang_timeout_s=0.5"])
    buffer = TrajectoryStore.open(redis_url, cfg.job_name)
    stuck = ray.remote(num_cpus=0)(_StuckWorker).remote()
    ray.get(stuck.health.remote(), timeout=60)  # started (an actor's start may take longer than 0.5 s)
    fleet = RolloutFleet(
        cfg,
        [stuck],
        buffer,
        JobTelemetry(buffer.connection),
        PromptSampler([PromptRecord(0, "p", [6, 7])], cfg.sampling, "task", 0, False),
        RayLauncher(),
    )
    fleet.check_workers()  # the counters are seen for the first time
    fleet.check_workers()  # unchanged, but not for long yet
    fleet.dashboard_paused = True  # a paused engine is not hung
    time.sleep(0.6)
    fleet.check_workers()
    fleet.dashboard_paused = False
    time.sleep(0.6)
    with pytest.raises(WorkerHung, match=r"no decode step for \ds with 3 requests queued"):
        fleet.check_workers()

    def killed() -> bool:  # ray.kill is asynchronous: a call sent at once may still be answered
        try:
            ray.get(stuck.health.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_for(killed, 30, "the hung worker killed")
    events = JobTelemetry(buffer.connection).events(10)
    assert any(e["kind"] == "worker_hung" for e in events)
    buffer.delete_job()


def test_async_admission_counts_the_version_the_engines_hold_not_the_one_the_learner_published(buffer, tmp_path):
    """The learner publishes its next version before the engines have its weights. Admission
    (max_staleness) must count the engines' version from the first step on: before the first push,
    reading the learner's let a group start under version 0 that the learner, two versions on,
    dropped as stale (a CI run saw a whole step dropped)."""
    from slime.launch.local import LocalLauncher

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "mode=async",
            "max_staleness=1",
            "rollout.batch_size=3",
            "rollout.n_samples_per_prompt=2",
            "april.enabled=true",  # 12 groups wanted in flight: the staleness cap is what holds them back
            "april.oversample=4",
        ],
    )
    records = [PromptRecord(i, f"p{i}", [6, 7 + i % 5]) for i in range(30)]
    fleet = RolloutFleet(
        cfg,
        [],
        buffer,
        JobTelemetry(buffer.connection),
        PromptSampler(records, cfg.sampling, "task", 0, False),
        LocalLauncher(),
    )
    buffer.set_policy_version(1)  # the learner's step 0 is done; the push has not happened yet
    fleet._schedule_groups()
    assert buffer.counts()["groups_total"] == 6  # (engine version 0 + 1 + max_staleness 1) x batch 3
    fleet.engine_version = 1  # what update_weights records once every engine has version 1
    fleet._schedule_groups()
    assert buffer.counts()["groups_total"] == 9
