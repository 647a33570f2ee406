"""Masked importance sampling (verl's rollout-correction "mask" presets): weights outside a band
are masked, not clipped, so a token (or sequence) far off-policy gives no gradient at all.

Token level:
  ρ_t = π_old(a_t|s_t) / μ(a_t|s_t)
  w_t = ρ_t  if 1/c ≤ ρ_t ≤ c,  else 0

Sequence level (one weight per response i, over its trainable tokens):
  ρ_i = Π_t ρ_t = exp(Σ_t log ρ_t)
  w_{i,t} = ρ_i  if 1/c ≤ ρ_i ≤ c,  else 0
"""

from __future__ import annotations

import math

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class MaskedISToken:
    name = "mis_token"
    batch_level = False

    def __init__(self, cap: float) -> None:
        self.log_cap = abs(math.log(cap))

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        log_ratio = x.log_ratio
        inside = log_ratio.abs() <= self.log_cap
        weights = torch.where(inside, torch.exp(log_ratio), 0.0) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))


class MaskedISSequence:
    name = "mis_seq"
    batch_level = False

    def __init__(self, cap: float) -> None:
        self.log_cap = abs(math.log(cap))

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        seq_log_ratio = x.log_ratio.sum(-1)  # log ρ_i
        inside = seq_log_ratio.abs() <= self.log_cap
        seq_weight = torch.where(inside, torch.exp(seq_log_ratio.clamp(max=self.log_cap)), 0.0)
        weights = seq_weight[:, None] * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
