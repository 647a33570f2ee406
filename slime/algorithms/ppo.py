"""PPO with a critic and token-level GAE (Schulman et al. 2017; GAE: Schulman et al. 2016).

Each trainable response token is one action a_t; the state s_t is the prompt plus everything
before it. The sequence-level score is a reward on the last trainable token, optionally with a
−β·KL penalty on every token (kl_mode="reward") and process-reward step scores.

  δ_t = r_t + γ V(s_{t+1}) − V(s_t)
  Â_t = Σ_l (γλ)^l δ_{t+l}          (computed backwards: Â_t = δ_t + γλ Â_{t+1})
  R_t = Â_t + V(s_t)                 (the critic's regression target)

Streaming (GLM-5): a segment of a trajectory that goes on ends in a state s_end that is not
terminal, so GAE bootstraps from the critic there: V(s_{T+1}) = V(s_end) instead of 0.

The loss, per token (Â_t whitened over the batch when normalize_advantages):

  r_t(θ) = π_θ(a_t|s_t) / π_old(a_t|s_t)
  L(θ, φ) = −min(r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t) · w_t
            + c_v · ½ max((V_φ − R_t)², (V_old + clip(V_φ − V_old, −ε_v, ε_v) − R_t)²)
            − c_H·H(π_θ) + β·KL(π_θ ‖ π_ref)          (the KL term when kl_mode="loss")

w_t are the off-policy correction's weights vs the behaviour policy (algorithm.correction.name; see
slime/algorithms/corrections/).
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, Forward, UpdateTensors
from slime.algorithms.core import (
    AggMode,
    add_regularizers,
    aggregate_loss,
    masked_mean,
    masked_whiten,
    policy_loss,
)
from slime.algorithms.corrections import Correction, surrogate_terms
from slime.algorithms.kl import kl_penalty
from slime.algorithms.shaping import shape_scores
from slime.config import AlgorithmConfig


@torch.no_grad()
def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """r_t [B, T]: score[b] on the last mask==1 token of row b, + token_rewards, − β·kl on every masked token.

    Rewards on mask-0 positions are dropped (GAE skips those positions), so place step scores on
    trainable tokens. A row without trainable tokens gets no reward.
    """
    B, T = mask.shape
    trainable = mask > 0
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(trainable, positions, -1).max(dim=-1).values  # −1 for an empty row
    rewards = torch.zeros_like(mask, dtype=scores.dtype if scores.is_floating_point() else torch.float32)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    if token_rewards is not None:
        rewards = rewards + token_rewards
    if kl is not None:
        rewards = rewards - kl_coef * kl
    return rewards * mask


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the trainable tokens: 1 when the critic predicts the returns, 0
    when it predicts no better than their mean, below 0 when worse (verl's critic/vf_explained_var)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float("nan") if var_returns <= 1e-12 else (1.0 - var_residual / var_returns).item()


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trainable tokens only. Returns (Â, R), both [B, T].

    Env/tool tokens (mask 0) in the middle of a response are not actions of the policy: they are
    skipped, so for a trainable token t, "t+1" is the NEXT TRAINABLE token and one γ step spans
    the whole tool call (the observation is part of s_{t+1}). Their rewards and values are ignored.

    After the last trainable token V(s_{t+1}) = bootstrap_values[b]: the critic's value of the
    state where an unfinished trajectory stopped (the learner passes it for streamed segments whose
    trajectory goes on); None or 0 means terminal. A response cut at max_new_tokens is terminal here,
    as in verl and OpenRLHF.
    Â and R are 0 where mask is 0.
    """
    B, T = rewards.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    if bootstrap_values is not None:
        next_value = bootstrap_values.to(values.dtype).clone()
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        trainable = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # δ_t
        adv_t = delta + gamma * lam * next_adv  # Â_t = δ_t + γλ Â_{t+1}
        advantages[:, t] = torch.where(trainable, adv_t, 0.0)
        # A skipped token leaves "the next trainable step" unchanged for the tokens before it.
        next_value = torch.where(trainable, values[:, t], next_value)
        next_adv = torch.where(trainable, adv_t, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg_mode: AggMode,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss ½ max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²); ½ (V − R)² without clip.

    stats: vf_loss, vf_clipfrac (share of tokens where the clipped branch is larger), value_mean.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss_mat = 0.5 * unclipped
        clipped_active = torch.zeros_like(mask)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (values_clipped - returns) ** 2
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipped_active = (clipped > unclipped).to(mask.dtype)
    loss = aggregate_loss(loss_mat, mask, agg_mode)
    with torch.no_grad():
        stats = {
            "vf_loss": loss.item(),
            "vf_clipfrac": masked_mean(clipped_active, mask).item(),
            "value_mean": masked_mean(values, mask).item(),
        }
    return loss, stats


def ppo_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | torch.Tensor,
    clip_high: float | torch.Tensor,
    dual_clip: float | None,
    value_clip: float | None,
    vf_coef: float,
    agg_mode: AggMode,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    router_aux: torch.Tensor | None = None,
    router_aux_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = L_clip + c_v·L_V − c_H·H + β·KL + c_aux·L_aux (each per-token term aggregated with agg_mode).

    entropy: per-token H [B, T] (entropy_from_logits); kl: per-token kl_penalty(logp, ref_logp)
    when the KL is in the loss (pass None when it is a reward penalty); router_aux: scalar MoE
    load-balancing loss. stats: policy_loss's and value_loss's, plus entropy, kl, router_aux
    (when given) and loss.
    """
    loss, stats = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg_mode, is_weights)
    vf, vf_stats = value_loss(values, old_values, returns, mask, value_clip, agg_mode)
    stats.update(vf_stats)
    loss = loss + vf_coef * vf
    loss = add_regularizers(
        loss, stats, mask, agg_mode, entropy, entropy_coef, kl, kl_coef, router_aux, router_aux_coef
    )
    return loss, stats


class PPO:
    """Token-level GAE on the critic's values, then the clipped surrogate plus the value loss."""

    needs_critic = True

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
        """r_t, then (Â_t, R_t) by GAE on V_old. bootstrap_values [N]: V(s_end) for rows whose
        trajectory goes on (streaming), 0 for the rest; None: every row ends in a terminal state."""
        cfg = self.cfg
        if old_values is None:
            raise ValueError("PPO needs the critic's values V_old(s_t)")
        kl_reward = None
        if cfg.kl_mode == "reward" and ref_logp is not None:
            kl_reward = kl_penalty(batch.behaviour_logp, ref_logp, cfg.kl_estimator)  # −β·KL on every r_t
        # A row with token rewards (e.g. a PRM's step scores) uses those alone: its scalar score is
        # their aggregate, so adding it on the last token too would count the reward twice.
        outcome = batch.scores
        if batch.token_reward_rows is not None:
            outcome = batch.scores.masked_fill(batch.token_reward_rows, 0.0)
        if bootstrap_values is not None and cfg.overlong_buffer is not None:
            raise ValueError("algorithm.overlong_buffer needs whole responses: it does not apply to streaming")
        outcome, shaping = shape_scores(outcome, batch, cfg)  # DAPO overlong shaping, when set
        rewards = token_level_rewards(outcome, batch.mask, kl_reward, kl_coef, batch.token_rewards)
        advantages, returns = gae(rewards, old_values, batch.mask, cfg.gamma, cfg.lam, bootstrap_values)
        if cfg.normalize_advantages:
            advantages = masked_whiten(advantages, batch.mask) * batch.mask
        metrics = {
            "advantage_mean": masked_mean(advantages, batch.mask).item(),
            "return_mean": masked_mean(returns, batch.mask).item(),
            "vf_explained_var": explained_variance(old_values, returns, batch.mask),
            **shaping,
        }
        if kl_reward is not None:  # KL(π_behaviour ‖ π_ref) per token: what kl_coef penalises
            metrics["kl_reward_mean"] = masked_mean(kl_reward, batch.mask).item()
        return UpdateTensors(
            advantages=advantages,
            returns=returns,
            old_values=old_values,
            old_logp=old_logp,
            ref_logp=ref_logp,
            metrics=metrics,
        )

    def loss(
        self, batch: Batch, fixed: UpdateTensors, out: Forward, *, clip_low: float, clip_high: float, kl_coef: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L(θ, φ) on one micro-batch (`batch` and `fixed` cut to the same rows)."""
        cfg = self.cfg
        if out.values is None or fixed.returns is None or fixed.old_values is None:
            raise ValueError("PPO's loss needs the critic's values and the returns from prepare")
        # One update per batch: π_old is π_θ before its step, i.e. this forward without grad.
        terms = surrogate_terms(self.correction, batch, fixed, out.logp)
        eps_low, eps_high = terms.clip_range(clip_low, clip_high)  # per token under behaviour_clip's band
        kl = None
        if fixed.ref_logp is not None and cfg.kl_mode == "loss":
            kl = kl_penalty(out.logp, fixed.ref_logp, cfg.kl_estimator)
        loss, stats = ppo_loss(
            logp=out.logp,
            old_logp=terms.base_logp,
            advantages=fixed.advantages,
            values=out.values,
            old_values=fixed.old_values,
            returns=fixed.returns,
            mask=batch.mask,
            clip_low=eps_low,
            clip_high=eps_high,
            dual_clip=cfg.dual_clip,
            value_clip=cfg.value_clip,
            vf_coef=cfg.vf_coef,
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
