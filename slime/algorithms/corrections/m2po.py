"""M2PO (Zheng et al. 2025, second-moment trust policy optimisation): bound the second moment of the
log importance ratio over the batch by masking its most extreme tokens, and weight the rest by
their full (untruncated) ratio.

  M2 = mean over trainable tokens of (log ρ_t)²,   ρ_t = π_old(a_t|s_t) / μ(a_t|s_t)
  while M2 > τ: mask the token with the largest (log ρ_t)²   (τ = 0.04 in the paper)
  w_t = ρ_t on kept tokens, 0 on masked ones

The mask depends on the whole batch, so the learner computes it once per update (batch_level).
Sorting once gives the smallest number k of tokens to mask: the mean of the remaining n − k
smallest squares, each sum accumulated from the smallest square up, in float64. (S − top-k sum)
would cancel: a few masked tokens at (log ρ)² ≈ 400 leave float32 sums about 3e-5 off, enough to
mask one token too many or one too few near τ.
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class M2PO:
    name = "m2po"
    batch_level = True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        log_ratio = x.log_ratio
        trainable = x.mask > 0
        squares = log_ratio[trainable].double() ** 2
        n = squares.numel()
        keep_flat = torch.ones(n, dtype=torch.bool, device=squares.device)
        if n and squares.mean() > self.threshold:
            order = torch.argsort(squares, descending=True)
            # entry k: the sum of squares[order[k:]], the n − k smallest, summed from the smallest up
            kept_sum = torch.cumsum(squares[order].flip(0), 0).flip(0)  # [n]
            kept_count = torch.arange(n, 0, -1, device=squares.device, dtype=squares.dtype)  # n − k
            ok = kept_sum / kept_count <= self.threshold
            k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n  # n: even the smallest is above τ
            keep_flat[order[:k]] = False
        keep = torch.zeros_like(trainable)
        keep[trainable] = keep_flat
        weights = torch.where(keep, torch.exp(log_ratio), 0.0) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
