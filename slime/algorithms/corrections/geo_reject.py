"""Geometric sequence rejection (verl's "geometric" rejection sampling): keep a whole response when
the geometric mean of its token ratios is inside a band, drop it otherwise. The geometric mean does
not grow with length the way the product does, so long and short responses face the same test.

  g_i = exp( (1/|o_i|) Σ_t log(π_old(a_t|s_t) / μ(a_t|s_t)) )
  w_{i,t} = 1  if low ≤ g_i ≤ high,  else 0
"""

from __future__ import annotations

import math

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats, sequence_mean


class GeometricRejection:
    name = "geo_reject"
    batch_level = False

    def __init__(self, low: float, high: float) -> None:
        if not 0 < low <= 1 <= high:
            raise ValueError(f"geo_band must satisfy 0 < low <= 1 <= high, got [{low}, {high}]")
        self.log_low, self.log_high = math.log(low), math.log(high)

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        log_g = sequence_mean(x.log_ratio, x.mask)
        keep = (log_g >= self.log_low) & (log_g <= self.log_high)
        weights = keep.to(x.mask.dtype)[:, None] * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
