"""One running job's lifecycle: start and stop its parts (Redis, Ray, the learner, the rollout fleet,
the dashboard), train and publish weights, time each step, write metrics and checkpoints. The loops
that drive it are in slime/train.py; the rollout side is slime/fleet.py. The learner and the rollout
workers are actors of the launcher cluster.launcher names (slime/launch/): Ray's or this process's."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import suppress
from pathlib import Path

import numpy as np

from envs import repeat
from rewards.group import load_group_reward
from rewards.group_filter import GroupFilter
from rewards.mix import load_reward_spec
from slime.algorithms.mismatch import probe_kl, weight_probe
from slime.algorithms.offpolicy_controller import Measurement, OffPolicyController
from slime.buffer import JobConnection, JobTelemetry, TrajectoryStore
from slime.buffer.owner import JobOwner
from slime.buffer.redis_server import connect_or_start
from slime.config import JobConfig, config_for_display, dump_config
from slime.dashboard.server import DashboardProcess
from slime.data import PromptRecord, check_context_fits, check_prompts_fit, load_prompts, write_jsonl
from slime.engines.contract import GenerationRequest
from slime.evaluation import HeldOutEval
from slime.export import (
    LATEST,
    checkpoint_due,
    clear_checkpoint_dir,
    export_checkpoint,
    prune_checkpoints,
    restore_point,
    resume_checkpoint,
    set_earlier_run_aside,
    write_resumed_config,
)
from slime.fleet import Abort, RolloutFleet, scheduler_for
from slime.launch.launcher import Launcher, WorkerLaunch, start_rollout_worker
from slime.launch.local import LocalLauncher
from slime.launch.ray_cluster import RayLauncher, RaySession, check_local_resources
from slime.learner import LearnerGroup
from slime.learner.lora import check_model_dir
from slime.metrics import FailureWatch, MetricsLogger, StepClock, write_atomic
from slime.model import (
    checked_rollout_stops,
    ensure_model_dir,
    load_tokenizer,
    rollout_sampling_params,
    warn_unstopped_turn_end,
)
from slime.run_lock import lock_run_dir, make_run_dir
from slime.sample import new_id
from slime.sampling import PromptSampler, fast_forward
from slime.security import JobCredentials
from slime.signals import GracefulStop
from slime.tracking import require_packages
from slime.weights.checksum import checksum_mismatch


class WeightSyncError(RuntimeError):
    """An engine's logprobs on the probe differ from the learner's after a weight update."""


class RunningJob:
    """Starts and stops the parts of one job; trains, pushes weights, logs and checkpoints."""

    def __init__(self, cfg: JobConfig, stop: GracefulStop | None = None):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.redis_server = None
        self.run_lock: int | None = None  # output_dir/job.lock (slime/run_lock.py)
        self.ray_session = RaySession()
        self.launcher: Launcher | None = None
        self.workers: list = []
        self.learner = None
        self.dashboard = None
        self.held_out: HeldOutEval | None = None  # eval.every_steps
        self.offpolicy: OffPolicyController | None = None  # algorithm.correction.auto
        self.weight_push_bytes = 0  # the last push's tensors (WeightHandle.total_bytes)
        self.stop = stop or GracefulStop()

    # ---- start / stop ------------------------------------------------------------------------
    def __enter__(self) -> RunningJob:
        cfg = self.cfg
        try:
            # A bad reward spec fails here, before anything starts (an http reward lives in its own server).
            if cfg.reward.scope == "group":
                load_group_reward(cfg.reward.fn)
            elif cfg.reward.mode != "http":
                load_reward_spec(cfg.reward.fn)
            check_local_resources(cfg)  # a learner that cannot fit fails before anything starts
            require_packages(cfg.logging)  # logging.wandb / logging.mlflow without the package
            make_run_dir(self.run_dir)
            self.run_lock = lock_run_dir(self.run_dir)  # one job per output_dir, until __exit__
            # Model and dataset are checked before an earlier run is set aside: a mistake leaves output_dir as it was.
            self.model_dir = str(ensure_model_dir(cfg.model))
            check_context_fits(cfg, self.model_dir)
            if cfg.learner.lora is not None:  # a target the model lacks fails here, before any actor
                check_model_dir(self.model_dir, cfg.learner.lora)
            self.tokenizer = load_tokenizer(self.model_dir)
            stop = checked_rollout_stops(cfg.rollout, self.tokenizer, self.model_dir)  # an empty stop string fails
            self.group_filter = (spec := cfg.april.group_filter) and GroupFilter(spec, self.tokenizer, stop)
            self.records = self._load_records()
            self.sampler = PromptSampler(self.records, cfg.sampling, cfg.data.task_key, cfg.data.seed, cfg.data.shuffle)
            if cfg.resume is None and (aside := set_earlier_run_aside(self.run_dir)) is not None:
                print(f"a fresh run in {self.run_dir}: the earlier run's files moved to {aside}")
            checkpoint = resume_checkpoint(cfg.resume, self.run_dir)
            if checkpoint is None:  # a resume's config is written once its checkpoint has loaded (_restore)
                dump_config(cfg, self.run_dir / "config.yaml")
            # One secret per run (run_dir/job.secret, 0600): the job's Redis password and every
            # service token derive from it; actors get it as an argument, children by environment.
            self.credentials = JobCredentials.create(self.run_dir, own_redis=cfg.buffer.url is None)
            redis_files, password = self.run_dir / "redis", self.credentials.redis_password
            self.redis_url, self.redis_server = connect_or_start(
                cfg.buffer.url, redis_files, cfg.buffer.aof, password, cfg.buffer.appendfsync
            )
            connection = JobConnection.of_job(cfg, self.redis_url, self.credentials.redis_password)
            self.owner = JobOwner(connection, self.run_dir, cfg.job_name)  # not a live run's job name (owner.py)
            self.buffer = TrajectoryStore(connection, cfg.buffer.lease_seconds)
            self.telemetry = JobTelemetry(connection)
            self.clock = StepClock(lambda: self.buffer.stats().get("generated_tokens", 0.0))
            if self.redis_server is not None:  # every part retries meanwhile (buffer.reconnect_timeout_s)
                self.redis_server.keep_alive(self._redis_restarted)
            if cfg.resume is None:
                self.buffer.delete_job()  # a fresh run starts from an empty buffer
            else:
                # The previous run's workers are gone: their trajectories go back to the queue now, tokens
                # kept. Then, before any worker leases: the sampler goes past the groups drawn after the
                # checkpoint (fast_forward), and the buffer drops the rest (store.restore_to_checkpoint).
                self.buffer.requeue_all_leased()
                next_step, sampler_state = restore_point(checkpoint)
                if sampler_state is not None:
                    self.sampler.load_state_dict(sampler_state)
                kept = fast_forward(self.sampler, self.buffer.groups_drawn_after(self.sampler.draws))
                args = (next_step, kept, cfg.buffer.keep_trained_steps, cfg.buffer.keep_group_records_steps)
                if any(restored := self.buffer.restore_to_checkpoint(*args)):
                    print(f"resume: {restored.describe()}")
            self._start_dashboard()
            if cfg.cluster.launcher == "ray":
                self.ray_session.start(cfg, self.credentials)
                if self.ray_session.started:
                    self.stop.install()  # ray.init installs its own SIGTERM handler; ours ends the step first
                self.launcher = RayLauncher()
            else:
                self.launcher = LocalLauncher(cfg.cluster.num_cpus)
            self._start_actors()
            if cfg.algorithm.correction.auto.enabled:
                self.offpolicy = OffPolicyController.for_job(cfg)
            self.start_step, self.lineage = 0, new_id()  # lineage: this run and its resumes (keep_last)
            if checkpoint is not None:
                self.start_step = self._restore(checkpoint)
            self.fleet.wait_started(self.learner.publish_weights())
            if self.offpolicy is not None:  # its start, or the checkpoint's decision
                self._apply_offpolicy()
            if checkpoint is not None:
                self.push_weights(self.start_step - 1)
            self.fleet.resume()  # workers start paused: no token before the engines hold the run's weights
            if cfg.eval.every_steps:  # after the actors: a reward in a Ray actor needs Ray started
                self.held_out = HeldOutEval(cfg, self.tokenizer, self.run_dir)
            self.logger = MetricsLogger(
                self.run_dir, cfg.logging, cfg.steps, self.start_step, config=config_for_display(cfg)
            )
            self.failures = FailureWatch(cfg.reward.max_failed_share, cfg.reward.failed_window_steps)
            self.last_checkpoint_at = time.time()
            self.clock.next_step()  # the first step starts now
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _redis_restarted(self, message: str) -> None:
        print(f"slime: {message}", file=sys.stderr, flush=True)
        self.telemetry.log_event("redis_restarted", {"message": message})

    def _start_actors(self) -> None:
        cfg = self.cfg
        run_id = new_id()[:6]  # lease owner names never collide with a previous run's workers
        launcher = self.launcher
        self.learner = LearnerGroup(cfg, self.model_dir, self.redis_url, self.credentials, launcher)
        launch = WorkerLaunch(self.model_dir, self.redis_url, self.credentials, run_id)
        self.workers = [
            start_rollout_worker(launcher, cfg, launch, i, paused=True, shared_gpu=self.learner.worker_placement(i))
            for i in range(cfg.rollout.num_workers)
        ]
        self.fleet = RolloutFleet(
            cfg, self.workers, self.buffer, self.telemetry, self.sampler, launcher, launch, self.group_filter
        )

    def _start_dashboard(self) -> None:
        cfg = self.cfg
        self.telemetry.set_job_info(
            {
                "mode": cfg.mode,
                "steps": cfg.steps,
                "april_enabled": cfg.april.enabled,
                "oversample": scheduler_for(cfg).target / cfg.rollout.batch_size if cfg.april.enabled else None,
                "batch_size": cfg.rollout.batch_size,
                "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                "model_dir": self.model_dir,
                "started_at": time.time(),
            }
        )
        self.telemetry.set_control(paused="0")  # a pause from a previous run does not carry over
        if cfg.dashboard.enabled:
            self.dashboard = DashboardProcess.for_job(cfg, self.redis_url, self.credentials, self.run_dir)

    def __exit__(self, *exc) -> None:
        try:  # a second SIGINT/SIGTERM may cut the graceful part short; the job's processes stop anyway
            self._stop_parts()
        finally:
            self.stop.cleaning_up = True
            try:
                self.ray_session.close()
                if self.dashboard is not None:
                    self.dashboard.stop()
                if getattr(self, "owner", None) is not None:  # last: the job's parts are stopped
                    self.owner.close()
                if self.redis_server is not None:
                    self.redis_server.stop()
                if self.run_lock is not None:
                    os.close(self.run_lock)
                    self.run_lock = None
            finally:
                self.stop.cleaning_up = False

    def _stop_parts(self) -> None:
        launcher = self.launcher  # None: the job failed before it started its actors
        if launcher is not None and self.workers:
            with suppress(Exception):  # first of all, stop generating and store every partial trajectory
                launcher.get([w.abort_all.remote() for w in self.workers], timeout=60)
        for part in (getattr(self, "logger", None), self.held_out):  # e.g. the plot on a full disk: stop the rest
            try:
                part is not None and part.close()
            except Exception as exc:
                print(f"slime: closing {type(part).__name__} failed: {exc!r}", file=sys.stderr, flush=True)
        if launcher is not None:
            if self.workers:
                with suppress(Exception):
                    launcher.get([w.stop.remote() for w in self.workers], timeout=60)
            if self.learner is not None:
                with suppress(Exception):
                    self.learner.result(self.learner.close(), timeout=30)
            for actor in self.workers:
                launcher.kill(actor)
            if hasattr(self, "fleet"):  # workers it was still adding or removing (rollout.elastic)
                with suppress(Exception):
                    self.fleet.release_added()
            if self.learner is not None:
                self.learner.kill()

    def _load_records(self) -> list[PromptRecord]:
        cfg, path = self.cfg, self.cfg.data.path
        if path is None:
            path = str(self.run_dir / "repeat_task.jsonl")
            if not Path(path).exists():
                write_jsonl(repeat.make_dataset(cfg.data.num_generated, cfg.data.seed), path)
        records = load_prompts(cfg.data, self.tokenizer, path)
        warn_unstopped_turn_end(self.tokenizer, cfg, records, self.model_dir)
        check_prompts_fit([len(r.prompt_ids) for r in records], self.model_dir)
        return records

    # ---- the step's phases, in the loops' order -------------------------------------------------
    def steps(self) -> range:
        """The steps still to train: from the checkpoint resumed (or 0) to cfg.steps."""
        return range(self.start_step, self.cfg.steps)

    def rebalance_workers(self, step: int) -> None:
        """rollout.elastic: add or remove a worker by how full the buffer is (april/elastic.py)."""
        self.fleet.rebalance(step)

    def wait_for_batch(self) -> None:
        self.fleet.wait_for_batch(self.logger.waiting)  # scheduling as it waits

    def wait_for_segments(self, step: int) -> None:
        self.fleet.wait_for_segments(step, self._segments_per_step(), self.logger.waiting)  # scheduling as it waits

    def abort_tail(self) -> Abort:
        """APRIL's abort of the groups still generating at the batch boundary (without APRIL: none)."""
        return self.fleet.abort_tail()

    def train_batch(self, step: int, abort: Abort) -> dict:
        """Sync: train on the step's batch. The rollout clock stops when the engines have stopped
        generating for this step: at once (the batch is complete), or, after APRIL's abort (started
        by the loop, overlapping the learner), when every engine has finished it: the decode step in
        flight done, every partial's last tokens stored. Those tokens are this step's."""
        released = 0
        if abort.sent_at is None:
            self.clock.stop_rollout()
            released = self._release_engine_memory()
        refs = self.learner.train_step(step, self.cfg.rollout.batch_size, None, commit=False)
        if abort.sent_at is not None:
            abort.wait()  # the learner is training meanwhile
            self.clock.stop_rollout(abort_sent_at=abort.sent_at)
            released = self._release_engine_memory()  # after the abort: the partials' caches go too
        metrics = self.learner.result(refs) | self.clock.rollout_metrics()
        if self.cfg.releases_engine_memory:
            metrics["engine_memory_released_bytes"] = released
        return metrics

    def train_while_generating(self, step: int) -> dict:
        """Async: train on the step's batch while the workers go on generating. The engines never stop:
        a step's rollout window runs until its update is done and the next one starts right there, so
        the tokens made while the learner trains count too (contiguous windows)."""
        # algorithm.correction.auto: admission follows the controller, the learner drops beyond its hard cap
        auto = self.cfg.algorithm.correction.auto
        drop_beyond = auto.max_staleness if self.offpolicy is not None else self.cfg.max_staleness
        refs = self.learner.train_step(step, self.cfg.rollout.batch_size, drop_beyond, commit=False)
        self.fleet.generate_while(refs)
        self.clock.stop_rollout()
        self.clock.rollout_goes_on()
        return self.learner.result(refs) | self.clock.rollout_metrics()

    def train_segments(self, step: int) -> dict:
        rollout_seconds = self.clock.rollout_elapsed()
        refs = self.learner.train_segments(step, self._segments_per_step(), self.cfg.april.streaming_chunk_tokens)
        self.fleet.generate_while(refs)
        metrics = self.learner.result(refs)
        # The engines never pause here: count what they made over the whole step, training included.
        generated = self.clock.tokens_since_rollout_start()
        metrics.update(rollout_seconds=rollout_seconds, generated_tokens=generated)
        metrics["rollout_tokens_per_s"] = generated / max(self.clock.rollout_elapsed(), 1e-9)
        return metrics

    def tune_offpolicy(self, step: int, metrics: dict) -> None:
        """algorithm.correction.auto: the step's measured mismatch sets the next step's staleness budget
        and tis_cap (slime/algorithms/offpolicy_controller.py); the decision joins the step's metrics,
        and a change is an event. Without it, nothing."""
        if self.offpolicy is None:
            return
        before = (self.offpolicy.staleness, self.offpolicy.tis_cap)
        metrics["staleness_budget_held_share"] = self.fleet.staleness_held_share()
        self.offpolicy.observe(Measurement.from_metrics(metrics))
        metrics.update(self.offpolicy.metrics())
        if (self.offpolicy.staleness, self.offpolicy.tis_cap) != before:
            self._apply_offpolicy()
            self.telemetry.log_event("offpolicy_auto", {"step": step, **self.offpolicy.event()})

    def probe_gap(self, step: int, metrics: dict) -> None:
        """algorithm.correction.auto, after the push: when no trained token was fresh for
        gap_probe_every steps (async after its first), the engines sample a few of the dataset's
        prompts and the learner scores the answers, both at the version just pushed: their KL is the
        engine-learner gap alone, which the controller folds into its estimate."""
        controller, t0 = self.offpolicy, time.time()
        if controller is None or not controller.wants_gap_probe() or self.cfg.rollout.temperature <= 0:
            return
        n, params = controller.settings.gap_probe_samples, rollout_sampling_params(self.cfg.rollout, self.tokenizer)
        prompts = [list(self.records[(step * n + i) % len(self.records)].prompt_ids) for i in range(n)]
        requests = [GenerationRequest(f"gap-probe-{step}-{i}", p, params) for i, p in enumerate(prompts)]
        got = self.fleet.generate_for_eval(requests)  # what the engines were generating resumes after
        answers = [(p, got[q.request_id]) for p, q in zip(prompts, requests) if got[q.request_id]["token_ids"]]
        refs = [self.learner.probe_logprobs(p, a["token_ids"]) for p, a in answers]
        controller.observe_gap_probe(
            *probe_kl([(a["logprobs"], self.learner.result(r)) for (_, a), r in zip(answers, refs)])
        )
        metrics.update(controller.metrics())
        metrics["offpolicy_auto"]["gap_probe_seconds"] = time.time() - t0

    def _apply_offpolicy(self) -> None:
        if (controller := self.offpolicy) is not None and controller.staleness is not None:
            self.fleet.set_staleness_budget(controller.knob, controller.staleness)
        if controller is not None and controller.tis_cap is not None:
            self.learner.result(self.learner.set_correction_cap(controller.tis_cap))

    def _segments_per_step(self) -> int:
        return self.cfg.rollout.batch_size * self.cfg.rollout.n_samples_per_prompt

    def _release_engine_memory(self) -> int:
        """Colocated: the learner gets the engines' KV memory (bytes freed; 0 when not released)."""
        return self.fleet.release_memory() if self.cfg.releases_engine_memory else 0

    def resume(self) -> None:
        """The engines go on (APRIL: the partials resume). The next step starts here, and after an
        abort its rollout clock too: its engines generate while the driver ends this step."""
        self.clock.resumed()
        self.fleet.resume()

    def push_weights(self, step: int) -> None:
        t0 = time.time()
        handle = self.learner.result(self.learner.publish_weights())
        if self.cfg.releases_engine_memory:  # vLLM/SGLang: awake before loading weights
            self.fleet.resume_memory()
        self.fleet.update_weights(handle)
        self.clock.weight_sync_seconds = time.time() - t0
        self.weight_push_bytes = handle.total_bytes  # learner.lora: the adapters only
        every, sums = self.cfg.weights.check_every, self.cfg.weights.checksum_every
        if every and (step + 1) % every == 0:
            self.check_weights()
        if sums and (step + 1) % sums == 0:
            self.check_checksums()

    def check_weights(self) -> float:
        """Engine and learner must give the same logprobs for a fixed probe after an update."""
        record = self.records[0]
        probe = weight_probe(self.tokenizer, self.records, self.cfg.rollout.max_new_tokens)
        learner_probe = self.learner.probe_logprobs(record.prompt_ids, probe)  # runs beside the engines'
        engine_probes, tolerance = self.fleet.probe_logprobs(record.prompt_ids, probe), self.cfg.weight_check_tolerance
        expected = self.learner.result(learner_probe)
        worst = max(float(np.max(np.abs(got - expected))) for got in engine_probes)
        if not worst <= tolerance:  # NaN too: diverged weights used to pass
            why = "the engine does not hold the learner's weights (e.g. tied embeddings not refreshed)"
            raise WeightSyncError(
                f"after the weight update the engine's probe logprobs differ from the learner's by {worst:.2e} "
                f"(weights.check_tolerance={tolerance}); "
                + (why if np.isfinite(worst) else "they are not finite: the weights diverged (lower learner.lr?)")
            )
        return worst

    def check_checksums(self) -> None:
        """Every tensor the learner pushed, as each engine holds it (slime/weights/checksum.py): what
        the probe cannot reach too (an expert only the responses route to). Engines that keep their
        weights under other names (vLLM, SGLang) or merge LoRA adapters give none."""
        engines = self.fleet.weight_checksums()
        if (first := next((got for got in engines if got), None)) is not None:
            expected = self.learner.result(self.learner.weight_checksums({k: v[0] for k, v in first.items()}))
            if problem := checksum_mismatch(expected, engines):
                raise WeightSyncError(f"after the weight update {problem}")

    # ---- metrics ---------------------------------------------------------------------------------
    def end_step(self, step: int, metrics: dict) -> None:
        metrics["weight_sync_seconds"] = self.clock.weight_sync_seconds
        metrics["weight_push_bytes"] = self.weight_push_bytes
        metrics.update(self.fleet.step_metrics())  # rollout_workers, the filter's counts (and elastic_fill)
        metrics["step_seconds"] = self.clock.end()
        metrics["buffer"] = counts = self.buffer.counts()
        stats = self.buffer.stats()
        metrics["partial_samples"] = counts["aborted"]
        # Generated but never trained on (restarted beyond the staleness budget, dropped groups).
        metrics["wasted_tokens_total"] = stats.get("restarted_tokens", 0.0) + sum(
            v for k, v in stats.items() if k.startswith("dropped_tokens:")
        )
        healths = self.fleet.healths()
        uptime = sum(h["uptime_seconds"] for h in healths)
        metrics["engine_busy_fraction"] = sum(h["busy_seconds"] for h in healths) / max(uptime, 1e-9)
        # Partials resumed from the KV cache their engine kept at the abort (no re-prefill); graph replays.
        metrics.update({f"{name}_total": n for name, n in self.fleet.engine_totals.update(healths).items()})
        rewards_by_task = metrics.get("reward_by_task", {})
        self.sampler.observe({k: [v] for k, v in rewards_by_task.items()})
        if self.sampler.current_stage_index is not None:  # its name is text, which metrics drop
            metrics["curriculum_stage"] = self.sampler.current_stage_index
        if self.sampler.task_weights:
            metrics["task_weight"] = self.sampler.task_weights
        if self.held_out is not None and self.held_out.due(step):
            evaluated = self.held_out.run(self.fleet.generate_for_eval)
            metrics["eval"] = {**evaluated, "policy_version": self.fleet.engine_version}
        self.failures.observe(metrics)
        self.logger.log(step, metrics)
        self.telemetry.record_step(step, self.logger.history[-1])
        self.failures.check(last_step=step + 1 == self.cfg.steps)  # too many failed: stop before a checkpoint
        self.fleet.apply_controls()
        if checkpoint_due(self.cfg, step, self.last_checkpoint_at) or self.stop.requested:
            if metrics.get("samples") and metrics.get("failed_samples") == metrics["samples"]:
                # Nothing was learned: a checkpoint would look like progress. The step's groups stay
                # uncommitted; the next checkpoint (or a resume) takes them.
                self.logger.say(f"step {step}: every sample failed, no checkpoint written")
            else:
                self.save_checkpoint(step)
        self.clock.next_step()

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        path = self.run_dir / "checkpoints" / f"step_{step + 1:06d}"
        clear_checkpoint_dir(path)  # one of this step an older resume point wrote: none of its files stays
        self.learner.result(self.learner.save(str(path)))
        dump_config(self.cfg, path / "config.yaml")  # what trained it: export and eval read this one
        state = {"next_step": step + 1, "sampler": self.sampler.state_dict(), "job_name": self.cfg.job_name}
        state["lineage"] = self.lineage  # keep_last prunes only its own run's checkpoints
        if self.offpolicy is not None:
            state["offpolicy_auto"] = self.offpolicy.state_dict()
        # Written last and atomically: a checkpoint directory counts only once this file exists,
        # however the process is stopped while saving.
        write_atomic(path / "driver_state.json", json.dumps(state))
        if self.cfg.checkpoint.export_hf:
            export_checkpoint(path, path / "hf", Path(self.model_dir))
        write_atomic(self.run_dir / "checkpoints" / LATEST, path.name)
        # Groups become "trained" only once the weights that learned from them are on disk. A crash
        # between the line above and this one is repaired by _restore (commit_through).
        keep = self.cfg.buffer
        self.buffer.commit_through(step, keep.keep_trained_steps, keep.keep_group_records_steps)
        prune_checkpoints(path, self.cfg.checkpoint.keep_last)  # after `latest` moved past them
        self.last_checkpoint_at = time.time()
        return path

    def _restore(self, checkpoint: Path) -> int:
        state = json.loads((checkpoint / "driver_state.json").read_text())
        self.lineage = state.get("lineage", self.lineage)
        done, steps = int(state["next_step"]), self.cfg.steps
        left = f"at step {done} of {steps}" if done < steps else f"with nothing left to train (steps={steps})"
        print(f"resume={self.cfg.resume}: resuming from {checkpoint} {left}", flush=True)
        self.learner.result(self.learner.load(str(checkpoint)))  # the sampler's state loaded in __enter__
        if self.offpolicy is not None and "offpolicy_auto" in state:  # absent: a run without it, start afresh
            self.offpolicy.load_state_dict(state["offpolicy_auto"])
        write_resumed_config(self.cfg, self.run_dir, checkpoint)  # everything of the checkpoint took
        if checkpoint.parent == self.run_dir / "checkpoints":  # an older one: resume=auto goes on from this branch
            write_atomic(self.run_dir / "checkpoints" / LATEST, checkpoint.name)
        return done
