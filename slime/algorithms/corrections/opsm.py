"""Off-policy sequence masking (OPSM, DeepSeek-V3.2): a negative-advantage response that the current
policy already finds unlikely relative to the sampler is dropped; positive ones are always kept.

  D_i = (1/|o_i|) Σ_t log(μ(a_t|s_t) / π_old(a_t|s_t))        (a sampled estimate of KL(μ ‖ π_old))
  M_{i,t} = 0  if Â_{i,t} < 0 and D_i > δ,  else 1
  L = −min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t) · M_{i,t}     (normalised over all tokens)

Pushing such a sequence down further mostly adds noise: the policy has already moved away from it.
"""

from __future__ import annotations

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats, sequence_mean


class OPSM:
    name = "opsm"
    batch_level = False

    def __init__(self, delta: float) -> None:
        self.delta = delta

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        divergence = sequence_mean(-x.log_ratio, x.mask)  # D_i
        drop = (x.advantages < 0) & (divergence > self.delta)[:, None]
        weights = (~drop).to(x.mask.dtype) * x.mask
        return CorrectionOutput(weights, ratio_stats(x, weights))
