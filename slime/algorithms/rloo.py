"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024; Kool et al. 2019).

Each response's baseline is the mean reward of the OTHER responses to the same prompt, so the
baseline does not depend on the response itself (no bias) and needs no critic:

  Â_i = r_i − 1/(G−1) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean(r_1..r_G))       Â_{i,t} = Â_i

A group of one has no other response: its Â is 0. The loss is GRPO's: PPO's clipped surrogate on
Â_{i,t} with the learner's clip range, w_t the off-policy correction's weights, and the
regularisers (algorithm.loss_agg).
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch
from slime.algorithms.grpo import GRPO, dense_groups, group_sum, in_constant_group


@torch.no_grad()
def leave_one_out_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Â_i [N] from scores [N] and integer group ids [N] (any ids, any order); valid samples only.

    A group of one, or a group whose rewards are all equal, gets exactly 0.
    """
    if scores.numel() == 0:
        return scores.clone()
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    group, num_groups = dense_groups(group_index)
    count = group_sum(torch.ones_like(scores), group, num_groups)
    mean = group_sum(scores, group, num_groups) / count
    size = count[group]
    adv = size / (size - 1).clamp_min(1.0) * (scores - mean[group])
    # a group of one has no baseline
    return torch.where(in_constant_group(scores, group, num_groups) | (size < 2), 0.0, adv)


class RLOO(GRPO):
    """Leave-one-out advantages, then GRPO's clipped-surrogate loss; no critic."""

    def sequence_advantages(self, scores: torch.Tensor, batch: Batch, valid: torch.Tensor) -> torch.Tensor:
        return leave_one_out_advantages(scores, batch.group_index[valid])
