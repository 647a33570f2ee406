"""Schedules for the clip range and the KL coefficient (GLM-5 report, section 4.7), the adaptive KL
coefficient (Ziegler et al. 2019) and the learning rate's warmup and decay."""

from __future__ import annotations

import math

from slime.config import AdaptiveClipConfig, LearnerConfig, StagedKL


class AdaptiveClip:
    """Keep the measured policy drift near a target by resizing the clip range (ε_low, ε_high).

    update(measured_kl):  KL > 1.5·target -> both ε × shrink;  KL < 0.5·target -> both ε × grow;
    otherwise unchanged; each ε clamped to [min_clip, max_clip]. A disabled config never changes
    the clips, so the caller can always construct it and call update.
    """

    def __init__(self, cfg: AdaptiveClipConfig, clip_low: float, clip_high: float) -> None:
        self.cfg = cfg
        self.clip_low = clip_low
        self.clip_high = clip_high

    def update(self, measured_kl: float) -> tuple[float, float]:
        cfg = self.cfg
        if cfg.enabled:
            if measured_kl > 1.5 * cfg.kl_target:
                factor = cfg.shrink
            elif measured_kl < 0.5 * cfg.kl_target:
                factor = cfg.grow
            else:
                factor = 1.0
            self.clip_low = min(max(self.clip_low * factor, cfg.min_clip), cfg.max_clip)
            self.clip_high = min(max(self.clip_high * factor, cfg.min_clip), cfg.max_clip)
        return self.clip_low, self.clip_high

    def state_dict(self) -> dict[str, float]:
        return {"clip_low": self.clip_low, "clip_high": self.clip_high}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.clip_low = float(state["clip_low"])
        self.clip_high = float(state["clip_high"])


def staged_kl_coef(step: int, schedule: list[StagedKL], default: float) -> float:
    """β at `step`: the first stage with step < until_step; past the last stage its coef stays.

    An empty schedule gives `default` (algorithm.kl_coef).
    """
    if not schedule:
        return default
    for stage in schedule:
        if step < stage.until_step:
            return stage.coef
    return schedule[-1].coef


class AdaptiveKL:
    """β toward a target KL (Ziegler et al. 2019, as verl's and OpenRLHF's adaptive controllers):
    after a step whose mean per-token KL to the reference is `kl` over `samples` samples,
    β *= 1 + clip(kl / target − 1, −0.2, 0.2) · samples / horizon."""

    def __init__(self, coef: float, target: float, horizon: int) -> None:
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, samples: int) -> float:
        if math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * samples / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


def lr_factor(step: int, steps: int, cfg: LearnerConfig) -> float:
    """The share of learner.lr (and critic_lr) that step `step` (0-based) of a `steps`-step job uses:
    (step+1)/W over the first W = lr_warmup_steps steps; then 1 (constant), or a linear or cosine
    decay from 1 at step W to min_lr_ratio at the last step. A pure function of the step, so a
    resumed job goes on where it was."""
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(steps - 1 - warmup, 1), 1.0)
    decay = 1.0 - progress if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay
