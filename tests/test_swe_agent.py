"""Long-horizon agent episodes end to end (issue 36): the software-engineering env (envs/swe.py)
driven through the real rollout worker, engine, Redis buffer and learner, by a scripted policy
(tests/scripted_policy.py: the real engine computes every position; only its choice of token
follows the script).

- A 32k-token, 31-turn episode on the tiny model at 40k positions: aborted in the middle, the
  worker gone, resumed by a new worker with the same workspace (file by file, from the snapshot
  stored with its last observation), finished with reward 1, and trained on by the learner.
- A whole job killed (SIGKILL) amid 16 running episodes and resumed: every episode continues from
  its stored state (tokens and workspace), none restarts from its first turn, none is trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.swe_tasks import generate_tasks, long_reference_actions, prompt, tool_call
from slime.buffer import TrajectoryStore
from slime.config import ModelConfig, TinyModelConfig, WarmstartConfig, load_config
from slime.model import ensure_model_dir, load_tokenizer
from slime.sample import FINAL_STATUSES, Status
from slime.security import JobCredentials
from tests.helpers import wait_for
from tests.scripted_policy import TurnScript, scripted_engine_class

pytestmark = pytest.mark.slow

POSITIONS = 40960
KILL_TURNS = 7  # the killed job's episodes: the kill comes in the third turn, well before the end


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The tiny MoE with room for 40k positions, one layer instead of four and half its width, which
    keeps the 32k episode's rollout and learner step near a minute and a half here (the default model:
    about 7 minutes; docs/benchmarks.md, "Long agent episodes"). Random init: the script picks every
    token."""
    cfg = ModelConfig(
        cache_dir=str(tmp_path_factory.mktemp("models")),
        tiny=TinyModelConfig(
            max_position_embeddings=POSITIONS,
            num_layers=1,
            hidden_size=64,
            num_heads=2,
            num_kv_heads=1,
            expert_hidden_size=64,
        ),
        warmstart=WarmstartConfig(enabled=False),
    )
    return ensure_model_dir(cfg)


def _model_turns(mask: np.ndarray) -> int:
    return int(mask[0] == 1) + int(np.sum(np.diff(mask.astype(int)) == 1))


def _workspace(files: dict[str, str], snapshot: dict) -> dict[str, str]:
    out = dict(files)
    for path, text in snapshot["changed"].items():
        if text is None:
            out.pop(path, None)
        else:
            out[path] = text
    return out


def test_a_32k_token_31_turn_episode_survives_abort_and_worker_loss_then_trains(
    long_model_dir, redis_url, buffer, tmp_path, monkeypatch
):
    from slime.learner import Learner
    from slime.rollout import RolloutWorker

    task = generate_tasks()[0]
    reads = long_reference_actions(task, 32, lines_per_read=40)[1:-4]
    # The fix goes in early, so the workspace at the abort differs from the repository's.
    script = [
        tool_call("list_dir", path="."),
        tool_call("apply_patch", patch=task.fix),
        *reads,
        tool_call("run_tests"),
        tool_call("finish"),
    ]
    tokenizer = load_tokenizer(long_model_dir)
    policy = TurnScript(tokenizer, {prompt(task): script})
    monkeypatch.setattr("slime.engines.builtin.BuiltinEngine", scripted_engine_class(policy))
    cfg = load_config(
        None,
        [
            f"job_name={buffer.job}",
            f"output_dir={tmp_path}",
            "algorithm.name=ppo",
            "rollout.temperature=1.0",
            f"rollout.max_new_tokens={POSITIONS - 1024}",
            "rollout.max_running_requests=2",
            "rollout.chunk_tokens=64",
            "learner.max_tokens_per_micro_batch=65536",
            "env.plugin=envs.swe:SweEnv",
            "env.kwargs={max_read_lines: 80, max_observation_chars: 8000}",
            "env.max_turns=40",
            "env.max_turn_tokens=1024",
            "env.max_observation_tokens=8192",
            f"env.max_episode_tokens={POSITIONS}",
        ],
    )
    prompt_ids = tokenizer(prompt(task), add_special_tokens=False)["input_ids"]
    gid = buffer.add_group(prompt_ids, 1, cfg.rollout.max_new_tokens, {"label": task.label(), "task": "swe"})

    worker = RolloutWorker(cfg, str(long_model_dir), redis_url, "w-long-1")
    try:
        wait_for(lambda: worker.error or buffer.get_group(gid)[0].response_length > 16000, 600, "16k tokens")
        assert worker.error is None, worker.error
        worker.abort_all()
    finally:
        worker.stop()
    (at_abort,) = buffer.get_group(gid)
    assert at_abort.status == Status.ABORTED
    snapshot = json.loads(buffer.env_state(at_abort.id))
    files_at_abort = _workspace(task.files, snapshot["state"])
    assert files_at_abort[task.buggy_path] != task.files[task.buggy_path]  # the fix is in

    # A new worker (new engine, new env instances) resumes the episode; its workspace is read the
    # moment restore() returns, on the env's own thread (the episode goes on at once).
    from envs.swe import SweEnv

    restored: dict[str, str] = {}
    original_restore = SweEnv.restore

    def recording_restore(self, sample, snapshot):
        original_restore(self, sample, snapshot)
        restored.update(self.workspace.files)

    monkeypatch.setattr(SweEnv, "restore", recording_restore)
    worker = RolloutWorker(cfg, str(long_model_dir), redis_url, "w-long-2")
    try:
        wait_for(lambda: worker.error or buffer.counts()["groups_ready"] == 1, 600, "the episode to finish")
        assert worker.error is None, worker.error
    finally:
        worker.stop()
    assert sorted(restored) == sorted(files_at_abort)
    for path, text in files_at_abort.items():
        assert restored[path] == text, path

    (done,) = buffer.get_group(gid)
    assert done.status == Status.COMPLETED and done.reward == 1.0, (done.status, done.reward, done.metadata)
    assert done.metadata["env_end"] == "finish"
    assert len(done.prompt_ids) + done.response_length >= 32768
    assert _model_turns(done.loss_mask) == len(script) == 31
    # Continued token for token from what was stored at the abort; nothing re-tokenized.
    n = at_abort.response_length
    assert np.array_equal(done.response_ids[:n], at_abort.response_ids)
    assert np.array_equal(done.loss_mask[:n], at_abort.loss_mask)
    stats = buffer.stats()
    assert stats.get("env_snapshot_restores") == 1 and not stats.get("env_replays")

    learner = Learner(cfg, str(long_model_dir), redis_url)
    try:
        m = learner.train_step(0, num_groups=1)
    finally:
        learner.close()
    assert m["groups"] == 1 and m["samples"] == 1 and np.isfinite(m["loss"])


def _job_args(out: Path, model_dir: str, data: Path) -> list[str]:
    return [
        "job_name=swe-kill",
        "cluster.launcher=local",
        f"output_dir={out}",
        f"model.path={model_dir}",
        f"data.path={data}",
        "data.max_prompt_tokens=2048",
        "mode=sync",
        "algorithm.name=grpo",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_running_requests=16",
        "rollout.max_new_tokens=12000",
        "rollout.chunk_tokens=16",
        "rollout.temperature=1.0",
        "checkpoint.every_steps=1",
        "logging.progress=false",
        "env.plugin=envs.swe:SweEnv",
        "env.kwargs={max_read_lines: 80}",
        "env.max_turns=12",
        "env.max_turn_tokens=1024",
        "env.max_observation_tokens=1024",
        "env.max_concurrency=4",
        "env.step_timeout_s=60",
    ]


def test_a_job_killed_amid_16_episodes_resumes_each_from_its_stored_state(long_model_dir, tmp_path):
    tasks = generate_tasks()[:8]
    data = tmp_path / "swe.jsonl"
    data.write_text("".join(json.dumps(t.record()) + "\n" for t in tasks))
    # KILL_TURNS turns each: list, reads, the fix, the tests, finish.
    turns = {prompt(t): long_reference_actions(t, KILL_TURNS, lines_per_read=12) for t in tasks}
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(long_model_dir), "turns": turns}))
    out = tmp_path / "run"
    args = _job_args(out, str(long_model_dir), data)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"

    def run_job(*extra: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.scripted_policy", str(script), "train", *args, *extra],
            env=env,
            start_new_session=True,
            stdout=stdout,
            stderr=subprocess.PIPE,
        )

    proc = run_job("steps=3")
    metrics = out / "metrics.jsonl"
    try:
        # Step 0 trains the first 16 episodes; step 1's 16 run when the job is killed.
        wait_for(lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text().strip()), 300, "step 0")
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        live = TrajectoryStore.open(
            f"redis://127.0.0.1:{json.loads((out / 'redis' / 'server.json').read_text())['port']}/0",
            "swe-kill",
            password=JobCredentials.read(out).redis_password,
        )

        def mid_episode() -> list:
            running = [s for s in live.iter_samples() if s.status not in FINAL_STATUSES]
            # Every one of the 16 has had two env turns answered, and none has finished.
            ok = len(running) == 16 and all(int(np.sum(np.diff(s.loss_mask.astype(int)) == -1)) >= 2 for s in running)
            return running if ok else []

        wait_for(lambda: proc.poll() is not None or mid_episode(), 300, "16 episodes in their third turn")
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    from slime.buffer.redis_server import LocalRedisServer

    with LocalRedisServer(out / "redis", password="inspect") as server:
        buffer = TrajectoryStore.open(server.url, "swe-kill", password="inspect")
        stored = {s.id: s for s in buffer.iter_samples() if s.status not in FINAL_STATUSES}
        snapshots = {sid: json.loads(buffer.env_state(sid)) for sid in stored}
    assert len(stored) == 16
    for sid, s in stored.items():
        # The snapshot belongs to a prefix of what is stored (the AOF keeps them together).
        assert snapshots[sid]["at_length"] <= s.response_length and snapshots[sid]["turns"] >= 1
    steps_before = len(metrics.read_text().splitlines())

    resumed = run_job("steps=2", "resume=auto", stdout=subprocess.PIPE)
    said, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err.decode()[-3000:]
    assert "resume=auto: resuming from" in said.decode()

    with LocalRedisServer(out / "redis", password="inspect") as server:
        buffer = TrajectoryStore.open(server.url, "swe-kill", password="inspect")
        for sid, before in stored.items():
            after = buffer.get_sample(sid)
            assert after.status == Status.COMPLETED and after.reward == 1.0, (sid, after.status, after.metadata)
            # Continued from its stored tokens: the turns before the kill are still its first turns.
            assert np.array_equal(after.response_ids[: before.response_length], before.response_ids), sid
            assert _model_turns(after.loss_mask) == KILL_TURNS
        stats = buffer.stats()
        # Every episode came back from its snapshot; no env replayed its tool calls.
        assert stats.get("env_snapshot_restores", 0) >= 16 and not stats.get("env_replays"), stats
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= steps_before
        c = buffer.counts()
        assert c["groups_trained"] == sum(r["groups"] for r in rows) == 4 * len(rows)
        assert c["groups_claimed"] == 0
