"""Truncated importance sampling (TIS; Ionides 2008, as in slime/verl for train-inference mismatch).

  ρ_t = π_old(a_t|s_t) / μ(a_t|s_t)
  w_t = min(ρ_t, c)

Only large weights are cut: a token the policy has moved away from (ρ_t < 1) keeps its small weight.
offpolicy_clipped_share counts the tokens with ρ_t > c.
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class TruncatedIS:
    name = "tis"
    batch_level = False

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        ratio = torch.exp(x.log_ratio)
        weights = ratio.clamp(max=self.cap) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights, clipped=ratio > self.cap))
