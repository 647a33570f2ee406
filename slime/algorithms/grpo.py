"""GRPO: group-relative advantages, no critic (Shao et al. 2024, DeepSeekMath).

For the G responses o_1..o_G sampled for one prompt, with scalar rewards r_1..r_G:

  Â_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps)     then Â_{i,t} = Â_i for every token t of o_i

std is the population std (unbiased=False): DeepSeekMath/verl use the sample std, which is larger
by sqrt(G/(G−1)) and so gives slightly smaller advantages. std_normalize=False keeps only the
centring (Dr. GRPO), which does not up-weight groups that are nearly solved or nearly failed.

The loss per token is PPO's clipped surrogate on Â_{i,t}, with the regularisers:

  r_t(θ) = π_θ(a_t|s_t) / π_old(a_t|s_t)
  L(θ) = −min(r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t) · w_t − c_H·H(π_θ) + β·KL(π_θ ‖ π_ref)

w_t are the off-policy correction's weights vs the behaviour policy (algorithm.correction.name; see
slime/algorithms/corrections/). The KL to π_ref is a loss term only: GRPO has no per-token reward to shape, so kl_mode="reward" adds none.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.core import AggMode, add_regularizers, policy_loss
from slime.algorithms.corrections import Correction, surrogate_terms
from slime.algorithms.kl import kl_penalty
from slime.algorithms.shaping import shape_scores
from slime.config import AlgorithmConfig


@torch.no_grad()
def dense_groups(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Group ids 0..G-1 [N] for integer group ids [N] (any ids, in any order), and G."""
    _, group = torch.unique(group_index, return_inverse=True)
    return group, int(group.max().item()) + 1 if group.numel() else 0


def group_sum(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Σ of `values` [N] per group: [G]."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group, values)


def group_mean_std(scores: torch.Tensor, group: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's mean and population std [G]."""
    count = group_sum(torch.ones_like(scores), group, num_groups)
    mean = group_sum(scores, group, num_groups) / count
    return mean, (group_sum((scores - mean[group]) ** 2, group, num_groups) / count).sqrt()


def in_constant_group(scores: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[N] bool: the row's group has one score only. Its advantage is set to exactly 0: float
    round-off in a baseline would leave tiny non-zero values."""
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full_like(high, torch.inf)
    return (high.scatter_reduce(0, group, scores, "amax") == low.scatter_reduce(0, group, scores, "amin"))[group]


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Â_i [N] from scores [N] and integer group ids [N] (any ids, in any order).

    The scores must be of valid samples only: the caller drops failed samples (no reward) first.
    A group whose rewards are all equal (including a group of one) carries no signal: its Â is
    exactly 0.
    """
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    group, num_groups = dense_groups(group_index)
    mean, std = group_mean_std(scores, group, num_groups)
    centered = scores - mean[group]
    if std_normalize:
        centered = centered / (std[group] + eps)
    return torch.where(in_constant_group(scores, group, num_groups), 0.0, centered)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Â_{i,t} = Â_i on every trainable token of response i: [N] x [N, T] -> [N, T]."""
    return advantages[:, None].to(mask.dtype) * mask


def grpo_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | torch.Tensor,
    clip_high: float | torch.Tensor,
    dual_clip: float | None,
    agg_mode: AggMode,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    router_aux: torch.Tensor | None = None,
    router_aux_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = L_clip − c_H·H + β·KL(π_θ ‖ π_ref) + c_aux·L_aux; advantages are token-level [N, T].

    entropy: per-token H [N, T]; kl: per-token kl_penalty(logp, ref_logp) [N, T], None when unused;
    router_aux: scalar MoE load-balancing loss. stats: policy_loss's, plus entropy, kl,
    router_aux (when given) and loss.
    """
    loss, stats = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg_mode, is_weights)
    loss = add_regularizers(
        loss, stats, mask, agg_mode, entropy, entropy_coef, kl, kl_coef, router_aux, router_aux_coef
    )
    return loss, stats


class GRPO:
    """Group-relative advantages from the scores, then the clipped surrogate; no critic."""

    needs_critic = False

    def __init__(self, cfg: AlgorithmConfig, correction: Correction) -> None:
        self.cfg = cfg
        self.correction = correction

    @torch.no_grad()
    def prepare(
        self,
        batch: Batch,
        *,
        kl_coef: float,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        old_values: torch.Tensor | None = None,
        bootstrap_values: torch.Tensor | None = None,
    ) -> UpdateTensors:
        """Â_{i,t} = Â_i of row i (sequence_advantages). Rows without trainable tokens (failed,
        fully masked) take no part in their group. No critic: values and bootstrap are unused."""
        valid = batch.mask.sum(-1) > 0
        scores, metrics = shape_scores(batch.scores, batch, self.cfg)  # DAPO overlong shaping, when set
        adv_seq = torch.zeros(batch.mask.shape[0], device=batch.mask.device, dtype=scores.dtype)
        if valid.any():
            adv_seq[valid] = self.sequence_advantages(scores[valid], batch, valid).to(adv_seq.dtype)
        advantages = broadcast_to_tokens(adv_seq, batch.mask)
        return UpdateTensors(advantages=advantages, old_logp=old_logp, ref_logp=ref_logp, metrics=metrics)

    def sequence_advantages(self, scores: torch.Tensor, batch: Batch, valid: torch.Tensor) -> torch.Tensor:
        """Â_i of the `valid` rows from their (shaped) scores; the algorithms built on GRPO's loss
        that differ only here (RLOO, Dr. GRPO, OPO, pass@k) override this."""
        return group_advantages(scores, batch.group_index[valid], std_normalize=self.cfg.grpo_std_normalize)

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L(θ) on one micro-batch (`batch` and `fixed` cut to the same rows)."""
        cfg = self.cfg
        # One update per batch: π_old is π_θ before its step, i.e. this forward without grad.
        terms = surrogate_terms(self.correction, batch, fixed, out.logp)
        eps_low, eps_high = terms.clip_range(clip_low, clip_high)  # per token under behaviour_clip's band
        kl = None
        if fixed.ref_logp is not None and cfg.kl_mode == "loss":
            kl = kl_penalty(out.logp, fixed.ref_logp, cfg.kl_estimator)
        loss, stats = grpo_loss(
            logp=out.logp,
            old_logp=terms.base_logp,
            advantages=fixed.advantages,
            mask=batch.mask,
            clip_low=eps_low,
            clip_high=eps_high,
            dual_clip=cfg.dual_clip,
            agg_mode=cfg.loss_agg,
            entropy=out.entropy,
            entropy_coef=cfg.entropy_coef,
            kl=kl,
            kl_coef=kl_coef,
            router_aux=out.router_aux,
            router_aux_coef=cfg.router_aux_coef,
            is_weights=terms.weights,
        )
        stats.update(terms.stats)
        return loss, stats
