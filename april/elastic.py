"""Elastic rollout: GLM-5's dynamic load balancing between inference and training, as a decision.

The signal is the buffer when the learner asks for its next batch (async mode). Its fill is the
share of the admission budget that the learner could take at once: the groups ready at the head
of the line (async trains in start order) / (max_staleness * batch_size), which is as many as can
be waiting for it then (april/scheduler.py, async). One step's fill swings with the long tail
(a step that waited for its stragglers is often followed by one whose batch is all there), so a
decision takes the mean fill of the last `cooldown_steps` steps since the last change:

  mean fill <= low_watermark    the buffer runs dry: the learner waits for rollouts. If samples
                                wait for a free engine slot, a worker more takes them -> add one.
                                If none does, every sample has a slot and the learner waits for the
                                long tail, which another worker would not shorten -> hold.
  mean fill >= high_watermark   the buffer is full: the workers idle on the staleness budget,
                                waiting for the learner -> remove a worker (capacity to learning)
  otherwise, or fewer steps than cooldown_steps since the last change (the job's first step counts
  as one: its buffer starts empty whatever the balance), or at min_workers / max_workers: hold.

Pure: the caller counts the workers and the ready groups and carries the decision out (the live
job: slime/fleet.py; the simulator: april/sim/run.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ElasticAction = Literal["add", "remove", "hold"]


@dataclass(frozen=True)
class ElasticDecision:
    action: ElasticAction
    workers: int  # the worker count after the action
    fill: float  # the mean fill it decided on (this step's while it holds for the cooldown)
    reason: str


@dataclass
class ElasticPolicy:
    min_workers: int
    max_workers: int
    low_watermark: float
    high_watermark: float
    cooldown_steps: int
    started: bool = False  # the job's first step has been seen
    fills: list[float] = field(default_factory=list)  # the fills of the last steps since the last change

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"elastic: need 1 <= min_workers ({self.min_workers}) <= max_workers ({self.max_workers})")
        if not 0.0 <= self.low_watermark < self.high_watermark:
            raise ValueError(
                f"elastic: need 0 <= low_watermark ({self.low_watermark}) < high_watermark ({self.high_watermark})"
            )
        if self.cooldown_steps < 0:
            raise ValueError(f"elastic: cooldown_steps must be >= 0, got {self.cooldown_steps}")

    def decide(self, workers: int, ready_groups: int, budget_groups: int, queued_samples: int) -> ElasticDecision:
        """One decision per training step, made when the learner asks for its batch. ``workers``:
        the workers running or starting; ``ready_groups``: ready at the head of the line;
        ``budget_groups``: max_staleness * batch_size; ``queued_samples``: waiting for an engine slot."""
        if budget_groups < 1:
            raise ValueError(f"elastic: budget_groups must be >= 1, got {budget_groups}")
        fill = ready_groups / budget_groups
        if not self.started:
            self.started = True
            return ElasticDecision("hold", workers, fill, "first step: the buffer starts empty")
        window = max(1, self.cooldown_steps)
        self.fills = [*self.fills[-(window - 1) :], fill] if window > 1 else [fill]
        if len(self.fills) < window:
            return ElasticDecision("hold", workers, fill, f"cooldown ({window} steps after a change)")
        fill = sum(self.fills) / window
        if fill <= self.low_watermark:
            if workers >= self.max_workers:
                return ElasticDecision("hold", workers, fill, f"buffer dry, at max_workers={self.max_workers}")
            if queued_samples == 0:
                return ElasticDecision("hold", workers, fill, "buffer dry, but every sample has an engine slot")
            self.fills = []
            return ElasticDecision(
                "add",
                workers + 1,
                fill,
                f"buffer dry: fill {fill:.2f} <= low_watermark {self.low_watermark:g}, "
                f"{queued_samples} samples wait for an engine slot",
            )
        if fill >= self.high_watermark:
            if workers <= self.min_workers:
                return ElasticDecision("hold", workers, fill, f"buffer full, at min_workers={self.min_workers}")
            self.fills = []
            return ElasticDecision(
                "remove", workers - 1, fill, f"buffer full: fill {fill:.2f} >= high_watermark {self.high_watermark:g}"
            )
        return ElasticDecision("hold", workers, fill, "between the watermarks")
