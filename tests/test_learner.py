"""The learner on real groups in a real Redis buffer (no Ray): exactly-once claims, real updates,
gradient accumulation equal to one big batch, PPO with a critic, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime.buffer import RedisBuffer
from slime.config import load_config
from slime.learner import Learner
from slime.sample import Status


def _fill(buffer: RedisBuffer, groups: int, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for g in range(groups):
        gid = buffer.add_group([6, 7, 77, 61, 86], n, 16, {"task": "repeat", "label": "ababab"})
        leased = buffer.lease(f"w{g}", n)
        assert len(leased) == n
        for s in leased:
            length = int(rng.integers(2, 12))
            tokens = rng.integers(3, 100, size=length)
            buffer.append_chunk(s.id, f"w{g}", tokens, -rng.random(length), 0)
            buffer.finish(s.id, f"w{g}", Status.COMPLETED, reward=float(rng.random()))
        assert buffer.get_group(gid)


def _learner(tiny_model_dir, redis_url, job, tmp_path, *overrides) -> Learner:
    cfg = load_config(None, [f"job_name={job}", f"output_dir={tmp_path}", *overrides])
    return Learner(cfg, str(tiny_model_dir), redis_url)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_train_step_consumes_each_group_once_and_updates(tiny_model_dir, redis_url, tmp_path, algo):
    job = f"learner-{algo}"
    buffer = RedisBuffer(redis_url, job)
    buffer.delete_job()
    _fill(buffer, groups=3, n=4)
    learner = _learner(tiny_model_dir, redis_url, job, tmp_path, f"algorithm.name={algo}", "rollout.batch_size=2",
                       "algorithm.kl_coef=0.01")
    before = [p.detach().clone() for p in learner.policy.parameters()]
    m = learner.train_step(0, num_groups=2)
    assert m["groups"] == 2 and m["samples"] == 8 and m["policy_version"] == 1
    assert np.isfinite(m["loss"]) and "kl" in m
    if algo == "ppo":
        assert "vf_loss" in m and "critic_grad_norm" in m
    changed = sum(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))
    assert changed > 0
    m2 = learner.train_step(1, num_groups=2)
    assert m2["groups"] == 1  # only one group was left: nothing is claimed twice
    m3 = learner.train_step(2, num_groups=2)
    assert m3["groups"] == 0
    c = buffer.counts()
    assert c["groups_trained"] == 3 and c["groups_ready"] == 0
    assert buffer.get_policy_version() == 3
    buffer.delete_job()


def test_gradient_accumulation_equals_one_batch(tiny_model_dir, redis_url, tmp_path):
    grads = []
    for micro in (32, 3):
        job = f"learner-accum-{micro}"
        buffer = RedisBuffer(redis_url, job)
        buffer.delete_job()
        _fill(buffer, groups=2, n=4, seed=5)
        learner = _learner(tiny_model_dir, redis_url, job, tmp_path, f"learner.micro_batch_size={micro}",
                           "rollout.batch_size=2", "algorithm.router_aux_coef=0")
        learner.train_step(0, num_groups=2)
        # The (clipped) gradient of the one optimizer step is still on the parameters.
        grads.append({n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.grad is not None})
        buffer.delete_job()
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7), name


def test_failed_samples_are_not_trained(tiny_model_dir, redis_url, tmp_path):
    job = "learner-failed"
    buffer = RedisBuffer(redis_url, job)
    buffer.delete_job()
    gid = buffer.add_group([6, 7, 77, 61, 86], 3, 16, {"task": "repeat"})
    for i, s in enumerate(buffer.lease("w", 3)):
        buffer.append_chunk(s.id, "w", [10, 11, 12], [-1.0, -1.0, -1.0], 0)
        if i == 0:
            buffer.finish(s.id, "w", Status.FAILED, failure="reward raised ValueError")
        else:
            buffer.finish(s.id, "w", Status.COMPLETED, reward=float(i))
    assert buffer.get_group(gid)
    learner = _learner(tiny_model_dir, redis_url, job, tmp_path, "rollout.batch_size=1")
    m = learner.train_step(0, num_groups=1)
    assert m["failed_samples"] == 1 and m["trained_tokens"] == 6
    assert m["reward_mean"] == pytest.approx(1.5)
    buffer.delete_job()


def test_checkpoint_roundtrip(tiny_model_dir, redis_url, tmp_path):
    job = "learner-ckpt"
    buffer = RedisBuffer(redis_url, job)
    buffer.delete_job()
    _fill(buffer, groups=1, n=4)
    learner = _learner(tiny_model_dir, redis_url, job, tmp_path, "rollout.batch_size=1", "algorithm.name=ppo")
    learner.train_step(0, num_groups=1)
    learner.save(str(tmp_path / "ckpt"))
    fresh = _learner(tiny_model_dir, redis_url, job, tmp_path, "rollout.batch_size=1", "algorithm.name=ppo")
    assert fresh.load(str(tmp_path / "ckpt")) == 1
    for a, b in zip(learner.policy.parameters(), fresh.policy.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(learner.critic.parameters(), fresh.critic.parameters()):
        assert torch.equal(a, b)
    probe = learner.probe_logprobs([6, 7, 77, 61, 86], [6, 7, 6])
    assert probe.shape == (3,) and np.all(probe <= 0)
    buffer.delete_job()
