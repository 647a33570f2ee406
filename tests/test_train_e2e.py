"""Whole jobs, end to end: real Redis, real Ray actors (or, cluster.launcher=local, the same actors on
threads of this process), the tiny MoE training for a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.buffer import TrajectoryStore
from slime.config import load_config
from slime.metrics import TooManyFailures
from slime.train import train

pytestmark = pytest.mark.slow

SMALL = [
    "rollout.batch_size=3",
    "rollout.n_samples_per_prompt=3",
    "rollout.max_new_tokens=40",
    "data.num_generated=64",
    "logging.progress=false",
    "weights.check_every=1",
]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_sync_grpo_trains_checkpoints_and_resumes(ray_session, tiny_model_dir, redis_url, tmp_path, launcher):
    """Also with MoE routing replay: every trained token's experts recorded by the engine, stored,
    and replayed by the learner (tests/test_routing_replay.py has the parts)."""
    job = f"e2e-sync-{launcher}"
    common = [
        f"job_name={job}",
        f"cluster.launcher={launcher}",
        f"output_dir={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        *SMALL,
        "learner.routing_replay=true",
    ]
    history = train(load_config(None, [*common, "steps=2", "checkpoint.every_steps=1"]))
    assert [h["step"] for h in history] == [0, 1]
    assert history[-1]["policy_version"] == 2
    for h in history:
        assert h["groups"] == 3 and h["samples"] == 9
        assert h["trained_tokens"] > 0 and h["rollout_tokens_per_s"] > 0
        assert h["off_policy_token_share"] == 0.0  # sync: every token from the current policy
    assert (tmp_path / "training.png").stat().st_size > 0
    assert (tmp_path / "checkpoints" / "step_000002" / "driver_state.json").exists()
    assert list((tmp_path / "tensorboard").iterdir())

    history = train(load_config(None, [*common, "steps=3", "resume=auto"]))
    assert [h["step"] for h in history] == [0, 1, 2]  # the series goes on: the plot shows the whole run
    assert history[-1]["policy_version"] == 3
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    buffer = TrajectoryStore.open(redis_url, job)
    assert buffer.counts()["groups_trained"] == 9  # 3 steps x 3 groups, each trained exactly once
    for gid in buffer.redis.zrange(buffer._key("trained"), 0, -1):
        for s in buffer.get_group(gid.decode()):
            # 4 MoE layers x top-2 experts per token, each one recorded (255: none)
            assert s.routing is not None and s.routing.shape == (s.response_length, 8) and (s.routing < 8).all()
    # On-policy tokens through the engine's own experts: the learner's logprobs are the engine's.
    assert all(h["mismatch_fresh_logp_abs_diff"] < 1e-3 for h in history)
    buffer.delete_job()


def test_a_long_job_prunes_old_trained_trajectories_and_resumes(tiny_model_dir, redis_url, tmp_path):
    """buffer.keep_trained_steps=1 with a checkpoint every step: after step s only the groups trained
    at step s keep their trajectories; counts stay whole, and a resume goes on from the pruned buffer."""
    job = "e2e-prune"
    common = [
        f"job_name={job}",
        f"output_dir={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        *SMALL,
        "checkpoint.every_steps=1",
        "buffer.keep_trained_steps=1",
        "april.enabled=true",
        "cluster.launcher=local",  # pruning is the buffer's and the driver's: no actor processes needed
    ]
    train(load_config(None, [*common, "steps=3"]))
    history = train(load_config(None, [*common, "steps=4", "resume=auto"]))
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    buffer = TrajectoryStore.open(redis_url, job)
    counts, stats = buffer.counts(), buffer.stats()
    assert counts["groups_trained"] == 12 and counts["groups_claimed"] == 0
    assert stats["pruned_groups"] == 9 and stats["pruned_through_step"] == 2
    trained_at = {
        gid.decode(): int(step) for gid, step in buffer.redis.zrange(buffer._key("trained"), 0, -1, withscores=True)
    }
    kept = {gid for gid, step in trained_at.items() if step == 3}
    assert len(kept) == 3 and all(len(buffer.get_group(gid)) == 3 for gid in kept)
    # Every sample still stored is of a kept group or not trained yet (APRIL's partials, open groups).
    assert all(s.group_id in kept or s.group_id not in trained_at for s in buffer.iter_samples())
    assert stats["pruned_samples"] == 27 and stats["pruned_tokens"] > 0
    buffer.delete_job()


@pytest.mark.parametrize("launcher", ["ray", "local"])
@pytest.mark.parametrize("april", [False, True])
def test_async_ppo_bounded_staleness(ray_session, tiny_model_dir, redis_url, tmp_path, april, launcher):
    job = f"e2e-async-{april}-{launcher}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"cluster.launcher={launcher}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *SMALL,
                "steps=3",
                "mode=async",
                "max_staleness=1",
                "algorithm.name=ppo",
                "algorithm.kl_coef=0.01",
                f"april.enabled={str(april).lower()}",  # APRIL in the async loop: over-provisioned, same bound
            ],
        )
    )
    assert len(history) == 3
    for h in history:
        # Admission control starts no group that would exceed the staleness bound, so none is dropped.
        # (The figures in the message: one CI run under load saw a step with 0 groups, cause unknown.)
        seen = {k: h.get(k) for k in ("step", "groups", "dropped_stale_groups", "samples", "policy_version")}
        assert h["groups"] == 3 and h["dropped_stale_groups"] == 0, seen
        assert 0.0 <= h["off_policy_token_share"] <= 1.0
        assert "vf_loss" in h
    buffer = TrajectoryStore.open(redis_url, job)
    assert buffer.counts()["groups_trained"] == 9
    buffer.delete_job()


@pytest.mark.timeout(600)
def test_async_with_a_filter_that_drops_groups_goes_on(tiny_model_dir, redis_url, tmp_path):
    """Async admission counted the groups a filter dropped as started: once more than
    max_staleness x batch_size were dropped, its cap was reached with nothing in flight, and the job
    waited for good without a word. Greedy rollouts make every group zero-variance: all dropped
    until the fallback (max_filtered_per_step) keeps some."""
    job = "e2e-async-filter"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                "cluster.launcher=local",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *SMALL,
                "steps=3",
                "mode=async",
                "max_staleness=1",
                "rollout.temperature=0",
                "april.filter_zero_variance=true",
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1, 2]
    assert sum(h.get("filtered_zero_variance", 0) for h in history) > 3  # past max_staleness x batch_size
    TrajectoryStore.open(redis_url, job).delete_job()


@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_failing_reward_fails_only_its_samples(ray_session, tiny_model_dir, redis_url, tmp_path, launcher):
    # The reward file imports a helper beside it, as a script would (in the rollout worker). One name
    # per launcher: this process imports both (the job checks the spec before it starts), and two
    # helpers of one name in one process are refused (rewards/plugin.py).
    rules = f"flaky_rules_{launcher}"
    (tmp_path / f"{rules}.py").write_text("def is_odd(text):\n    return len(text) % 2 == 1\n")
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(
        f"from {rules} import is_odd\n"
        "def reward(prompt, response, label, metadata):\n"
        "    if is_odd(response):\n"
        "        raise ValueError('odd length')\n"
        "    return 1.0\n"
    )
    job = f"e2e-flaky-{launcher}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"cluster.launcher={launcher}",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *SMALL,
                "steps=2",
                f"reward.fn={reward_file}:reward",
                "reward.max_failed_share=0.95",  # about half fail: this job goes on
            ],
        )
    )
    assert len(history) == 2
    assert sum(h["failed_samples"] for h in history) > 0
    key = "failures_by_reason/reward function flaky_reward.py:reward raised ValueError/count"
    assert sum(h.get(key, 0) for h in history) == sum(h["failed_samples"] for h in history)
    assert all(h["samples"] == 9 for h in history)
    # Reward statistics per route (task) reach the metrics, failures and latency included.
    assert sum(h["reward_stats/repeat/failures"] for h in history) == sum(h["failed_samples"] for h in history)
    assert all(h["reward_stats/repeat/latency_p99_s"] >= 0 for h in history)
    failed = [s for s in TrajectoryStore.open(redis_url, job).iter_samples() if s.failure]
    assert failed and all("odd length" in s.failure for s in failed)
    TrajectoryStore.open(redis_url, job).delete_job()


def test_a_reward_that_always_fails_stops_the_job_loudly_without_a_checkpoint(
    ray_session, tiny_model_dir, redis_url, tmp_path, capsys
):
    """Before: 3 steps trained on nothing, a checkpoint, exit 0 and `reward nan -> nan`, the reason
    only inside Redis. Now the reason is printed when first seen, counted in the metrics, and the
    job stops once the window's failed share passes reward.max_failed_share."""
    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text("def reward(prompt, response, label, metadata):\n    raise RuntimeError('boom')\n")
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "job_name=e2e-all-fail",
            f"output_dir={run}",
            f"model.path={tiny_model_dir}",
            f"buffer.url={redis_url}",
            *SMALL,
            "steps=6",
            "checkpoint.every_steps=1",
            "reward.failed_window_steps=2",
            f"reward.fn={reward_file}:reward",
        ],
    )
    with pytest.raises(TooManyFailures) as err:
        train(cfg)
    key = "reward function broken_reward.py:reward raised RuntimeError"
    assert "18 of 18 samples failed over the last 2 steps (100% > reward.max_failed_share=0.5)" in str(err.value)
    assert f"18x {key}" in str(err.value) and "boom" in str(err.value)
    assert f"failed sample ({key}): " in capsys.readouterr().out  # said once, when first seen
    rows = _lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r[f"failures_by_reason/{key}/count"] == 9 == r["failed_samples"] for r in rows)
    assert not list(run.glob("checkpoints/step_*/driver_state.json"))  # nothing learned, nothing saved
    TrajectoryStore.open(redis_url, "e2e-all-fail").delete_job()


def test_bad_reward_spec_fails_before_anything_starts(tmp_path):
    from rewards.plugin import PluginError

    with pytest.raises(PluginError, match="no_such_function"):
        train(load_config(None, [f"output_dir={tmp_path}", "reward.fn=envs.repeat:no_such_function"]))
    assert not (tmp_path / "redis").exists()


def test_a_user_error_in_a_ray_workers_constructor_ends_the_job_with_it_and_no_restart(
    ray_session, tiny_model_dir, redis_url, tmp_path, capsys
):
    """A plugin that only the rollout worker loads, and cannot: Ray reported the constructor's error
    as ActorDiedError, with its text only, and the job restarted max_restarts times over the same
    mistake. Kept and raised by the actor's first call, it ends the job at once as itself."""
    from rewards.plugin import PluginError
    from slime.errors import user_error_behind

    cfg = load_config(
        None,
        [
            "job_name=e2e-bad-plugin",
            "cluster.launcher=ray",
            f"output_dir={tmp_path}",
            f"model.path={tiny_model_dir}",
            f"buffer.url={redis_url}",
            *SMALL,
            "steps=1",
            "max_restarts=2",
            f"april.chunk_sampler={tmp_path / 'missing_sampler.py'}:temperature",
        ],
    )
    with pytest.raises(Exception) as failed:
        train(cfg)
    error = user_error_behind(failed.value)
    assert isinstance(error, PluginError) and "missing_sampler.py" in str(error), repr(failed.value)
    assert "restarting from the last checkpoint" not in capsys.readouterr().err
