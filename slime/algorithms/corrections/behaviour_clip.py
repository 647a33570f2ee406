"""The surrogate's ratio and clip taken against the behaviour policy (PPO's own form for data an
older policy sampled; OpenRLHF and verl without recomputation do the same), with a band that
widens by one PPO step per version the sampler lags.

  r_t = π_θ(a_t|s_t) / μ(a_t|s_t)          instead of π_θ / π_old
  k_t = versions between μ and π_old (0 for a token the learner's current version sampled)
  ℓ_t = −min(r_t Â_t, clip(r_t, lo_t, hi_t) Â_t)
  lo_t = max((1 − ε_low)^(k_t+1), 1/c),   hi_t = min((1 + ε_high)^(k_t+1), c)   (c ≥ 1 + ε_high)

Why against μ: with one optimizer step per batch, π_old is π_θ at the start of the step, so a clip
around π_old never bites and a stale token is pushed by its full advantage (times its IS weight)
even where the policy has already moved past μ in that direction (tis collapsed async and APRIL at
lr 1e-3 that way; docs/offpolicy.md). Around μ, such a token gets no gradient. Inside the band
r_t is the importance weight itself.

Why the band widens: every version since μ was itself one update, allowed to move a token's
probability by up to (1 + ε) (PPO's band, one step at a time). A fixed band around μ would allow a
token sampled k versions ago no more movement in k + 1 updates than a fresh token gets in one, so
the tokens the policy is learning fastest (a stop token whose probability grows step after step)
drop out of the gradient first. In one 50-step run (2 seeds) a fixed band left APRIL's and async's
greedy policies running to the length cap on 65-85% of held-out prompts, against 5-23% for sync;
a 3-seed study then could not tell the two bands apart on held-out reward (docs/offpolicy.md).
With `clip_band_per_version=False` the band is [1 − ε_low, 1 + ε_high] for every token.

Why the cap c (`tis_cap`, 2 by default): APRIL's partials carry tokens up to 12 versions old, and
a band of 1.28^13 is no trust region at all. Uncapped, such tokens brought back the spikes of
KL(μ‖π_old) (0.2-0.3) that made tis collapse, and APRIL's held-out reward fell at the end (2 seeds).

How, with the algorithms' fixed-band clip: only one side of the clip can bite for a given sign of
Â_t (the upper for Â_t > 0, the lower for Â_t < 0), so the ratio's base is moved to
b_t = μ·hi_t/(1 + ε_high) (Â_t > 0) or μ·lo_t/(1 − ε_low) (Â_t < 0), and the weight w_t = b_t/μ
restores the gradient: w_t·∇(π_θ/b_t) = ∇(π_θ/μ) inside the band, 0 beyond it. Tokens off the loss
mask keep π_old, so padding (μ's logprob undefined there) never enters the ratio.

offpolicy_clipped_share counts the trainable tokens whose ρ_t = π_old/μ already lies outside
their band, on the side their advantage's sign makes bite, when the step starts.
"""

from __future__ import annotations

import math

import torch

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class BehaviourClip:
    name = "behaviour_clip"
    batch_level = False

    def __init__(self, clip_low: float, clip_high: float, per_version: bool = True, cap: float = 2.0) -> None:
        self.clip_low, self.clip_high = clip_low, clip_high
        self.per_version = per_version
        self.log_cap = math.log(max(cap, 1.0 + clip_high, 1.0 / (1.0 - clip_low)))

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        trainable = x.mask > 0
        lag = x.lag if (self.per_version and x.lag is not None) else torch.zeros_like(x.mask)
        lag = torch.where(trainable, lag.to(x.mask.dtype).clamp_min(0), 0.0)
        up, down = math.log1p(self.clip_high), math.log1p(-self.clip_low)
        # log(b_t/μ): the base moves only toward the side the advantage's sign makes bite
        shift_up = (lag * up).clamp(max=self.log_cap - up)
        shift_down = (lag * down).clamp(min=-self.log_cap - down)
        shift = torch.where(x.advantages > 0, shift_up, torch.where(x.advantages < 0, shift_down, 0.0))
        ratio_base = torch.where(trainable, x.behaviour_logp + shift, x.old_logp)
        weights = torch.where(trainable, torch.exp(shift), 0.0) if bool((lag > 0).any()) else None
        log_ratio = x.log_ratio
        above = log_ratio > shift_up + up
        below = log_ratio < shift_down + down
        outside = torch.where(x.advantages > 0, above, torch.where(x.advantages < 0, below, above | below))
        return CorrectionOutput(weights, ratio_stats(x, weights, clipped=outside & trainable), ratio_base)
