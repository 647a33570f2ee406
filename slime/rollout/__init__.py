"""Rollout workers (room 3): one engine each; they drive the engine, the environment of a
multi-turn episode and the reward, and write every token to the buffer."""

from slime.rollout.worker import RolloutWorker

__all__ = ["RolloutWorker"]
