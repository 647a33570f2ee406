"""No reweighting.

none:        w_t = 1. Tokens of older policies train as if the current policy had sampled them.
mask_stale:  w_t = 1, but tokens sampled by a version older than the trainer's are removed from
             the loss mask before the advantages are computed (the learner does this, because
             it changes which rows take part in a group's mean; see core.off_policy_mask).
"""

from __future__ import annotations

from slime.algorithms.corrections.base import CorrectionInputs, CorrectionOutput, ratio_stats


class NoCorrection:
    name = "none"
    batch_level = False

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput:
        return CorrectionOutput(None, ratio_stats(x, None))


class MaskStale(NoCorrection):
    name = "mask_stale"
