"""reward.scope=group in the learner: rank 0 scores each group it claims, all its responses in one
call (rewards/group.py), before the update; the scores go into the claimed samples and the buffer.
The rollout workers score nothing then. A group trained after a restart (its claim was not
committed) is scored again when it is claimed again."""

from __future__ import annotations

import time

from rewards.group import GroupScorer, load_group_reward
from slime.buffer import TrajectoryStore
from slime.config import JobConfig
from slime.data import sample_reward_inputs
from slime.model import load_tokenizer, rollout_stop_token_ids
from slime.sample import Sample, Status

# In the metadata of a sample its group's reward failed: the status it generated with, so that a
# scoring of the group after a restart (a requeued claim) scores it again and can restore it.
GENERATED = "generated_status"


class GroupRewards:
    def __init__(self, cfg: JobConfig, model_dir: str) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.stop = set(rollout_stop_token_ids(cfg.rollout, self.tokenizer))
        rc = cfg.reward
        self.scorer = GroupScorer(load_group_reward(rc.fn), rc.timeout_s, rc.max_concurrency)

    def score(self, groups: list[list[Sample]], buffer: TrajectoryStore) -> dict[str, float]:
        """Score each group's samples that generated (their responses only; a sample an earlier
        scoring of this group failed is scored again); a failed score fails its sample, with the
        reason. Returns the step's metrics."""
        started = time.time()
        scored = [[s for s in g if s.status != Status.FAILED or GENERATED in s.metadata] for g in groups]
        scored = [g for g in scored if g]
        items = [
            [
                sample_reward_inputs(
                    s, _generated_status(s), self.tokenizer, self.stop, self.scorer.reads_model_text, _row(s.metadata)
                )
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
                meta = _row(sample.metadata)
                generated = Status(sample.metadata.get(GENERATED, sample.status.value))
                meta["reward_latency_s"] = result.latency_s
                if result.info:
                    meta["reward_info"] = result.info
                if failure is None:
                    sample.status, sample.reward, sample.failure = generated, result.reward, None
                else:  # what it generated as, for a scoring of this group after a restart
                    meta[GENERATED] = generated.value
                    sample.status, sample.reward, sample.failure = Status.FAILED, None, failure
                sample.metadata = meta
                writes.append((sample.id, sample.reward, failure, meta, sample.status))
        buffer.set_rewards(writes)
        return {"group_reward_seconds": time.time() - started, "group_reward_hung_calls": float(self.scorer.hung)}

    def close(self) -> None:
        self.scorer.close()


def _row(metadata: dict) -> dict:
    """A sample's metadata without what an earlier scoring of its group wrote."""
    return {k: v for k, v in metadata.items() if k not in (GENERATED, "reward_info", "reward_latency_s")}


def _generated_status(sample: Sample) -> Status:
    """How its generation ended (an earlier failed scoring of the group keeps it under GENERATED)."""
    return Status(sample.metadata.get(GENERATED, sample.status.value))
