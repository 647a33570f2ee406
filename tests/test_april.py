"""APRIL: abort and resume through the real worker and buffer, token accounting, the staleness
budget, the zero-variance filter, and whole over-provisioned jobs (sync, async, SIGKILL + resume)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from slime.buffer import TrajectoryStore
from slime.config import load_config
from slime.engines.builtin import BuiltinEngine
from slime.engines.contract import GenerationRequest, SamplingParams
from slime.model import load_model
from slime.sample import FINAL_STATUSES, Status
from slime.security import JobCredentials
from tests.helpers import APRIL_SMALL_JOB, wait_for

PROMPTS = [[6, 7, 77, 61, 86], [8, 77, 62, 64, 86], [9, 10, 11, 77, 63, 86]]


def _worker_cfg(tmp_path, job: str, *extra: str):
    return load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "rollout.temperature=0",
            "rollout.ignore_eos=true",
            "rollout.max_new_tokens=40",
            "rollout.chunk_tokens=3",
            "rollout.max_running_requests=4",
            *extra,
        ],
    )


def _assert_each_is_the_uninterrupted_greedy_run(tiny_model_dir, buffer: TrajectoryStore, groups: list[str]) -> None:
    """Every sample of group i is the greedy 40 tokens the engine makes for PROMPTS[i] in one go."""
    engine = BuiltinEngine(load_model(tiny_model_dir), max_running_requests=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    reference = engine.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)])
    for gi, gid in enumerate(groups):
        for s in buffer.get_group(gid):
            assert s.status == Status.TRUNCATED and s.response_length == 40
            assert s.response_ids.tolist() == reference[str(gi)].token_ids


def test_abort_at_random_points_resumes_token_exact(tiny_model_dir, redis_url, tmp_path):
    """Greedy trajectories aborted again and again by the worker, resumed from the buffer's stored
    token ids, end exactly as one uninterrupted run; every generated token is stored exactly once."""
    from slime.rollout import RolloutWorker

    job = "april-exact"
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    groups = [buffer.add_group(p, 2, 40, {"label": "x", "prompt_text": "x"}) for p in PROMPTS]
    worker = RolloutWorker(_worker_cfg(tmp_path, job), str(tiny_model_dir), redis_url, "w0")
    rng = np.random.default_rng(0)
    aborts = 0
    try:
        while buffer.counts()["groups_ready"] < len(groups):
            time.sleep(float(rng.uniform(0.0, 0.04)))  # short: a faster engine finishes in a few aborts
            aborts += worker.abort_all()
            worker.resume()
        engine_tokens = worker.health()["engine_tokens_generated"]
    finally:
        worker.stop()
    assert aborts >= 3

    _assert_each_is_the_uninterrupted_greedy_run(tiny_model_dir, buffer, groups)
    samples = [s for gid in groups for s in buffer.get_group(gid)]
    # Every token the engine generated is in the buffer once: nothing lost, nothing duplicated.
    assert buffer.stats()["generated_tokens"] == sum(s.response_length for s in samples) == engine_tokens
    buffer.delete_job()


# Cuts a RUNNING sample's four per-token arrays to their first ARGV[1] tokens, as a crash of the
# machine within the AOF's unsynced second would leave them; returns how many tokens it cut (a
# finished sample is left alone: -1).
_LOSE_TAIL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -1 end
local keep = tonumber(ARGV[1])
local stored = redis.call('STRLEN', KEYS[5])
for i, width in ipairs({4, 4, 4, 1}) do
  local key = KEYS[i + 1]
  redis.call('SET', key, redis.call('GETRANGE', key, 0, keep * width - 1))
end
return stored - keep
"""


def test_writes_redis_lost_are_detected_and_regenerated_token_exact(tiny_model_dir, redis_url, tmp_path):
    """Trajectories whose stored tail is lost again and again while the worker generates them:
    the worker's next append finds fewer tokens stored than it wrote, releases the sample, and it
    resumes from the stored prefix; every trajectory ends exactly as one uninterrupted run."""
    from slime.rollout import RolloutWorker

    job = "april-lost-writes"
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    groups = [buffer.add_group(p, 2, 40, {"label": "x", "prompt_text": "x"}) for p in PROMPTS]
    lose_tail = buffer.redis.register_script(_LOSE_TAIL)
    worker = RolloutWorker(_worker_cfg(tmp_path, job), str(tiny_model_dir), redis_url, "w0")
    cut_tokens = cuts = 0
    try:
        while buffer.counts()["groups_ready"] < len(groups):
            for s in buffer.iter_samples(Status.RUNNING):
                if cuts < 6 and s.response_length >= 6:
                    head = buffer._key("sample", s.id)
                    keep = s.response_length // 2
                    keys = [head, *(f"{head}:{part}" for part in ("tok", "lp", "ver", "mask"))]
                    lost = lose_tail(keys=keys, args=[keep])  # tokens cut (-1: it finished meanwhile)
                    if lost >= 0:
                        cuts += 1
                        cut_tokens += lost
            time.sleep(0.01)
    finally:
        worker.stop()
    assert cuts >= 2

    _assert_each_is_the_uninterrupted_greedy_run(tiny_model_dir, buffer, groups)
    stats = buffer.stats()
    assert stats["lost_chunk_tokens"] > 0  # the worker noticed (a cut may also land before its next write)
    stored = sum(s.response_length for gid in groups for s in buffer.get_group(gid))
    assert stats["generated_tokens"] - cut_tokens == stored  # nothing appended after a gap
    buffer.delete_job()


def test_staleness_budget_restarts_or_drops(tiny_model_dir, redis_url, tmp_path):
    from slime.rollout import RolloutWorker

    for policy in ("restart", "drop"):
        job = f"april-budget-{policy}"
        buffer = TrajectoryStore.open(redis_url, job)
        buffer.delete_job()
        gid = buffer.add_group(PROMPTS[0], 1, 40, {"label": "x", "prompt_text": "x"})
        (s,) = buffer.lease("old", 1)
        buffer.append_chunk(s.id, "old", [6, 7, 6], [-0.1, -0.2, -0.3], version=0)
        buffer.release(s.id, "old")
        buffer.set_policy_version(3)  # the partial's tokens are now 3 versions old
        cfg = _worker_cfg(tmp_path, job, "april.max_version_span=2", f"april.beyond_budget={policy}")
        worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w0")
        try:
            wait_for(lambda: buffer.counts()["groups_ready"] == 1, 60, "the group to complete")
        finally:
            worker.stop()
        (final,) = buffer.get_group(gid)
        if policy == "restart":
            assert final.status == Status.TRUNCATED and final.response_length == 40
            assert set(final.versions.tolist()) == {3}  # regenerated by the current policy only
            assert buffer.stats()["restarted_tokens"] == 3
        else:
            assert final.status == Status.FAILED and "max_version_span=2" in final.failure
            assert final.response_length == 3
        buffer.delete_job()


def test_buffer_drop_and_requeue_operations(buffer):
    gid = buffer.add_group([1, 2], 2, 8, {})
    for s in buffer.lease("w", 2):
        buffer.append_chunk(s.id, "w", [5, 6], [-1.0, -1.0], 0)
        buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    assert buffer.ready_group_ids() == [gid]
    assert buffer.drop_ready_group(gid, "zero_variance")
    assert not buffer.drop_ready_group(gid, "zero_variance")  # only a ready group can be dropped
    c = buffer.counts()
    assert c["groups_ready"] == 0 and c["groups_dropped"] == 1 and c["groups_open"] == 0
    assert buffer.stats()["dropped_tokens:zero_variance"] == 4

    buffer.add_group([1, 2], 2, 8, {})
    leased = buffer.lease("dead-worker", 2)
    buffer.append_chunk(leased[0].id, "dead-worker", [7], [-1.0], 0)
    assert buffer.requeue_all_leased() == 2
    again = buffer.lease("new-worker", 2)
    assert {s.id for s in again} == {s.id for s in leased}
    assert max(s.response_length for s in again) == 1  # tokens kept


# ---- whole jobs --------------------------------------------------------------------------------

SMALL = APRIL_SMALL_JOB


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_april_sync_job_aborts_resumes_and_wastes_nothing(ray_session, tiny_model_dir, redis_url, tmp_path, launcher):
    from slime.train import train

    job = f"april-e2e-sync-{launcher}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"cluster.launcher={launcher}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                # 4 engine slots for 6 groups in flight: when 3 groups are done, others are mid-generation.
                *SMALL,
                "steps=4",
                "rollout.ignore_eos=true",
                "rollout.max_running_requests=4",
                # Colocated placement's release, forced on CPU: the engine frees its KV memory after
                # each abort, and the partials resume by prefill (nothing else changes below).
                "rollout.release_memory=true",
            ],
        )
    )
    assert len(history) == 4
    assert all(h["engine_memory_released_bytes"] > 0 for h in history)
    assert all(h["groups"] == 3 for h in history)
    assert sum(h["aborted_samples"] for h in history) > 0
    assert sum(h["resumed_samples"] for h in history) > 0
    assert max(h["off_policy_token_share"] for h in history) > 0
    assert history[-1]["wasted_tokens_total"] == 0
    assert any(key.startswith("version_span_hist/1") for h in history for key in h)
    buffer = TrajectoryStore.open(redis_url, job)
    c = buffer.counts()
    assert c["groups_trained"] == 12
    # Every generated token is either trained (in a trained group) or held by a group still open.
    stored = sum(s.response_length for s in buffer.iter_samples())
    assert buffer.stats()["generated_tokens"] == stored
    buffer.delete_job()


def _run_cli(args: list[str], env: dict, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "slime.cli", "train", *args],
        env=env,
        start_new_session=True,
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, launcher",
    [
        ("SIGKILL", "ray"),
        ("SIGTERM", "ray"),
        ("SIGKILL", "local"),
        ("SIGTERM", "local"),
        # The second SIGTERM's stop at once is the driver's own handler under either launcher (SIGTERM
        # under Ray checks that handler is the one in place after ray.init): one launcher is enough
        # (40 s of the suite's time).
        ("SIGTERM twice", "local"),
    ],
)
def test_killed_job_resumes_partials_and_trains_nothing_twice(tiny_model_dir, tmp_path, how, launcher):
    """Kill the whole job (driver, its Redis, its Ray) mid-run, or stop it by SIGTERM (it ends the
    step, checkpoints, exits 0) or by SIGTERM twice (it stops at once); `resume=auto` continues the
    partials stored in Redis from their tokens and trains every group exactly once."""
    sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM
    out = tmp_path / "run"
    args = [
        f"job_name=kill-{sig.name}",
        f"cluster.launcher={launcher}",
        f"output_dir={out}",
        f"model.path={tiny_model_dir}",
        *SMALL,
        "rollout.ignore_eos=true",
        "rollout.max_running_requests=4",
        "checkpoint.every_steps=1",
        "cluster.num_cpus=2",
        # Small chunks: a running sample has tokens in Redis within a few decode steps, so the kill
        # finds partials whenever it lands (with 16-token chunks it could land between flushes).
        "rollout.chunk_tokens=4",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = _run_cli([*args, "steps=40"], env)
    # stderr read as it comes: the second SIGTERM goes the moment the first one is acknowledged
    # (two signals sent close together may arrive as one; a fixed sleep let the partials finish)
    stderr_lines: list[bytes] = []
    acknowledged = threading.Event()

    def read_stderr() -> None:
        for line in iter(proc.stderr.readline, b""):
            stderr_lines.append(line)
            if b"finishing this step" in line:
                acknowledged.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "two steps")
    # Kill at a moment the live buffer holds a partial with most of its tokens still to come (with
    # a fast engine a fixed sleep can land while no sample has tokens in flight).
    # The job's own Redis requires the password derived from its secret (run_dir/job.secret).
    live = TrajectoryStore.open(
        f"redis://127.0.0.1:{json.loads((out / 'redis' / 'server.json').read_text())['port']}/0",
        f"kill-{sig.name}",
        password=JobCredentials.read(out).redis_password,
    )
    wait_for(
        lambda: any(
            s.status in (Status.ABORTED, Status.RUNNING) and 0 < s.response_length <= 24 for s in live.iter_samples()
        ),
        120,
        "a partial trajectory in the live buffer",
    )
    if sig == signal.SIGKILL:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
        if how == "SIGTERM twice":
            assert acknowledged.wait(30), b"".join(stderr_lines).decode()[-3000:]
            proc.send_signal(sig)
    proc.wait(timeout=120)
    reader.join(timeout=30)
    stop_err = b"".join(stderr_lines)
    if how == "SIGTERM":  # graceful: the step ends, its checkpoint holds every logged step
        assert proc.returncode == 0, stop_err.decode()[-3000:]
        assert "finishing this step, then a checkpoint and exit" in stop_err.decode()
        latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
        logged = len(metrics.read_text().splitlines())
        assert json.loads((latest / "driver_state.json").read_text())["next_step"] == logged
    elif how == "SIGTERM twice":
        assert proc.returncode == 130, stop_err.decode()[-3000:]
    if sig == signal.SIGKILL:
        # Ray and Redis were in the job's session: make sure nothing of it survives.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # Look at what the dead job left in Redis (a server started by hand over its AOF).
    from slime.buffer.redis_server import LocalRedisServer

    with LocalRedisServer(out / "redis", password="inspect") as server:
        buffer = TrajectoryStore.open(server.url, f"kill-{sig.name}", password="inspect")
        partials = {
            s.id: s.response_ids.copy()
            for s in buffer.iter_samples()
            if s.status in (Status.ABORTED, Status.RUNNING) and s.response_length > 0
        }
        steps_done = len(metrics.read_text().splitlines())
    assert partials, "the killed job left no partial trajectories to resume"
    if how != "SIGKILL":
        # Stopped (gracefully, or at once), partials stored: the resume from them is the SIGKILL
        # case's, from the same buffer and checkpoint code (a suite-time saving).
        return

    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    drawn_by_checkpoint = json.loads((latest / "driver_state.json").read_text())["sampler"]["draws"]
    # The resume runs under `local` whatever the killed job ran under: what it continues is in Redis
    # and the checkpoint, written the same way by both launchers (a Ray job's resume under Ray:
    # tests/test_train_e2e.py), and a second Ray start would cost the suite ~20 s.
    resumed = _run_cli(
        [*args, f"steps={steps_done + 3}", "resume=auto", "cluster.launcher=local"], env, stdout=subprocess.PIPE
    )
    said, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-3000:]
    assert f"resume=auto: resuming from {out / 'checkpoints'}/step_" in said.decode()  # says where from

    with LocalRedisServer(out / "redis", password="inspect") as server:
        buffer = TrajectoryStore.open(server.url, f"kill-{sig.name}", password="inspect")
        for sid, prefix in partials.items():
            s = buffer.get_sample(sid)
            assert np.array_equal(s.response_ids[: len(prefix)], prefix), sid  # continued, not regenerated
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        # One series: the steps logged after the last checkpoint were redone and logged once.
        assert [r["step"] for r in rows] == list(range(len(rows)))
        last_by_step = {r["step"]: r for r in rows}
        trained_in_metrics = sum(r["groups"] for r in last_by_step.values())
        c = buffer.counts()
        assert c["groups_trained"] == trained_in_metrics == 3 * len(last_by_step)
        assert c["groups_claimed"] == 0
        resumed_final = [buffer.get_sample(sid) for sid in partials]
        assert all(s.status in FINAL_STATUSES for s in resumed_final)
        # Every partial went on from its tokens, those drawn after the checkpoint too: the restored
        # sampler walked over them (fast_forward) rather than drawing their prompts again (kill -9
        # trained the prompts drawn after the last checkpoint twice).
        assert not any(s.failure == "drawn_after_checkpoint" for s in resumed_final)
        assert buffer.groups_drawn_after(drawn_by_checkpoint)  # the kill landed after the checkpoint's draws
        trained = {gid.decode() for gid in buffer.redis.zrange(buffer.connection.key("trained"), 0, -1)}
        prompts = [buffer.get_group(gid)[0].metadata["record_index"] for gid in trained]
        assert len(prompts) == len(set(prompts)), sorted(prompts)  # within the first epoch: each once


SLOW_REWARD = """
import time

from envs.repeat import score


def reward(prompt, response, label):
    time.sleep(1.5)
    return score(response, label)
"""


@pytest.mark.slow
def test_a_graceful_stop_leaves_the_samples_whose_reward_was_running_to_the_resume(tiny_model_dir, tmp_path):
    """One SIGINT stops the job at the end of its step; the reward calls still running then (APRIL
    keeps more in flight than the step needs) are cut short. They are not the reward's failures:
    their samples stay unfinished in the buffer, and the resumed job scores and trains them (they
    were written FAILED and trained as failures, and the resumed job stopped on max_failed_share)."""
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    out = tmp_path / "run"
    args = [
        "job_name=stop-mid-reward",
        "cluster.launcher=local",
        f"output_dir={out}",
        f"model.path={tiny_model_dir}",
        *SMALL,
        f"reward.fn={tmp_path / 'slow_reward.py'}:reward",
        "reward.max_concurrency=16",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = _run_cli([*args, "steps=40"], env)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 1, 240, "one step")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "received SIGINT: finishing this step" in err.decode(), err.decode()[-3000:]
    steps_done = len(metrics.read_text().splitlines())

    resumed = _run_cli([*args, f"steps={steps_done + 2}", "resume=auto"], env)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-3000:]
    assert "RewardRunner was closed" not in err.decode()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps_done + 2))
    assert [r["failed_samples"] for r in rows] == [0] * len(rows)


GROUP_FILTER = """
from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:  # slime's answer type: .keep (and a reason)
    keep: bool
    reason: str | None = None


def one_at_least_half_right(args, samples, **kwargs):
    assert all(s.status.value in ("completed", "truncated") and s.reward is not None for s in samples)
    assert args.label == samples[0].label
    return DynamicFilterOutput(keep=max(s.reward for s in samples) >= 0.5)
"""


EASY_CONSTANT_REWARD = """
def reward(prompt, response, label, metadata):
    if metadata['difficulty'] == 'easy':
        return 1.0  # the same for every sample: no signal
    return len(response) / 100
"""


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["zero_variance", "group_filter"])
def test_a_filter_drops_the_groups_its_rule_rejects_and_counts_them(tiny_model_dir, redis_url, tmp_path, rule):
    """DAPO's dynamic sampling (april.filter_zero_variance: the rewards differ), or a rule of the
    user's (april.group_filter, slime's --dynamic-sampling-filter-path: a slime-style filter keeping
    the groups with a reward of at least 0.5): every trained group passes, the dropped ones are
    counted under the rule's reason, and the fallback keeps none."""
    from slime.train import train

    (tmp_path / "easy_constant.py").write_text(EASY_CONSTANT_REWARD)
    (tmp_path / "keep_good.py").write_text(GROUP_FILTER)
    settings = {
        "zero_variance": ["april.filter_zero_variance=true", f"reward.fn={tmp_path / 'easy_constant.py'}:reward"],
        "group_filter": [f"april.group_filter={tmp_path / 'keep_good.py'}:one_at_least_half_right"],
    }[rule]
    job = f"april-e2e-{rule}"
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *SMALL,
                "steps=2",
                "april.max_filtered_per_step=1000",
                "cluster.launcher=local",  # the filter is the driver's: no actor processes needed
                *settings,
            ],
        )
    )
    counted = "filtered_zero_variance" if rule == "zero_variance" else "filtered_by_group_filter"
    dropped = sum(h[counted] for h in history)
    assert dropped > 0 and all(h["groups"] == 3 for h in history)
    assert sum(h["filter_kept_by_fallback"] for h in history) == 0
    buffer = TrajectoryStore.open(redis_url, job)
    assert buffer.stats()[f"dropped_groups:{rule}"] == dropped
    for gid in buffer.redis.zrange(buffer._key("trained"), 0, -1):
        rewards = [s.reward for s in buffer.get_group(gid.decode())]
        assert len(set(rewards)) > 1 if rule == "zero_variance" else max(rewards) >= 0.5
    buffer.delete_job()


def test_a_group_filter_that_raises_or_answers_no_bool_stops_the_job_naming_it(tiny_model_dir, tmp_path, buffer):
    from rewards.group_filter import GroupFilter, GroupFilterError
    from slime.model import load_tokenizer

    (tmp_path / "bad.py").write_text(
        "def raises(samples):\n    raise KeyError('score')\n\n\ndef says_maybe(samples):\n    return 'maybe'\n"
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    gid = buffer.add_group([6, 7, 77], 2, 8, {"label": "ab"})
    for s in buffer.lease("w", 2):
        buffer.append_chunk(s.id, "w", np.array([6, 7]), np.array([-0.1, -0.2]), 0)
        buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    group = buffer.get_group(gid)
    with pytest.raises(GroupFilterError, match=r"bad.py:raises raised KeyError: 'score'"):
        GroupFilter(f"{tmp_path / 'bad.py'}:raises", tokenizer, [2]).keep(group)
    with pytest.raises(GroupFilterError, match=r"bad.py:says_maybe returned 'maybe'; it must return True"):
        GroupFilter(f"{tmp_path / 'bad.py'}:says_maybe", tokenizer, [2]).keep(group)
