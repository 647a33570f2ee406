"""OPO: on-policy RL with the optimal reward baseline (Hao et al. 2025).

The baseline that minimises the policy gradient's variance, when a response's gradient norm grows
with its length, is the length-weighted mean reward of the group. For the G responses o_1..o_G to
one prompt, with rewards r_1..r_G and |o_i| trainable tokens each:

  b = Σ_j |o_j| r_j / Σ_j |o_j|        Â_i = r_i − b        Â_{i,t} = Â_i

No std normalisation (it would reintroduce the per-group scaling the baseline is chosen to avoid).
A group whose rewards are all equal, or a group of one, gets Â = 0. OPO's other half is exact
on-policy training, one gradient step per batch: the learner's defaults (learner.ppo_epochs=1,
learner.num_minibatches=1). The loss is GRPO's clipped surrogate with the regularisers.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch
from slime.algorithms.grpo import GRPO, dense_groups, group_sum, in_constant_group


@torch.no_grad()
def length_weighted_baseline_advantages(
    scores: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """Â_i [N] from scores [N], response lengths [N] (> 0) and integer group ids [N]; valid samples only."""
    if scores.numel() == 0:
        return scores.clone()
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    lengths = lengths.to(scores.dtype)
    group, num_groups = dense_groups(group_index)
    baseline = group_sum(lengths * scores, group, num_groups) / group_sum(lengths, group, num_groups)
    return torch.where(in_constant_group(scores, group, num_groups), 0.0, scores - baseline[group])


class OPO(GRPO):
    """Length-weighted group baseline, then GRPO's clipped-surrogate loss; no critic."""

    def sequence_advantages(self, scores: torch.Tensor, batch: Batch, valid: torch.Tensor) -> torch.Tensor:
        return length_weighted_baseline_advantages(scores, batch.mask[valid].sum(-1), batch.group_index[valid])
