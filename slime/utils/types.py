"""`from slime.utils.types import Sample` for reward files written for THUDM's slime.

A slime-style reward, `async def rm(args, sample)`, reads the sample's text, label and metadata;
this `Sample` is what it receives here (rewards/adapters.py), so such a file loads unchanged. Only
what a reward reads is filled in: the prompt and response text, the label, the dataset columns as
`metadata`, and `status` (`Sample.Status`, equal to its lower-case name as a string too). The
rollout's tokens and logprobs live in the buffer (slime.sample.Sample), not here.
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
