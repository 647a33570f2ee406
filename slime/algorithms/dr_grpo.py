"""Dr. GRPO: GRPO done right (Liu et al. 2025, "Understanding R1-Zero-like training").

GRPO's two normalisations bias the update: dividing Â by the group's std up-weights nearly
solved or nearly failed prompts, and dividing each response's loss by its own length |o_i|
shrinks the penalty on long wrong answers. Dr. GRPO drops both:

  Â_i = r_i − mean(r_1..r_G)                                       Â_{i,t} = Â_i
  ℓ_{i,t} = −min(r_t Â_i, clip(r_t, 1 − ε_low, 1 + ε_high) Â_i) · w_t     (PPO's, learner's clip range)
  L(θ) = 1/G Σ_i (1/C) Σ_t (ℓ_{i,t} − c_H·H_{i,t} + β·KL_{i,t})

C is a constant, not a length: algorithm.dr_grpo.norm_tokens (DrGrpoConfig), or None (the default) for each
sample's generation budget max_new_tokens (the paper divides by the generation budget too), so
every token weighs the same whatever the length of its response. The regularisers are summed and
divided the same way.

Micro-batches: the loss is a mean over sequences, and the config turns algorithm.loss_agg to
seq_mean_token_sum for dr_grpo (token_mean is refused), so the learner weighs each micro-batch
by its share of sequences and the accumulated gradient equals the one of the whole batch.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.core import add_regularizers, masked_mean, policy_loss
from slime.algorithms.corrections import surrogate_terms
from slime.algorithms.grpo import GRPO, group_advantages
from slime.algorithms.kl import kl_penalty


def norm_constants(batch: Batch, norm_tokens: int | None) -> torch.Tensor:
    """C per row [n, 1]: norm_tokens, or each row's max_new_tokens when None."""
    n = batch.mask.shape[0]
    if norm_tokens is not None:
        return torch.full((n, 1), float(norm_tokens), dtype=batch.mask.dtype, device=batch.mask.device)
    if batch.max_new_tokens is None:
        raise ValueError("dr_grpo needs algorithm.dr_grpo.norm_tokens or each row's max_new_tokens in the batch")
    return batch.max_new_tokens.to(batch.mask.device, batch.mask.dtype)[:, None]


class DrGRPO(GRPO):
    """Centred group advantages (no std) and a loss summed over tokens over a constant."""

    def sequence_advantages(self, scores: torch.Tensor, batch: Batch, valid: torch.Tensor) -> torch.Tensor:
        """Â_i = r_i − mean of its group."""
        return group_advantages(scores, batch.group_index[valid], std_normalize=False)

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L(θ) on one micro-batch. stats: policy_loss's, the regularisers' and dr_grpo_norm (mean C)."""
        cfg = self.cfg
        terms = surrogate_terms(self.correction, batch, fixed, out.logp)
        eps_low, eps_high = terms.clip_range(clip_low, clip_high)  # per token under behaviour_clip's band
        inv_c = 1.0 / norm_constants(batch, cfg.dr_grpo.norm_tokens)
        # 1/C is a constant per row: it rides with the (detached) correction weights, and the
        # seq_mean_token_sum aggregate then gives mean_i Σ_t ℓ_{i,t} / C.
        weights = inv_c if terms.weights is None else terms.weights * inv_c
        loss, stats = policy_loss(
            out.logp,
            terms.base_logp,
            fixed.advantages,
            batch.mask,
            eps_low,
            eps_high,
            cfg.dual_clip,
            "seq_mean_token_sum",
            weights,
        )
        kl_per_token = None
        if fixed.ref_logp is not None and cfg.kl_mode == "loss":
            kl_per_token = kl_penalty(out.logp, fixed.ref_logp, cfg.kl_estimator)
        kl = kl_per_token * inv_c if kl_per_token is not None else None
        entropy = out.entropy * inv_c if out.entropy is not None else None
        loss = add_regularizers(
            loss,
            stats,
            batch.mask,
            "seq_mean_token_sum",
            entropy,
            cfg.entropy_coef,
            kl,
            kl_coef,
            out.router_aux,
            cfg.router_aux_coef,
        )
        # The stats are per-token means, as under the other algorithms (the adaptive β reads kl).
        if kl_per_token is not None:
            stats["kl"] = masked_mean(kl_per_token.detach(), batch.mask).item()
        if out.entropy is not None:
            stats["entropy"] = masked_mean(out.entropy.detach(), batch.mask).item()
        stats["dr_grpo_norm"] = (1.0 / inv_c).mean().item()
        stats.update(terms.stats)
        return loss, stats
