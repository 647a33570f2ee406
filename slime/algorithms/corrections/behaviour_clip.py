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

How: the correction hands the algorithm μ as the ratio's base and the band per token
(`ClipBand`), built at loss time from the ε the update clips with, so an adaptive clip widens it
too. GRPO, PPO and Dr. GRPO clip each token with its own band; `algorithm.dual_clip` still
bounds r_t = π_θ/μ where it did. GSPO's sequence-level clip and CISPO's capped weight take the ratio against μ
with their own band, not widened: theirs are not one PPO step per version. GSPO keeps π_old as the
base of the tokens the current version sampled: the engine's numerics alone (bf16) move a
sequence's mean log-ratio past its band of 4e-4 (slime/algorithms/gspo.py). Tokens off the loss
mask keep π_old, so padding (μ's logprob undefined there) never enters the ratio.

offpolicy_clipped_share counts the trainable tokens whose ρ_t = π_old/μ already lies outside
their band (with the configured ε), on the side their advantage's sign makes bite, when the step
starts.
"""

from __future__ import annotations

import torch

from slime.algorithms.corrections.base import ClipBand, CorrectionInputs, CorrectionOutput, ratio_stats


class BehaviourClip:
    name = "behaviour_clip"
    batch_level = False

    def __init__(self, clip_low: float, clip_high: float, per_version: bool = True, cap: float = 2.0) -> None:
        self.clip_low, self.clip_high = clip_low, clip_high
        self.per_version = per_version
        self.cap = cap

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        band = None
        eps_low: float | torch.Tensor = self.clip_low
        eps_high: float | torch.Tensor = self.clip_high
        if self.per_version and x.lag is not None:
            band = ClipBand(x.lag.to(x.mask.dtype), self.cap)
            eps_low, eps_high = band.bounds(self.clip_low, self.clip_high)
        ratio = torch.exp(x.log_ratio)
        above, below = ratio > 1.0 + eps_high, ratio < 1.0 - eps_low
        outside = torch.where(x.advantages > 0, above, torch.where(x.advantages < 0, below, above | below))
        # surrogate_terms takes the base on trainable tokens only (padding keeps π_old)
        return CorrectionOutput(None, ratio_stats(x, None, clipped=outside), x.behaviour_logp, band)
