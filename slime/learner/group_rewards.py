"""reward.scope=group in the learner: rank 0 scores each group it claims, all its responses in one
call (rewards/group.py), before the update; the scores go into the claimed samples and the buffer.
The rollout workers score nothing then. A group trained after a restart (its claim was not
committed) is scored again when it is claimed again."""

from __future__ import annotations

import time

from rewards.group import GroupScorer, load_group_reward
from slime.buffer import TrajectoryStore
from slime.config import JobConfig
from slime.data import reward_inputs
from slime.model import load_tokenizer, rollout_stop_token_ids
from slime.sample import Sample, Status


class GroupRewards:
    def __init__(self, cfg: JobConfig, model_dir: str) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.stop = set(rollout_stop_token_ids(cfg.rollout, self.tokenizer))
        rc = cfg.reward
        self.scorer = GroupScorer(load_group_reward(rc.fn), rc.timeout_s, rc.max_concurrency)

    def score(self, groups: list[list[Sample]], buffer: TrajectoryStore) -> dict[str, float]:
        """Score the samples of `groups` that did not fail already (their responses only); a failed
        score fails its sample, with the reason. Returns the step's metrics."""
        started = time.time()
        scored = [[s for s in g if s.status != Status.FAILED] for g in groups]
        scored = [g for g in scored if g]
        items = [
            [
                reward_inputs(s.metadata, s.prompt_ids.tolist(), s.response_ids.tolist(), self.tokenizer, self.stop)
                for s in g
            ]
            for g in scored
        ]
        writes = []
        for group, results in zip(scored, self.scorer.score(items)):
            for sample, result in zip(group, results):
                failure = result.failure
                if failure is None and result.steps is not None:
                    failure = "a group reward gives one reward per response, not per-step rewards (step_scores)"
                sample.metadata = {**sample.metadata, "reward_latency_s": result.latency_s}
                if result.info:
                    sample.metadata["reward_info"] = result.info
                if failure is None:
                    sample.reward = result.reward
                else:
                    sample.status, sample.failure, sample.reward = Status.FAILED, failure, None
                writes.append((sample.id, sample.reward, failure, sample.metadata))
        buffer.set_rewards(writes)
        return {"group_reward_seconds": time.time() - started, "group_reward_hung_calls": float(self.scorer.hung)}

    def close(self) -> None:
        self.scorer.close()
