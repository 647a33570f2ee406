"""`from slime.utils.types import Sample` for reward files written for THUDM's slime.

A slime-style reward, `async def rm(args, sample)`, reads the sample's text, label and metadata;
this `Sample` is what it receives here (rewards/adapters.py), so such a file loads unchanged. Only
what a reward reads is filled in: the prompt and response text, the label, the dataset columns as
`metadata`, `response_length` (tokens; the ids are `metadata["response_ids"]`), `reward` (for a
group filter) and `status` (`Sample.Status`, equal to its lower-case name as a string too). The
rollout's per-token arrays live in the buffer (slime.sample.Sample), not here: reading one of
slime's names for them raises an AttributeError that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    class Status(str, Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    prompt: str | list[dict[str, str]] = ""
    response: str = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: Any = None
    status: Status = Status.COMPLETED
    index: int | None = None
    group_index: int | None = None
    response_length: int = 0

    def get_reward_value(self, args: Any) -> Any:
        """The reward, or its ``args.reward_key`` entry when the reward is a dict (as slime reads it)."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_CARRIED:
            raise AttributeError(
                f"Sample.{name}: a reward or filter gets the text, label, metadata, response_length and "
                f"reward here; the response's token ids are metadata['response_ids'], and per-token "
                f"arrays (loss mask, logprobs) stay in the buffer"
            )
        raise AttributeError(f"'Sample' object has no attribute {name!r}")


# slime's Sample fields a reward here does not get (tokens and per-token arrays, engine state).
_NOT_CARRIED = frozenset(
    {"tokens", "loss_mask", "rollout_log_probs", "rollout_routed_experts", "multimodal_inputs", "weight_versions"}
)
