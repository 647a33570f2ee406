"""Tensor math shared by PPO and GRPO.

Every per-token tensor is [B, T] over RESPONSE tokens, with a float `mask` [B, T]:
1 = a token the policy produced and we train on, 0 = padding or an env/tool token.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
OffPolicyMode = str  # algorithm.correction.name; only "mask_stale" changes the loss mask here


MAX_LOG_RATIO = 20.0  # |log π_θ/π_old| beyond this is clamped in the policy loss


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the entries where mask == 1 (0 when there are none)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + eps), with μ, σ² (population variance) over the masked entries only.

    shift_mean=False adds μ back (scale only). Masked-out entries come back as 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean:          Σ_{b,t} m·ℓ / Σ_{b,t} m            (every token weighs the same)
    seq_mean_token_sum:  mean_b Σ_t m·ℓ                     (Dr. GRPO style, no length normalisation)
    seq_mean_token_mean: mean_b (Σ_t m·ℓ / Σ_t m)           (every sequence weighs the same)
    The seq_* modes average over the sequences that have at least one trainable token.
    """
    if mode == "token_mean":
        return masked_mean(loss_mat, mask)
    has_tokens = (mask.sum(-1) > 0).to(loss_mat.dtype)
    if mode == "seq_mean_token_sum":
        per_seq = (loss_mat * mask).sum(-1)
    elif mode == "seq_mean_token_mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    if not bool((mask > 0).any()):
        return 0.0
    return x[mask > 0].max().item()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | torch.Tensor,
    clip_high: float | torch.Tensor,
    dual_clip: float | None,
    agg_mode: AggMode,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate (PPO), with decoupled clip range (DAPO "clip-higher") and dual clip.
    clip_low/clip_high are scalars, or [N, T] per token (behaviour_clip's band per version).

    r_t = π_θ(a_t|s_t) / π_old(a_t|s_t) = exp(logp − old_logp)
    ℓ_t = −min(r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t)
    dual clip (Ye et al. 2020), for Â_t < 0 only:  ℓ_t = min(ℓ_t, −c Â_t)   (bounds the loss when r_t ≫ 1)
    is_weights (truncated importance-sampling weights vs the behaviour policy, no grad) scale ℓ_t.

    Returns (loss to minimise, stats). stats:
      pg_loss, clipfrac (share of tokens where the ε clip is the active branch),
      dual_clipfrac (share where the dual clip is active; 0 when disabled),
      approx_kl (masked mean of the k3 estimate of KL(π_old ‖ π_θ): (r − 1) − log r),
      ratio_mean, ratio_max.
    """
    # Clamped (as verl does) so one token's log-ratio beyond ~88 cannot make the step's loss or
    # gradient inf/NaN and skip the whole update; such a token gets no gradient.
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surr_unclipped = -advantages * ratio
    surr_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(surr_unclipped, surr_clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        dual_bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss_mat > dual_bound)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual_bound), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, agg_mode)

    with torch.no_grad():
        clipped = (surr_clipped > surr_unclipped).to(mask.dtype)
        k3 = torch.expm1(log_ratio) - log_ratio
        stats = {
            "pg_loss": loss.item(),
            "clipfrac": masked_mean(clipped, mask).item(),
            "dual_clipfrac": masked_mean(dual_active.to(mask.dtype), mask).item(),
            "approx_kl": masked_mean(k3, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": _masked_max(ratio, mask),
        }
    return loss, stats


def stale_tokens(versions: torch.Tensor, mask: torch.Tensor, policy_version: int) -> torch.Tensor:
    """[B, T] bool: trainable tokens sampled by a policy older than `policy_version`."""
    return (versions < policy_version) & (mask > 0)


def off_policy_mask(mask: torch.Tensor, stale: torch.Tensor, mode: OffPolicyMode) -> torch.Tensor:
    """The loss mask under `mode`: "mask_stale" drops the stale tokens; "none" and "tis" keep all."""
    if mode == "mask_stale":
        return mask * (~stale).float()
    return mask


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p_v log p_v per position: [..., V] -> [...].

    log p = logits − logsumexp(logits) keeps it stable; −inf logits (top-k/top-p masking)
    contribute 0 instead of 0·(−inf) = nan.
    """
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    p = logp.exp()
    return -(p * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)


def add_regularizers(
    loss: torch.Tensor,
    stats: dict[str, float],
    mask: torch.Tensor,
    agg_mode: AggMode,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    kl: torch.Tensor | None,
    kl_coef: float,
    router_aux: torch.Tensor | None,
    router_aux_coef: float,
) -> torch.Tensor:
    """loss − c_H·H + β·KL + c_aux·L_aux (per-token terms aggregated like the loss); fills stats.
    stats' entropy and kl are per-token means whatever the aggregation (the adaptive KL controller
    reads kl as one), so a sum over each sequence's tokens does not read as a larger KL."""
    if entropy is not None:
        loss = loss - entropy_coef * aggregate_loss(entropy, mask, agg_mode)
        stats["entropy"] = masked_mean(entropy.detach(), mask).item()
    if kl is not None:
        loss = loss + kl_coef * aggregate_loss(kl, mask, agg_mode)
        stats["kl"] = masked_mean(kl.detach(), mask).item()
    if router_aux is not None:
        loss = loss + router_aux_coef * router_aux
        stats["router_aux"] = router_aux.item()
    stats["loss"] = loss.item()
    return loss
