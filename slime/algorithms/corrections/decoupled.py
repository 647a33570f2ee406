"""Decoupled PPO (AReaL, Fu et al. 2025): the trust region is taken around a proximal policy, and the
behaviour policy only enters through an importance weight.

  π_prox = π_old, the learner's weights before this update
  r_t(θ) = π_θ(a_t|s_t) / π_prox(a_t|s_t)                  (the clipped ratio, as in every algorithm here)
  w_t    = π_prox(a_t|s_t) / μ(a_t|s_t)                    (no truncation)
  L      = −min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t) · w_t
  tokens with w_t > c are masked (AReaL's behav_imp_weight_cap)

π_prox needs one forward of the current weights over the batch before the update. With one
optimizer step per batch (ppo_epochs = num_minibatches = 1) that forward is the update's own
first forward, detached: same weights, same inputs, so no extra pass is run. With more steps the
learner recomputes π_old once before the first step.
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class DecoupledPPO:
    name = "decoupled"
    batch_level = False

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        ratio = torch.exp(x.log_ratio)
        weights = torch.where(ratio > self.cap, 0.0, ratio) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
