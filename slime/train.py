"""The driver: `slime train`. Short loops over the parts that `RunningJob` starts (slime/job.py);
the rollout side of each step is the fleet's (slime/fleet.py), its decisions APRIL's
(april/scheduler.py).

sync:      wait until the step's groups are complete (APRIL: over-provisioned, refilled one group
           at a time) -> abort the long tail -> train -> push weights -> resume the partials.
async:     keep groups in flight all the time; train on complete groups while the workers go on
           generating; no group starts that would be trained more than `max_staleness` versions late.
           With rollout.elastic, a worker more when the learner finds the buffer dry, one less when
           it finds it full (april/elastic.py).
streaming: train trajectories chunk by chunk while they grow (GLM-5's variant, PPO).
"""

from __future__ import annotations

import signal
import sys

from slime.config import JobConfig
from slime.errors import UserError, dump_stacks_on_sigusr1
from slime.fleet import WorkerHung
from slime.job import RunningJob
from slime.signals import GracefulStop

__all__ = ["RunningJob", "async_loop", "streaming_loop", "sync_loop", "train"]


def sync_loop(job: RunningJob) -> None:
    for step in job.steps():
        job.wait_for_batch()  # APRIL: over-provisioned, refilled one group at a time
        # APRIL: the long tail waits for the next step. The abort (each partial's last tokens stored,
        # then released) runs while the learner trains: it touches no group of this batch. Without
        # APRIL there is nothing to abort.
        abort = job.abort_tail()
        abort.start()
        metrics = job.train_batch(step, abort)  # the rollout clock stops when the abort has completed
        metrics["aborted_samples"] = abort.wait()
        job.tune_offpolicy(step, metrics)  # algorithm.correction.auto: before the partials resume
        job.push_weights(step)
        job.probe_gap(step, metrics)  # algorithm.correction.auto: the gap, when no batch had fresh tokens
        job.resume()  # the next step starts here
        job.end_step(step, metrics)
        if job.stop.requested:  # SIGINT/SIGTERM: this step is checkpointed; stop here
            break


def async_loop(job: RunningJob) -> None:
    for step in job.steps():
        job.rebalance_workers(step)  # rollout.elastic: add or remove a worker by how full the buffer is
        job.wait_for_batch()  # scheduling as it waits
        metrics = job.train_while_generating(step)  # the workers generate the next groups meanwhile
        job.tune_offpolicy(step, metrics)  # algorithm.correction.auto: the next admissions follow it
        job.push_weights(step)
        job.probe_gap(step, metrics)  # algorithm.correction.auto: the gap, when no batch had fresh tokens
        job.end_step(step, metrics)
        if job.stop.requested:  # SIGINT/SIGTERM: this step is checkpointed; stop here
            break


def streaming_loop(job: RunningJob) -> None:
    """Trajectories are trained chunk by chunk while they grow; later chunks come from newer
    policies; unfinished returns are bootstrapped by the critic."""
    for step in job.steps():
        job.wait_for_segments(step)  # scheduling as it waits
        metrics = job.train_segments(step)  # the workers keep generating meanwhile
        job.tune_offpolicy(step, metrics)  # algorithm.correction.auto: the next update's tis_cap
        job.push_weights(step)
        job.probe_gap(step, metrics)  # algorithm.correction.auto: the gap, when no batch had fresh tokens
        job.end_step(step, metrics)
        if job.stop.requested:  # SIGINT/SIGTERM: this step is checkpointed; stop here
            break


LOOPS = {"sync": sync_loop, "async": async_loop, "streaming": streaming_loop}  # by JobConfig.loop_mode


def train(cfg: JobConfig) -> list[dict]:
    """Run the job; its metrics, one dict per step. SIGINT/SIGTERM end it after the current step
    with a checkpoint (a second signal at once, see GracefulStop). When a Ray actor dies (the
    learner or a rollout worker: killed, pre-empted, out of memory), the job restarts itself from
    its last checkpoint and the buffer, up to `max_restarts` times: partials keep their tokens, and
    the restored sampler walks over the groups drawn after the checkpoint instead of drawing their
    prompts again (those it cannot are dropped), so each prompt trains once per epoch."""
    dump_stacks_on_sigusr1()
    if (notice := unused_reward_notice(cfg)) is not None:
        print(f"slime: {notice}", file=sys.stderr, flush=True)
    stop = GracefulStop()
    previous = stop.install()
    restarts = 0
    try:
        while True:
            try:
                return _run(cfg, stop)
            except Exception as exc:
                if (failed := _start_failure(exc)) is not None:
                    raise ActorStartError(failed) from exc
                if not _actor_lost(exc, cfg) or restarts == cfg.max_restarts or stop.requested:
                    raise
                restarts += 1
                print(
                    f"the job lost a Ray actor ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                    f"restarting from the last checkpoint (restart {restarts} of max_restarts={cfg.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                cfg = cfg.model_copy(update={"resume": "auto"})
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def unused_reward_notice(cfg: JobConfig) -> str | None:
    """A reward.fn set beside env.reward=env is never called: say so rather than ignore it."""
    if cfg.env.plugin is None or cfg.env.reward != "env":
        return None
    if cfg.reward.fn == type(cfg.reward).model_fields["fn"].default:
        return None
    return (
        f"reward.fn={cfg.reward.fn} is not called: with env.reward=env each episode's reward is the env's "
        "return; set env.reward=reward_fn to score the transcript with reward.fn"
    )


def _run(cfg: JobConfig, stop: GracefulStop) -> list[dict]:
    with RunningJob(cfg, stop) as job:
        if not job.stop.requested:  # a signal during start-up: nothing to train
            LOOPS[cfg.loop_mode](job)
        if job.stop.requested:
            trained = bool(job.logger.history)  # a signal during start-up: no step, so no checkpoint
            said = "with a checkpoint; resume=auto goes on from it" if trained else "before its first step"
            job.logger.say(f"stopped by {job.stop.requested} {said}")
        return list(job.logger.history)  # the last HISTORY_ROWS steps (metrics.jsonl has every one)


class ActorStartError(UserError, RuntimeError):
    """A Ray actor failed in its constructor (an engine option the engine refuses, a model it cannot
    load): the same start would fail the same way, so the job is not restarted."""

    hint = "the last lines above are the actor's own error: fix what they name and run again"


def _start_failure(exc: BaseException) -> str | None:
    """What a Ray actor that died in its constructor said (its error's last lines); None otherwise."""
    ray = sys.modules.get("ray")
    if ray is None or not isinstance(exc, ray.exceptions.RayActorError) or not exc.actor_init_failed:
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = " | ".join(lines[-3:])
    return f"a Ray actor failed while it started; not restarted (the same start would fail again): {said[-600:]}"


def _actor_lost(exc: BaseException, cfg: JobConfig) -> bool:
    """A Ray actor died, or a hung rollout worker was killed (see RolloutFleet.check_workers). With
    cluster.launcher=local nothing is lost alone: a thread cannot be killed, so a hang fails the job."""
    if cfg.cluster.launcher == "local":
        return False
    ray = sys.modules.get("ray")  # imported by the job once it started Ray
    return isinstance(exc, WorkerHung) or (ray is not None and isinstance(exc, ray.exceptions.RayActorError))
