"""The automatic off-policy controller (`algorithm.correction.auto`): after each learner step it
reads the mismatch the learner measured and sets, for the next step, the staleness budget and the
correction's cap, moving toward a target KL(μ ‖ π_old). Pure: plain numbers in and out. The driver
applies each decision and checkpoints the state (slime/job.py, driver_state.json).

What it reads, from the step's metrics (slime/learner/actor.py, slime/algorithms/mismatch.py):
  kl             mean k3 estimate of KL(μ ‖ π_old) per trained token, over every kind of token
                 (mismatch_<kind>_kl weighted by mismatch_<kind>_tokens)
  spread         mean |log ρ| over the same tokens (mismatch_<kind>_logp_abs_diff); reported
                 with the decision, not used by the rule: the KL already summarises it
  fresh kl       the KL over the fresh tokens alone (sampled by π_old's own version): the gap
                 between engine and learner that no staleness budget or band can remove (kernels,
                 dtype, a perturbed sampler). Async batches hold none after the first step, so the
                 gap is a running estimate: gap ← (smoothing · gap_kl_sum + fresh kl sum) /
                 (smoothing · gap_tokens + fresh tokens), updated on the steps that have fresh tokens
                 and carried over the others (0 before any). After gap_probe_every steps in a row
                 without fresh tokens it asks for a probe (`wants_gap_probe`): the driver has the
                 engines sample a few responses right after the push and the learner score them at
                 the same version, and hands their KL to `observe_gap_probe`, folded in the same way
  clipped_share  offpolicy_clipped_share: trainable tokens outside the correction's band
  max_lag        the oldest trained token's lag in versions (version_lag_hist); reported only
  held_share     staleness_budget_held_share (slime/fleet.py): how much the staleness budget held
                 the rollout back since the last decision. Async: the share of the time the learner
                 waited for its batch while admission was capped below the in-flight target; APRIL:
                 the share of the generated tokens thrown away because their partial was beyond
                 max_version_span (restarted)

What it sets (JobConfig.staleness_knob says which budget the job's loop reads):
  staleness      async: max_staleness at admission; APRIL in the sync loop: april.max_version_span
                 when a partial resumes; plain sync and streaming: nothing
  tis_cap        c of tis, mis_token, mis_seq, decoupled and behaviour_clip; other corrections: nothing

The rule acts on the KL that staleness adds, excess = max(0, kl − gap), smoothed over steps
(kl_s ← smoothing · kl_s + (1 − smoothing) · excess). Steered on the total, it tightened at every
step once the engine's gap alone came near the target, though no budget can remove that part:
  nothing measured (no trained tokens, a non-finite KL)   hold_no_measurement
  kl_s > target_kl                                          tighten: tis_cap ÷ step; async's staleness
                                                            − 1. APRIL's span is never tightened: a
                                                            tighter span restarts partials, which threw
                                                            away 30-58% of the tokens and bought no
                                                            reward (docs/offpolicy.md, the span study)
  kl_s < loosen_below · target_kl, and
      clipped_share > max_clipped_share                     hold_clipped (a heavy tail, a small mean)
      otherwise                                             loosen: tis_cap × step, staleness + 1 only
                                                            when held_share > min_held_share: a looser
                                                            budget buys speed only where the rollout
                                                            waited on it, and costs staler tokens always
  otherwise                                                 hold_in_band
Each value then stays within its floor and hard cap (AutoOffPolicyConfig's min_* and max_*), so a
step moves the staleness by one version and the cap by one factor at most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from slime.algorithms.mismatch import KINDS
from slime.config import TIS_CAP_CORRECTIONS, AutoOffPolicyConfig, JobConfig, StrictModel, format_validation_error

Knob = Literal["max_staleness", "max_version_span", "none"]


class Reason(IntEnum):
    """Why the last decision: the code goes to the step metrics (`offpolicy_auto/reason`), the
    lower-case name to the job's events."""

    START = 0  # the job's configured values clamped into the bounds; nothing measured yet
    HOLD_IN_BAND = 1
    TIGHTEN = 2
    LOOSEN = 3
    HOLD_CLIPPED = 4
    HOLD_NO_MEASUREMENT = 5


@dataclass(frozen=True)
class Measurement:
    """One learner step's mismatch, as the controller reads it."""

    tokens: float  # trained tokens the mismatch was measured on
    kl: float  # mean k3 estimate of KL(μ ‖ π_old) per token (0 without tokens)
    spread: float  # mean |log ρ| per token
    clipped_share: float
    max_lag: int  # the oldest trained token's lag, in versions
    fresh_tokens: float = 0.0  # trained tokens sampled by π_old's own version
    fresh_kl: float = 0.0  # their mean k3 estimate (0 without any)
    held_share: float = 0.0  # how much the staleness budget held the rollout back

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> Measurement:
        """From a learner step's metrics (Learner.update's names, before flattening)."""
        tokens = kl = spread = 0.0
        for kind in KINDS:
            n = float(metrics.get(f"mismatch_{kind}_tokens", 0.0))
            if n > 0:
                tokens += n
                kl += n * float(metrics[f"mismatch_{kind}_kl"])
                spread += n * float(metrics[f"mismatch_{kind}_logp_abs_diff"])
        lags = [int(lag) for lag in metrics.get("version_lag_hist", {})]
        fresh_tokens = float(metrics.get("mismatch_fresh_tokens", 0.0))
        return cls(
            tokens=tokens,
            kl=kl / tokens if tokens else 0.0,
            spread=spread / tokens if tokens else 0.0,
            clipped_share=float(metrics.get("offpolicy_clipped_share", 0.0)),
            max_lag=max(lags, default=0),
            fresh_tokens=fresh_tokens,
            fresh_kl=float(metrics["mismatch_fresh_kl"]) if fresh_tokens > 0 else 0.0,
            held_share=float(metrics.get("staleness_budget_held_share", 0.0)),
        )


class ControllerState(StrictModel):
    """What a checkpoint keeps of the controller (driver_state.json, key "offpolicy_auto")."""

    # A measured state, not a setting: a NaN kl_smoothed a checkpoint holds still loads.
    model_config = ConfigDict(allow_inf_nan=True)  # merged with StrictModel's (extra="forbid", ...)

    staleness: int | None = Field(..., ge=0)
    tis_cap: float | None = Field(..., gt=0)
    kl_smoothed: float | None
    reason: int = Field(..., ge=0, le=max(Reason))
    steps: int = Field(..., ge=0)
    # the gap estimate's decayed sums; a checkpoint written before the gap was measured has none
    gap_kl_sum: float = Field(0.0, ge=0)
    gap_tokens: float = Field(0.0, ge=0)
    steps_without_fresh: int = Field(0, ge=0)  # since the gap was last measured (fresh tokens or a probe)


class OffPolicyController:
    """The state machine of the module docstring. `observe` takes a step's measurement and moves
    `staleness` and `tis_cap` (the next step's settings); `reason` says why."""

    def __init__(self, settings: AutoOffPolicyConfig, knob: Knob, staleness: int | None, tis_cap: float | None):
        """``staleness``: the budget the job starts with (None: unbounded, starts at the hard cap);
        ignored when ``knob`` is "none". ``tis_cap``: the correction's cap, None when it has none."""
        self.settings = settings
        self.knob: Knob = knob
        self.staleness: int | None = None
        if knob != "none":
            self.staleness = self._clamp_staleness(settings.max_staleness if staleness is None else staleness)
        self.tis_cap = None if tis_cap is None else self._clamp_cap(tis_cap)
        self.kl_smoothed: float | None = None
        self.gap_kl_sum = 0.0
        self.gap_tokens = 0.0
        self.steps_without_fresh = 0
        self.reason = Reason.START
        self.steps = 0
        self.last: Measurement | None = None
        self.last_probe: tuple[float, float] | None = None  # (tokens, kl) of the probe since the last step
        self.gap_read = 0.0  # the gap estimate the last decision read

    @property
    def gap_kl(self) -> float:
        """The engine-learner gap: the running mean KL of fresh tokens (0 before any was measured)."""
        return self.gap_kl_sum / self.gap_tokens if self.gap_tokens > 0 else 0.0

    @classmethod
    def for_job(cls, cfg: JobConfig) -> OffPolicyController:
        """Starting from the job's own max_staleness (async) or april.max_version_span (APRIL) and tis_cap."""
        knob = cfg.staleness_knob
        start = {"max_staleness": cfg.max_staleness, "max_version_span": cfg.april.max_version_span, "none": None}
        correction = cfg.algorithm.correction
        tis_cap = correction.tis_cap if correction.name in TIS_CAP_CORRECTIONS else None
        return cls(correction.auto, knob, start[knob], tis_cap)

    def _clamp_staleness(self, value: int) -> int:
        return min(max(int(value), self.settings.min_staleness), self.settings.max_staleness)

    def _clamp_cap(self, value: float) -> float:
        return min(max(float(value), self.settings.min_tis_cap), self.settings.max_tis_cap)

    def _move(self, versions: int, cap_factor: float) -> None:
        if self.staleness is not None:
            self.staleness = self._clamp_staleness(self.staleness + versions)
        if self.tis_cap is not None:
            self.tis_cap = self._clamp_cap(self.tis_cap * cap_factor)

    def observe(self, m: Measurement) -> Reason:
        """One step's measurement in; the next step's settings (attributes) and why out."""
        s = self.settings
        self.steps += 1
        self.last, self.last_probe = m, None
        fresh = m.tokens > 0 and m.fresh_tokens > 0 and math.isfinite(m.fresh_kl)
        self.steps_without_fresh = 0 if fresh else self.steps_without_fresh + 1
        if fresh and math.isfinite(m.kl):
            self._fold_gap(m.fresh_tokens, m.fresh_kl)
        self.gap_read = self.gap_kl
        if m.tokens <= 0 or not math.isfinite(m.kl):
            self.reason = Reason.HOLD_NO_MEASUREMENT
            return self.reason
        excess = max(m.kl - self.gap_kl, 0.0)
        past = self.kl_smoothed
        self.kl_smoothed = excess if past is None else s.smoothing * past + (1.0 - s.smoothing) * excess
        if self.kl_smoothed > s.target_kl:
            self.reason = Reason.TIGHTEN
            self._move(0 if self.knob == "max_version_span" else -1, 1.0 / s.tis_cap_step)
        elif self.kl_smoothed < s.loosen_below * s.target_kl:
            if m.clipped_share > s.max_clipped_share:
                self.reason = Reason.HOLD_CLIPPED
            else:
                self.reason = Reason.LOOSEN
                self._move(1 if m.held_share > s.min_held_share else 0, s.tis_cap_step)
        else:
            self.reason = Reason.HOLD_IN_BAND
        return self.reason

    def _fold_gap(self, tokens: float, kl: float) -> None:
        self.gap_kl_sum = self.settings.smoothing * self.gap_kl_sum + tokens * max(kl, 0.0)
        self.gap_tokens = self.settings.smoothing * self.gap_tokens + tokens

    def wants_gap_probe(self) -> bool:
        """True after gap_probe_every steps in a row without a fresh trained token (0: never)."""
        every = self.settings.gap_probe_every
        return every > 0 and self.steps_without_fresh >= every

    def observe_gap_probe(self, tokens: float, kl: float) -> None:
        """A gap probe's result (tokens sampled and scored at one version, their mean k3), folded into
        the gap estimate as fresh tokens are; it takes effect at the next decision."""
        self.steps_without_fresh = 0
        self.last_probe = (tokens, kl)
        if tokens > 0 and math.isfinite(kl):
            self._fold_gap(tokens, kl)

    def metrics(self) -> dict[str, dict[str, float]]:
        """The decision and what it read, as step metrics (`offpolicy_auto/*` once flattened)."""
        out: dict[str, float] = {"reason": float(self.reason), "kl_target": self.settings.target_kl}
        if self.staleness is not None:
            out[self.knob] = float(self.staleness)
        if self.tis_cap is not None:
            out["tis_cap"] = self.tis_cap
        if self.kl_smoothed is not None:
            out["kl_smoothed"] = self.kl_smoothed
        if self.last is not None:
            out.update(
                kl=self.last.kl,
                kl_gap=self.gap_read,
                logp_spread=self.last.spread,
                max_lag=float(self.last.max_lag),
                held_share=self.last.held_share,
            )
        if self.last_probe is not None:  # the gap the next decision reads: kl_gap was this one's
            out.update(gap_probe_tokens=self.last_probe[0], gap_probe_kl=self.last_probe[1], kl_gap_next=self.gap_kl)
        return {"offpolicy_auto": out}

    def event(self) -> dict[str, Any]:
        """The decision for the job's event log (the dashboard's events list)."""
        detail: dict[str, Any] = {"reason": self.reason.name.lower(), "tis_cap": self.tis_cap}
        if self.knob != "none":
            detail[self.knob] = self.staleness
        if self.kl_smoothed is not None:
            detail["kl_smoothed"] = round(self.kl_smoothed, 5)
            detail["kl_gap"] = round(self.gap_read, 5)
        return detail

    def state_dict(self) -> dict[str, Any]:
        return ControllerState(
            staleness=self.staleness,
            tis_cap=self.tis_cap,
            kl_smoothed=self.kl_smoothed,
            reason=int(self.reason),
            steps=self.steps,
            gap_kl_sum=self.gap_kl_sum,
            gap_tokens=self.gap_tokens,
            steps_without_fresh=self.steps_without_fresh,
        ).model_dump()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's state. Values are clamped into this job's bounds (a resume may change them);
        a knob or cap this job lacks stays off, one it has that the checkpoint lacks keeps its start."""
        try:
            saved = ControllerState.model_validate(state)
        except ValidationError as err:
            raise ValueError(
                format_validation_error(err, "driver_state.json: bad offpolicy_auto state", "offpolicy_auto.")
            ) from None
        if self.staleness is not None and saved.staleness is not None:
            self.staleness = self._clamp_staleness(saved.staleness)
        if self.tis_cap is not None and saved.tis_cap is not None:
            self.tis_cap = self._clamp_cap(saved.tis_cap)
        self.kl_smoothed = saved.kl_smoothed
        self.reason = Reason(saved.reason)
        self.steps = saved.steps
        self.gap_kl_sum = saved.gap_kl_sum
        self.gap_tokens = saved.gap_tokens
        self.steps_without_fresh = saved.steps_without_fresh
        self.gap_read = self.gap_kl
