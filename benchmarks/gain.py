"""Time to a share of sync's reward gain, the off-policy study's robust measure (docs/offpolicy.md).

"Time to sync's final held-out reward" turned on single noisy checkpoints: sync's own curve is not
monotone, and an arm's early peak it then lost counted as reaching it. This measure:

    threshold = initial + share x (sync's final - initial)          (share 0.9: 90% of sync's gain)
    smoothed  = each run's held-out curve, a trailing running mean over `window` checkpoints
                (the point at t = 0 included), sync's final read on its smoothed curve
    time      = the wall-clock of the first checkpoint whose smoothed value reaches the threshold,
                per run (seed); then the mean and the sample std over the runs that reached it

Pure functions over plain lists: the study calls them, tests/test_time_to_gain.py checks them on
hand-made curves.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.spread import mean_sd

Curve = list[tuple[float, float]]  # (wall-clock s from the first step's start, held-out reward), in time order


def running_mean(values: list[float], window: int = 3) -> list[float]:
    """Trailing running mean: point i is the mean of points i - window + 1 .. i (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def smoothed(curve: Curve, window: int = 3) -> Curve:
    return list(zip([w for w, _ in curve], running_mean([r for _, r in curve], window)))


def gain_threshold(initial: float, sync_final: float, share: float = 0.9) -> float | None:
    """initial + share x (sync_final - initial); None when sync gained nothing (no gain to share)."""
    if sync_final <= initial:
        return None
    return initial + share * (sync_final - initial)


def time_to_threshold(curve: Curve, threshold: float, window: int = 3) -> float | None:
    """The wall-clock of the first checkpoint whose smoothed reward reaches the threshold; None: never."""
    for wall, reward in smoothed(curve, window):
        if reward >= threshold - 1e-9:
            return wall
    return None


@dataclass(frozen=True)
class TimeToGain:
    """One arm's time to the threshold over its runs (seeds)."""

    times: list[float | None]  # per run; None: not reached
    mean_s: float | None  # over the runs that reached it; None: none did
    std_s: float | None  # sample std over those runs (0 for one)

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times)

    def text(self) -> str:
        """ "12.3 ± 1.2 s (3/3)", or "not reached (0/3)"."""
        if self.mean_s is None:
            return f"not reached (0/{len(self.times)})"
        return f"{self.mean_s:.1f} ± {self.std_s:.1f} s ({self.reached}/{len(self.times)})"


def sync_final_smoothed(sync_curves: list[Curve], window: int = 3) -> float:
    """Sync's final held-out reward: the mean over its runs of each smoothed curve's last point."""
    return sum(smoothed(c, window)[-1][1] for c in sync_curves) / len(sync_curves)


def time_to_gain(curves: list[Curve], threshold: float | None, window: int = 3) -> TimeToGain:
    """Each run's time to ``threshold`` on its smoothed curve, and their mean and spread."""
    if threshold is None:
        return TimeToGain([None] * len(curves), None, None)
    times = [time_to_threshold(c, threshold, window) for c in curves]
    reached = [t for t in times if t is not None]
    if not reached:
        return TimeToGain(times, None, None)
    mean, sd = mean_sd(reached)
    return TimeToGain(times, mean, sd)
