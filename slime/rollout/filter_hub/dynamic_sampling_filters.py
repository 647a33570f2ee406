"""DAPO's dynamic sampling as slime names it: keep a group whose rewards are not all the same
(april.filter_zero_variance does the same without a function)."""

from __future__ import annotations

from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    rewards = [float(s.get_reward_value(args)) for s in samples]
    if max(rewards, default=0.0) > min(rewards, default=0.0):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1) if rewards else 'empty'}")
