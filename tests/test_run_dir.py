"""One output_dir across runs: a fresh run over an earlier run's checkpoints, and resume=auto,
`slime export` after it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slime import cli
from slime.export import ExportError, find_checkpoint, latest_checkpoint, set_earlier_run_aside
from slime.run_lock import check_run_dir, lock_run_dir
from slime.security import write_private
from tests.helpers import TINY_JOB


def _train(run, tiny_model_dir, *extra) -> int:
    args = [f"output_dir={run}", f"model.path={tiny_model_dir}", "cluster.launcher=local", *TINY_JOB]
    return cli.main(["train", *args, "checkpoint.every_steps=2", *extra])


def _steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(run, step: int, with_state: bool = True) -> None:
    path = run / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    if with_state:
        (path / "driver_state.json").write_text(json.dumps({"next_step": step}))


def test_latest_follows_the_last_run_not_the_highest_step_dir(tmp_path):
    for step in (2, 4, 6, 8):  # an earlier run's
        _checkpoint(tmp_path, step)
    assert latest_checkpoint(tmp_path).name == "step_000008"  # no `latest` file: the newest, as before
    assert find_checkpoint(tmp_path, 6).name == "step_000006"
    (tmp_path / "checkpoints" / "latest").write_text("step_000004")  # a later run's second checkpoint
    assert latest_checkpoint(tmp_path).name == "step_000004"
    (tmp_path / "checkpoints" / "latest").write_text("step_000005")  # named, then removed: the one before
    assert latest_checkpoint(tmp_path).name == "step_000004"


def test_a_fresh_run_sets_the_earlier_runs_files_aside_and_keeps_them(tmp_path):
    """A fresh run overwrote metrics.jsonl, training.png and config.yaml, mixed its TensorBoard
    events into the earlier run's, and left that run's checkpoints beside its own."""
    assert set_earlier_run_aside(tmp_path) is None  # nothing trained here yet
    (tmp_path / "config.yaml").write_text("a run that stopped before training\n")
    assert set_earlier_run_aside(tmp_path) is None
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out").write_text("events")
    (tmp_path / "repeat_task.jsonl").write_text("the generated dataset\n")
    (tmp_path / "wandb" / "offline-run-1").mkdir(parents=True)  # W&B's own folder (logging.wandb.dir unset)
    first = set_earlier_run_aside(tmp_path)
    assert (first / "wandb" / "offline-run-1").is_dir() and not (tmp_path / "wandb").exists()
    assert first == tmp_path / "earlier_runs" / "1"
    assert (first / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert (first / "config.yaml").read_text() == "a run that stopped before training\n"
    assert (first / "tensorboard" / "events.out").read_text() == "events"
    assert [p.name for p in sorted((first / "checkpoints").iterdir())] == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path) is None  # the new run has none yet: resume=auto starts at 0
    with pytest.raises(ExportError):
        find_checkpoint(tmp_path)
    assert (tmp_path / "repeat_task.jsonl").exists()  # the dataset stays
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert set_earlier_run_aside(tmp_path) == tmp_path / "earlier_runs" / "2"  # never over an earlier one


def test_a_run_refused_for_its_dataset_or_model_leaves_the_earlier_run_in_place(tiny_model_dir, tmp_path, capsys):
    """It set the earlier run aside first, then failed on the dataset: the output_dir held a
    config.yaml of a run that never started, and the earlier run's files under earlier_runs/1."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "config.yaml").write_text("the earlier run's\n")
    assert _train(run, tiny_model_dir, "steps=1", f"data.path={tmp_path / 'nope.jsonl'}") == 2
    assert _train(run, tmp_path / "no-model", "steps=1") == 2
    assert "dataset not found" in capsys.readouterr().err
    assert not (run / "earlier_runs").exists()
    assert (run / "config.yaml").read_text() == "the earlier run's\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.slow
def test_resume_after_a_fresh_run_over_an_earlier_one_continues_the_fresh_run(tiny_model_dir, tmp_path, capsys):
    """resume=auto took the highest step_* of the directory: an earlier run's step_000004 after a
    fresh 2-step run, 'resuming at step 4 of 3', nothing trained; `slime export` exported it too."""
    run = tmp_path / "run"
    assert _train(run, tiny_model_dir, "steps=4") == 0  # checkpoints 2 and 4
    assert _train(run, tiny_model_dir, "steps=2", "seed=1") == 0  # fresh: its own step_000002
    assert f"the earlier run's files moved to {run / 'earlier_runs' / '1'}" in (capsys.readouterr().out)
    assert _steps(run / "earlier_runs" / "1") == [0, 1, 2, 3]  # the earlier run's, kept whole
    assert (run / "earlier_runs" / "1" / "checkpoints" / "step_000004" / "driver_state.json").is_file()
    assert find_checkpoint(run).name == "step_000002"
    assert _train(run, tiny_model_dir, "steps=3", "seed=1", "resume=auto") == 0
    assert f"resuming from {run / 'checkpoints' / 'step_000002'} at step 2 of 3" in capsys.readouterr().out
    assert _steps(run) == [0, 1, 2]


def test_a_second_job_in_a_running_jobs_output_dir_stops_before_touching_it(tiny_model_dir, tmp_path, capsys):
    """Both ran to exit 0: the second stopped the first's redis-server as a leftover, the first's
    keep-alive restarted it (two servers appending to one AOF), checkpoints interleaved, and the
    first's metrics went to a metrics.jsonl the second had replaced."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("the running job's\n")
    held = lock_run_dir(run)  # the running job
    try:
        assert _train(run, tiny_model_dir, "steps=1") == 2
        assert f"output_dir {run} is in use by another job (pid {os.getpid()})" in capsys.readouterr().err
        assert (run / "config.yaml").read_text() == "the running job's\n"
        assert not (run / "redis").exists() and not (run / "job.secret").exists()
    finally:
        os.close(held)
    fd = lock_run_dir(run)  # released with its holder (the kernel drops it on SIGKILL too)
    os.close(fd)


def test_a_planted_job_lock_symlink_is_never_followed_and_a_shared_output_dir_is_warned_about(
    tiny_model_dir, tmp_path, capsys, caplog
):
    """An output_dir another user made first (mkdir -m 777 /tmp/run, job.lock a symlink to a file
    of the job's user): the job ftruncate'd that file through the symlink. Now it refuses to start
    there (exit 2) and the file is untouched. A directory every user may write is only warned
    about (a Kubernetes emptyDir is 0777)."""
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    run = tmp_path / "shared"
    run.mkdir()
    os.chmod(run, 0o777)
    (run / "job.lock").symlink_to(victim)
    assert _train(run, tiny_model_dir, "steps=1") == 2
    assert "job.lock is a symlink" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run.iterdir()) == ["job.lock"]
    (run / "job.lock").unlink()
    with caplog.at_level("WARNING"):
        os.close(lock_run_dir(run))
    assert f"{run} is writable by every user (mode 777)" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_an_output_dir_of_another_user_is_warned_about(tmp_path, caplog):
    """Another user's directory or symlink is allowed (a bind mount owned by the host's user, a
    root job in a user's home), with a warning naming the owner."""
    run = tmp_path / "theirs"
    run.mkdir()
    os.chown(run, 65534, 65534)
    with caplog.at_level("WARNING"):
        os.close(lock_run_dir(run))
    assert "belongs to uid 65534" in caplog.text
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)  # its owner could point it at a directory of theirs at any time
    assert any("is a symlink of uid 65534" in w for w in check_run_dir(link))


def test_write_private_never_writes_through_a_planted_temporary_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (tmp_path / f".job.secret.{os.getpid()}.tmp").symlink_to(target)
    write_private(tmp_path / "job.secret", "s3cret\n")
    assert target.read_text() == "keep\n" and (tmp_path / "job.secret").read_text() == "s3cret\n"


def test_a_failing_plot_at_the_end_does_not_skip_stopping_the_jobs_parts(tmp_path, capsys):
    """On a full disk the plot raised in __exit__: the redis-server, the workers, the learner and
    Ray were not stopped, and that OSError hid the job's own error."""
    from slime.config import load_config
    from slime.job import RunningJob

    class Full:
        def close(self):
            raise OSError(28, "No space left on device")

    class Server:
        stopped = False

        def stop(self):
            self.stopped = True

    job = RunningJob(load_config(None, [f"output_dir={tmp_path}"]))
    job.logger, job.redis_server = Full(), Server()
    job.__exit__(None, None, None)
    assert job.redis_server.stopped
    assert "closing Full failed: OSError(28, 'No space left on device')" in capsys.readouterr().err


def test_diverged_weights_fail_the_probe_check_naming_it(tmp_path, tiny_model_dir):
    """A NaN difference compared as 'not above the tolerance': a job whose weights had diverged
    (learner.lr=1e30) passed every probe check and finished with exit 0 and NaN losses."""
    from slime.job import WeightSyncError

    with pytest.raises(WeightSyncError, match="not finite: the weights diverged"):
        _train(tmp_path / "run", tiny_model_dir, "learner.lr=1e30", "weights.check_every=1", "steps=3")


def test_a_signal_during_the_jobs_stop_still_stops_its_redis_server(tiny_model_dir, tmp_path, monkeypatch):
    """A second SIGTERM that landed while the job was stopping (closing its logger, say) cut
    __exit__ short: the job's redis-server outlived it, owned by init, until a later run there."""
    import signal

    from slime.config import load_config
    from slime.job import RunningJob
    from slime.signals import JobInterrupted

    args = [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "cluster.launcher=local", *TINY_JOB]
    job = RunningJob(load_config(None, args))
    job.__enter__()
    server = job.redis_server._process
    assert server.poll() is None

    def interrupted() -> None:
        job.stop(signal.SIGTERM, None)  # the first signal: noted
        job.stop(signal.SIGTERM, None)  # the second: raises here, in the middle of the stop

    monkeypatch.setattr(job.logger, "close", interrupted)
    with pytest.raises(JobInterrupted):
        job.__exit__(None, None, None)
    assert server.wait(timeout=15) is not None  # stopped, not left behind
    assert job.run_lock is None
    job.stop.cleaning_up = True  # and a signal while the processes stop is noted, not raised
    job.stop(signal.SIGTERM, None)


def test_a_plot_that_fails_midway_leaves_the_last_training_png_whole(tmp_path, monkeypatch):
    """On a full disk savefig wrote training.png in place and left it at 0 bytes; now the plot goes to
    a temporary file that replaces training.png only once it is whole."""
    from matplotlib.figure import Figure

    from slime.config import LoggingConfig
    from slime.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, progress=False), 3)
    logger.log(0, {"reward_mean": 0.1, "rollout_tokens_per_s": 10.0})
    first = logger.plot().read_bytes()
    assert first.startswith(b"\x89PNG")

    def full_disk(self, fname, **kwargs):
        Path(fname).write_bytes(b"")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    logger.log(1, {"reward_mean": 0.2, "rollout_tokens_per_s": 11.0})
    with pytest.raises(OSError, match="No space left"):
        logger.plot()
    assert (tmp_path / "training.png").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "training.png"]


def test_a_resume_from_an_older_checkpoint_rewrites_the_later_ones_whole(tiny_model_dir, tmp_path):
    """Resumed from step 2 of a 4-step run: step 4 is written again. The old step 4's files stayed
    beside the new ones (export read the abandoned branch's weights; a resume failed on a layout
    mismatch), and `latest` named the abandoned step 4 until the new one was written."""
    run = tmp_path / "run"
    assert _train(run, tiny_model_dir, "steps=4") == 0
    old_step_4 = run / "checkpoints" / "step_000004"
    (old_step_4 / "hf").mkdir()  # a file of the abandoned branch only (its checkpoint.export_hf, say)
    resume_from = run / "checkpoints" / "step_000002"
    assert _train(run, tiny_model_dir, "steps=4", f"resume={resume_from}", "checkpoint.every_steps=100") == 0
    assert not (old_step_4 / "hf").exists() and (old_step_4 / "driver_state.json").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000004"
