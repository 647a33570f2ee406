"""The rollout side of the driver: the workers as one fleet the loops command.

It starts groups in the buffer as APRIL's scheduler decides (april/scheduler.py), waits for the
step's batch (or, streaming, for segments) and keeps them coming while the learner trains, drops
zero-variance groups, aborts the long tail (Abort) and resumes it, pushes weights into the engines, follows the dashboard's controls, watches the
workers' health, and (rollout.elastic) adds and removes workers as april/elastic.py decides. The
decisions are APRIL's; this file only carries them out.

The workers are actors of the job's launcher (slime/launch/: Ray's, or threads of this process), called through it.

Longer than 500 lines: one object owns the worker list, and admission, waiting, weights, health and
elastic membership each read or change it; every decision it carries out is made in april/.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from april.elastic import ElasticPolicy
from april.scheduler import BudgetHold, GroupCounts, GroupScheduler, ZeroVarianceFilter
from rewards.group_filter import GroupFilter
from slime.buffer import JobTelemetry, NewGroup, TrajectoryStore
from slime.config import JobConfig
from slime.data import reward_metadata
from slime.launch.launcher import Launcher, WorkerLaunch, start_rollout_worker, worker_resources
from slime.sampling import PromptSampler


class WorkerFailed(RuntimeError):
    pass


class WorkerHung(RuntimeError):
    """A rollout worker stopped making progress (rollout.hang_timeout_s); it has been killed."""


def scheduler_for(cfg: JobConfig) -> GroupScheduler:
    """APRIL's plain settings from the job config (april/ never reads slime.config)."""
    policy = cfg.loop_mode
    if policy == "sync" and cfg.april.enabled:
        policy = "april"
    return GroupScheduler(
        policy,
        cfg.rollout.batch_size,
        oversample=cfg.april.oversample if cfg.april.enabled else None,
        oversample_groups=cfg.april.oversample_groups if cfg.april.enabled else None,
        max_staleness=cfg.max_staleness,
    )


@dataclass
class _Changing:
    """A worker joining the fleet (``done``: its first health call, answered once it has started) or
    leaving it (``done``: its retire call)."""

    actor: Any
    worker_id: str
    placement: Any  # its placement group, or None
    done: Any  # the launcher's ref of that call
    since: float


class WorkerTotals:
    """Counters that workers report since they started, summed over the job: a worker that left
    (elastic rollout, a restart) keeps what it counted, and one that restarted under the same id
    (its counters back below what it last said) adds on top."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.last: dict[str, dict[str, float]] = {}  # worker id -> its counters when last read
        self.gone = dict.fromkeys(names, 0.0)  # what workers counted before they left or restarted

    def update(self, healths: list[dict]) -> dict[str, float]:
        now = {h["worker_id"]: {n: float(h.get(n, 0)) for n in self.names} for h in healths}
        for worker, before in self.last.items():
            after = now.get(worker)
            if after is None or any(after[n] < before[n] for n in self.names):
                for n in self.names:
                    self.gone[n] += before[n]
        self.last = now
        return {n: self.gone[n] + sum(c[n] for c in now.values()) for n in self.names}


class RolloutFleet:
    def __init__(
        self,
        cfg: JobConfig,
        workers: list,
        buffer: TrajectoryStore,
        telemetry: JobTelemetry,
        sampler: PromptSampler,
        launcher: Launcher,
        launch: WorkerLaunch | None = None,
        group_filter: GroupFilter | None = None,
    ):
        self.cfg = cfg
        self.group_filter = group_filter  # april.group_filter: the user's rule instead of "rewards differ"
        self.launcher = launcher
        self.workers = workers  # the job's list: changed in place as workers join and leave
        self.buffer = buffer
        self.telemetry = telemetry
        self.sampler = sampler
        self.scheduler = scheduler_for(cfg)
        limit = cfg.april.max_filtered_per_step
        self.filter = ZeroVarianceFilter(cfg.rollout.batch_size if limit is None else limit)
        # The policy version every engine holds: the one they started with (each worker reads it from
        # the buffer as it starts), then the last one pushed. Never the learner's: the learner
        # publishes its next version before the engines have its weights.
        self.engine_version: int = buffer.get_policy_version()
        self.dashboard_paused = False
        self.oversample_override: float | None = None  # the dashboard's over-provisioning ratio
        self.controls_read_at = 0.0
        self.last_health = time.time()
        self.progress: dict[int, tuple[tuple, float]] = {}  # worker -> (engine counters, since when)
        self.forward_said = False  # the engines' forward path, printed once
        # over the job, workers gone included
        self.engine_totals = WorkerTotals("kv_resumes", "kv_resumed_tokens", "cuda_graph_replays")
        self.graphs_failed_said = False
        # Elastic rollout (rollout.elastic): april decides, the methods under "elastic rollout" act.
        e = cfg.rollout.elastic
        self.elastic = (
            ElasticPolicy(e.min_workers, e.max_workers, e.low_watermark, e.high_watermark, e.cooldown_steps)
            if e.enabled
            else None
        )
        if self.elastic is not None and launch is None:
            raise ValueError("RolloutFleet: rollout.elastic needs the WorkerLaunch the job starts workers with")
        self.launch = launch
        self.worker_ids = [launch.worker_id(i) for i in range(len(workers))] if launch else []
        self.next_index = len(workers)
        self.weights: Any = None  # the handle last pushed to every engine: a joining worker loads it
        self.placements: dict[str, Any] = {}  # worker id -> placement group, for the workers added here
        self.joining: list[_Changing] = []
        self.leaving: list[_Changing] = []
        self.last_fill: float | None = None
        self.peak_queued = 0  # the most samples beyond the workers' engine slots since the last decision
        self.budget_hold = BudgetHold(totals_seen=self._discard_totals())  # algorithm.correction.auto reads it
        self.admission_held = False  # async: the staleness budget refused groups at the last scheduling

    # ---- starting groups -------------------------------------------------------------------------
    def _schedule_groups(self) -> int:
        """Top the buffer up with new groups, one per prompt, as many as the scheduler says. Called as
        a sync step starts, at each poll while the driver waits, and while the learner trains."""
        cfg = self.cfg
        c = self.buffer.counts()
        # Elastic rollout's saturation signal: samples to generate (or score) beyond the engines' slots.
        unfinished = c["pending"] + c["aborted"] + c["running"]
        slots = len(self.workers) * cfg.rollout.max_running_requests
        self.peak_queued = max(self.peak_queued, unfinished - slots)
        # The engines' version, not the learner's (async admission): see engine_version.
        version = self.engine_version
        # Dropped groups never train (a filter's, the learner's stale ones, a resume's): not "started"
        # for async admission, whose cap assumes the k-th group trains at step k // B. Counted, the
        # filter's drops alone reached the cap with nothing in flight, and the job waited for good.
        started = c["groups_total"] - c["groups_dropped"]
        counts = GroupCounts(unfinished=c["groups_open"], ready=c["groups_ready"], started=started)
        missing = self.scheduler.groups_to_start(counts, version)
        self.admission_held = self.scheduler.held_by_staleness(counts, version) > 0
        groups = []
        for _ in range(missing):
            record = self.sampler.next()
            groups.append(
                NewGroup(
                    record.prompt_ids,
                    cfg.rollout.n_samples_per_prompt,
                    cfg.rollout.max_new_tokens,
                    {**reward_metadata(record), "record_index": record.index},
                    draw=self.sampler.draws,
                    streaming=cfg.loop_mode == "streaming",
                )
            )
        self.buffer.add_groups(groups)  # one round trip: an idle worker leases them together
        return missing

    def staleness_held_share(self) -> float:
        """How much the staleness budget held the rollout back since the last call (april.scheduler.BudgetHold).
        Async: the share of the time the learner waited for its batch while admission was capped."""
        if self.scheduler.policy == "async":
            return self.budget_hold.take_time(time.monotonic())
        return self.budget_hold.take_tokens(*self._discard_totals())

    def _discard_totals(self) -> tuple[float, float]:
        stats = self.buffer.stats()  # running totals: tokens restarted beyond APRIL's span, and generated
        return stats.get("restarted_tokens", 0.0), stats.get("generated_tokens", 0.0)

    # ---- waiting for the batch -------------------------------------------------------------------
    def wait_for_batch(self, on_wait: Callable[[dict[str, int], int], None]) -> None:
        """Until the step's batch is ready (with the filter: ready and checked). Sync and APRIL start
        the step's groups first; async kept its groups going while the learner trained."""
        needed = self.cfg.rollout.batch_size
        self.filter.new_step()  # each batch is filtered afresh
        if self.scheduler.policy != "async":
            self._schedule_groups()
        while True:
            filtering = self.cfg.april.filter_zero_variance or self.group_filter is not None
            checked = self.filter_ready_groups() if filtering else None
            counts = self.buffer.counts()
            # With the filter, only groups it has seen count: one that turned ready after its pass
            # would reach the learner (FIFO claims) unchecked. Async trains in start order (the
            # staleness bound's premise): the batch is full when the oldest waiting groups are ready.
            ready = counts["groups_ready"] if checked is None else checked
            if self.scheduler.policy == "async":
                ready = min(ready, self.buffer.ready_in_start_order(needed))
            if self.scheduler.batch_full(ready):
                self.budget_hold.note(time.monotonic(), held=False)  # the learner waits no longer
                return
            self._poll(needed, on_wait)  # refill as groups finish or are filtered, one group at a time
            # Woken the moment a group turns ready: the batch-full check (and with APRIL the abort
            # and the refill) does not wait out a polling interval; APRIL's rollout phases are short.
            self.buffer.wait_for_ready_signal(0.02)

    def wait_for_segments(self, step: int, needed: int, on_wait: Callable[[dict[str, int], int], None]) -> None:
        chunk = self.cfg.april.streaming_chunk_tokens
        while (available := self.buffer.count_segments(chunk, step)) < needed:
            counts = self._poll(needed, on_wait)
            if available and counts["groups_open"] == 0:
                # Every group in flight has finished generating and its last segments are stored: no
                # more can come until they are trained (ready groups count toward the in-flight target).
                return
            time.sleep(0.02)

    def _poll(self, needed: int, on_wait: Callable[[dict[str, int], int], None]) -> dict[str, int]:
        """One turn of a wait: new groups as the scheduler says, the dashboard's controls, elastic
        changes, and (every 2 s) the workers' health. Returns the buffer's counts after scheduling."""
        self._schedule_groups()
        # async's budget costs time only while the learner waits on the rollout, which is when this runs
        self.budget_hold.note(time.monotonic(), held=self.admission_held)
        counts = self.buffer.counts()
        on_wait(counts, needed)
        self.apply_controls()
        if self.joining or self.leaving:
            self.follow_changes()
        if time.time() - self.last_health > 2.0:
            self.check_workers()
            self.last_health = time.time()
        return counts

    def generate_while(self, refs: list) -> None:
        """Until ``refs`` (the learner's training) are done, the workers keep generating new groups."""
        while len(self.launcher.wait(refs, num_returns=len(refs), timeout=0.05)[0]) < len(refs):
            self._schedule_groups()

    def filter_ready_groups(self) -> int:
        """DAPO dynamic sampling (the decision is april's ZeroVarianceFilter; april.group_filter's rule
        instead of "the rewards differ" when set). Returns how many ready groups passed (the oldest in
        the ready queue). A drop the buffer refuses: the group was claimed meanwhile."""
        kept = 0
        for gid in self.buffer.ready_group_ids():
            if gid in self.filter.seen:
                kept += 1
                continue
            group = self.buffer.get_group(gid)
            rewards = [s.reward for s in group if s.reward is not None and s.failure is None]
            informative = self.group_filter.keep(group) if self.group_filter is not None else None
            if self.filter.check(gid, rewards, informative) == "keep":
                kept += 1
            elif self.buffer.drop_ready_group(gid, "zero_variance" if informative is None else "group_filter"):
                self.filter.dropped()
        return kept

    # ---- APRIL's abort and resume ----------------------------------------------------------------
    def abort_tail(self) -> Abort:
        """The abort at this batch's boundary: APRIL's long tail waits for the next step."""
        return Abort(self, enabled=self.scheduler.aborts_at_batch_boundary)

    def release_memory(self) -> int:
        """Every engine frees its KV memory (colocated placement, sync loops); total bytes freed."""
        return int(sum(self._wait_all([w.release_memory.remote() for w in self.workers], "release_memory")))

    def resume_memory(self) -> None:
        self._wait_all([w.resume_memory.remote() for w in self.workers], "resume_memory")

    def resume(self) -> None:
        if not self.dashboard_paused:  # paused from the dashboard: stays paused until resumed there
            self._wait_all([w.resume.remote() for w in self.workers], "resume")

    # ---- weights ------------------------------------------------------------------------------------
    def update_weights(self, handle: Any) -> None:
        self._wait_all([w.update_weights.remote(handle) for w in self.workers], "update_weights")
        self.engine_version = handle.version
        self.weights = handle

    def set_staleness_budget(self, knob: str, value: int) -> None:
        """algorithm.correction.auto's budget from now on: async's admission (the scheduler) or APRIL's
        max_version_span (every worker, read when a partial resumes)."""
        if knob == "max_staleness":
            self.scheduler.max_staleness = value
        elif knob == "max_version_span":
            self._wait_all([w.set_max_version_span.remote(value) for w in self.workers], "set_max_version_span")

    def probe_logprobs(self, prompt_ids: list[int], probe: list[int]) -> list:
        return self._wait_all([w.probe_logprobs.remote(prompt_ids, probe) for w in self.workers], "probe_logprobs")

    def weight_checksums(self) -> list:
        """Each engine's per-tensor checksums (None from an engine that cannot give them)."""
        return self._wait_all([w.weight_checksums.remote() for w in self.workers], "weight_checksums")

    def generate_for_eval(self, requests: list) -> dict[str, dict]:
        """Held-out requests dealt over the workers, each share run alone on its engine (what the
        engines were generating is stored and resumed later): request id -> its answer."""
        n = len(self.workers)
        shares = [(w, requests[i::n]) for i, w in enumerate(self.workers) if requests[i::n]]
        answers: dict[str, dict] = {}
        for part in self._wait_all([w.generate_for_eval.remote(share) for w, share in shares], "generate_for_eval"):
            answers.update(part)
        return answers

    # ---- dashboard controls and health -----------------------------------------------------------
    def apply_controls(self) -> None:
        """Honour the dashboard's control hash (read at most every 0.25 s): pause/resume rollout,
        and the APRIL over-provisioning override, which the next _schedule_groups uses."""

        if time.time() - self.controls_read_at < 0.25:
            return
        self.controls_read_at = time.time()
        control = self.telemetry.get_control()
        paused = control.get("paused") == "1"
        if paused != self.dashboard_paused:
            self._wait_all([(w.pause if paused else w.resume).remote() for w in self.workers], "pause")
            self.dashboard_paused = paused
            self.telemetry.log_event("rollout_paused" if paused else "rollout_resumed", {"by": "driver"})
        oversample = float(control["oversample"]) if "oversample" in control else None
        if self.cfg.april.enabled and oversample != self.oversample_override:
            self.oversample_override = oversample
            self.scheduler.oversample = self.cfg.april.oversample if oversample is None else oversample
            self.scheduler.oversample_groups = self.cfg.april.oversample_groups if oversample is None else None
            self.telemetry.log_event("oversample_applied", {"by": "driver", "groups_in_flight": self.scheduler.target})

    def check_workers(self) -> list[dict]:
        healths = []
        limit, now = self.cfg.rollout.hang_timeout_s, time.time()
        for i, w in enumerate(self.workers):
            # A dead actor's RayActorError goes up as it is: train() restarts the job from its
            # checkpoint. A worker that reports an error (its rollout thread raised) fails the job.
            try:
                h = self.launcher.get(w.health.remote(), timeout=limit)
            except self.launcher.timeout_error:
                self._kill_hung(i, f"it did not answer its health check for {limit:g}s")
            if h.get("error"):
                raise WorkerFailed(f"rollout worker failed:\n{h['error']}")
            counters = (h["engine_tokens_generated"], h.get("decode_steps", 0))
            queued = h["running"] + h["waiting"]
            last = self.progress.get(i)
            if last is None or last[0] != counters or not queued or self.dashboard_paused:
                self.progress[i] = (counters, now)
            elif now - last[1] > limit:
                self._kill_hung(i, f"no decode step for {now - last[1]:.0f}s with {queued} requests queued")
            healths.append(h)
        self.telemetry.record_engine_health(healths)
        self.note_forward(healths)
        if healths and not any(h.get("alive") for h in healths):
            raise WorkerFailed("every rollout worker has stopped")
        return healths

    def wait_started(self, other_refs: list) -> None:
        """Until every worker answers its first health call (it has started) and ``other_refs`` are done."""
        self.note_forward(self.launcher.get([w.health.remote() for w in self.workers] + other_refs))

    def note_forward(self, replies: list) -> None:
        """Print once which forward the built-in engines took (it was only in their log, at INFO)."""
        kinds = sorted({str(h["forward"]) for h in replies if isinstance(h, dict) and h.get("forward")})
        if kinds and not self.forward_said:
            self.forward_said = True
            slow = " (the Hugging Face forward, the slowest; docs/engines.md says why one is refused)" * ("hf" in kinds)
            print(f"rollout engines: the built-in engine's forward path is {'/'.join(kinds)}{slow}", flush=True)

    def _wait_all(self, refs: list, what: str) -> list:
        """The workers' replies to one call each (refs in worker order); a worker that has not
        replied within rollout.hang_timeout_s is hung (a call into a live engine returns in seconds)."""
        limit = self.cfg.rollout.hang_timeout_s
        ready, _ = self.launcher.wait(refs, num_returns=len(refs), timeout=limit)
        if len(ready) < len(refs):
            late = next(i for i, r in enumerate(refs) if r not in ready)
            self._kill_hung(late, f"{what} did not return for {limit:g}s")
        return self.launcher.get(refs)

    def _kill_hung(self, index: int, why: str) -> typing.NoReturn:
        self.launcher.kill(self.workers[index])
        self.telemetry.log_event("worker_hung", {"worker": index, "why": why})
        raise WorkerHung(f"rollout worker {index} hung ({why}, rollout.hang_timeout_s); killed")

    def healths(self) -> list[dict]:
        healths = self._wait_all([w.health.remote() for w in self.workers], "health")
        self.telemetry.record_engine_health(healths)
        failed = next((h["cuda_graphs_failed"] for h in healths if h.get("cuda_graphs_failed")), None)
        if failed and not self.graphs_failed_said:  # the decode goes on eagerly, host-bound on a GPU
            self.graphs_failed_said = True
            print(f"rollout engines: CUDA graphs were given up, decode runs eagerly: {failed}", flush=True)
        return healths

    # ---- elastic rollout (rollout.elastic) --------------------------------------------------------
    def rebalance(self, step: int) -> None:
        """When the learner asks for its batch: april's ElasticPolicy reads how full the buffer is and
        a worker is added (it joins once started, with the engines' weights) or the newest removed
        (it leaves once its partials are requeued and its rewards stored). Each decision is an event."""
        if self.joining or self.leaving:
            self.follow_changes()
        if self.elastic is None:
            return
        budget = max(1, self.scheduler.max_staleness) * self.cfg.rollout.batch_size
        # Async trains in start order: a group ready behind an unfinished older one cannot be trained yet.
        ready = self.buffer.ready_in_start_order(budget)
        queued, self.peak_queued = max(0, self.peak_queued), 0
        decision = self.elastic.decide(len(self.workers) + len(self.joining), ready, budget, queued)
        self.last_fill = decision.fill
        if decision.action == "hold":
            return
        worker_id = self._add_worker() if decision.action == "add" else self._remove_newest()
        self.telemetry.log_event(
            f"elastic_{decision.action}",
            {
                "step": step,
                "worker": worker_id,
                "workers": decision.workers,
                "fill": round(decision.fill, 3),
                "ready_groups": ready,
                "queued_samples": queued,
                "reason": decision.reason,
            },
        )

    def _add_worker(self) -> str:
        """Start a worker, paused until it holds the engines' weights (follow_changes). A worker that
        reserves anything (a GPU, rollout.resources_per_worker) gets a placement group of its own:
        removing the worker returns exactly that to the cluster."""
        index, self.next_index = self.next_index, self.next_index + 1
        worker_id = self.launch.worker_id(index)
        need = worker_resources(self.cfg)
        placement = None
        if need:
            placement = self.launcher.placement_group([need], "PACK", f"{self.cfg.job_name}-rollout-{worker_id}")
        actor = start_rollout_worker(self.launcher, self.cfg, self.launch, index, paused=True, placement=placement)
        self.joining.append(_Changing(actor, worker_id, placement, actor.health.remote(), time.time()))
        return worker_id

    def _remove_newest(self) -> str:
        """The newest worker leaves: one still starting has leased nothing and just goes; a running
        one retires (RolloutWorker.retire) while the others go on."""
        if self.joining:
            member = self.joining.pop()
            self._discard(member)
            self.telemetry.log_event("elastic_removed", {"worker": member.worker_id, "while": "starting"})
            return member.worker_id
        actor, worker_id = self.workers.pop(), self.worker_ids.pop()
        self.progress = {}  # keyed by position in the list
        placement = self.placements.pop(worker_id, None)
        self.leaving.append(_Changing(actor, worker_id, placement, actor.retire.remote(), time.time()))
        return worker_id

    def follow_changes(self) -> None:
        """Workers that have started load the weights the engines hold and start generating; workers
        that have retired are stopped, their placement groups removed. Either past
        rollout.hang_timeout_s is dropped (its leases, if any, expire and requeue, tokens kept)."""
        limit, now = self.cfg.rollout.hang_timeout_s, time.time()
        for member in list(self.joining):
            if not self.launcher.wait([member.done], timeout=0)[0] and now - member.since < limit:
                continue
            self.joining.remove(member)
            try:
                self.launcher.get(member.done, timeout=0)
                if self.weights is not None:  # else it holds the model it was started with: no update yet
                    self.launcher.get(member.actor.update_weights.remote(self.weights), timeout=limit)
                if not self.dashboard_paused:
                    self.launcher.get(member.actor.resume.remote(), timeout=limit)
            except self.launcher.call_errors as exc:
                self._discard(member)
                if isinstance(exc, self.launcher.timeout_error):
                    need = worker_resources(self.cfg)
                    why = f"not started within rollout.hang_timeout_s={limit:g}s" + (
                        f" (it needs {need} free in the cluster)" if need else ""
                    )
                else:
                    why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
                self.telemetry.log_event("elastic_add_failed", {"worker": member.worker_id, "why": why})
                continue
            self.workers.append(member.actor)
            self.worker_ids.append(member.worker_id)
            if member.placement is not None:
                self.placements[member.worker_id] = member.placement
            self.progress = {}
            self.telemetry.log_event(
                "elastic_joined",
                {
                    "worker": member.worker_id,
                    "workers": len(self.workers),
                    "weights_version": None if self.weights is None else self.weights.version,
                    "seconds": round(time.time() - member.since, 2),
                },
            )
        # retire waits for the rewards still running (reward.timeout_s + hang_timeout_s), then stops
        # (its thread join: up to 30 s); cut short, their finishes would be scored again elsewhere.
        leave_limit = limit + self.cfg.reward.timeout_s + 30
        for member in list(self.leaving):
            if self.launcher.wait([member.done], timeout=0)[0] or now - member.since >= leave_limit:
                self._finish_leaving(member)

    def _finish_leaving(self, member: _Changing) -> None:
        self.leaving.remove(member)
        detail: dict[str, Any] = {"worker": member.worker_id, "seconds": round(time.time() - member.since, 2)}
        try:
            retired = self.launcher.get(member.done, timeout=0)
            detail.update(requeued_partials=retired["aborted"], generated_tokens=retired["generated_tokens"])
        except self.launcher.call_errors as exc:
            detail["why"] = f"retire did not complete ({type(exc).__name__}); its leases expire and requeue"
        self._discard(member)
        self.telemetry.forget_engine(member.worker_id)
        self.telemetry.log_event("elastic_removed", {**detail, "workers": len(self.workers)})

    def _discard(self, member: _Changing) -> None:
        self.launcher.kill(member.actor)
        if member.placement is not None:
            self.launcher.remove_placement_group(member.placement)

    def release_added(self, timeout_s: float = 60.0) -> None:
        """At the job's end, after its workers were stopped: workers still leaving finish (bounded),
        workers still starting go, and the placement groups of the workers added are removed."""
        if self.leaving:
            self.launcher.wait([m.done for m in self.leaving], num_returns=len(self.leaving), timeout=timeout_s)
        for member in list(self.leaving):
            self._finish_leaving(member)
        for member in self.joining:
            self._discard(member)
        self.joining = []
        for placement in self.placements.values():
            self.launcher.remove_placement_group(placement)
        self.placements = {}

    def step_metrics(self) -> dict[str, float]:
        """The fleet's part of a step's metrics: workers generating now, the fill elastic decided on,
        and the groups the zero-variance filter dropped (or kept only by its fallback)."""
        metrics: dict[str, float] = {"rollout_workers": float(len(self.workers))}
        if self.last_fill is not None:
            metrics["elastic_fill"] = self.last_fill
        dropped = "filtered_zero_variance" if self.group_filter is None else "filtered_by_group_filter"
        metrics[dropped] = self.filter.dropped_this_step
        metrics["filter_kept_by_fallback"] = self.filter.kept_by_fallback
        return metrics


class Abort:
    """APRIL's abort of the long tail at a batch boundary: every engine stops, each partial's last
    tokens are stored and its lease released (it goes first next step). Started before the learner
    trains, waited for while it trains: it touches no group of the batch. Without APRIL (no abort at
    the batch boundary) it does nothing."""

    def __init__(self, fleet: RolloutFleet, enabled: bool) -> None:
        self.fleet = fleet
        self.enabled = enabled
        self.sent_at: float | None = None  # when start() sent it; None: nothing to abort
        self._refs: list = []
        self._aborted: int | None = None

    def start(self) -> None:
        if self.enabled:
            self.sent_at = time.time()
            self._refs = [w.abort_all.remote() for w in self.fleet.workers]

    def wait(self) -> int:
        """Blocks until every engine has finished its abort; the partials stored (a worker hung in it
        is killed: WorkerHung). Waits once; later calls return the same count."""
        if self._aborted is None:
            self._aborted = int(sum(self.fleet._wait_all(self._refs, "abort_all"))) if self._refs else 0
        return self._aborted
