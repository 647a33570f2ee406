"""RL algorithms: each file owns how its algorithm turns a batch into a loss.

An algorithm is built from the config and answers three things for the learner:
  needs_critic                          whether the learner trains a value model beside the policy
  prepare(batch, ...) -> UpdateTensors  advantages (and returns), once per update, no grad
  loss(micro-batch, fixed, forward)     the scalar to minimise and its metrics

The learner does everything else (micro-batching, accumulation, optimizers, clipping, weights).
To add an algorithm: a file here with a class of that shape, and its name in ALGORITHMS (and in
`AlgorithmConfig.name`). One that keeps GRPO's loss and differs only in each response's advantage
subclasses GRPO and overrides `sequence_advantages` (rloo.py, dr_grpo.py, opo.py, grpo_passk.py).

  ppo                    critic + token-level GAE, clipped surrogate, value loss     (ppo.py)
  grpo                   group-normalised Â_i, clipped surrogate                    (grpo.py)
  gspo                   GRPO's Â_i, clipped SEQUENCE ratio (geometric mean)         (gspo.py)
  cispo                  GRPO's Â_i, REINFORCE weighted by the clipped detached IS   (cispo.py)
  rloo                   leave-one-out Â_i, clipped surrogate                        (rloo.py)
  reinforce_pp           discounted token returns (KL in the reward), batch-whitened (reinforce_pp.py)
  reinforce_pp_baseline  the same on group-centred scores                            (reinforce_pp.py)
  dr_grpo                centred Â_i (no std), Σ_t ℓ / C with a constant C           (dr_grpo.py)
  opo                    r_i − the group's length-weighted mean, clipped surrogate   (opo.py)
  grpo_passk             the group's best alone, by its margin over the runner-up    (grpo_passk.py)
Any of them can add DAPO's overlong length penalty to the scores (shaping.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.cispo import CISPO
from slime.algorithms.corrections import Correction, make_correction
from slime.algorithms.dr_grpo import DrGRPO
from slime.algorithms.grpo import GRPO
from slime.algorithms.grpo_passk import GRPOPassK
from slime.algorithms.gspo import GSPO
from slime.algorithms.opo import OPO
from slime.algorithms.ppo import PPO
from slime.algorithms.reinforce_pp import ReinforcePP, ReinforcePPBaseline
from slime.algorithms.rloo import RLOO
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


ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO,
    "ppo": PPO,
    "gspo": GSPO,
    "cispo": CISPO,
    "rloo": RLOO,
    "reinforce_pp": ReinforcePP,
    "reinforce_pp_baseline": ReinforcePPBaseline,
    "dr_grpo": DrGRPO,
    "opo": OPO,
    "grpo_passk": GRPOPassK,
}


def make_algorithm(cfg: JobConfig) -> Algorithm:
    """The algorithm `cfg.algorithm.name` names, with the job's off-policy correction."""
    clip = (cfg.algorithm.clip_low, cfg.algorithm.clip_high)
    return ALGORITHMS[cfg.algorithm.name](cfg.algorithm, make_correction(cfg.algorithm.correction, clip))
