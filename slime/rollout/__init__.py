"""Rollout workers (room 3): one engine each; they drive the engine, the environment of a
multi-turn episode and the reward, and write every token to the buffer.

`RolloutWorker` loads on first use, so that `slime.rollout.filter_hub` (what filter files written
for THUDM's slime import) costs no engine import.
"""

from typing import Any

__all__ = ["RolloutWorker"]


def __getattr__(name: str) -> Any:
    if name == "RolloutWorker":
        from slime.rollout.worker import RolloutWorker

        return RolloutWorker
    raise AttributeError(f"module 'slime.rollout' has no attribute {name!r}")
