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
class ClipBand:
    """A clip band per token for PPO's token-level ratio: PPO's band compounded `steps` + 1 times,
    within [1/cap, cap]. The ε it compounds are the ones the update clips with (adaptive or not)."""

    steps: torch.Tensor  # [N, T] float: PPO steps the band spans beyond its own one (0: PPO's band)
    cap: float

    def bounds(self, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(ε_low_t, ε_high_t) [N, T]: the band [1 − ε_low_t, 1 + ε_high_t] of each token."""
        cap = max(self.cap, 1.0 + clip_high, 1.0 / (1.0 - clip_low))
        high = torch.pow(1.0 + clip_high, self.steps + 1.0).clamp(max=cap)
        low = torch.pow(1.0 - clip_low, self.steps + 1.0).clamp(min=1.0 / cap)
        return 1.0 - low, high - 1.0


@dataclass
class CorrectionOutput:
    weights: torch.Tensor | None  # [N, T] w_t; None: every weight is 1
    stats: dict[str, float] = field(default_factory=dict)
    # [N, T] log of the surrogate's ratio base on trainable tokens, for a correction that takes the
    # ratio against something other than π_old (behaviour_clip: the sampler); None: π_old
    ratio_base: torch.Tensor | None = None
    # a band per token for the token-level PPO clip (GRPO, PPO, Dr. GRPO); None: the update's band.
    # GSPO's sequence clip and CISPO's weight cap keep their own.
    band: ClipBand | None = None


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
