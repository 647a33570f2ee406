"""Schedules for the clip range and the KL coefficient (GLM-5 report, section 4.7)."""

from __future__ import annotations

from slime.config import AdaptiveClipConfig, StagedKL


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
