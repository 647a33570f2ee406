"""The simulator's workload (response lengths, requests, groups) and its model of one
continuous-batching engine; april/sim/run.py drives them."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from april.sim.config import SimConfig

# --------------------------------------------------------------------------- workload


class LengthSampler:
    """Response lengths of each new group, drawn in group order from one seeded stream."""

    def __init__(self, cfg: SimConfig, seed: int):
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.filter_rng = np.random.default_rng([seed, 1])  # its own stream: lengths do not depend on it

    def filtered(self) -> bool:
        return bool(self.filter_rng.random() < self.cfg.filter_rate)

    def group(self, scale: float = 1.0) -> list[int]:
        """``scale``: every length drawn is multiplied by it (SimConfig.length_growth), then capped."""
        c = self.cfg
        if c.lengths is not None:
            drawn = self.rng.choice(np.asarray(c.lengths), size=c.n_samples)
        else:
            prompt_median = c.median_tokens * math.exp(c.sigma_prompt * self.rng.standard_normal())
            drawn = prompt_median * np.exp(c.sigma_sample * self.rng.standard_normal(c.n_samples))
        return [int(min(c.max_tokens, max(1, round(float(x) * scale)))) for x in drawn]


@dataclass(eq=False)
class Request:
    group: Group
    prompt_tokens: int
    target: int  # response length at which it finishes
    generated: int = 0
    segments: list[list[int]] = field(default_factory=list)  # [policy version, tokens] runs
    finished: bool = False
    kv_on: Engine | None = None  # the engine that kept its KV cache at an abort

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.target - self.generated

    def add(self, tokens: int, version: int) -> None:
        self.generated += tokens
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1][1] += tokens
        else:
            self.segments.append([version, tokens])


@dataclass(eq=False)
class Group:
    gid: int
    requests: list[Request] = field(default_factory=list)
    n_done: int = 0
    filtered: bool = False  # the dynamic-sampling filter drops it when it completes
    state: Literal["open", "trained", "dropped", "filtered"] = "open"

    @property
    def complete(self) -> bool:
        return self.n_done == len(self.requests)

    @property
    def generated(self) -> int:
        return sum(r.generated for r in self.requests)


# --------------------------------------------------------------------------- engine


class Engine:
    """Continuous batching: a FIFO waiting queue, a running list, a KV budget, preemption.

    Step time: t0 + k*batch + t_kv*kv (kv = cached tokens the step's attention reads), plus
    p*prefix for the requests admitted in that step. The current "macro step" is `n` decode
    steps with the same batch from `start`: step j lasts `a + g*j` (g = t_kv*batch, the KV
    growth), after `extra` seconds of prefill (a step that admits requests is never merged).
    `epoch` changes whenever the macro step is replaced, so a stale end-event is ignored.
    """

    def __init__(self, cfg: SimConfig, joined_at: float = 0.0):
        self.cfg = cfg
        self.joined_at = joined_at  # elastic: when it joined (0: from the start)
        self.left_at: float | None = None  # elastic: when it was removed
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.kv = 0
        self.version = 0
        self.hold = False  # set by the controller: finish the current step, then stop
        self.busy = False
        self.epoch = 0
        self.start = self.a = self.g = self.extra = 0.0
        self.n = 0
        # statistics
        self.step_time = 0.0  # seconds spent stepping
        self.slot_time = 0.0  # sum over steps of (running requests x step seconds)
        self.tokens = 0
        self.prefill_tokens = 0
        self.preemptions = 0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def elapsed(self, m: int) -> float:
        """Seconds from `start` to the end of the macro step's m-th step."""
        return self.extra + m * self.a + self.g * m * (m - 1) / 2

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.n)

    def steps_done(self, now: float) -> int:
        """Steps of the macro step completed by `now` (the largest m with start + elapsed(m) <= now)."""
        rel = now - self.start - self.extra + 1e-9
        if rel <= 0:
            return 0
        if self.g == 0:
            m = int(rel / self.a)
        else:  # g/2 m^2 + (a - g/2) m = rel
            h = self.a - self.g / 2
            m = int((-h + math.sqrt(h * h + 2 * self.g * rel)) / self.g)
        while m > 0 and self.elapsed(m) - self.extra > rel:
            m -= 1
        while m < self.n and self.elapsed(m + 1) - self.extra <= rel:
            m += 1
        return min(m, self.n)

    def plan(self, now: float) -> float | None:
        """Admit from the queue, preempt if the KV budget overflows, pick the macro step; its end."""
        c = self.cfg
        prefill = 0
        fresh_groups: set[int] = set()  # groups whose prompt this admission already prefills
        while self.waiting and len(self.running) < c.slots:
            r = self.waiting[0]
            if self.kv + r.context + len(self.running) + 1 > c.kv_tokens:
                break  # no room for its prefix plus this step's tokens
            self.waiting.popleft()
            self.running.append(r)
            self.kv += r.context
            if r.kv_on is not self:
                shared = c.shared_prompt_prefill and r.generated == 0
                if not (shared and id(r.group) in fresh_groups):
                    prefill += r.context
                if shared:
                    fresh_groups.add(id(r.group))
            r.kv_on = None
        while self.running and self.kv + len(self.running) > c.kv_tokens:
            youngest = self.running.pop()  # KV dropped; it re-queues first and re-prefills later
            self.kv -= youngest.context
            self.waiting.appendleft(youngest)
            self.preemptions += 1
        if not self.running:
            self.busy = False
            return None
        b = len(self.running)
        self.a = c.t0 + c.k * b + c.t_kv * self.kv
        self.g = c.t_kv * b
        if prefill:
            self.n, self.extra = 1, c.p * prefill
            self.prefill_tokens += prefill
        else:
            until_finish = min(r.remaining for r in self.running)
            until_kv_full = (c.kv_tokens - self.kv) // b
            self.n, self.extra = max(1, min(until_finish, until_kv_full)), 0.0
        self.busy, self.start = True, now
        self.epoch += 1
        return self.end

    def cut(self, now: float) -> float | None:
        """Shorten the macro step to the first step boundary at or after `now`.

        Returns the new end, or None when no step of it has begun (the engine is then idle).
        """
        if not self.busy:
            return None
        self.epoch += 1  # the caller schedules the (possibly unchanged) end again
        if self.extra > 0:
            return self.end  # a prefill step is one step: it always completes
        m = self.steps_done(now)
        if m < self.n and self.start + self.elapsed(m) < now - 1e-9:
            m += 1  # the step in progress completes
        if m == 0:
            self.busy = False
            return None
        self.n = m
        return self.end

    def finish(self) -> list[Request]:
        """Apply the macro step's tokens; return the requests that reached their length."""
        n = self.n
        for r in self.running:
            r.add(n, self.version)
        self._account(n, self.elapsed(n))
        done = [r for r in self.running if r.remaining == 0]
        if done:
            self.running = [r for r in self.running if r.remaining > 0]
            self.kv -= sum(r.context for r in done)
        self.busy = False
        return done

    def stop(self, now: float) -> None:
        """End of the simulation: keep only the steps completed by `now` (tokens stay in requests)."""
        if not self.busy:
            return
        steps = self.steps_done(now)
        if steps:
            for r in self.running:
                r.add(steps, self.version)
        self._account(steps, min(now, self.end) - self.start)
        self.busy = False

    def clear(self) -> list[Request]:
        """Abort: drop every running and queued request (their tokens stay in the requests); with
        `resume_from_kept_kv` the running ones' caches stay on this engine."""
        if self.cfg.resume_from_kept_kv:
            for r in self.running:
                r.kv_on = self
        aborted = self.running + list(self.waiting)
        self.running, self.waiting, self.kv = [], deque(), 0
        return aborted

    def _account(self, steps: int, seconds: float) -> None:
        b = len(self.running)
        self.kv += steps * b
        self.tokens += steps * b
        self.step_time += seconds
        self.slot_time += b * seconds
