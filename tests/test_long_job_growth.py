"""What must not grow with the number of steps in a long job (found by measuring long runs,
repro/monitor.py): checkpoints on disk, what a pruned group keeps in Redis, the driver's memory per step."""

from __future__ import annotations

import json
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from slime.buffer import TrajectoryStore
from slime.config import LoggingConfig, load_config
from slime.export import checkpoints_of, prune_checkpoints
from slime.metrics import HISTORY_ROWS, MetricsLogger
from slime.sample import Status
from slime.train import train
from tests.helpers import TINY_JOB


def _fake_checkpoint(run_dir: Path, step: int, complete: bool = True, lineage: str | None = None) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    (path / "policy").mkdir(parents=True, exist_ok=True)
    (path / "learner_state.pt").write_bytes(b"x" * 100)
    if complete:
        (path / "driver_state.json").write_text(json.dumps({"next_step": step, "lineage": lineage}))
    return path


def test_prune_checkpoints_keeps_the_newest_and_never_a_later_timeline(tmp_path):
    for step in (10, 20, 30):
        _fake_checkpoint(tmp_path, step)
    current = _fake_checkpoint(tmp_path, 40)
    assert prune_checkpoints(current, None) == []
    assert [p.name for p in prune_checkpoints(current, 2)] == ["step_000010", "step_000020"]
    assert [p.name for p in checkpoints_of(tmp_path)] == ["step_000030", "step_000040"]
    assert not (tmp_path / "checkpoints" / "step_000010").exists()
    # A run resumed from step 30 writes step 35: the checkpoint of step 40 (a later step of the
    # abandoned run) is not the pruner's to judge, and the one just written is never deleted.
    resumed = _fake_checkpoint(tmp_path, 35)
    assert prune_checkpoints(resumed, 1) == [tmp_path / "checkpoints" / "step_000030"]
    assert [p.name for p in checkpoints_of(tmp_path)] == ["step_000035", "step_000040"]


def test_prune_checkpoints_leaves_an_earlier_runs_checkpoints_alone(tmp_path):
    """A fresh run in an output_dir holding an earlier run's step_1..5 (found by review): with
    keep_last=2 its step 6 pruned its own step 4 and kept the earlier run's step 5."""
    for step in range(1, 6):
        _fake_checkpoint(tmp_path, step, lineage="earlier")
    _fake_checkpoint(tmp_path, 2, lineage="this")  # written over the earlier run's
    _fake_checkpoint(tmp_path, 4, lineage="this")
    current = _fake_checkpoint(tmp_path, 6, lineage="this")
    assert [p.name for p in prune_checkpoints(current, 2)] == ["step_000002"]
    assert [p.name for p in checkpoints_of(tmp_path)] == [f"step_00000{i}" for i in (1, 3, 4, 5, 6)]


@pytest.mark.slow
def test_a_long_job_keeps_only_its_last_checkpoints_and_group_records(tiny_model_dir, redis_url, tmp_path):
    """Measured before the fix: 3000 steps with a checkpoint every 50 left 60 checkpoints (1.3 GB for
    the 2M-parameter model); nothing ever deleted one. checkpoint.keep_last bounds them. The same
    for the group records a pruned group left in Redis (~0.5 KB each): buffer.keep_group_records_steps
    bounds them, here under async claims in start order (a cursor into the groups) and a resume."""
    common = [
        "job_name=keep-last",
        "mode=async",
        "buffer.keep_trained_steps=0",
        "buffer.keep_group_records_steps=1",
        "cluster.launcher=local",
        f"output_dir={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        *TINY_JOB,
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=2",
    ]
    train(load_config(None, [*common, "steps=4"]))
    assert [p.name for p in checkpoints_of(tmp_path)] == ["step_000003", "step_000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000003", "step_000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004"
    history = train(load_config(None, [*common, "steps=6", "resume=auto"]))
    assert [h["step"] for h in history] == list(range(6))
    assert [p.name for p in checkpoints_of(tmp_path)] == ["step_000005", "step_000006"]
    store = TrajectoryStore.open(redis_url, "keep-last")
    counts, stats = store.counts(), store.stats()
    assert counts["groups_trained"] == 6 * 2 and counts["groups_claimed"] == 0
    # The last checkpoint (after step 5) forgot the groups trained at steps 0..4: only step 5's remain.
    assert stats["forgotten_groups_trained"] == 5 * 2
    assert store.redis.zcard(store.connection.key("trained")) == 2
    store.connection.close()


def test_a_pruned_group_keeps_no_metadata(buffer: TrajectoryStore):
    """A group's hash outlives its pruned trajectories (the group counts go on counting it). It kept
    the row's metadata: with examples/data/swe_tasks.jsonl (a 7.7 KB repository as the label),
    repro/group_records.py measured 15.6 KB of Redis per trained group for good, 6 MB per 100 steps of
    4 groups; without the metadata, 0.7 KB."""
    label = "x" * 8000
    gids = []
    for step in range(3):
        gids.append(buffer.add_group(np.arange(1, 9), n=2, max_new_tokens=4, metadata={"label": label}))
        for sample in buffer.lease("w", 2):
            buffer.append_chunk(sample.id, "w", [1, 2], [-0.1, -0.2], version=step)
            buffer.finish(sample.id, "w", Status.COMPLETED, reward=1.0)
        buffer.claim_groups(1, step)
        buffer.commit_through(step, keep_trained_steps=1)
    raw = buffer.redis
    for gid in gids[:2]:  # trained at steps 0 and 1, pruned by the checkpoint of step 2
        fields = raw.hgetall(buffer._key("group", gid))
        assert fields[b"pruned"] == b"1" and fields[b"status"] == b"trained"
        assert b"metadata" not in fields
        assert raw.memory_usage(buffer._key("group", gid)) < 1000
    assert buffer.counts()["groups_trained"] == 3
    assert len(raw.hget(buffer._key("group", gids[2]), "metadata")) > 8000  # not pruned yet: kept whole


def test_the_metrics_history_stops_growing_and_the_plot_keeps_every_step(tmp_path):
    """The driver kept every step's metrics (MetricsLogger.history, what train() returns). Measured
    before the first fix: the driver's RSS grew 520 -> 546 MB over 2,570 steps of the local example
    job, 10 KB a step, most of it each step's own copy of ~85 metric names; after it, a trial's
    20,000 steps still held 2.4-5 KB a step. Now the last HISTORY_ROWS rows are kept and the plot's
    three series (24 bytes a step); metrics.jsonl has every row."""
    logger = MetricsLogger(tmp_path, LoggingConfig(jsonl=False, tensorboard=False, plot=False, progress=False), 10**6)
    names = [f"metric_name_number_{i}" for i in range(60)]
    metrics = {"reward_stats": {"repeat": {n: 0.5 for n in names[:20]}}, **{n: 1.0 for n in names[20:]}}
    for step in range(HISTORY_ROWS + 50):  # the kept rows full; the sinks' and dict's first allocations
        logger.log(step, pickle.loads(pickle.dumps(metrics)))  # fresh name strings, as from a Ray actor
    tracemalloc.start()
    for step in range(HISTORY_ROWS + 50, 2 * HISTORY_ROWS + 50):  # every kept row now allocated while traced
        logger.log(step, pickle.loads(pickle.dumps(metrics)))
    before = tracemalloc.get_traced_memory()[0]
    for step in range(2 * HISTORY_ROWS + 50, 2 * HISTORY_ROWS + 3050):
        logger.log(step, pickle.loads(pickle.dumps(metrics)))
    per_step = (tracemalloc.get_traced_memory()[0] - before) / 3000
    tracemalloc.stop()
    logger.close()
    assert len(logger.history) == HISTORY_ROWS and logger.history[-1]["step"] == 2 * HISTORY_ROWS + 3049
    assert [len(series) for series in logger.curve] == [2 * HISTORY_ROWS + 3050] * 3
    assert per_step < 200, per_step  # the plot's 3 floats (array growth); before: 2.4-4.5 KB


def test_a_resume_keeps_the_earlier_rows_in_the_file_and_the_plot(tmp_path):
    cfg = LoggingConfig(tensorboard=False, plot=False, progress=False)
    first = MetricsLogger(tmp_path, cfg, 10**6)
    for step in range(HISTORY_ROWS + 200):
        first.log(step, {"reward_mean": step / 1e4})
    first.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 99999, "rew')  # a torn last line
    resumed = MetricsLogger(tmp_path, cfg, 10**6, start_step=HISTORY_ROWS + 100)  # steps from there redone
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(HISTORY_ROWS + 100))
    assert list(resumed.curve[1]) == [r["reward_mean"] for r in rows]
    assert [r["step"] for r in resumed.history] == list(range(100, HISTORY_ROWS + 100))
    resumed.log(HISTORY_ROWS + 100, {"reward_mean": 1.0})
    resumed.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == HISTORY_ROWS + 100
