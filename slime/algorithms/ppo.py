"""PPO with a critic and token-level GAE (Schulman et al. 2017; GAE: Schulman et al. 2016).

Each trainable response token is one action a_t; the state s_t is the prompt plus everything
before it. The sequence-level score is a reward on the last trainable token, optionally with a
−β·KL penalty on every token (kl_mode="reward") and process-reward step scores.

  δ_t = r_t + γ V(s_{t+1}) − V(s_t)
  Â_t = Σ_l (γλ)^l δ_{t+l}          (computed backwards: Â_t = δ_t + γλ Â_{t+1})
  R_t = Â_t + V(s_t)                 (the critic's regression target)
"""

from __future__ import annotations

import torch

from slime.algorithms.core import AggMode, add_regularizers, aggregate_loss, masked_mean, policy_loss


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
    state where an unfinished (aborted/truncated) trajectory stopped; None or 0 means terminal.
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
    clip_low: float,
    clip_high: float,
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
