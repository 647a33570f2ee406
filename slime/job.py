"""One running job's lifecycle: start and stop its parts (Redis, Ray, the learner, the rollout
fleet, the dashboard), train and publish weights, write metrics and checkpoints. The loops that
drive it are in slime/train.py; the rollout side is slime/fleet.py.

Ray is imported inside the methods: Ray reads its authentication settings when it is first
imported, and the job sets them (`_ray_token_auth`) just before it starts Ray.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from transformers import AutoConfig

from envs import repeat
from rewards.mix import load_reward_spec
from slime.buffer import JobConnection, JobTelemetry, TrajectoryStore
from slime.buffer.redis_server import connect_or_start
from slime.config import ConfigError, JobConfig, dump_config
from slime.dashboard.server import DashboardProcess
from slime.data import PromptRecord, load_prompts, write_jsonl
from slime.errors import ClusterError
from slime.fleet import RolloutFleet, WorkerLaunch, scheduler_for, start_rollout_worker
from slime.learner import LearnerGroup
from slime.learner.group import check_resources
from slime.learner.sharding import CheckpointError
from slime.metrics import FailureWatch, MetricsLogger, write_atomic
from slime.model import ensure_model_dir, load_tokenizer
from slime.sample import new_id
from slime.sampling import PromptSampler
from slime.security import JobCredentials, write_private


class WeightSyncError(RuntimeError):
    """An engine's logprobs on the probe differ from the learner's after a weight update."""


class JobInterrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop at once, storing every partial trajectory on the way out."""


class GracefulStop:
    """The job's SIGINT/SIGTERM handler. The first signal asks the loop to finish its step, write a
    checkpoint and return (exit 0); a second one stops at once (JobInterrupted): partials are
    stored, no checkpoint is written, the last complete one stays the resume point."""

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name once one arrived

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            raise JobInterrupted(f"received {name} again: stopping now")
        self.requested = name
        print(
            f"\nreceived {name}: finishing this step, then a checkpoint and exit (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> dict:
        """Handle SIGINT and SIGTERM (main thread only); returns the handlers it replaced."""
        if not main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class RunningJob:
    """Starts and stops the parts of one job; trains, pushes weights, logs and checkpoints."""

    def __init__(self, cfg: JobConfig, stop: GracefulStop | None = None):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.redis_server = None
        self.ray_started = False
        self._ray_auth_env: tuple[str, ...] = ()  # environment variables set for the job's own Ray
        self.workers: list = []
        self.learner = None
        self.dashboard = None
        # The step's clocks (see _reset_step_counters and train_step).
        self.tokens_at_rollout_end = 0.0
        self.abort_sent_at: float | None = None  # APRIL's abort of this step, overlapping the learner
        self.abort_seconds = 0.0
        self.step_boundary: float | None = None  # where this step ends and the next begins
        self.engines_released: tuple[float, float] | None = None  # (time, generated tokens) at the resume
        self.weight_sync_seconds = 0.0
        self.stop = stop or GracefulStop()

    # ---- start / stop ------------------------------------------------------------------------
    def __enter__(self) -> RunningJob:
        cfg = self.cfg
        try:
            if cfg.reward.mode != "http":  # an http reward lives in its own server
                load_reward_spec(cfg.reward.fn)  # a bad reward spec fails here, before anything starts
            _check_local_resources(cfg)  # a learner that cannot fit fails before anything starts
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.run_dir / "config.yaml")
            # One secret per run (run_dir/job.secret, 0600): the job's Redis password and every
            # service token derive from it; actors get it as an argument, children by environment.
            self.credentials = JobCredentials.create(self.run_dir, own_redis=cfg.buffer.url is None)
            self.redis_url, self.redis_server = connect_or_start(
                cfg.buffer.url,
                self.run_dir / "redis",
                cfg.buffer.aof,
                self.credentials.redis_password,
                cfg.buffer.appendfsync,
            )
            connection = JobConnection.of_job(cfg, self.redis_url, self.credentials.redis_password)
            self.buffer = TrajectoryStore(connection, cfg.buffer.lease_seconds)
            self.telemetry = JobTelemetry(connection)
            if self.redis_server is not None:  # every part retries meanwhile (buffer.reconnect_timeout_s)
                self.redis_server.keep_alive(self._redis_restarted)
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
            self._start_ray()
            self._start_actors()
            self.start_step = 0
            if checkpoint is not None:
                self.start_step = self._restore(checkpoint)
            elif cfg.resume is not None:
                self.buffer.requeue_uncommitted()  # no checkpoint yet: no step's update survived
            import ray  # started above

            ray.get([w.health.remote() for w in self.workers] + self.learner.publish_weights())
            if checkpoint is not None:
                self.push_weights(self.start_step - 1)
            self.logger = MetricsLogger(self.run_dir, cfg.logging, cfg.steps, self.start_step)
            self.failures = FailureWatch(cfg.reward.max_failed_share, cfg.reward.failed_window_steps)
            self.last_checkpoint_at = time.time()
            self._reset_step_counters()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _redis_restarted(self, message: str) -> None:
        print(f"slime: {message}", file=sys.stderr, flush=True)
        self.telemetry.log_event("redis_restarted", {"message": message})

    def _start_ray(self) -> None:
        cfg = self.cfg
        if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
            # before `import ray`: Ray reads its auth settings when imported
            self._ray_auth_env = _ray_token_auth(self.credentials, cfg.cluster.ray_address)
        import ray  # after its auth settings are in the environment

        if not ray.is_initialized():
            address = cfg.cluster.ray_address or "local"
            try:
                ray.init(
                    # "local": a Ray of the job's own, even where a cluster runs on this machine (Ray
                    # would join that one); "auto" joins it on purpose (a submitted job: slime/tools/submit.py).
                    address=address,
                    num_cpus=cfg.cluster.num_cpus,
                    include_dashboard=False,
                    logging_level="warning",
                    log_to_driver=True,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ClusterError(f"cluster.ray_address={address}: Ray could not start or join: {first}") from exc
            self.ray_started = True
            self.stop.install()  # ray.init installs its own SIGTERM handler; ours ends the step first

    def _start_actors(self) -> None:
        cfg = self.cfg
        run_id = new_id()[:6]  # lease owner names never collide with a previous run's workers
        self.learner = LearnerGroup(cfg, self.model_dir, self.redis_url, self.credentials)
        launch = WorkerLaunch(self.model_dir, self.redis_url, self.credentials, run_id)
        self.workers = [start_rollout_worker(cfg, launch, i) for i in range(cfg.rollout.num_workers)]
        self.fleet = RolloutFleet(cfg, self.workers, self.buffer, self.telemetry, self.sampler, launch)

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
            d = cfg.dashboard
            token = d.token or self.credentials.token("dashboard")
            token_file = write_private(self.run_dir / "dashboard.token", token + "\n")
            self.dashboard = DashboardProcess(
                self.redis_url, cfg.job_name, d.host, d.port, token, redis_password=self.credentials.redis_password
            )
            print(f"dashboard: {self.dashboard.url} (control token in {token_file})", flush=True)

    def __exit__(self, *exc) -> None:
        ray = sys.modules.get("ray")  # None: the job failed before it started Ray
        if ray is not None and self.workers:
            try:  # first of all, stop generating and store every partial trajectory
                ray.get([w.abort_all.remote() for w in self.workers], timeout=60)
            except Exception:
                pass
        if hasattr(self, "logger"):
            self.logger.close()
        if ray is not None:
            if self.workers:
                try:
                    ray.get([w.stop.remote() for w in self.workers], timeout=60)
                except Exception:
                    pass
            if self.learner is not None:
                try:
                    LearnerGroup.result(self.learner.close(), timeout=30)
                except Exception:
                    pass
            for actor in self.workers:
                ray.kill(actor)
            if hasattr(self, "fleet"):  # workers it was still adding or removing (rollout.elastic)
                try:
                    self.fleet.release_added()
                except Exception:
                    pass
            if self.learner is not None:
                self.learner.kill()
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
            path = str(self.run_dir / "repeat_task.jsonl")
            if not Path(path).exists():
                write_jsonl(repeat.make_dataset(cfg.data.num_generated, cfg.data.seed), path)
        return load_prompts(cfg.data, self.tokenizer, path)

    # ---- learning --------------------------------------------------------------------------------
    def train_step(self, step: int, max_staleness: int | None, aborting: list | None = None) -> dict:
        """Train on the step's batch. The rollout clock stops when the engines have stopped generating
        for this step: at once (the batch is complete), or, with ``aborting`` (APRIL's abort, sent by
        start_abort and overlapping the learner), when every engine has finished the abort: the decode
        step in flight done, every partial's last tokens stored. Those tokens are this step's. Async:
        the engines never stop, so the window runs until the update is done (contiguous windows)."""
        import ray  # see the module docstring

        released = 0
        if not aborting and self.cfg.mode != "async":
            self._stop_rollout_clock()
            if self.cfg.releases_engine_memory:  # colocated: the learner gets the engines' KV memory
                released = self.fleet.release_memory()
        refs = self.learner.train_step(step, self.cfg.rollout.batch_size, max_staleness, commit=False)
        if aborting:
            # The learner is training meanwhile. A worker hung in its abort is found by finish_abort.
            ray.wait(list(aborting), num_returns=len(aborting), timeout=self.cfg.rollout.hang_timeout_s)
            self._stop_rollout_clock()
            self.abort_seconds = self.rollout_ended_at - (self.abort_sent_at or self.rollout_ended_at)
            if self.cfg.releases_engine_memory:  # after the abort: the partials' caches go too
                released = self.fleet.release_memory()
        while self.cfg.mode == "async" and len(ray.wait(refs, num_returns=len(refs), timeout=0.05)[0]) < len(refs):
            self.fleet.schedule_groups()  # the workers keep generating while the learner trains
        if self.cfg.mode == "async":
            # The engines never stop: a step's window runs until its update is done and the next
            # one starts right there, so the tokens made while the learner trains count too.
            self._stop_rollout_clock()
            self.engines_released = (self.rollout_ended_at, self.tokens_at_rollout_end)
        metrics = LearnerGroup.result(refs)
        generated = self.tokens_at_rollout_end - self.tokens_at_step_start
        rollout_seconds = self.rollout_ended_at - self.rollout_started_at
        metrics["rollout_seconds"] = rollout_seconds
        metrics["rollout_tokens_per_s"] = generated / max(rollout_seconds, 1e-9)
        metrics["generated_tokens"] = generated
        metrics["abort_seconds"] = self.abort_seconds  # inside rollout_seconds, overlapping the learner
        if self.cfg.releases_engine_memory:
            metrics["engine_memory_released_bytes"] = released
        return metrics

    def _stop_rollout_clock(self) -> None:
        self.rollout_ended_at = time.time()
        self.tokens_at_rollout_end = self.buffer.stats().get("generated_tokens", 0.0)

    def train_segments(self, step: int, segments: int) -> dict:
        import ray  # see the module docstring

        rollout_seconds = time.time() - self.rollout_started_at
        refs = self.learner.train_segments(step, segments, self.cfg.april.streaming_chunk_tokens)
        while len(ray.wait(refs, num_returns=len(refs), timeout=0.05)[0]) < len(refs):
            self.fleet.schedule_groups()  # the workers keep generating while the learner trains
        metrics = LearnerGroup.result(refs)
        # The engines never pause here: count what they made over the whole step, training included.
        generated = self.buffer.stats().get("generated_tokens", 0.0) - self.tokens_at_step_start
        metrics.update(
            rollout_seconds=rollout_seconds,
            generated_tokens=generated,
            rollout_tokens_per_s=generated / max(time.time() - self.rollout_started_at, 1e-9),
        )
        return metrics

    def start_abort(self) -> list:
        """APRIL's abort, sent now; pass the returned refs to train_step, whose rollout clock stops when
        the abort completes (while the learner trains), and then to fleet.finish_abort."""
        self.abort_sent_at = time.time()
        return self.fleet.start_abort()

    def resume(self) -> None:
        """The engines go on (APRIL: the partials resume). The next step starts here, and after an
        abort its rollout clock too: its engines generate while the driver ends this step."""
        self.step_boundary = time.time()
        if self.abort_sent_at is not None:
            self.engines_released = (self.step_boundary, self.buffer.stats().get("generated_tokens", 0.0))
        self.fleet.resume()

    def push_weights(self, step: int) -> None:
        t0 = time.time()
        handle = LearnerGroup.result(self.learner.publish_weights())
        if self.cfg.releases_engine_memory:  # vLLM/SGLang: awake before loading weights
            self.fleet.resume_memory()
        self.fleet.update_weights(handle)
        self.weight_sync_seconds = time.time() - t0
        every = self.cfg.weights.check_every
        if every and (step + 1) % every == 0:
            self.check_weights()

    def check_weights(self) -> float:
        """Engine and learner must give the same logprobs for a fixed probe after an update."""
        record = self.records[0]
        probe = [
            int(t) for t in (self.tokenizer(str(record.label or "probe"), add_special_tokens=False)["input_ids"] or [0])
        ]
        expected = LearnerGroup.result(self.learner.probe_logprobs(record.prompt_ids, probe))
        worst = 0.0
        for got in self.fleet.probe_logprobs(record.prompt_ids, probe):
            diff = float(np.max(np.abs(got - expected)))
            worst = max(worst, diff)
            if diff > self.cfg.weight_check_tolerance:
                raise WeightSyncError(
                    f"after the weight update the engine's probe logprobs differ from the learner's by {diff:.2e} "
                    f"(weights.check_tolerance={self.cfg.weight_check_tolerance}); the engine does not hold the "
                    "learner's weights (e.g. tied embeddings not refreshed)"
                )
        return worst

    # ---- metrics ---------------------------------------------------------------------------------
    def end_step(self, step: int, metrics: dict) -> None:
        metrics["weight_sync_seconds"] = self.weight_sync_seconds
        metrics.update(self.fleet.step_metrics())  # rollout_workers (and elastic_fill)
        boundary = time.time() if self.step_boundary is None else self.step_boundary
        metrics["step_seconds"] = boundary - self.step_started
        metrics["buffer"] = counts = self.buffer.counts()
        metrics["filtered_zero_variance"] = self.fleet.filter.dropped_this_step
        metrics["filter_kept_by_fallback"] = self.fleet.filter.kept_by_fallback
        stats = self.buffer.stats()
        metrics["partial_samples"] = counts["aborted"]
        # Generated but never trained on (restarted beyond the staleness budget, dropped groups).
        metrics["wasted_tokens_total"] = stats.get("restarted_tokens", 0.0) + sum(
            v for k, v in stats.items() if k.startswith("dropped_tokens:")
        )
        healths = self.fleet.healths()
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
        self.failures.observe(metrics)
        self.logger.log(step, metrics)
        self.telemetry.record_step(step, self.logger.history[-1])
        self.failures.check(last_step=step + 1 == self.cfg.steps)  # too many failed: stop before a checkpoint
        self.fleet.apply_controls()
        if self._checkpoint_due(step) or self.stop.requested:
            if metrics.get("samples") and metrics.get("failed_samples") == metrics["samples"]:
                # Nothing was learned: a checkpoint would look like progress. The step's groups stay
                # uncommitted; the next checkpoint (or a resume) takes them.
                self.logger.say(f"step {step}: every sample failed, no checkpoint written")
            else:
                self.save_checkpoint(step)
        self._reset_step_counters(boundary)

    def _checkpoint_due(self, step: int) -> bool:
        """Every checkpoint_every steps or checkpoint_every_seconds, whichever comes first; and at the end."""
        every, seconds = self.cfg.checkpoint_every, self.cfg.checkpoint_every_seconds
        by_steps = bool(every) and (step + 1) % every == 0
        by_time = bool(seconds) and time.time() - self.last_checkpoint_at >= seconds
        return by_steps or by_time or step + 1 == self.cfg.steps

    def _reset_step_counters(self, boundary: float | None = None) -> None:
        """The clocks of the next step. Steps are contiguous: one starts where the last ended, so the
        step seconds add up to the loop's wall-clock. Its rollout clock runs while its engines may
        generate: from the resume when the last step aborted (APRIL: the partials go on while the
        driver ends the last step), else from now (the step's groups are scheduled next); until
        train_step stops it. Every generated token is counted in the rollout window it was made in."""
        now = time.time()
        self.step_started = now if boundary is None else boundary
        if self.engines_released is not None:
            self.rollout_started_at, self.tokens_at_step_start = self.engines_released
        else:
            self.rollout_started_at = now
            self.tokens_at_step_start = self.buffer.stats().get("generated_tokens", 0.0)
        self.abort_sent_at, self.abort_seconds = None, 0.0
        self.step_boundary = self.engines_released = None
        self.fleet.filter.new_step()

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        path = self.run_dir / "checkpoints" / f"step_{step + 1:06d}"
        LearnerGroup.result(self.learner.save(str(path)))
        state = {"next_step": step + 1, "sampler": self.sampler.state_dict(), "job_name": self.cfg.job_name}
        # Written last and atomically: a checkpoint directory counts only once this file exists,
        # however the process is stopped while saving.
        write_atomic(path / "driver_state.json", json.dumps(state))
        write_atomic(self.run_dir / "checkpoints" / "latest", path.name)
        # Groups become "trained" only once the weights that learned from them are on disk. A crash
        # between the line above and this one is repaired by _restore (commit_through).
        self.buffer.commit_through(step, self.cfg.buffer.keep_trained_steps)
        self.last_checkpoint_at = time.time()
        return path

    def _find_checkpoint(self) -> Path | None:
        resume = self.cfg.resume
        if resume is None:
            return None
        if resume == "auto":
            complete = sorted((self.run_dir / "checkpoints").glob("step_*/driver_state.json"))
            if not complete:
                print(
                    f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}: training starts at step 0 "
                    "(the buffer's unfinished trajectories are kept and resumed)",
                    flush=True,
                )
                return None
            return complete[-1].parent
        path = Path(resume).expanduser()
        if not (path / "driver_state.json").is_file():
            raise CheckpointError(f"resume={resume}: not a checkpoint directory (no driver_state.json in it)")
        return path

    def _restore(self, checkpoint: Path) -> int:
        state = json.loads((checkpoint / "driver_state.json").read_text())
        print(
            f"resume={self.cfg.resume}: resuming from {checkpoint} at step {state['next_step']} of {self.cfg.steps}",
            flush=True,
        )
        LearnerGroup.result(self.learner.load(str(checkpoint)))
        self.sampler.load_state_dict(state["sampler"])
        # Claims of steps inside the checkpoint are trained (the process may have died before it
        # marked them); claims of later steps go back to the ready queue, to train on these weights.
        self.buffer.commit_through(int(state["next_step"]) - 1, self.cfg.buffer.keep_trained_steps)
        self.buffer.requeue_uncommitted()
        return int(state["next_step"])


def _check_local_resources(cfg: JobConfig) -> None:
    """The Ray this job starts itself has this machine's CPUs and GPUs and no custom resources:
    check the learner against them now (a cluster is checked once connected, LearnerGroup)."""
    ray = sys.modules.get("ray")
    if cfg.cluster.ray_address is not None or (ray is not None and ray.is_initialized()):
        return
    import torch

    available = {"CPU": float(cfg.cluster.num_cpus or os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
    check_resources(cfg, available, "this machine (the job's local Ray)")


def _check_context_fits(cfg: JobConfig, model_dir: str) -> None:
    """The engines refuse a response budget longer than the model reads (validate_sampling in the
    engine contract): say so at start, naming the field, instead of failing every request."""
    context = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    if context is not None and cfg.rollout.max_new_tokens > context:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} exceeds the model's context "
            f"(max_position_embeddings={context} in {model_dir})"
        )


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
        print(
            "warning: Ray was imported before the job started and cannot switch to token "
            "authentication; the job's Ray accepts unauthenticated clients (set RAY_AUTH_MODE)",
            flush=True,
        )
        return ()
    return ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def _reload_ray_auth() -> bool:
    """Ray reads its auth settings when first imported; an imported Ray must read them again.
    (`ray._raylet`'s loader is Ray's own test hook for this; without it, say so.)"""
    if "ray" not in sys.modules:
        return True
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # Ray is loaded already
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
