"""Off-policy corrections: how the loss treats tokens an older or a different policy sampled.

Every trained token was sampled by a behaviour policy μ (the engine, possibly several versions
behind, possibly numerically different from the learner). The surrogate's ratio is taken against
π_old, the learner's weights before this update (AReaL's proximal policy). A correction turns the
behaviour ratio

    ρ_t = π_old(a_t|s_t) / μ(a_t|s_t)

into a per-token weight w_t that multiplies the per-token loss (no gradient through w_t). A weight
of 0 masks the token: it still counts in the loss's normaliser, as in IcePop's and OPSM's
formulas, so masking many tokens shrinks the step instead of rescaling the rest.

The same correction applies to every source of mismatch: APRIL's resumed partials, async
staleness and plain train-inference numerics. One file per correction, its formula in its
docstring; `algorithm.correction.name` picks one (settings: CorrectionConfig, slime/config/learner.py):

  none        w = 1                                        (passthrough.py)
  mask_stale  stale tokens dropped from the loss mask       (passthrough.py)
  tis         w = min(ρ, c)                                (tis.py)
  mis_token   w = ρ inside [1/c, c], else 0                (masked_is.py)
  mis_seq     w = ρ_seq inside [1/c, c], else 0            (masked_is.py)
  decoupled   w = ρ, tokens with ρ > c masked (AReaL)      (decoupled.py)
  icepop      w = ρ inside [α, β], else 0                  (icepop.py)
  geo_reject  whole sequence kept iff geo-mean ρ in band   (geo_reject.py)
  m2po        mask the largest (log ρ)² until the batch's mean is under τ   (m2po.py)
  opsm        drop Â<0 tokens of sequences whose KL(μ‖π_old) > δ           (opsm.py)
  behaviour_clip  the surrogate's ratio and clip taken against μ, not π_old; the band widens per
              version the sampler lags (behaviour_clip.py)

Each reports offpolicy_ratio_mean / _max (ρ over trainable tokens), offpolicy_masked_share and
offpolicy_clipped_share (shares of trainable tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.algorithms.batch import Batch, UpdateTensors
from slime.algorithms.corrections.base import ClipBand, Correction, CorrectionInputs, CorrectionOutput
from slime.algorithms.corrections.behaviour_clip import BehaviourClip
from slime.algorithms.corrections.decoupled import DecoupledPPO
from slime.algorithms.corrections.geo_reject import GeometricRejection
from slime.algorithms.corrections.icepop import IcePop
from slime.algorithms.corrections.m2po import M2PO
from slime.algorithms.corrections.masked_is import MaskedISSequence, MaskedISToken
from slime.algorithms.corrections.opsm import OPSM
from slime.algorithms.corrections.passthrough import MaskStale, NoCorrection
from slime.algorithms.corrections.tis import TruncatedIS
from slime.config import AlgorithmConfig, CorrectionConfig

__all__ = [
    "ClipBand",
    "Correction",
    "CorrectionInputs",
    "CorrectionOutput",
    "make_correction",
    "SurrogateTerms",
    "surrogate_terms",
]


def make_correction(cfg: CorrectionConfig, clip: tuple[float, float] | None = None) -> Correction:
    """The correction `algorithm.correction.name` names, with its parameters from the same section;
    ``clip`` (ε_low, ε_high) is the algorithm's (default: AlgorithmConfig's), for behaviour_clip's band."""
    if clip is None:
        defaults = AlgorithmConfig()
        clip = (defaults.clip_low, defaults.clip_high)
    builders = {
        "none": lambda: NoCorrection(),
        "mask_stale": lambda: MaskStale(),
        "tis": lambda: TruncatedIS(cfg.tis_cap),
        "mis_token": lambda: MaskedISToken(cfg.tis_cap),
        "mis_seq": lambda: MaskedISSequence(cfg.tis_cap),
        "decoupled": lambda: DecoupledPPO(cfg.tis_cap),
        "icepop": lambda: IcePop(*cfg.icepop_band),
        "geo_reject": lambda: GeometricRejection(*cfg.geo_band),
        "m2po": lambda: M2PO(cfg.m2po_threshold),
        "opsm": lambda: OPSM(cfg.opsm_delta),
        "behaviour_clip": lambda: BehaviourClip(*clip, per_version=cfg.clip_band_per_version, cap=cfg.tis_cap),
    }
    return builders[cfg.name]()


def _apply(correction: Correction, batch: Batch, fixed: UpdateTensors, old_logp: torch.Tensor) -> CorrectionOutput:
    if fixed.is_weights is not None:
        return CorrectionOutput(fixed.is_weights, {})
    inputs = CorrectionInputs(old_logp.detach(), batch.behaviour_logp, batch.mask, fixed.advantages, fixed.version_lag)
    return correction(inputs)


@dataclass
class SurrogateTerms:
    """What an algorithm's loss takes from the correction, for one micro-batch."""

    base_logp: torch.Tensor  # the log-probabilities the surrogate's ratio is taken against
    weights: torch.Tensor | None  # w_t (no grad); None: every weight is 1
    stats: dict[str, float]  # the correction's figures
    band: ClipBand | None  # a clip band per token; None: the update's own

    def clip_range(self, clip_low: float, clip_high: float) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """The token-level clip's (ε_low, ε_high): per token under a band, else the update's."""
        return self.band.bounds(clip_low, clip_high) if self.band is not None else (clip_low, clip_high)


def surrogate_terms(
    correction: Correction, batch: Batch, fixed: UpdateTensors, logp: torch.Tensor, fresh_keep_old: bool = False
) -> SurrogateTerms:
    """For one micro-batch: the log-probabilities the surrogate's ratio is taken against, the
    per-token weights w_t, the correction's figures and its clip band. The ratio's base is π_old
    (the learner's weights before this update: ``fixed.old_logp`` when recomputed, else this
    forward without grad), or on trainable tokens the base a correction gives (behaviour_clip: μ).
    ``fresh_keep_old`` (GSPO): tokens the current version sampled (lag 0, when lags are known)
    keep π_old, their μ differing from it by the engine's numerics only."""
    old_logp = fixed.old_logp if fixed.old_logp is not None else logp.detach()
    out = _apply(correction, batch, fixed, old_logp)
    if out.ratio_base is not None:
        takes_base = batch.mask > 0
        if fresh_keep_old and fixed.version_lag is not None:
            takes_base = takes_base & (fixed.version_lag > 0)
        old_logp = torch.where(takes_base, out.ratio_base, old_logp)
    return SurrogateTerms(old_logp, out.weights, out.stats, out.band)
