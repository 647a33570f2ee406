"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025).

Advantages are GRPO's group-relative Â_i (grpo_std_normalize as for GRPO). PPO's clip drops
the gradient of every token whose ratio leaves the trust region (often the rare tokens that
matter); CISPO clips the importance-sampling WEIGHT instead and detaches it, so every token keeps
its REINFORCE gradient:

  r_t(θ) = π_θ(a_t|s_t) / π_old(a_t|s_t)
  ℓ_t(θ) = −sg(min(r_t, 1 + ε_IS_high)) · Â_t · log π_θ(a_t|s_t) · w_t
  L(θ) = agg(ℓ_t) − c_H·H(π_θ) + β·KL(π_θ ‖ π_ref)          (agg: algorithm.loss_agg, token_mean by default)

∇ℓ_t = −min(r_t, 1 + ε_IS_high) · Â_t · ∇log π_θ(a_t|s_t): nonzero for every token with Â_t ≠ 0.
No lower bound on the weight (the paper sets ε_IS_low large and tunes only ε_IS_high).
ε_IS_high is algorithm.cispo.clip_high (CispoConfig). w_t are the off-policy correction's weights.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.core import AggMode, add_regularizers, aggregate_loss, masked_mean
from slime.algorithms.corrections import surrogate_terms
from slime.algorithms.grpo import GRPO
from slime.algorithms.kl import kl_penalty


def cispo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_high: float,
    agg_mode: AggMode,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """agg(−sg(min(r_t, 1 + ε)) · Â_t · log π_θ · w_t) on [N, T] tensors.

    stats: pg_loss, clipfrac (share of tokens whose IS weight is capped), is_weight_mean,
    approx_kl (k3 of KL(π_old ‖ π_θ)), ratio_mean, ratio_max.
    """
    log_ratio = (logp - old_logp).detach()
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=1.0 + clip_high)
    loss_mat = -weight * advantages * logp
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, agg_mode)
    with torch.no_grad():
        has_tokens = bool((mask > 0).any())
        stats = {
            "pg_loss": loss.item(),
            "clipfrac": masked_mean((ratio > 1.0 + clip_high).to(mask.dtype), mask).item(),
            "is_weight_mean": masked_mean(weight, mask).item(),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask > 0].max().item() if has_tokens else 0.0,
        }
    return loss, stats


class CISPO(GRPO):
    """GRPO's advantages; the REINFORCE loss weighted by the clipped, detached IS ratio."""

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L(θ) on one micro-batch; clip_low/clip_high (the learner's PPO range) are not used."""
        cfg = self.cfg
        terms = surrogate_terms(self.correction, batch, fixed, out.logp)
        loss, stats = cispo_policy_loss(
            out.logp, terms.base_logp, fixed.advantages, batch.mask, cfg.cispo.clip_high, cfg.loss_agg, terms.weights
        )
        kl = None
        if fixed.ref_logp is not None and cfg.kl_mode == "loss":
            kl = kl_penalty(out.logp, fixed.ref_logp, cfg.kl_estimator)
        loss = add_regularizers(
            loss,
            stats,
            batch.mask,
            cfg.loss_agg,
            out.entropy,
            cfg.entropy_coef,
            kl,
            kl_coef,
            out.router_aux,
            cfg.router_aux_coef,
        )
        stats.update(terms.stats)
        return loss, stats
