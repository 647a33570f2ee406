"""The types every correction shares: its inputs, its output, the Protocol, and the figures it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# exp() of a log ratio beyond this overflows float32; such ratios are masked or capped anyway.
_MAX_LOG_RATIO = 20.0


@dataclass
class CorrectionInputs:
    """[N, T] response-aligned tensors, no grad."""

    old_logp: torch.Tensor  # log π_old: the learner before this update (the proximal policy)
    behaviour_logp: torch.Tensor  # log μ: what the engine reported when it sampled the token
    mask: torch.Tensor  # float, 1 on trainable tokens
    advantages: torch.Tensor  # Â_t (sequence-level algorithms broadcast Â_i to every token)
    # versions each token's sampler lags π_old (0: sampled by the learner's current version); None: unknown, 0
    lag: torch.Tensor | None = None

    @property
    def log_ratio(self) -> torch.Tensor:
        """log ρ_t = log π_old − log μ on trainable tokens, 0 elsewhere. Selected, not multiplied by
        the mask: a −inf logprob on padding would otherwise give inf·0 = nan."""
        log_ratio = torch.where(self.mask > 0, self.old_logp - self.behaviour_logp, 0.0)
        return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


@dataclass
class CorrectionOutput:
    weights: torch.Tensor | None  # [N, T] w_t; None: every weight is 1
    stats: dict[str, float] = field(default_factory=dict)
    # [N, T] log of the surrogate's ratio base on trainable tokens, for a correction that takes the
    # ratio against something other than π_old (behaviour_clip: the sampler); None: π_old
    ratio_base: torch.Tensor | None = None


class Correction(Protocol):
    name: str
    # True when a token's weight depends on the whole batch (M2PO): the learner then computes π_old
    # for the whole batch first and the weights once, instead of per micro-batch.
    batch_level: bool

    def __call__(self, x: CorrectionInputs) -> CorrectionOutput: ...


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] -> [N]: mean of values over each row's trainable tokens (0 for an empty row)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def ratio_stats(x: CorrectionInputs, weights: torch.Tensor | None, clipped: torch.Tensor | None = None) -> dict:
    """The four figures every correction reports, over trainable tokens."""
    trainable = x.mask > 0
    n = int(trainable.sum())
    if n == 0:
        return {
            "offpolicy_ratio_mean": 1.0,
            "offpolicy_ratio_max": 1.0,
            "offpolicy_masked_share": 0.0,
            "offpolicy_clipped_share": 0.0,
        }
    ratio = torch.exp(x.log_ratio)[trainable]
    masked = 0 if weights is None else int((weights[trainable] == 0).sum())
    n_clipped = 0 if clipped is None else int((clipped & trainable).sum())
    return {
        "offpolicy_ratio_mean": ratio.mean().item(),
        "offpolicy_ratio_max": ratio.max().item(),
        "offpolicy_masked_share": masked / n,
        "offpolicy_clipped_share": n_clipped / n,
    }
