"""The rollout side of the driver: the workers as one fleet the loops command.

It starts groups in the buffer as APRIL's scheduler decides (april/scheduler.py), waits for the
step's batch (or, streaming, for segments), drops zero-variance groups, aborts the long tail and
resumes it, pushes weights into the engines, follows the dashboard's controls and watches the
workers' health. The decisions are APRIL's; this file only carries them out.

Ray is imported inside the methods: the job sets Ray's token authentication in the environment
before Ray is first imported (slime/job.py), and Ray reads it then.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Callable
from typing import Any

from april.scheduler import GroupCounts, GroupScheduler, ZeroVarianceFilter
from slime.buffer import JobTelemetry, TrajectoryStore
from slime.config import JobConfig
from slime.data import PromptRecord
from slime.sampling import PromptSampler


class WorkerFailed(RuntimeError):
    pass


class WorkerHung(RuntimeError):
    """A rollout worker stopped making progress (rollout.hang_timeout_s); it has been killed."""


def scheduler_for(cfg: JobConfig) -> GroupScheduler:
    """APRIL's plain settings from the job config (april/ never reads slime.config)."""
    if cfg.april.streaming_chunk_tokens is not None:
        policy = "streaming"
    elif cfg.mode == "async":
        policy = "async"
    else:
        policy = "april" if cfg.april.enabled else "sync"
    return GroupScheduler(
        policy,
        cfg.rollout.batch_size,
        oversample=cfg.april.oversample if cfg.april.enabled else None,
        oversample_groups=cfg.april.oversample_groups if cfg.april.enabled else None,
        max_staleness=cfg.max_staleness,
    )


def prompt_text(record: PromptRecord) -> str:
    if isinstance(record.prompt, str):
        return record.prompt
    return "\n".join(m.get("content", "") for m in record.prompt)


class RolloutFleet:
    def __init__(
        self, cfg: JobConfig, workers: list, buffer: TrajectoryStore, telemetry: JobTelemetry, sampler: PromptSampler
    ):
        self.cfg = cfg
        self.workers = workers
        self.buffer = buffer
        self.telemetry = telemetry
        self.sampler = sampler
        self.scheduler = scheduler_for(cfg)
        limit = cfg.april.max_filtered_per_step
        self.filter = ZeroVarianceFilter(cfg.rollout.batch_size if limit is None else limit)
        self.engine_version: int | None = None  # the policy version last pushed to every engine
        self.dashboard_paused = False
        self.oversample_override: float | None = None  # the dashboard's over-provisioning ratio
        self.controls_read_at = 0.0
        self.last_health = time.time()
        self.progress: dict[int, tuple[tuple, float]] = {}  # worker -> (engine counters, since when)

    # ---- starting groups -------------------------------------------------------------------------
    def schedule_groups(self) -> int:
        """Top the buffer up with new groups, one per prompt, as many as the scheduler says."""
        cfg = self.cfg
        c = self.buffer.counts()
        # The engines' version, not the learner's: the learner publishes its new version before the
        # engines have its weights (async admission).
        version = self.buffer.get_policy_version() if self.engine_version is None else self.engine_version
        missing = self.scheduler.groups_to_start(
            GroupCounts(unfinished=c["groups_open"], ready=c["groups_ready"], started=c["groups_total"]), version
        )
        for _ in range(missing):
            record = self.sampler.next()
            metadata = {
                **record.metadata,
                "label": record.label,
                "prompt_text": prompt_text(record),
                "record_index": record.index,
            }
            gid = self.buffer.add_group(
                record.prompt_ids, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens, metadata
            )
            if cfg.april.streaming_chunk_tokens is not None:
                self.buffer.track_streaming(gid)
        return missing

    # ---- waiting for the batch -------------------------------------------------------------------
    def wait_for_ready_groups(self, needed: int, on_wait: Callable[[dict[str, int], int], None]) -> None:
        while True:
            checked = self.filter_ready_groups() if self.cfg.april.filter_zero_variance else None
            counts = self.buffer.counts()
            # With the filter, only groups it has seen count: one that turned ready after its pass
            # would reach the learner (FIFO claims) unchecked. Async trains in start order (the
            # staleness bound's premise): the batch is full when the oldest waiting groups are ready.
            ready = counts["groups_ready"] if checked is None else checked
            if self.scheduler.policy == "async":
                ready = min(ready, self.buffer.ready_in_start_order(needed))
            if self.scheduler.batch_full(ready):
                return
            self.schedule_groups()  # refill as groups finish or are filtered, one group at a time
            self._between_polls(counts, needed, on_wait)
            # Woken the moment a group turns ready: the batch-full check (and with APRIL the abort
            # and the refill) does not wait out a polling interval; APRIL's rollout phases are short.
            self.buffer.wait_for_ready_signal(0.02)

    def wait_for_segments(self, needed: int, on_wait: Callable[[dict[str, int], int], None]) -> None:
        chunk = self.cfg.april.streaming_chunk_tokens
        while (available := self.buffer.count_segments(chunk)) < needed:
            self.schedule_groups()
            counts = self.buffer.counts()
            if available and counts["groups_open"] == 0:
                # Every group in flight has finished generating and its last segments are stored: no
                # more can come until they are trained (ready groups count toward the in-flight target).
                return
            self._between_polls(counts, needed, on_wait)
            time.sleep(0.02)

    def _between_polls(
        self, counts: dict[str, int], needed: int, on_wait: Callable[[dict[str, int], int], None]
    ) -> None:
        on_wait(counts, needed)
        self.apply_controls()
        if time.time() - self.last_health > 2.0:
            self.check_workers()
            self.last_health = time.time()

    def filter_ready_groups(self) -> int:
        """DAPO dynamic sampling (the decision is april's ZeroVarianceFilter). Returns how many
        ready groups passed (the oldest in the ready queue)."""
        kept = 0
        for gid in self.buffer.ready_group_ids():
            if gid in self.filter.seen:
                kept += 1
                continue
            rewards = [s.reward for s in self.buffer.get_group(gid) if s.reward is not None and s.failure is None]
            if self.filter.check(gid, rewards) == "keep":
                kept += 1
            elif self.buffer.drop_ready_group(gid, "zero_variance"):  # refused: claimed meanwhile
                self.filter.dropped()
        return kept

    # ---- APRIL's abort and resume ----------------------------------------------------------------
    def start_abort(self) -> list:
        """Every engine stops, its partials are stored and go first next step. Not waited for here."""
        return [w.abort_all.remote() for w in self.workers]

    def finish_abort(self, refs: list) -> int:
        return int(sum(self._wait_all(refs, "abort_all"))) if refs else 0

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

    def probe_logprobs(self, prompt_ids: list[int], probe: list[int]) -> list:
        return self._wait_all([w.probe_logprobs.remote(prompt_ids, probe) for w in self.workers], "probe_logprobs")

    # ---- dashboard controls and health -----------------------------------------------------------
    def apply_controls(self) -> None:
        """Honour the dashboard's control hash (read at most every 0.25 s): pause/resume rollout,
        and the APRIL over-provisioning override, which the next schedule_groups uses."""

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
        import ray  # see the module docstring

        healths = []
        limit, now = self.cfg.rollout.hang_timeout_s, time.time()
        for i, w in enumerate(self.workers):
            # A dead actor's RayActorError goes up as it is: train() restarts the job from its
            # checkpoint. A worker that reports an error (its rollout thread raised) fails the job.
            try:
                h = ray.get(w.health.remote(), timeout=limit)
            except ray.exceptions.GetTimeoutError:
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
        if healths and not any(h.get("alive") for h in healths):
            raise WorkerFailed("every rollout worker has stopped")
        return healths

    def _wait_all(self, refs: list, what: str) -> list:
        """The workers' replies to one call each (refs in worker order); a worker that has not
        replied within rollout.hang_timeout_s is hung (a call into a live engine returns in seconds)."""
        import ray  # see the module docstring

        limit = self.cfg.rollout.hang_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if len(ready) < len(refs):
            done = {r.hex() for r in ready}
            late = next(i for i, r in enumerate(refs) if r.hex() not in done)
            self._kill_hung(late, f"{what} did not return for {limit:g}s")
        return ray.get(refs)

    def _kill_hung(self, index: int, why: str) -> typing.NoReturn:
        import ray  # see the module docstring

        ray.kill(self.workers[index])
        self.telemetry.log_event("worker_hung", {"worker": index, "why": why})
        raise WorkerHung(f"rollout worker {index} hung ({why}, rollout.hang_timeout_s); killed")

    def healths(self) -> list[dict]:
        healths = self._wait_all([w.health.remote() for w in self.workers], "health")
        self.telemetry.record_engine_health(healths)
        return healths
