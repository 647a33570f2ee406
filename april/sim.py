"""Rollout simulator for capacity planning: sync vs APRIL vs one-step async vs bounded-staleness async.

A discrete-event model of E continuous-batching engines (S slots, a KV budget of K tokens each)
and one learner. Every engine runs decode steps of `t0 + k * batch (+ t_kv * cached_tokens)`
seconds in which each running request emits one token; a step that admits requests also pays
`p * prefix_tokens` of prefill. Between two events nothing changes the batch, so an engine runs a
whole run of steps as one event ("macro step") and is cut back to the next step boundary when
something happens (a request arrives while slots are free, an abort, a weight-sync pause).
No time is discretised: every step boundary is where the model puts it.

Policies (same seed => the same groups with the same lengths, in the same order):
  sync            B groups, wait for every response, train, sync weights.
  april           keep ceil(oversample*B) groups in flight, refill one group per finished group;
                  when B groups are complete abort everything, keep the partials, train, sync,
                  and resume the partials first (paying the prefill of their stored prefix).
  april_drop      the same over-provisioning, but aborted groups are thrown away (no recycling):
                  the contrast that shows what "wasted tokens" means.
  one_step_async  generation of batch k+1 (a sync-style wave) overlaps training of batch k.
  async_bounded   engines never stop; the learner trains groups in start order; a group may
                  start only if it will be trained within `max_staleness` versions.

Entry points: `simulate`, `compare`, `plot`, `sim_config_from_job`, and the CLI `main_simulate`.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import sys
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slime.config import ConfigError, JobConfig, format_validation_error, load_config, parse_override

POLICIES: tuple[str, ...] = ("sync", "april", "april_drop", "one_step_async", "async_bounded")


class SimConfig(BaseModel):
    """Every knob of the model. The defaults are the `paper` preset (8 GPU engines, 16k tokens)."""

    model_config = ConfigDict(extra="forbid")

    # cluster
    engines: int = Field(8, gt=0, description="Rollout engines (one per GPU / rollout worker).")
    slots: int = Field(64, gt=0, description="Max concurrent requests per engine (max_running_requests).")
    kv_tokens: int = Field(
        350_000, gt=0, description="KV budget K per engine, tokens (prompt + generated) of running requests."
    )
    # workload
    batch_size: int = Field(64, gt=0, description="B: prompt groups per training step.")
    n_samples: int = Field(8, gt=0, description="Responses per prompt (group size).")
    prompt_tokens: int = Field(512, ge=0)
    max_tokens: int = Field(16_384, gt=0, description="Response length cap (max_new_tokens).")
    median_tokens: float = Field(2048.0, gt=0, description="Median response length m.")
    sigma_prompt: float = Field(0.6, ge=0, description="Log-normal sigma of a prompt's median around m.")
    sigma_sample: float = Field(0.5, ge=0, description="Log-normal sigma of a sample around its prompt's median.")
    lengths: list[int] | None = Field(
        None, description="Empirical response lengths, sampled with replacement (replaces the log-normal)."
    )
    filter_rate: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of groups a dynamic-sampling filter drops when they complete (DAPO's zero reward "
        "variance); drawn per group from its own seeded stream, so every policy drops the same groups. "
        "Modelled for the wave policies (sync, april, april_drop).",
    )
    refill: Literal["group", "batch"] = Field(
        "group",
        description="How the wave policies start groups. group (this project): APRIL keeps ceil(r*B) in flight "
        "and starts one group per finished or filtered group; sync starts one per filtered group. batch "
        "(slime's rollout loop, the APRIL paper's runs): while kept + in-flight groups < B, submit a chunk "
        "of ceil(r*B) groups (B for sync), partials first; at the end sync drops what is still in flight.",
    )
    # engine timing (seconds)
    t0: float = Field(0.006, ge=0, description="Decode step time at batch 0 (weights read, launch overhead).")
    k: float = Field(5e-5, ge=0, description="Decode step time per running request (MLP, sampling).")
    t_kv: float = Field(
        5e-8, ge=0, description="Decode step time per cached KV token of the running requests (attention reads)."
    )
    p: float = Field(2e-5, ge=0, description="Prefill time per prefix token of an admitted request.")
    resume_from_kept_kv: bool = Field(
        False,
        description="An aborted partial keeps its KV cache on its engine (the built-in engine's "
        "rollout.kept_kv_tokens): resumed there, it pays no prefill; on another engine it prefills.",
    )
    shared_prompt_prefill: bool = Field(
        True,
        description="Fresh samples of one group admitted to an engine together pay their shared prompt's "
        "prefill once (the built-in engine feeds identical contexts once; vLLM's and SGLang's prefix caches "
        "do the same).",
    )
    # learner timing (seconds)
    t_sync: float = Field(5.0, ge=0, description="Weight sync (learner -> engines) per step.")
    t_train0: float = Field(10.0, ge=0, description="Fixed cost of a training step.")
    t_train_per_token: float = Field(2e-5, ge=0, description="Training cost per (prompt + response) token.")
    # run
    steps: int = Field(20, gt=0, description="Training steps simulated per policy.")
    oversample: float = Field(2.0, ge=1.0, description="APRIL default over-provisioning ratio.")
    max_staleness: int = Field(1, ge=1, description="async_bounded default staleness budget.")
    compare_oversample: list[float] = Field(default_factory=lambda: [1.5, 2.0, 3.0])
    compare_staleness: list[int] = Field(default_factory=lambda: [1, 2])
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "SimConfig":
        if self.kv_tokens < self.prompt_tokens + self.max_tokens:
            raise ValueError(
                f"kv_tokens={self.kv_tokens} cannot hold one request of prompt_tokens + max_tokens = "
                f"{self.prompt_tokens + self.max_tokens} tokens"
            )
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError("lengths must be a non-empty list of positive token counts")
        if any(r < 1 for r in self.compare_oversample):
            raise ValueError("compare_oversample ratios must be >= 1")
        if any(s < 1 for s in self.compare_staleness):
            raise ValueError("compare_staleness budgets must be >= 1")
        return self

    @property
    def wave_policies_only(self) -> bool:
        """The async policies do not model a filter or slime's chunked refill."""
        return self.filter_rate > 0 or self.refill == "batch"


PRESETS: dict[str, SimConfig] = {
    # The APRIL paper's setting: 8 engines x 64 slots, 16k cap, 2x over-provisioning, B*n = 512 =
    # the slots, a long-tailed reasoning workload (median 2k, mean ~2.75k, 0.3% at the cap).
    # One H100 per engine serving a ~4B model (Qwen3-4B-like: 8 GB bf16 weights, 36 layers x 8 KV
    # heads x 128 dims = 147 KB of KV per token, ~3 TB/s HBM, ~1 PFLOP/s bf16):
    #   t0   = 6 ms      weights read (8 GB / 3 TB/s = 2.7 ms) + launch, sampling, scheduler
    #   k    = 50 us     per request: MLP/projection FLOPs (8 GFLOP at ~50% MFU) + bookkeeping
    #   t_kv = 50 ns     per cached token per step: its 147 KB of KV read at ~3 TB/s
    #   p    = 20 us     per prefilled token: 8 GFLOP at ~50% MFU, plus attention
    #   K    = 350k      tokens of KV pool (~52 GB after weights and activations)
    # Colocated training on the same 8 GPUs: ~58 GFLOP per token (old/ref log-prob forwards,
    # forward, backward, recompute) at 40% MFU -> ~50k tok/s -> 2e-5 s/token, 10 s fixed
    # (offload/onload, optimizer), 5 s weight sync.
    "paper": SimConfig(),
    # The runs behind the APRIL paper's figures, as its published scripts set them (Qwen3-4B,
    # DAPO-Math-17k, 8 GPUs colocated): 4 SGLang engines of tensor parallel 2, 32 prompts x 8
    # samples per step, 2x over-sampling (64 prompts), 16k cap, the DAPO zero-variance filter in
    # both arms, and slime's rollout loop (refill=batch: the baseline over-submits a whole batch
    # whenever the filter drops a group, and discards what is in flight at the end; APRIL keeps
    # it). Per engine: 2 GPUs at mem fraction 0.6 -> ~88 GB of KV pool at 74 KB/token per GPU ->
    # 600k tokens; weights read per GPU halve (1.35 ms) plus ~0.7 ms of all-reduces, FLOPs and
    # KV reads per GPU halve: t0 5.5 ms, k 42 us, t_kv 25 ns, p 10 us. Slots never bind (SGLang
    # sizes its running batch by the KV pool). The filter rate (half the groups have zero reward
    # variance) is an assumption; docs/april_simulator.md sweeps it. Lengths as in `paper`.
    "paper_runs": SimConfig(
        engines=4, slots=512, kv_tokens=600_000, batch_size=32, t0=0.0055, k=4.2e-5, t_kv=2.5e-8, p=1e-5,
        filter_rate=0.5, refill="batch", compare_oversample=[2.0],
    ),
    # This machine's CPU engine with the tiny MoE on the example (repeat) task; to be calibrated.
    "cpu_tiny": SimConfig(
        engines=1, slots=64, kv_tokens=64 * 512, batch_size=8, n_samples=4, prompt_tokens=6, max_tokens=96,
        median_tokens=6.0, sigma_prompt=0.9, sigma_sample=0.75, t0=0.006, k=0.0003, t_kv=0.0, p=2e-5,
        t_sync=0.05, t_train0=0.3, t_train_per_token=2e-4, steps=30,
    ),
}


# --------------------------------------------------------------------------- workload


class LengthSampler:
    """Response lengths of each new group, drawn in group order from one seeded stream."""

    def __init__(self, cfg: SimConfig, seed: int):
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.filter_rng = np.random.default_rng([seed, 1])  # its own stream: lengths do not depend on it

    def filtered(self) -> bool:
        return bool(self.filter_rng.random() < self.cfg.filter_rate)

    def group(self) -> list[int]:
        c = self.cfg
        if c.lengths is not None:
            drawn = self.rng.choice(np.asarray(c.lengths), size=c.n_samples)
        else:
            prompt_median = c.median_tokens * math.exp(c.sigma_prompt * self.rng.standard_normal())
            drawn = prompt_median * np.exp(c.sigma_sample * self.rng.standard_normal(c.n_samples))
        return [int(min(c.max_tokens, max(1, round(float(x))))) for x in drawn]


@dataclass(eq=False)
class Request:
    group: "Group"
    prompt_tokens: int
    target: int  # response length at which it finishes
    generated: int = 0
    segments: list[list[int]] = field(default_factory=list)  # [policy version, tokens] runs
    finished: bool = False
    kv_on: "Engine | None" = None  # the engine that kept its KV cache at an abort

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

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
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


# --------------------------------------------------------------------------- results


@dataclass
class SimResult:
    policy: str  # label, e.g. "april_x2"
    oversample: float | None
    max_staleness: int | None
    steps: int
    wall_s: float
    step_s: float  # mean wall-clock seconds per training step
    generated_tokens: int
    trained_tokens: int  # response tokens trained on
    held_tokens: int  # generated, not trained yet at the end (partials, queued groups): not waste
    wasted_tokens: int  # generated and thrown away by the policy (aborted and dropped)
    filtered_tokens: int  # generated in groups the dynamic-sampling filter dropped
    rollout_s: float | None  # wave policies: mean seconds of a step's rollout phase (start to abort done)
    trained_rollout_throughput: float | None  # trained response tokens per rollout-phase second
    throughput: float  # generated tokens / wall-clock second
    trained_throughput: float  # trained response tokens / wall-clock second
    engine_busy: float  # slot occupancy: mean share of slots decoding, over engines and wall-clock
    engine_stepping: float  # share of wall-clock an engine is executing steps (any batch size)
    bubble_ratio: float  # 1 - engine_busy
    learner_busy: float  # share of wall-clock the learner trains
    off_policy_share: float  # trained tokens produced by a version older than the trainer's
    span_histogram: dict[int, int]  # trainer version - oldest token version, per trained sample
    max_span: int
    partials: int  # requests aborted with tokens kept for resumption
    preemptions: int
    prefill_tokens: int  # prefix tokens prefilled (new prompts, resumed partials, preempted requests)
    step_times: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- simulation core


class Simulation:
    """The event loop, the engines, dispatch and training accounting; policies subclass it."""

    label = "?"

    def __init__(self, cfg: SimConfig, seed: int):
        self.cfg = cfg
        self.sampler = LengthSampler(cfg, seed)
        self.engines = [Engine(cfg) for _ in range(cfg.engines)]
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.done = False
        self.on_drained: Callable[[], None] | None = None
        self.groups: list[Group] = []
        self.version = 0  # trainer version = training steps completed; engines get it at sync
        self.step_ends: list[float] = []
        self.learner_time = 0.0
        self.rollout_time = 0.0  # wave policies: seconds from a rollout's start to the end of its abort
        self.trained_tokens = self.off_policy_tokens = 0
        self.spans: Counter[int] = Counter()
        self.partials = 0

    # ---- policy hooks
    def start(self) -> None:
        raise NotImplementedError

    def on_group_complete(self, g: Group) -> None:
        raise NotImplementedError

    # ---- event loop
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self) -> None:
        self.start()
        while not self.done:
            if not self.events:
                raise RuntimeError(f"{self.label}: simulation stalled at t={self.now:.3f}s")
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        for e in self.engines:
            e.stop(self.now)

    # ---- engines
    def wake(self, e: Engine) -> None:
        """Let an engine take new work: start it if idle, or cut its macro step if slots are free."""
        if e.hold:
            return
        if e.busy:
            if not (e.waiting and len(e.running) < self.cfg.slots):
                return
            end = e.cut(self.now)
            if end is not None:
                self._schedule(e, end)
                return
        end = e.plan(self.now)
        if end is not None:
            self._schedule(e, end)

    def _schedule(self, e: Engine, end: float) -> None:
        epoch = e.epoch
        self.at(end, lambda: self._step_end(e, epoch))

    def _step_end(self, e: Engine, epoch: int) -> None:
        if epoch != e.epoch or not e.busy:
            return
        for r in e.finish():
            r.finished = True
            r.group.n_done += 1
            if r.group.complete:
                self.on_group_complete(r.group)
        self.wake(e)
        self._check_drained()

    def hold_engines(self, then: Callable[[], None]) -> None:
        """Every engine finishes its current step and stops; then call `then`."""
        for e in self.engines:
            e.hold = True
            end = e.cut(self.now)
            if end is not None:
                self._schedule(e, end)
        self.on_drained = then
        self.at(self.now, self._check_drained)  # after the current event has been fully handled

    def _check_drained(self) -> None:
        if self.on_drained is not None and not any(e.busy for e in self.engines):
            then, self.on_drained = self.on_drained, None
            then()

    def release_engines(self) -> None:
        for e in self.engines:
            e.hold = False
            e.version = self.version
        for e in self.engines:
            self.wake(e)

    # ---- work
    def new_group(self) -> Group:
        g = Group(gid=len(self.groups), filtered=self.sampler.filtered())
        g.requests = [Request(g, self.cfg.prompt_tokens, n) for n in self.sampler.group()]
        self.groups.append(g)
        return g

    def dispatch(self, groups: list[Group]) -> None:
        """Queue every unfinished request on the least-loaded engine (in order: first in, first served)."""
        touched: dict[int, Engine] = {}
        for g in groups:
            for r in g.requests:
                if not r.finished:
                    e = min(self.engines, key=lambda x: x.load)
                    e.waiting.append(r)
                    touched[id(e)] = e
        for e in touched.values():
            self.wake(e)

    def train(self, batch: list[Group], then: Callable[[], None]) -> None:
        """Account the batch at the current trainer version; call `then` when training ends."""
        tokens = 0
        for g in batch:
            g.state = "trained"
            for r in g.requests:
                tokens += r.context
                self.trained_tokens += r.generated
                self.off_policy_tokens += sum(n for v, n in r.segments if v < self.version)
                self.spans[self.version - min(v for v, _ in r.segments)] += 1
        seconds = self.cfg.t_train0 + self.cfg.t_train_per_token * tokens
        self.learner_time += seconds
        self.at(self.now + seconds, then)

    def finish_step(self) -> None:
        """The weight sync of a training step ended: new version, maybe the end of the run."""
        self.version += 1
        for e in self.engines:
            e.version = self.version
        self.step_ends.append(self.now)
        self.done = len(self.step_ends) >= self.cfg.steps

    # ---- results
    def result(self, oversample: float | None, max_staleness: int | None) -> SimResult:
        c, wall = self.cfg, self.now
        generated = sum(e.tokens for e in self.engines)
        wasted = sum(g.generated for g in self.groups if g.state == "dropped")
        filtered = sum(g.generated for g in self.groups if g.state == "filtered")
        held = sum(g.generated for g in self.groups if g.state == "open")
        assert generated == self.trained_tokens + wasted + filtered + held, "token accounting does not add up"
        busy = sum(e.slot_time for e in self.engines) / (c.engines * c.slots * wall)
        return SimResult(
            policy=self.label,
            oversample=oversample,
            max_staleness=max_staleness,
            steps=len(self.step_ends),
            wall_s=wall,
            step_s=wall / len(self.step_ends),
            generated_tokens=generated,
            trained_tokens=self.trained_tokens,
            held_tokens=held,
            wasted_tokens=wasted,
            filtered_tokens=filtered,
            rollout_s=self.rollout_time / len(self.step_ends) if self.rollout_time else None,
            trained_rollout_throughput=self.trained_tokens / self.rollout_time if self.rollout_time else None,
            throughput=generated / wall,
            trained_throughput=self.trained_tokens / wall,
            engine_busy=busy,
            engine_stepping=sum(e.step_time for e in self.engines) / (c.engines * wall),
            bubble_ratio=1.0 - busy,
            learner_busy=self.learner_time / wall,
            off_policy_share=self.off_policy_tokens / max(1, self.trained_tokens),
            span_histogram=dict(sorted(self.spans.items())),
            max_span=max(self.spans, default=0),
            partials=self.partials,
            preemptions=sum(e.preemptions for e in self.engines),
            prefill_tokens=sum(e.prefill_tokens for e in self.engines),
            step_times=[b - a for a, b in zip([0.0, *self.step_ends], self.step_ends)],
        )


# --------------------------------------------------------------------------- policies


class WaveRollout(Simulation):
    """sync / april / april_drop: generate, (abort), train, sync, repeat; engines idle while training."""

    def __init__(self, cfg: SimConfig, seed: int, oversample: float | None, keep_partials: bool = True):
        super().__init__(cfg, seed)
        self.refill = oversample is not None
        self.target = math.ceil(oversample * cfg.batch_size) if oversample is not None else cfg.batch_size
        # slime's sync loop with a filter over-submits whole batches and drops what is left in flight
        self.keep_partials = keep_partials and not (oversample is None and cfg.refill == "batch")
        if oversample is None:
            self.label = "sync"
        else:
            self.label = f"april{'' if keep_partials else '_drop'}_x{oversample:g}"
        self.in_flight: dict[int, Group] = {}
        self.completed: list[Group] = []  # complete and kept by the filter, not trained yet
        self.partial_groups: list[Group] = []  # aborted, waiting to be resumed (oldest first)
        self.collecting = False
        self.rollout_started = 0.0

    def start(self) -> None:
        self.begin_rollout()

    def begin_rollout(self) -> None:
        self.collecting, self.rollout_started = True, self.now
        if self.cfg.refill == "group":
            resumed, self.partial_groups = self.partial_groups, []
            self.start_groups(resumed)  # partials first: they sit at the head of every engine's queue
        self.fill()
        if len(self.completed) >= self.cfg.batch_size:
            self.batch_ready()

    def start_groups(self, groups: list[Group]) -> None:
        for g in groups:
            self.in_flight[g.gid] = g
        self.dispatch(groups)

    def fill(self) -> None:
        b = self.cfg.batch_size
        if self.cfg.refill == "batch":
            while len(self.in_flight) + len(self.completed) < b:
                resumed, self.partial_groups = self.partial_groups[: self.target], self.partial_groups[self.target :]
                self.start_groups(resumed + [self.new_group() for _ in range(self.target - len(resumed))])
            return
        limit = self.target if self.refill else b - len(self.completed)
        new = []
        while len(self.in_flight) + len(new) < limit:
            new.append(self.new_group())
        self.start_groups(new)

    def on_group_complete(self, g: Group) -> None:
        del self.in_flight[g.gid]
        if g.filtered:
            g.state = "filtered"
        else:
            self.completed.append(g)
        if not self.collecting:
            return  # finished during the abort's last step: trained next time
        if len(self.completed) >= self.cfg.batch_size:
            self.batch_ready()
        elif self.refill or g.filtered:
            self.fill()

    def batch_ready(self) -> None:
        self.collecting = False
        self.hold_engines(self.after_abort)

    def after_abort(self) -> None:
        self.rollout_time += self.now - self.rollout_started
        for e in self.engines:
            self.partials += sum(1 for r in e.clear() if r.generated > 0)
        leftover, self.in_flight = list(self.in_flight.values()), {}
        if self.keep_partials:
            self.partial_groups += leftover
        else:
            for g in leftover:
                g.state = "dropped"
        batch, self.completed = self.completed[: self.cfg.batch_size], self.completed[self.cfg.batch_size :]
        self.train(batch, then=lambda: self.at(self.now + self.cfg.t_sync, self.after_sync))

    def after_sync(self) -> None:
        self.finish_step()
        if not self.done:
            self.release_engines()
            self.begin_rollout()


class OneStepAsync(Simulation):
    """slime's train_async: generate wave k+1 (B groups, no refill) while training wave k."""

    label = "one_step_async"

    def __init__(self, cfg: SimConfig, seed: int):
        super().__init__(cfg, seed)
        self.waves_started = 0
        self.wave: dict[int, Group] = {}
        self.wave_done: list[Group] = []
        self.ready: list[Group] | None = None  # a generated wave waiting for the learner
        self.generating = self.training = self.trained_this_phase = False

    def start(self) -> None:
        self.phase()

    def phase(self) -> None:
        if self.ready is not None:
            batch, self.ready = self.ready, None
            self.training = True
            self.train(batch, then=self.trained)
        if self.waves_started < self.cfg.steps:
            self.waves_started += 1
            self.generating = True
            groups = [self.new_group() for _ in range(self.cfg.batch_size)]
            self.wave = {g.gid: g for g in groups}
            self.dispatch(groups)

    def on_group_complete(self, g: Group) -> None:
        del self.wave[g.gid]
        self.wave_done.append(g)
        if not self.wave:
            self.generating = False
            self.end_phase()

    def trained(self) -> None:
        self.training, self.trained_this_phase = False, True
        self.end_phase()

    def end_phase(self) -> None:
        if self.generating or self.training:
            return
        self.ready, self.wave_done = (self.wave_done or None), []
        if self.trained_this_phase:
            self.trained_this_phase = False
            self.at(self.now + self.cfg.t_sync, self.synced)
        else:
            self.phase()

    def synced(self) -> None:
        self.finish_step()
        if not self.done:
            self.phase()


class BoundedAsync(Simulation):
    """Engines never stop (except to load weights); the learner trains groups in start order.

    Batch i is groups i*B .. (i+1)*B-1. A group started while the engines hold version w is
    admitted only if started < (w + s + 1) * B, so it is trained at a version <= w + s: every
    trained token is at most `s` versions old. The learner waits when its batch is not done.
    """

    def __init__(self, cfg: SimConfig, seed: int, max_staleness: int):
        super().__init__(cfg, seed)
        self.s = max_staleness
        self.label = f"async_bounded_s{max_staleness}"
        self.queue: deque[Group] = deque()  # started, not trained, in start order
        self.learner_free = True

    def start(self) -> None:
        self.admit()

    def admit(self) -> None:
        limit = (self.version + self.s + 1) * self.cfg.batch_size
        new = []
        while len(self.groups) < limit:
            g = self.new_group()
            self.queue.append(g)
            new.append(g)
        self.dispatch(new)

    def on_group_complete(self, g: Group) -> None:
        self.maybe_train()

    def maybe_train(self) -> None:
        b = self.cfg.batch_size
        if not self.learner_free or len(self.queue) < b or not all(self.queue[i].complete for i in range(b)):
            return
        self.learner_free = False
        batch = [self.queue.popleft() for _ in range(b)]
        self.train(batch, then=lambda: self.hold_engines(self.engines_paused))

    def engines_paused(self) -> None:
        self.at(self.now + self.cfg.t_sync, self.synced)

    def synced(self) -> None:
        self.finish_step()
        if self.done:
            return
        self.learner_free = True
        self.release_engines()
        self.admit()
        self.maybe_train()


# --------------------------------------------------------------------------- API


def simulate(
    policy: str,
    cfg: SimConfig,
    oversample: float | None = None,
    max_staleness: int | None = None,
    seed: int = 0,
) -> SimResult:
    """Run one policy for `cfg.steps` training steps. `oversample` / `max_staleness` default to cfg's."""
    sim: Simulation
    if policy == "sync":
        sim = WaveRollout(cfg, seed, oversample=None)
    elif policy in ("april", "april_drop"):
        oversample = cfg.oversample if oversample is None else oversample
        if oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {oversample}")
        sim = WaveRollout(cfg, seed, oversample, keep_partials=policy == "april")
    elif cfg.wave_policies_only:
        raise ValueError(f"{policy}: filter_rate and refill=batch are modelled for sync, april and april_drop only")
    elif policy == "one_step_async":
        sim = OneStepAsync(cfg, seed)
    elif policy == "async_bounded":
        max_staleness = cfg.max_staleness if max_staleness is None else max_staleness
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        sim = BoundedAsync(cfg, seed, max_staleness)
    else:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    sim.run()
    return sim.result(
        oversample if policy.startswith("april") else None,
        max_staleness if policy == "async_bounded" else None,
    )


def compare(cfg: SimConfig) -> list[SimResult]:
    """sync, april at each cfg.compare_oversample, one_step_async, async_bounded at each budget
    (the async policies only where they are modelled: no filter, refill=group)."""
    seed = cfg.seed
    results = [simulate("sync", cfg, seed=seed)]
    results += [simulate("april", cfg, oversample=r, seed=seed) for r in cfg.compare_oversample]
    if cfg.wave_policies_only:
        return results
    results.append(simulate("one_step_async", cfg, seed=seed))
    results += [simulate("async_bounded", cfg, max_staleness=s, seed=seed) for s in cfg.compare_staleness]
    return results


def headline(results: list[SimResult]) -> dict[str, float]:
    """Each policy relative to sync (the first result named 'sync'): generated tokens per second, and
    for the wave policies trained tokens per rollout-phase second (`<policy>_trained_per_rollout_s`)."""
    sync = next(r for r in results if r.policy == "sync")
    out: dict[str, float] = {}
    for r in results:
        if r.policy == "sync":
            continue
        out[r.policy] = round(r.throughput / sync.throughput, 3)
        if r.trained_rollout_throughput and sync.trained_rollout_throughput:
            out[f"{r.policy}_trained_per_rollout_s"] = round(
                r.trained_rollout_throughput / sync.trained_rollout_throughput, 3
            )
    return out


def format_table(results: list[SimResult]) -> str:
    sync = next((r for r in results if r.policy == "sync"), results[0])
    head = (
        f"{'policy':<18} {'tok/s':>9} {'vs sync':>8} {'trained/s':>9} {'step s':>8} {'engine busy':>11} "
        f"{'off-policy':>10} {'max span':>8} {'wasted tok':>10} {'filtered tok':>12} {'trained/rollout s':>17}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        per_rollout = "n/a"
        if r.trained_rollout_throughput and sync.trained_rollout_throughput:
            per_rollout = (
                f"{r.trained_rollout_throughput:.0f} "
                f"({r.trained_rollout_throughput / sync.trained_rollout_throughput:.2f}x)"
            )
        rows.append(
            f"{r.policy:<18} {r.throughput:>9.0f} {r.throughput / sync.throughput:>7.2f}x {r.trained_throughput:>9.0f} "
            f"{r.step_s:>8.2f} {100 * r.engine_busy:>10.1f}% {100 * r.off_policy_share:>9.1f}% {r.max_span:>8d} "
            f"{r.wasted_tokens:>10d} {r.filtered_tokens:>12d} {per_rollout:>17}"
        )
    return "\n".join(rows)


def plot(results: list[SimResult], path: str | Path) -> Path:
    """Bars: throughput relative to sync, and off-policy token share, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r.throughput for r in results if r.policy == "sync"), results[0].throughput)
    names = [r.policy for r in results]
    x = np.arange(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    bars = ax1.bar(x, [r.throughput / base for r in results], color="tab:blue")
    ax1.bar_label(bars, fmt="%.2f", fontsize=8)
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_title("rollout throughput vs sync")
    ax1.set_ylabel("ratio")
    bars = ax2.bar(x, [100 * r.off_policy_share for r in results], color="tab:orange")
    ax2.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax2.set_title("off-policy token share")
    ax2.set_ylabel("% of trained tokens")
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def sim_config_from_job(job: JobConfig, overrides: dict[str, Any] | None = None) -> SimConfig:
    """A job's rollout shape on the preset matching its device (cpu -> cpu_tiny, else paper)."""
    base = PRESETS["cpu_tiny" if job.rollout.device == "cpu" else "paper"].model_dump()
    r = job.rollout
    base.update(
        engines=r.num_workers,
        slots=r.max_running_requests,
        batch_size=r.batch_size,
        n_samples=r.n_samples_per_prompt,
        max_tokens=r.max_new_tokens,
        oversample=job.april.oversample,
        max_staleness=max(1, job.max_staleness),
        seed=job.seed,
    )
    base["resume_from_kept_kv"] = r.engine == "builtin" and r.kept_kv_tokens > 0
    if job.rollout.device == "cpu":  # the CPU engine has no KV pool to exhaust: room for every slot
        per_request = base["prompt_tokens"] + r.max_new_tokens
        base["kv_tokens"] = max(base["kv_tokens"], r.max_running_requests * per_request)
    base.update(overrides or {})
    return _validate(base)


def _validate(data: dict[str, Any]) -> SimConfig:
    try:
        return SimConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, "invalid simulator config", "sim.", "SimConfig in april/sim.py")
        ) from None


def _preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].model_dump()


def config_from_cli(args: list[str]) -> tuple[SimConfig, Path]:
    """`[CONFIG.yaml | PRESET] [key=value ...]` -> (SimConfig, plot path).

    CONFIG is a job YAML (its rollout shape is simulated) or a YAML with a top-level `sim:`
    section (optionally `preset: NAME` inside it); a bare word is a preset name; nothing means
    `paper`. Overrides: `sim.<field>=v` (or `<field>=v` outside a job YAML) set simulator fields,
    other dotted keys override the job YAML, `preset=NAME` picks the base, `out=PATH` the plot.
    """
    import yaml

    source = args[0] if args and "=" not in args[0] else None
    rest = args[1:] if source is not None else args
    sim_overrides: dict[str, Any] = {}
    job_overrides: list[str] = []
    out, preset = Path("simulate.png"), None
    is_job = source is not None and Path(source).is_file()
    loaded: dict[str, Any] = {}
    if is_job:
        try:
            loaded = yaml.safe_load(Path(source).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML ({exc})") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping")
        is_job = "sim" not in loaded
    for text in rest:
        path, value = parse_override(text)
        if path == ["out"]:
            out = Path(str(value))
        elif path == ["preset"]:
            preset = str(value)
        elif path[0] == "sim" and len(path) == 2:
            sim_overrides[path[1]] = value
        elif is_job:
            job_overrides.append(text)
        elif len(path) == 1:
            sim_overrides[path[0]] = value
        else:
            raise ConfigError(f"override {text!r}: simulator fields are flat (e.g. t0=0.01 or sim.t0=0.01)")

    if is_job:
        return sim_config_from_job(load_config(source, job_overrides), sim_overrides), out
    if source is not None and not Path(source).is_file():
        if preset is not None:
            raise ConfigError("give either a preset name or preset=NAME, not both")
        if source not in PRESETS:
            raise ConfigError(f"{source}: not a file and not a preset ({', '.join(PRESETS)})")
        preset = source
    section = dict(loaded.get("sim") or {})
    if not isinstance(loaded.get("sim") or {}, dict):
        raise ConfigError(f"{source}: `sim:` must be a mapping of simulator fields")
    data = _preset(preset or section.pop("preset", None) or "paper")
    section.pop("preset", None)
    data.update(section)
    data.update(sim_overrides)
    return _validate(data), out


def main_simulate(args: list[str]) -> int:
    """`slime simulate [CONFIG.yaml | PRESET] [key=value ...]`: table, simulate.png, JSON last line."""
    try:
        cfg, out = config_from_cli(args)
    except ConfigError as exc:
        print(f"slime simulate: {exc}", file=sys.stderr)
        return 2
    results = compare(cfg)
    print(
        f"{cfg.engines} engines x {cfg.slots} slots, B={cfg.batch_size} groups x {cfg.n_samples}, "
        f"max {cfg.max_tokens} tokens, {cfg.steps} steps; t0={cfg.t0 * 1e3:g} ms, k={cfg.k * 1e3:g} ms/request, "
        f"t_kv={cfg.t_kv * 1e9:g} ns/KV token, p={cfg.p * 1e6:g} us/prefill token"
    )
    print(format_table(results))
    print(f"plot: {plot(results, out)}")
    print(json.dumps(headline(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main_simulate(sys.argv[1:]))
