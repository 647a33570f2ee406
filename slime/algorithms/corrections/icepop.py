"""IcePop (Ring-1T, inclusionAI 2025): calibrate each token by its train/inference probability ratio
and mask the tokens where the two disagree too much.

  k_t = π_old(a_t|s_t) / μ(a_t|s_t)
  M(k) = k  if α ≤ k ≤ β,  else 0
  L = −min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t) · M(k_t)      (normalised over all tokens)

Defaults α = 0.5, β = 5 (the paper's): a wide band upward, a narrow one downward.
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class IcePop:
    name = "icepop"
    batch_level = False

    def __init__(self, low: float, high: float) -> None:
        if not 0 < low <= 1 <= high:
            raise ValueError(f"icepop band must satisfy 0 < low <= 1 <= high, got [{low}, {high}]")
        self.low, self.high = low, high

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        k = torch.exp(x.log_ratio)
        weights = torch.where((k >= self.low) & (k <= self.high), k, 0.0) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
