"""REINFORCE++ and REINFORCE++-baseline (Hu 2025): token-level returns, no critic, the batch
as the baseline.

Per trainable token, the score on the response's last trainable token and a KL penalty on every
token (when kl_coef > 0, against π_ref, estimated on the behaviour policy's log-probs as PPO's
kl_mode="reward" does):

  r_t = score·[t = last] − β·KL_t              (+ token rewards, e.g. a PRM's, as in PPO)
  G_t = Σ_{s≥t} γ^{s−t} r_s                    (over trainable tokens: env/tool tokens are skipped)
  Â_t = (G_t − mean(G)) / std(G)               (mean and std over every trainable token of the batch)

REINFORCE++-baseline first centres the scores within each prompt's group, score_i − mean(group),
then the same; a row with token rewards (env.turn_rewards, a PRM's) keeps them and gets −mean(group)
on its last trainable token. The loss is GRPO's: PPO's clipped surrogate on Â_t with the learner's clip range,
w_t the off-policy correction's weights, and the entropy regulariser. The KL is always a reward
penalty here (the method's definition), never a loss term, whatever algorithm.kl_mode says.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch, UpdateTensors
from slime.algorithms.core import masked_mean, masked_whiten
from slime.algorithms.grpo import GRPO, group_advantages
from slime.algorithms.kl import kl_penalty
from slime.algorithms.ppo import gae, token_level_rewards
from slime.algorithms.shaping import shape_scores


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{s≥t} γ^{s−t} r_s over the trainable tokens, [B, T]; 0 where mask is 0.

    This is GAE with V ≡ 0 and λ = 1 (δ_t = r_t, Â_t = r_t + γ Â_{t+1}).
    """
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


class ReinforcePP(GRPO):
    """Token rewards with the KL penalty, discounted returns, batch-whitened; GRPO's loss."""

    baseline = False

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
        """Â_t from the (shaped, for the baseline variant centred) scores. metrics: return_mean
        (masked mean of G_t before whitening), kl_reward_mean (of KL_t, when penalised)."""
        cfg = self.cfg
        raw, metrics = shape_scores(batch.scores, batch, cfg)
        scores = raw
        if self.baseline:
            valid = batch.mask.sum(-1) > 0
            scores = raw.clone()
            if valid.any():
                scores[valid] = group_advantages(raw[valid], batch.group_index[valid], std_normalize=False)
        if batch.token_reward_rows is not None:
            # As in PPO, such a row's token rewards replace its score; the baseline variant still takes
            # its group's mean score off (score − mean − score), on the last trainable token.
            scores = torch.where(batch.token_reward_rows, scores - raw if self.baseline else 0.0, scores)
        kl = None
        if kl_coef > 0 and ref_logp is not None:
            kl = kl_penalty(batch.behaviour_logp, ref_logp, cfg.kl_estimator)
            metrics["kl_reward_mean"] = masked_mean(kl, batch.mask).item()
        rewards = token_level_rewards(scores, batch.mask, kl, kl_coef, batch.token_rewards)
        returns = discounted_returns(rewards, batch.mask, cfg.gamma)
        metrics["return_mean"] = masked_mean(returns, batch.mask).item()
        advantages = masked_whiten(returns, batch.mask)
        # ref_logp stays out of UpdateTensors: the KL is in the reward, not in the loss.
        return UpdateTensors(advantages=advantages, old_logp=old_logp, metrics=metrics)


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++ on group-centred scores."""

    baseline = True
