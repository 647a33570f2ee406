"""`slime replay RUN_DIR`: a fresh learner trained on the batches a finished run trained, from its
buffer, with no engine: under the run's own config it gives the run's own numbers; with an
override, the same data under another loss."""

from __future__ import annotations

import json

import pytest

from slime import cli
from slime.tools.replay import ReplayError, replay
from tests.helpers import TINY_JOB


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["sync", "april"])
def test_a_replay_under_the_runs_config_gives_the_runs_losses(tiny_model_dir, tmp_path, capsys, loop):
    run = tmp_path / "run"
    extra = ["april.enabled=true", "april.oversample=2.0"] if loop == "april" else []
    trained = [f"output_dir={run}", f"job_name=replay-{loop}", f"model.path={tiny_model_dir}", "steps=3"]
    assert cli.main(["train", *trained, "cluster.launcher=local", *TINY_JOB, *extra]) == 0
    ran = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    history = replay(run, [], out=tmp_path / "replay.jsonl")
    assert [h["step"] for h in history] == [0, 1, 2]
    for mine, theirs in zip(history, ran):
        assert mine["samples"] == theirs["samples"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert len((tmp_path / "replay.jsonl").read_text().splitlines()) == 3
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps_replayed"] == 3 and summary["max_loss_abs_diff_vs_run"] < 1e-6

    other = replay(run, ["algorithm.clip_high=0.05", "learner.lr=1e-2"], steps=2)
    assert len(other) == 2 and other[1]["loss"] != pytest.approx(ran[1]["loss"], abs=1e-6)
    assert not (run / "replay.jsonl").exists()  # nothing written into the run directory


def test_a_directory_with_no_trained_step_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("job_name: x\n")
    with pytest.raises(ReplayError, match="has no metrics.jsonl"):
        replay(tmp_path, [])


def test_a_replay_stops_at_a_step_whose_group_records_are_forgotten(buffer) -> None:
    """slime replay trains a fresh learner on the run's steps in order and stops, naming the step,
    at one whose trajectories are pruned. A step whose records are forgotten has no groups left at
    all: it was skipped as 'a step the run did not train', and the later steps replayed on weights
    that never learned from it. Now it stops there too."""
    from slime.tools.replay import _replay_steps
    from tests.test_buffer import complete_group

    for step in range(4):
        complete_group(buffer, n=1)
        assert len(buffer.claim_groups(1, step)) == 1
        buffer.commit_through(step, keep_trained_steps=1, keep_group_records_steps=0)  # records: max -> 1

    class Learner:
        version = 0

        def update(self, samples, group_index, step):
            return {"loss": 0.0, "grad_norm": 0.0}

    with pytest.raises(ReplayError, match="step 0"):
        _replay_steps(buffer, Learner(), {s: {"loss": 0.0, "grad_norm": 0.0} for s in range(4)}, None, None)
