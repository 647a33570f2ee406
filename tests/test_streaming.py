"""GLM-5's streaming variant: trajectories trained chunk by chunk before they finish, with the
critic's value bootstrapping unfinished returns (truncated GAE)."""

from __future__ import annotations

import pytest
import torch

from april.scheduler import GroupCounts, GroupScheduler
from slime.buffer import TrajectoryStore
from slime.buffer.telemetry import JobTelemetry
from slime.config import ConfigError, load_config
from slime.learner import Learner
from slime.sample import Status
from slime.train import train


def test_segments_are_claimed_once_in_chunks(buffer):
    buffer.add_group([1, 2], 2, 32, {}, streaming=True)
    a, b = buffer.lease("w", 2)
    buffer.append_chunk(a.id, "w", [5] * 6, [-1.0] * 6, 0)
    buffer.append_chunk(b.id, "w", [5] * 3, [-1.0] * 3, 0)
    assert buffer.count_segments(4, 0) == 1  # b has only 3 new tokens
    ((seg, start, final),) = buffer.claim_segments(4, 10, 0)
    assert (seg.id, start, final, seg.response_length) == (a.id, 0, False, 6)
    assert buffer.claim_segments(4, 10, 0) == []  # nothing claimed twice

    buffer.append_chunk(a.id, "w", [6, 7], [-1.0, -1.0], 1)
    buffer.finish(a.id, "w", Status.COMPLETED, reward=1.0)
    buffer.finish(b.id, "w", Status.TRUNCATED, reward=0.0)
    segs = {s.id: (start, final, s.response_length) for s, start, final in buffer.claim_segments(4, 10, 0)}
    assert segs == {a.id: (6, True, 8), b.id: (0, True, 3)}
    assert buffer.counts()["groups_trained"] == 1  # every member's last segment trained
    assert buffer.count_segments(1, 0) == 0


def test_final_sample_with_everything_trained_yields_its_last_token(buffer):
    buffer.add_group([1, 2], 1, 32, {}, streaming=True)
    (a,) = buffer.lease("w", 1)
    buffer.append_chunk(a.id, "w", [5] * 4, [-1.0] * 4, 0)
    assert [start for _, start, _ in buffer.claim_segments(4, 10, 0)] == [0]
    buffer.finish(a.id, "w", Status.COMPLETED, reward=1.0)
    ((seg, start, final),) = buffer.claim_segments(4, 10, 0)
    assert (start, final, seg.response_length) == (3, True, 4)  # the reward still reaches the learner


@pytest.mark.parametrize("how", ["finished FAILED before its first token", "dropped by the dashboard"])
def test_a_group_with_a_tokenless_final_member_is_trained_and_frees_its_slot(buffer, how):
    """A member final with no tokens has nothing to train but still counts toward its group: else the
    group stays ready, the streaming scheduler counts it in flight for good, and a job whose
    in-flight groups all end so waits forever."""
    buffer.add_group([1, 2], n=2, max_new_tokens=8, metadata={}, streaming=True)
    if how.startswith("finished"):
        good, bad = buffer.lease("w", 2)
        buffer.finish(bad.id, "w", Status.FAILED, failure="env raised at reset")
    else:
        (good,) = buffer.lease("w", 1)
        (bad_id,) = [s.id for s in buffer.iter_samples(Status.PENDING)]
        JobTelemetry(buffer.connection).drop_sample(bad_id, "operator")
    buffer.append_chunk(good.id, "w", [5, 6], [-0.1, -0.2], version=0)
    buffer.finish(good.id, "w", Status.COMPLETED, reward=1.0)
    assert buffer.count_segments(1, 3) == 1
    assert len(buffer.claim_segments(1, 100, 3)) == 1 and buffer.claim_segments(1, 100, 3) == []
    counts = buffer.counts()
    missing = GroupScheduler("streaming", batch_size=1).groups_to_start(
        GroupCounts(unfinished=counts["groups_open"], ready=counts["groups_ready"], started=1)
    )
    assert (counts["groups_trained"], counts["groups_ready"], missing) == (1, 0, 1)


def test_a_group_whose_members_all_end_without_tokens_frees_its_slot_in_a_count(buffer):
    """Every member failed before its first token (an env's reset raised): no segment ever comes, so
    only counts run (fleet.wait_for_segments), and the group must leave its slot there."""
    buffer.add_group([1, 2], n=2, max_new_tokens=8, metadata={}, streaming=True)
    for s in buffer.lease("w", 2):
        buffer.finish(s.id, "w", Status.FAILED, failure="env raised at reset")
    assert buffer.count_segments(1, 2) == 0
    counts = buffer.counts()
    assert (counts["groups_trained"], counts["groups_ready"]) == (1, 0)


def test_a_restarted_sample_trains_all_of_its_new_tokens(buffer):
    """april.max_version_span's restart discards a partial whose first segment trained: the new
    trajectory is trained from its first token, not from where the discarded one stopped."""
    buffer.add_group([1, 2], n=1, max_new_tokens=16, metadata={}, streaming=True)
    (s,) = buffer.lease("w", 1)
    buffer.append_chunk(s.id, "w", [5, 6, 7, 8], [-0.1] * 4, version=0)
    assert [(start, final) for _, start, final in buffer.claim_segments(4, 10, 0)] == [(0, False)]
    assert buffer.restart_sample(s.id, "w") == 4
    buffer.append_chunk(s.id, "w", [7, 8, 9], [-0.3] * 3, version=5)
    buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    ((sample, start, final),) = buffer.claim_segments(4, 10, 1)
    assert (sample.response_ids.tolist(), start, final) == ([7, 8, 9], 0, True)


def test_segments_whose_claim_redis_lost_are_not_trained_twice(buffer):
    """A crash within the AOF's unsynced second loses the claim's trained_upto: the same tokens come
    back as untrained. The learner's store remembers what it trained and takes only the new tokens;
    a final segment it trained already does not come again."""
    buffer.add_group([1, 2], n=1, max_new_tokens=16, metadata={}, streaming=True)
    (s,) = buffer.lease("w", 1)
    buffer.append_chunk(s.id, "w", [5, 6, 7, 8], [-0.1] * 4, version=0)
    assert [start for _, start, _ in buffer.claim_segments(2, 10, 0)] == [0]
    sample_key = f"{buffer.prefix}sample:{s.id}"
    buffer.redis.hdel(sample_key, "trained_upto")  # the claim's write, lost
    buffer.append_chunk(s.id, "w", [9, 10], [-0.1] * 2, version=1)
    ((seg, start, final),) = buffer.claim_segments(2, 10, 1)
    assert (start, seg.response_length, final) == (4, 6, False)
    buffer.redis.hset(sample_key, "trained_upto", 4)  # lost again
    assert buffer.claim_segments(2, 10, 2) == []  # [4, 6) was trained at step 1
    buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    ((seg, start, final),) = buffer.claim_segments(2, 10, 3)
    assert (start, seg.response_length, final) == (5, 6, True)  # only the reward's token again
    buffer.redis.hdel(sample_key, "trained_upto")
    buffer.redis.sadd(f"{buffer.prefix}stream:untrained", s.id)  # the final claim, lost
    assert buffer.claim_segments(2, 10, 4) == []


def test_keep_trained_steps_prunes_streamed_groups_by_their_step(buffer):
    buffer.add_group([1, 2], n=1, max_new_tokens=8, metadata={}, streaming=True)
    (s,) = buffer.lease("w", 1)
    buffer.append_chunk(s.id, "w", [5, 6], [-0.1, -0.2], version=0)
    buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    assert len(buffer.claim_segments(1, 10, 4)) == 1 and buffer.counts()["groups_trained"] == 1
    buffer.commit_through(5, keep_trained_steps=2)
    assert buffer.stats().get("pruned_groups", 0) == 0  # trained at step 4: kept through step 5
    buffer.commit_through(6, keep_trained_steps=2)
    assert buffer.stats()["pruned_groups"] == 1


@pytest.mark.parametrize("final", [False, True])
def test_bootstrapped_advantages_by_hand(tiny_model_dir, redis_url, tmp_path, final):
    """With V(s) = c everywhere (critic head: zero weights, bias c), γ = λ = 1 and reward r at the
    end: an unfinished segment bootstraps V(s_end) = c, so δ_t = 0 and Â_t = 0 on every token;
    a final one ends in the terminal state: δ_T = r − c, so Â_t = r − c on every token."""
    job = f"stream-adv-{final}"
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    buffer.add_group([6, 7, 77, 61, 86], 1, 32, {}, streaming=True)
    (s,) = buffer.lease("w", 1)
    buffer.append_chunk(s.id, "w", [6, 7, 6, 7], [-0.5] * 4, 0)
    if final:
        buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "algorithm.name=ppo",
            "algorithm.gamma=1",
            "algorithm.lam=1",
            "algorithm.normalize_advantages=false",
            "april.streaming_chunk_tokens=4",
        ],
    )
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    c = 0.5
    with torch.no_grad():
        learner.critic.head.bias.fill_(c)
    m = learner.train_segments(0, max_segments=4, chunk_tokens=4)
    assert m["segments"] == 1 and m["final_segments"] == int(final)
    expected = (1.0 - c) if final else 0.0
    assert m["advantage_mean"] == pytest.approx(expected, abs=1e-6)
    assert m["return_mean"] == pytest.approx(1.0 if final else c, abs=1e-6)
    buffer.delete_job()


def test_streaming_needs_ppo():
    with pytest.raises(ConfigError, match="streaming_chunk_tokens needs algorithm.name=ppo"):
        load_config(None, ["april.streaming_chunk_tokens=8", "algorithm.name=grpo"])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_streaming_job_trains_unfinished_trajectories(ray_session, tiny_model_dir, redis_url, tmp_path, launcher):
    sampler = tmp_path / "active_sampler.py"
    sampler.write_text("def temperature(state):\n    return 0.7 if state['response_length'] > 8 else None\n")
    job = f"stream-e2e-{launcher}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"cluster.launcher={launcher}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=3",
                "rollout.max_new_tokens=48",
                "rollout.ignore_eos=true",
                "rollout.chunk_tokens=4",
                "data.num_generated=64",
                "logging.progress=false",
                "algorithm.name=ppo",
                "april.streaming_chunk_tokens=8",
                "steps=5",
                f"april.chunk_sampler={sampler}:temperature",
            ],
        )
    )
    assert len(history) == 5
    per_step = [
        (h["segments"], h["final_segments"], {k: v for k, v in h.items() if k.startswith("buffer")}) for h in history
    ]
    assert all(h["segments"] == 6 for h in history), per_step
    assert sum(h["segments"] - h["final_segments"] for h in history) > 0  # trained before the end
    assert max(h["off_policy_token_share"] for h in history) > 0  # later chunks: newer policies
    buffer = TrajectoryStore.open(redis_url, job)
    assert buffer.counts()["groups_trained"] >= 1
    buffer.delete_job()


@pytest.mark.timeout(300)
def test_streaming_job_with_uneven_lengths_never_waits_for_segments_that_cannot_come(
    tiny_model_dir, redis_url, tmp_path
):
    """Responses end at EOS (uneven lengths): once every group in flight has finished generating,
    fewer segments than a full step may be left; the step trains them instead of waiting forever
    (ready groups count toward the in-flight target, so nothing new would start)."""
    job = "stream-uneven"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=4",
                "rollout.max_new_tokens=40",
                "rollout.chunk_tokens=4",
                "data.num_generated=64",
                "logging.progress=false",
                "algorithm.name=ppo",
                "april.streaming_chunk_tokens=8",
                "steps=6",
                "cluster.launcher=local",  # the streaming loop is the driver's (both launchers: above)
            ],
        )
    )
    assert len(history) == 6
    assert all(0 < h["segments"] <= 8 for h in history)
    TrajectoryStore.open(redis_url, job).delete_job()
