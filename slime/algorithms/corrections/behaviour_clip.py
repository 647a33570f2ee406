"""The surrogate's ratio and clip taken against the behaviour policy (PPO's own form for data an
older policy sampled; OpenRLHF and verl without recomputation do the same).

  r_t = π_θ(a_t|s_t) / μ(a_t|s_t)          instead of π_θ / π_old
  ℓ_t = −min(r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t)
  w_t = 1

Why: with one optimizer step per batch, π_old is π_θ at the start of the step, so a clip around
π_old never bites and a stale token is pushed by its full advantage (times its IS weight) even
where the policy has already moved past μ in that direction. Around μ, such a token (r_t beyond
1 + ε_high with Â_t > 0, or under 1 − ε_low with Â_t < 0) gives no gradient: the trust region is
kept against the policy that sampled the token, however many versions ago. Inside the band r_t
is the importance weight itself. Tokens off the loss mask keep π_old, so padding (μ's logprob
undefined there) never enters the ratio.

offpolicy_clipped_share counts the trainable tokens whose ρ_t = π_old/μ already lies outside
[1 − ε_low, 1 + ε_high] when the step starts (the clip's reach before any step is taken).
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class BehaviourClip:
    name = "behaviour_clip"
    batch_level = False
    against_behaviour = True  # the algorithms take the surrogate's ratio against μ (surrogate_terms)

    def __init__(self, clip_low: float, clip_high: float) -> None:
        self.clip_low, self.clip_high = clip_low, clip_high

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        ratio = torch.exp(x.log_ratio)
        outside = (ratio < 1.0 - self.clip_low) | (ratio > 1.0 + self.clip_high)
        return CorrectionOutput(None, ratio_stats(x, None, clipped=outside))
