"""The driver: `slime train`. Two short loops over the parts that `RunningJob` starts.

sync:  schedule a batch of groups -> wait until they are complete -> train -> push weights.
async: keep groups in flight all the time; train on complete groups while the workers go on
       generating; groups whose oldest token lags more than `max_staleness` versions are dropped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from slime.config import ConfigError, JobConfig, dump_config
from slime.data import PromptRecord, load_prompts, write_jsonl
from slime.metrics import MetricsLogger
from slime.model import ensure_model_dir, load_tokenizer
from slime.sample import new_id
from slime.sampling import PromptSampler
from slime.security import JobCredentials, write_private


class WeightSyncError(RuntimeError):
    """An engine's logprobs on the probe differ from the learner's after a weight update."""


class WorkerFailed(RuntimeError):
    pass


def sync_loop(job: "RunningJob") -> None:
    cfg = job.cfg
    for step in range(job.start_step, cfg.steps):
        job.schedule_groups()
        job.wait_for_ready_groups(cfg.rollout.batch_size)  # APRIL: refills one group at a time
        # APRIL: the long tail waits for the next step. The abort (each partial's last tokens
        # stored, then released) runs while the learner trains: it touches no group of this batch.
        aborting = job.start_abort() if cfg.april.enabled else []
        metrics = job.train_step(step, max_staleness=None)
        aborted = job.finish_abort(aborting)
        job.push_weights(step)
        job.resume_rollouts()
        job.end_step(step, metrics | {"aborted_samples": aborted})


def async_loop(job: "RunningJob") -> None:
    cfg = job.cfg
    for step in range(job.start_step, cfg.steps):
        job.wait_for_ready_groups(cfg.rollout.batch_size)  # scheduling as it waits
        # The workers keep generating the next groups while the learner trains on these.
        metrics = job.train_step(step, max_staleness=cfg.max_staleness)
        job.push_weights(step)
        job.end_step(step, metrics)


class JobInterrupted(KeyboardInterrupt):
    """SIGTERM: stop like Ctrl-C, storing every partial trajectory on the way out."""


def _raise_interrupted(signum, frame) -> None:
    raise JobInterrupted(f"received signal {signum}")


def streaming_loop(job: "RunningJob") -> None:
    """GLM-5's streaming variant: trajectories are trained chunk by chunk while they grow; later
    chunks come from newer policies; unfinished returns are bootstrapped by the critic."""
    cfg = job.cfg
    segments = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    for step in range(job.start_step, cfg.steps):
        job.wait_for_segments(segments)  # scheduling as it waits
        metrics = job.train_segments(step, segments)
        job.push_weights(step)
        job.end_step(step, metrics)


def train(cfg: JobConfig) -> list[dict]:
    previous = signal.signal(signal.SIGTERM, _raise_interrupted) if _main_thread() else None
    try:
        with RunningJob(cfg) as job:
            if cfg.april.streaming_chunk_tokens is not None:
                streaming_loop(job)
            else:
                (sync_loop if cfg.mode == "sync" else async_loop)(job)
            return job.logger.history
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _check_context_fits(cfg: JobConfig, model_dir: str) -> None:
    """The engines refuse a response budget longer than the model reads (slime.engine.validate_sampling):
    say so at start, naming the field, instead of failing every request."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    if context is not None and cfg.rollout.max_new_tokens > context:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} exceeds the model's context "
                          f"(max_position_embeddings={context} in {model_dir})")


def _ray_token_auth(credentials: JobCredentials, ray_address: str | None) -> tuple[str, ...]:
    """A local Ray this job starts listens on every interface: with Ray's token authentication
    (the token derived from the job secret, inherited by every Ray process through the
    environment) nobody else can connect to it and run code. An explicit RAY_AUTH_MODE, or an
    existing cluster (cluster.ray_address), is the user's choice. Returns the variables set here."""
    if ray_address is not None or "RAY_AUTH_MODE" in os.environ:
        return ()
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = credentials.token("ray")
    if not _reload_ray_auth():
        _unset_ray_auth(("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"))
        print("warning: Ray was imported before the job started and cannot switch to token "
              "authentication; the job's Ray accepts unauthenticated clients (set RAY_AUTH_MODE)", flush=True)
        return ()
    return ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def _reload_ray_auth() -> bool:
    """Ray reads its auth settings when first imported; an imported Ray must read them again.
    (`ray._raylet`'s loader is Ray's own test hook for this; without it, say so.)"""
    if "ray" not in sys.modules:
        return True
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return True


def _unset_ray_auth(names: tuple[str, ...]) -> None:
    for name in names:
        os.environ.pop(name, None)
    if names:
        _reload_ray_auth()


class RunningJob:
    """Starts and stops the parts of one job: Redis, Ray, the learner and the rollout workers."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.redis_server = None
        self.ray_started = False
        self._ray_auth_env: tuple[str, ...] = ()  # environment variables set for the job's own Ray
        self.workers: list = []
        self.learner = None
        self.dashboard = None
        self.dashboard_paused = False
        self.oversample_override: float | None = None
        self.controls_read_at = 0.0
        self.count_from_rollout_end = False  # an APRIL abort overlaps the learner this step
        self.engine_version: int | None = None  # the policy version last pushed to every engine
        self.tokens_at_rollout_end = 0.0

    # ---- start / stop ------------------------------------------------------------------------
    def __enter__(self) -> "RunningJob":
        from slime.buffer import RedisBuffer
        from slime.learner import Learner
        from slime.redis_server import connect_or_start
        from slime.rollout import RolloutWorker

        cfg = self.cfg
        try:
            from rewards.mix import load_reward_spec

            if cfg.reward.mode != "http":  # an http reward lives in its own server
                load_reward_spec(cfg.reward.fn)  # a bad reward spec fails here, before anything starts
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")
            # One secret per run (run_dir/job.secret, 0600): the job's Redis password and every
            # service token derive from it; actors get it as an argument, children by environment.
            self.credentials = JobCredentials.create(self.run_dir, own_redis=cfg.buffer.url is None)
            self.redis_url, self.redis_server = connect_or_start(
                cfg.buffer.url, self.run_dir / "redis", cfg.buffer.aof, self.credentials.redis_password
            )
            self.buffer = RedisBuffer(self.redis_url, cfg.job_name, cfg.buffer.lease_seconds,
                                      password=self.credentials.redis_password)
            self.model_dir = str(ensure_model_dir(cfg.model))
            _check_context_fits(cfg, self.model_dir)
            self.tokenizer = load_tokenizer(self.model_dir)
            self.records = self._load_records()
            self.sampler = PromptSampler(self.records, cfg.sampling, cfg.data.task_key, cfg.data.seed, cfg.data.shuffle)
            checkpoint = self._find_checkpoint()
            if cfg.resume is None:
                self.buffer.delete_job()  # a fresh run starts from an empty buffer
            else:
                # The previous run's workers are gone: their trajectories go back to the queue now,
                # tokens kept, instead of after their leases expire.
                self.buffer.requeue_all_leased()
            self._start_dashboard()

            if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
                # before `import ray`: Ray reads its auth settings when imported
                self._ray_auth_env = _ray_token_auth(self.credentials, cfg.cluster.ray_address)
            import ray

            if not ray.is_initialized():
                ray.init(
                    address=cfg.cluster.ray_address,
                    num_cpus=cfg.cluster.num_cpus,
                    include_dashboard=False,
                    logging_level="warning",
                    log_to_driver=True,
                )
                self.ray_started = True
                if _main_thread():  # ray.init installs its own SIGTERM handler; ours stores partials
                    signal.signal(signal.SIGTERM, _raise_interrupted)
            # These actors mostly wait on each other; num_cpus=0 keeps a 2-core box schedulable.
            run_id = new_id()[:6]  # lease owner names never collide with a previous run's workers
            self.learner = ray.remote(num_cpus=0)(Learner).remote(cfg, self.model_dir, self.redis_url,
                                                                  self.credentials)
            self.workers = [
                ray.remote(num_cpus=0)(RolloutWorker).remote(cfg, self.model_dir, self.redis_url, f"w{i}-{run_id}", i,
                                                             self.credentials)
                for i in range(cfg.rollout.num_workers)
            ]
            self.start_step = 0
            if checkpoint is not None:
                self.start_step = self._restore(checkpoint)
            elif cfg.resume is not None:
                self.buffer.requeue_uncommitted()  # no checkpoint yet: no step's update survived
            ray.get([w.health.remote() for w in self.workers] + [self.learner.publish_weights.remote()])
            if checkpoint is not None:
                self.push_weights(self.start_step - 1)
            self.logger = MetricsLogger(self.run_dir, cfg.logging, cfg.steps, self.start_step)
            self._reset_step_counters()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if self.workers:
            try:  # first of all, stop generating and store every partial trajectory
                ray.get([w.abort_all.remote() for w in self.workers], timeout=60)
            except Exception:
                pass
        if hasattr(self, "logger"):
            self.logger.close()
        if self.workers:
            try:
                ray.get([w.stop.remote() for w in self.workers], timeout=60)
            except Exception:
                pass
        if self.learner is not None:
            try:
                ray.get(self.learner.close.remote(), timeout=30)
            except Exception:
                pass
        for actor in self.workers + ([self.learner] if self.learner is not None else []):
            ray.kill(actor)
        if self.ray_started:
            ray.shutdown()
        _unset_ray_auth(self._ray_auth_env)
        if self.dashboard is not None:
            self.dashboard.stop()
        if self.redis_server is not None:
            self.redis_server.stop()

    def _load_records(self) -> list[PromptRecord]:
        cfg = self.cfg
        path = cfg.data.path
        if path is None:
            from envs import repeat

            path = str(self.run_dir / "repeat_task.jsonl")
            if not Path(path).exists():
                write_jsonl(repeat.make_dataset(cfg.data.num_generated, cfg.data.seed), path)
        return load_prompts(cfg.data, self.tokenizer, path)

    # ---- the steps the loops are made of -------------------------------------------------------
    def schedule_groups(self) -> int:
        """Top the buffer up with new groups, one per prompt.

        sync: `groups_in_flight` groups per step, ready ones included; with APRIL,
        `groups_in_flight` (over-provisioned) unfinished groups, each finished group replaced.
        async: `groups_in_flight` unfinished groups at all times, but no group is started that
        would be trained more than `max_staleness` versions after the version current now:
        group k is trained at step k // batch_size, so at most (version + 1 + max_staleness)
        batches may ever have been started.
        """
        cfg = self.cfg
        c = self.buffer.counts()
        unfinished = c["groups_open"]
        target = self.groups_in_flight()
        if cfg.april.streaming_chunk_tokens is not None:
            missing = target - unfinished - c["groups_ready"]  # ready: final, last segments untrained
        elif cfg.mode == "sync" and not cfg.april.enabled:
            missing = target - unfinished - c["groups_ready"]
        elif cfg.mode == "sync":  # APRIL: over-provisioned; a finished group is replaced at once
            missing = target - unfinished
        else:
            # The engines' version, not the learner's: the learner publishes its new version before
            # the engines have its weights, and a group started in between would be generated by
            # the older policy, then dropped as too stale.
            version = self.buffer.get_policy_version() if self.engine_version is None else self.engine_version
            started_cap = (version + 1 + cfg.max_staleness) * cfg.rollout.batch_size
            missing = min(target - unfinished, started_cap - c["groups_total"])
        for _ in range(max(0, missing)):
            record = self.sampler.next()
            metadata = {**record.metadata, "label": record.label, "prompt_text": _prompt_text(record),
                        "record_index": record.index}
            gid = self.buffer.add_group(record.prompt_ids, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens, metadata)
            if cfg.april.streaming_chunk_tokens is not None:
                self.buffer.track_streaming(gid)
        return max(0, missing)

    def wait_for_ready_groups(self, needed: int) -> None:
        import ray

        last_health = time.time()
        while True:
            checked = self.filter_ready_groups() if self.cfg.april.filter_zero_variance else None
            counts = self.buffer.counts()
            # With the filter, only groups it has seen count: one that turned ready after its pass
            # would reach the learner (FIFO claims) unchecked.
            if (counts["groups_ready"] if checked is None else checked) >= needed:
                return
            self.schedule_groups()  # refill as groups finish or are filtered, one group at a time
            self.logger.waiting(counts, needed)
            self.apply_controls()
            if time.time() - last_health > 2.0:
                self.check_workers(ray)
                last_health = time.time()
            # Woken the moment a group turns ready: the batch-full check (and with APRIL the abort
            # and the refill) does not wait out a polling interval; APRIL's rollout phases are short.
            self.buffer.wait_for_ready_signal(0.02)

    def wait_for_segments(self, needed: int) -> None:
        import ray

        chunk = self.cfg.april.streaming_chunk_tokens
        last_health = time.time()
        while (available := self.buffer.count_segments(chunk)) < needed:
            self.schedule_groups()
            counts = self.buffer.counts()
            if available and counts["groups_open"] == 0:
                # Every group in flight has finished generating and its last segments are stored: no
                # more can come until they are trained (ready groups count toward the in-flight target).
                return
            self.logger.waiting(counts, needed)
            self.apply_controls()
            if time.time() - last_health > 2.0:
                self.check_workers(ray)
                last_health = time.time()
            time.sleep(0.02)

    def train_segments(self, step: int, segments: int) -> dict:
        import ray

        rollout_seconds = time.time() - self.step_started
        ref = self.learner.train_segments.remote(step, segments, self.cfg.april.streaming_chunk_tokens)
        while not ray.wait([ref], timeout=0.05)[0]:
            self.schedule_groups()  # the workers keep generating while the learner trains
        metrics = ray.get(ref)
        # The engines never pause here: count what they made over the whole step, training included.
        generated = self.buffer.stats().get("generated_tokens", 0.0) - self.tokens_at_step_start
        metrics.update(rollout_seconds=rollout_seconds, generated_tokens=generated,
                       rollout_tokens_per_s=generated / max(time.time() - self.step_started, 1e-9))
        return metrics

    def filter_ready_groups(self) -> int:
        """DAPO dynamic sampling: a group whose rewards are all equal has no signal; drop it and let
        the scheduler start another. After max_filtered_per_step drops, keep groups (fallback).
        Returns how many ready groups passed (the oldest in the ready queue)."""
        limit = self.cfg.april.max_filtered_per_step
        limit = self.cfg.rollout.batch_size if limit is None else limit
        kept = 0
        for gid in self.buffer.ready_group_ids():
            if gid in self.filter_checked:
                kept += 1
                continue
            self.filter_checked.add(gid)
            rewards = {s.reward for s in self.buffer.get_group(gid) if s.reward is not None and s.failure is None}
            if len(rewards) > 1:
                kept += 1
            elif self.filtered_this_step >= limit:
                self.step_counters["filter_kept_by_fallback"] += 1
                kept += 1
            elif self.buffer.drop_ready_group(gid, "zero_variance"):
                self.filtered_this_step += 1
                self.step_counters["filtered_zero_variance"] += 1
        return kept

    def start_abort(self) -> list:
        """APRIL's active abort: every engine stops, its partials are stored and go first next step.
        Not waited for here (finish_abort); the tokens its partials' last chunks add to the buffer
        count toward the next step (see _reset_step_counters)."""
        self.count_from_rollout_end = True
        return [w.abort_all.remote() for w in self.workers]

    def finish_abort(self, refs: list) -> int:
        import ray

        return int(sum(ray.get(refs))) if refs else 0

    def resume_rollouts(self) -> None:
        import ray

        if not self.dashboard_paused:  # paused from the dashboard: stays paused until resumed there
            ray.get([w.resume.remote() for w in self.workers])

    def apply_controls(self) -> None:
        """Honour the dashboard's control hash (read at most every 0.25 s): pause/resume rollout,
        and the APRIL over-provisioning override, which the next schedule_groups uses."""
        import ray

        if time.time() - self.controls_read_at < 0.25:
            return
        self.controls_read_at = time.time()
        control = self.buffer.get_control()
        paused = control.get("paused") == "1"
        if paused != self.dashboard_paused:
            ray.get([(w.pause if paused else w.resume).remote() for w in self.workers])
            self.dashboard_paused = paused
            self.buffer.log_event("rollout_paused" if paused else "rollout_resumed", {"by": "driver"})
        oversample = float(control["oversample"]) if "oversample" in control else None
        if oversample != self.oversample_override and self.cfg.april.enabled:
            self.oversample_override = oversample
            self.buffer.log_event("oversample_applied", {"by": "driver", "groups_in_flight": self.groups_in_flight()})

    def groups_in_flight(self) -> int:
        if self.oversample_override is not None and self.cfg.april.enabled:
            return max(self.cfg.rollout.batch_size, math.ceil(self.oversample_override * self.cfg.rollout.batch_size))
        return self.cfg.groups_in_flight

    def _start_dashboard(self) -> None:
        cfg = self.cfg
        self.buffer.set_job_info({
            "mode": cfg.mode, "steps": cfg.steps, "april_enabled": cfg.april.enabled,
            "oversample": cfg.groups_in_flight / cfg.rollout.batch_size if cfg.april.enabled else None,
            "batch_size": cfg.rollout.batch_size, "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
            "model_dir": self.model_dir, "started_at": time.time(),
        })
        self.buffer.set_control(paused="0")  # a pause from a previous run does not carry over
        if cfg.dashboard.enabled:
            from slime.dashboard.server import DashboardProcess

            d = cfg.dashboard
            token = d.token or self.credentials.token("dashboard")
            token_file = write_private(self.run_dir / "dashboard.token", token + "\n")
            self.dashboard = DashboardProcess(self.redis_url, cfg.job_name, d.host, d.port, token,
                                              redis_password=self.credentials.redis_password)
            print(f"dashboard: {self.dashboard.url} (control token in {token_file})", flush=True)

    def check_workers(self, ray) -> list[dict]:
        healths = []
        for w in self.workers:
            try:
                h = ray.get(w.health.remote(), timeout=30)
            except ray.exceptions.RayActorError as exc:
                h = {"alive": False, "error": f"actor died: {exc}"}
            if h.get("error"):
                raise WorkerFailed(f"rollout worker failed:\n{h['error']}")
            healths.append(h)
        self.buffer.record_engine_health(healths)
        if healths and not any(h.get("alive") for h in healths):
            raise WorkerFailed("every rollout worker has stopped")
        return healths

    def train_step(self, step: int, max_staleness: int | None) -> dict:
        import ray

        self.tokens_at_rollout_end = self.buffer.stats().get("generated_tokens", 0.0)
        generated = self.tokens_at_rollout_end - self.tokens_at_step_start
        rollout_seconds = time.time() - self.step_started
        ref = self.learner.train_step.remote(step, self.cfg.rollout.batch_size, max_staleness, commit=False)
        while self.cfg.mode == "async" and not ray.wait([ref], timeout=0.05)[0]:
            self.schedule_groups()
        metrics = ray.get(ref)
        metrics["rollout_seconds"] = rollout_seconds
        metrics["rollout_tokens_per_s"] = generated / max(rollout_seconds, 1e-9)
        metrics["generated_tokens"] = generated
        return metrics

    def push_weights(self, step: int) -> None:
        import ray

        t0 = time.time()
        handle = ray.get(self.learner.publish_weights.remote())
        ray.get([w.update_weights.remote(handle) for w in self.workers])
        self.engine_version = handle.version
        self.weight_sync_seconds = time.time() - t0
        every = self.cfg.weights.check_every
        if every and (step + 1) % every == 0:
            self.check_weights()

    def check_weights(self) -> float:
        """Engine and learner must give the same logprobs for a fixed probe after an update."""
        import ray

        record = self.records[0]
        probe = [int(t) for t in (self.tokenizer(str(record.label or "probe"), add_special_tokens=False)["input_ids"] or [0])]
        expected = ray.get(self.learner.probe_logprobs.remote(record.prompt_ids, probe))
        worst = 0.0
        for w in self.workers:
            got = ray.get(w.probe_logprobs.remote(record.prompt_ids, probe))
            diff = float(np.max(np.abs(got - expected)))
            worst = max(worst, diff)
            if diff > self.cfg.weights.check_tolerance:
                raise WeightSyncError(
                    f"after the weight update the engine's probe logprobs differ from the learner's by {diff:.2e} "
                    f"(weights.check_tolerance={self.cfg.weights.check_tolerance}); the engine does not hold the "
                    "learner's weights (e.g. tied embeddings not refreshed)"
                )
        return worst

    def end_step(self, step: int, metrics: dict) -> None:
        import ray

        metrics["weight_sync_seconds"] = self.weight_sync_seconds
        metrics["step_seconds"] = time.time() - self.step_started
        metrics["buffer"] = counts = self.buffer.counts()
        metrics.update(self.step_counters)
        stats = self.buffer.stats()
        metrics["partial_samples"] = counts["aborted"]
        # Generated but never trained on (restarted beyond the staleness budget, dropped groups).
        metrics["wasted_tokens_total"] = stats.get("restarted_tokens", 0.0) + sum(
            v for k, v in stats.items() if k.startswith("dropped_tokens:")
        )
        healths = ray.get([w.health.remote() for w in self.workers])
        self.buffer.record_engine_health(healths)
        uptime = sum(h["uptime_seconds"] for h in healths)
        metrics["engine_busy_fraction"] = sum(h["busy_seconds"] for h in healths) / max(uptime, 1e-9)
        # Partials resumed from the KV cache their engine kept at the abort (no re-prefill).
        metrics["kv_resumes_total"] = sum(h.get("kv_resumes", 0) for h in healths)
        metrics["kv_resumed_tokens_total"] = sum(h.get("kv_resumed_tokens", 0) for h in healths)
        rewards_by_task = metrics.get("reward_by_task", {})
        self.sampler.observe({k: [v] for k, v in rewards_by_task.items()})
        if self.sampler.current_stage is not None:
            metrics["curriculum_stage"] = self.sampler.current_stage
        if self.sampler.task_weights:
            metrics["task_weight"] = self.sampler.task_weights
        self.logger.log(step, metrics)
        self.buffer.record_step(step, self.logger.history[-1])
        self.apply_controls()
        every = self.cfg.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.cfg.steps:
            self.save_checkpoint(step)
        self._reset_step_counters()

    def _reset_step_counters(self) -> None:
        self.step_started = time.time()
        if self.count_from_rollout_end:
            # An abort overlapped the learner: what it stored after this step's count goes to the next.
            self.tokens_at_step_start = self.tokens_at_rollout_end
        else:
            self.tokens_at_step_start = self.buffer.stats().get("generated_tokens", 0.0)
        self.count_from_rollout_end = False
        self.filter_checked: set[str] = set()
        self.filtered_this_step = 0
        self.step_counters = {"filtered_zero_variance": 0, "filter_kept_by_fallback": 0}

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        import ray

        path = self.run_dir / "checkpoints" / f"step_{step + 1:06d}"
        ray.get(self.learner.save.remote(str(path)))
        state = {"next_step": step + 1, "sampler": self.sampler.state_dict(), "job_name": self.cfg.job_name}
        # Written last and atomically: a checkpoint directory counts only once this file exists,
        # however the process is stopped while saving.
        _write_atomic(path / "driver_state.json", json.dumps(state))
        _write_atomic(self.run_dir / "checkpoints" / "latest", path.name)
        # Groups become "trained" only once the weights that learned from them are on disk. A crash
        # between the line above and this one is repaired by _restore (commit_through).
        self.buffer.commit_through(step)
        return path

    def _find_checkpoint(self) -> Path | None:
        resume = self.cfg.resume
        if resume is None:
            return None
        if resume == "auto":
            complete = sorted((self.run_dir / "checkpoints").glob("step_*/driver_state.json"))
            return complete[-1].parent if complete else None
        path = Path(resume).expanduser()
        if not (path / "driver_state.json").is_file():
            raise FileNotFoundError(f"resume={resume}: not a checkpoint directory (no driver_state.json)")
        return path

    def _restore(self, checkpoint: Path) -> int:
        import ray

        state = json.loads((checkpoint / "driver_state.json").read_text())
        ray.get(self.learner.load.remote(str(checkpoint)))
        self.sampler.load_state_dict(state["sampler"])
        # Claims of steps inside the checkpoint are trained (the process may have died before it
        # marked them); claims of later steps go back to the ready queue, to train on these weights.
        self.buffer.commit_through(int(state["next_step"]) - 1)
        self.buffer.requeue_uncommitted()
        return int(state["next_step"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prompt_text(record: PromptRecord) -> str:
    if isinstance(record.prompt, str):
        return record.prompt
    return "\n".join(m.get("content", "") for m in record.prompt)
