"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen).

Advantages are GRPO's group-relative Â_i (grpo_std_normalize as for GRPO). The ratio is per
SEQUENCE, the geometric mean of the token ratios over response i's trainable tokens y_i:

  s_i(θ) = exp( 1/|y_i| Σ_t log(π_θ(y_{i,t}) / π_old(y_{i,t})) )

written per token so that autograd gives the right gradient:

  s_{i,t}(θ) = sg[s_i(θ)] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]     (value s_i, ∇ = s_i ∇log π_θ(y_{i,t}))

  L(θ) = 1/G Σ_i 1/|y_i| Σ_t −min(s_{i,t} Â_i, clip(s_{i,t}, 1 − ε_low, 1 + ε_high) Â_i) · w_t
         − c_H·H(π_θ) + β·KL(π_θ ‖ π_ref)

so ∇L = −1/G Σ_i s_i Â_i · 1/|y_i| Σ_t ∇log π_θ(y_{i,t}) where the clip is inactive. ε_low/ε_high
are algorithm.gspo.clip_low/clip_high (GspoConfig, 3e-4/4e-4, the paper's: a sequence ratio moves far less than
a token ratio); the learner's clip range (and adaptive clip) is not used. The surrogate is always
the mean over sequences of the token mean (the paper's objective); the regularisers use
algorithm.loss_agg, which the config requires to be a seq_* mode so that the learner weighs
micro-batches by their sequences. w_t are the off-policy correction's weights, per token.

Under `behaviour_clip` the ratio of a token an older version sampled is taken against that
sampler, μ (as for every algorithm). A token the learner's current version sampled keeps π_old:
its μ differs from π_old only by the engine's numerics, and that gap alone is wider than GSPO's
band. With a bf16 engine (a per-token log-ratio spread of a few 1e-3 over a few hundred tokens)
a sequence's mean log-ratio falls outside ±4e-4 for many on-policy sequences, which then got no
gradient at all in a sync job.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.core import add_regularizers, masked_mean, policy_loss
from slime.algorithms.corrections import surrogate_terms
from slime.algorithms.grpo import GRPO
from slime.algorithms.kl import kl_penalty


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GSPO surrogate on [N, T] tensors (advantages broadcast per sequence).

    stats: policy_loss's (its clipfrac is the share of tokens whose sequence is clipped), with
    approx_kl, ratio_mean and ratio_max of the TOKEN ratios (comparable with the other
    algorithms), plus seq_ratio_mean, seq_ratio_max and seq_clipfrac over the sequences.
    """
    log_ratio = logp - old_logp
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach()  # log s_i
    token_log_ratio = seq_log_ratio[:, None] + logp - logp.detach()  # log s_{i,t}
    loss, stats = policy_loss(
        token_log_ratio,
        torch.zeros_like(logp),
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        "seq_mean_token_mean",
        is_weights,
    )
    with torch.no_grad():
        has_tokens = mask.sum(-1) > 0
        seq_ratio = seq_log_ratio.exp()[has_tokens]
        seq_adv = advantages.sum(-1)[has_tokens] / mask.sum(-1)[has_tokens]
        clipped = torch.where(seq_adv > 0, seq_ratio > 1 + clip_high, seq_ratio < 1 - clip_low) & (seq_adv != 0)
        ratio = log_ratio.exp()
        n_seqs = max(1, seq_ratio.numel())
        stats.update(
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
            ratio_mean=masked_mean(ratio, mask).item(),
            ratio_max=ratio[mask > 0].max().item() if has_tokens.any() else 0.0,
            seq_ratio_mean=seq_ratio.sum().item() / n_seqs,
            seq_ratio_max=seq_ratio.max().item() if seq_ratio.numel() else 0.0,
            seq_clipfrac=clipped.float().sum().item() / n_seqs,
        )
    return loss, stats


class GSPO(GRPO):
    """GRPO's advantages; the clipped surrogate on the sequence-level ratio."""

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L(θ) on one micro-batch; clip_low/clip_high (the learner's PPO range) are not used."""
        cfg = self.cfg
        # behaviour_clip: μ is the base of the stale tokens only (module docstring)
        terms = surrogate_terms(self.correction, batch, fixed, out.logp, fresh_keep_old=True)
        loss, stats = gspo_policy_loss(
            out.logp,
            terms.base_logp,
            fixed.advantages,
            batch.mask,
            cfg.gspo.clip_low,
            cfg.gspo.clip_high,
            cfg.dual_clip,
            terms.weights,
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
