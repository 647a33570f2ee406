"""RL algorithms: each file owns how its algorithm turns a batch into a loss.

An algorithm is built from the config and answers three things for the learner:
  needs_critic                          whether the learner trains a value model beside the policy
  prepare(batch, ...) -> UpdateTensors  advantages (and returns), once per update, no grad
  loss(micro-batch, fixed, forward)     the scalar to minimise and its metrics

The learner does everything else (micro-batching, accumulation, optimizers, clipping, weights).
To add an algorithm: a file here with a class of that shape, and its name in ALGORITHMS (and in
`AlgorithmConfig.name`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.corrections import Correction, make_correction
from slime.algorithms.grpo import GRPO
from slime.algorithms.ppo import PPO
from slime.config import AlgorithmConfig, JobConfig


class Algorithm(Protocol):
    needs_critic: bool

    def __init__(self, cfg: AlgorithmConfig, correction: Correction) -> None: ...

    def prepare(
        self,
        batch: Batch,
        *,
        kl_coef: float,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        old_values: torch.Tensor | None = None,
        bootstrap_values: torch.Tensor | None = None,
    ) -> UpdateTensors: ...

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPO, "ppo": PPO}


def make_algorithm(cfg: JobConfig) -> Algorithm:
    """The algorithm `cfg.algorithm.name` names, with the job's off-policy correction."""
    return ALGORITHMS[cfg.algorithm.name](cfg.algorithm, make_correction(cfg.april))
