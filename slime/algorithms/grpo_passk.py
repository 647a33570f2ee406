"""GRPO for pass@k: only the best response of each group is reinforced (arXiv:2503.19595, as
verl's `grpo_passk`).

Pass@k rewards a prompt by the best of its k samples, so a response matters only when it is the
group's best, and then by how much it beats the runner-up. For the G responses to one prompt, with
rewards r_1..r_G, b the first index of the largest reward and r_(2) the largest of the others:

  Â_b = (r_b − r_(2)) / (std(r_1..r_G) + eps)        Â_i = 0 for i ≠ b        Â_{i,t} = Â_i

std is the population std, as in grpo.py; algorithm.grpo_std_normalize=false keeps r_b − r_(2).
Tied best responses give Â = 0 (the runner-up is as good); a group of one has no runner-up: 0.
The loss is GRPO's clipped surrogate with the regularisers.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch
from slime.algorithms.grpo import GRPO, dense_groups, group_mean_std


@torch.no_grad()
def best_of_group_advantages(
    scores: torch.Tensor, group_index: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Â_i [N] from scores [N] and integer group ids [N] (any ids, any order); valid samples only."""
    if scores.numel() == 0:
        return scores.clone()
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    group, num_groups = dense_groups(group_index)
    rows = torch.arange(scores.numel(), device=scores.device)
    best_score = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best_score = best_score.scatter_reduce(0, group, scores, "amax")
    # the first row of each group that holds its best score
    candidates = torch.where(scores == best_score[group], rows, scores.numel())
    best_row = torch.full((num_groups,), scores.numel(), device=scores.device).scatter_reduce(
        0, group, candidates, "amin"
    )
    is_best = rows == best_row[group]
    others = torch.where(is_best, -torch.inf, scores)
    runner_up = torch.full_like(best_score, -torch.inf).scatter_reduce(0, group, others, "amax")
    margin = best_score - runner_up  # +inf for a group of one
    if std_normalize:
        margin = margin / (group_mean_std(scores, group, num_groups)[1] + eps)
    return torch.where(is_best & torch.isfinite(runner_up[group]), margin[group], 0.0)


class GRPOPassK(GRPO):
    """Best-of-group advantages, then GRPO's clipped-surrogate loss; no critic."""

    def sequence_advantages(self, scores: torch.Tensor, batch: Batch, valid: torch.Tensor) -> torch.Tensor:
        return best_of_group_advantages(scores, batch.group_index[valid], std_normalize=self.cfg.grpo_std_normalize)
