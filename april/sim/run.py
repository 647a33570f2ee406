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
                  start only if it will be trained within `max_staleness` versions. With
                  `elastic`, april/elastic.py adds and removes engines when the learner asks for
                  its batch, as the live job does (rollout.elastic).

Entry points: `simulate`, `compare`, and the report (april/sim/report.py: `headline`, `format_table`,
`plot`); `slime simulate` (slime/tools/simulate.py) builds a SimConfig from a job.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable

from april.elastic import ElasticPolicy
from april.scheduler import GroupCounts, GroupScheduler
from april.sim.config import POLICIES, PRESETS, SimConfig
from april.sim.engine import Engine, Group, LengthSampler, Request
from april.sim.report import SimResult, format_table, headline, plot

__all__ = ["POLICIES", "PRESETS", "SimConfig", "SimResult", "compare", "format_table", "headline", "plot", "simulate"]


# --------------------------------------------------------------------------- simulation core


class Simulation:
    """The event loop, the engines, dispatch and training accounting; policies subclass it."""

    label = "?"

    def __init__(self, cfg: SimConfig, seed: int):
        self.cfg = cfg
        self.sampler = LengthSampler(cfg, seed)
        self.engines = [Engine(cfg) for _ in range(cfg.engines)]
        self.starting: list[Engine] = []  # elastic: added, not generating yet (they hold a GPU)
        self.removed: list[Engine] = []  # elastic: their tokens and times still count
        self.engines_per_step: list[int] = []
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
        lengths = self.sampler.group(self.cfg.length_growth**self.version)
        g.requests = [Request(g, self.cfg.prompt_tokens, n) for n in lengths]
        self.groups.append(g)
        return g

    def dispatch(self, groups: list[Group]) -> None:
        """Queue every unfinished request on the least-loaded engine (in order: first in, first served)."""
        touched: dict[int, Engine] = {}
        loads = [e.load for e in self.engines]  # read once per call: hundreds of engines x requests
        for g in groups:
            for r in g.requests:
                if not r.finished:
                    i = loads.index(min(loads))  # the first least-loaded engine
                    self.engines[i].waiting.append(r)
                    loads[i] += 1
                    touched[i] = self.engines[i]
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
        c = self.cfg
        per_token = c.t_train_per_token
        if c.gpu_pool is not None:  # the GPUs no engine holds train
            per_token /= c.gpu_pool - len(self.engines) - len(self.starting)
        seconds = c.t_train0 + per_token * tokens
        self.learner_time += seconds
        self.at(self.now + seconds, then)

    def finish_step(self) -> None:
        """The weight sync of a training step ended: new version, maybe the end of the run."""
        self.version += 1
        for e in self.engines:
            e.version = self.version
        self.step_ends.append(self.now)
        self.engines_per_step.append(len(self.engines) + len(self.starting))
        self.done = len(self.step_ends) >= self.cfg.steps

    # ---- results
    def result(self, oversample: float | None, max_staleness: int | None) -> SimResult:
        c, wall = self.cfg, self.now
        every = self.engines + self.removed + self.starting  # a starting engine holds its GPU, idle
        generated = sum(e.tokens for e in every)
        wasted = sum(g.generated for g in self.groups if g.state == "dropped")
        filtered = sum(g.generated for g in self.groups if g.state == "filtered")
        held = sum(g.generated for g in self.groups if g.state == "open")
        assert generated == self.trained_tokens + wasted + filtered + held, "token accounting does not add up"
        engine_seconds = sum((wall if e.left_at is None else e.left_at) - e.joined_at for e in every)
        busy = sum(e.slot_time for e in every) / (c.slots * engine_seconds)
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
            engine_stepping=sum(e.step_time for e in every) / engine_seconds,
            bubble_ratio=1.0 - busy,
            learner_busy=self.learner_time / wall,
            off_policy_share=self.off_policy_tokens / max(1, self.trained_tokens),
            span_histogram=dict(sorted(self.spans.items())),
            max_span=max(self.spans, default=0),
            partials=self.partials,
            preemptions=sum(e.preemptions for e in every),
            prefill_tokens=sum(e.prefill_tokens for e in every),
            mean_engines=engine_seconds / wall,
            step_times=[b - a for a, b in zip([0.0, *self.step_ends], self.step_ends)],
            engines_per_step=list(self.engines_per_step),
        )


# --------------------------------------------------------------------------- policies


class WaveRollout(Simulation):
    """sync / april / april_drop: generate, (abort), train, sync, repeat; engines idle while training."""

    def __init__(self, cfg: SimConfig, seed: int, oversample: float | None, keep_partials: bool = True):
        super().__init__(cfg, seed)
        self.refill = oversample is not None
        # The live job's decisions (april/scheduler.py): how many groups to keep in flight and start.
        self.scheduler = GroupScheduler("april" if self.refill else "sync", cfg.batch_size, oversample)
        self.target = self.scheduler.target
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
        if self.scheduler.batch_full(len(self.completed)):
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
        counts = GroupCounts(unfinished=len(self.in_flight), ready=len(self.completed), started=len(self.groups))
        self.start_groups([self.new_group() for _ in range(self.scheduler.groups_to_start(counts))])

    def on_group_complete(self, g: Group) -> None:
        del self.in_flight[g.gid]
        if g.filtered:
            g.state = "filtered"
        else:
            self.completed.append(g)
        if not self.collecting:
            return  # finished during the abort's last step: trained next time
        if self.scheduler.batch_full(len(self.completed)):
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

    Elastic: when the learner asks for its batch (after each weight sync), april/elastic.py decides
    on the ready share of the s * B admission budget. An added engine holds its GPU at once and
    generates `t_engine_start` later, taking queued requests from the others; a removed one (the
    newest) gives its requests, tokens kept, to the front of the others' queues.
    """

    def __init__(self, cfg: SimConfig, seed: int, max_staleness: int, elastic: bool = False):
        super().__init__(cfg, seed)
        self.s = max_staleness
        self.label = f"async_bounded_s{max_staleness}" + ("_elastic" if elastic else "")
        self.elastic = (
            ElasticPolicy(
                cfg.elastic_min_engines,
                cfg.elastic_max_engines,
                cfg.elastic_low_watermark,
                cfg.elastic_high_watermark,
                cfg.elastic_cooldown_steps,
            )
            if elastic
            else None
        )
        self.syncing = False  # engines held for the weight sync
        self.peak_queued = 0  # elastic: the most requests waiting for a slot since the last decision
        # The live job's admission rule; the engines here take every admitted group (an in-flight
        # target of (s + 1) * B never binds before the staleness cap does).
        self.scheduler = GroupScheduler(
            "async", cfg.batch_size, oversample_groups=(max_staleness + 1) * cfg.batch_size, max_staleness=max_staleness
        )
        self.queue: deque[Group] = deque()  # started, not trained, in start order
        self.learner_free = True

    def start(self) -> None:
        self.rebalance()
        self.admit()

    def admit(self) -> None:
        unfinished = sum(1 for g in self.queue if not g.complete)
        counts = GroupCounts(unfinished=unfinished, ready=len(self.queue) - unfinished, started=len(self.groups))
        new = [self.new_group() for _ in range(self.scheduler.groups_to_start(counts, self.version))]
        self.queue.extend(new)
        self.dispatch(new)
        self.peak_queued = max(self.peak_queued, sum(len(e.waiting) for e in self.engines))

    def on_group_complete(self, g: Group) -> None:
        self.maybe_train()

    def maybe_train(self) -> None:
        b = self.cfg.batch_size
        if not self.learner_free or len(self.queue) < b or not all(self.queue[i].complete for i in range(b)):
            return
        self.learner_free = False
        batch = [self.queue.popleft() for _ in range(b)]
        self.train(batch, then=self.pause_for_sync)

    def pause_for_sync(self) -> None:
        self.syncing = True
        self.hold_engines(self.engines_paused)

    def engines_paused(self) -> None:
        self.at(self.now + self.cfg.t_sync, self.synced)

    def synced(self) -> None:
        self.finish_step()
        if self.done:
            return
        self.learner_free = True
        self.rebalance()  # the learner asks for its next batch
        self.syncing = False
        self.release_engines()
        self.admit()
        self.maybe_train()

    # ---- elastic rollout
    def rebalance(self) -> None:
        """As the live job's RolloutFleet.rebalance; every engine is idle here (held, or at the start)."""
        if self.elastic is None:
            return
        ready = next((i for i, g in enumerate(self.queue) if not g.complete), len(self.queue))  # in start order
        workers = len(self.engines) + len(self.starting)
        queued, self.peak_queued = self.peak_queued, 0
        decision = self.elastic.decide(workers, ready, self.s * self.cfg.batch_size, queued)
        if decision.action == "add":
            e = Engine(self.cfg, joined_at=self.now)
            e.hold = True
            self.starting.append(e)
            self.at(self.now + self.cfg.t_engine_start, lambda: self.join(e))
        elif decision.action == "remove":
            e = self.starting.pop() if self.starting else self.engines.pop()
            e.left_at = self.now
            self.removed.append(e)
            aborted = e.clear()
            self.partials += sum(1 for r in aborted if r.generated > 0)
            for r in reversed(aborted):  # first in line on the engines left
                min(self.engines, key=lambda x: x.load).waiting.appendleft(r)

    def join(self, e: Engine) -> None:
        if e not in self.starting:
            return  # removed while it was starting
        self.starting.remove(e)
        self.engines.append(e)
        e.version = self.version
        e.hold = self.syncing  # released with the others after the sync
        # The live worker leases from the one shared queue: here it takes queued requests from the others.
        while (donor := max(self.engines, key=lambda x: len(x.waiting))).waiting and donor.load > e.load + 1:
            e.waiting.appendleft(donor.waiting.pop())
        self.wake(e)


# --------------------------------------------------------------------------- API


def simulate(
    policy: str,
    cfg: SimConfig,
    oversample: float | None = None,
    max_staleness: int | None = None,
    seed: int = 0,
    elastic: bool = False,
) -> SimResult:
    """Run one policy for `cfg.steps` training steps. `oversample` / `max_staleness` default to cfg's;
    `elastic` (async_bounded only) adds and removes engines within cfg's elastic_* bounds."""
    if elastic and policy != "async_bounded":
        raise ValueError(f"elastic is modelled for async_bounded, not {policy}")
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
        sim = BoundedAsync(cfg, seed, max_staleness, elastic)
    else:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    sim.run()
    return sim.result(
        oversample if policy.startswith("april") else None,
        max_staleness if policy == "async_bounded" else None,
    )


def compare(cfg: SimConfig) -> list[SimResult]:
    """sync, april at each cfg.compare_oversample, one_step_async, async_bounded at each budget, and
    with cfg.elastic async_bounded at cfg.max_staleness with elastic rollout (the async policies
    only where they are modelled: no filter, refill=group)."""
    seed = cfg.seed
    results = [simulate("sync", cfg, seed=seed)]
    results += [simulate("april", cfg, oversample=r, seed=seed) for r in cfg.compare_oversample]
    if cfg.wave_policies_only:
        return results
    results.append(simulate("one_step_async", cfg, seed=seed))
    results += [simulate("async_bounded", cfg, max_staleness=s, seed=seed) for s in cfg.compare_staleness]
    if cfg.elastic:
        results.append(simulate("async_bounded", cfg, max_staleness=cfg.max_staleness, seed=seed, elastic=True))
    return results
