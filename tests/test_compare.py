"""`slime compare`: run directories with real config.yaml files (a JobConfig dumped as a job does)
and synthetic metrics; the grouping of seeds, the table's mean ± std against numbers computed by
hand, the PNG, and the one-line errors. No Ray, no Redis."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from slime.cli import main
from slime.config.job import JobConfig, dump_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8  # the last 5 are steps 3..7, whose mean step is 5


def make_run(
    root: Path,
    name: str,
    seed: int,
    *,
    april: bool = False,
    offset: float = 0.0,
    slope: float = 0.1,
    wall: float = 1.0,
    **settings: Any,
) -> Path:
    """A run directory: reward_mean = slope * step + offset, wall_seconds = wall * (step + 1), and a torn last line."""
    run = root / name
    run.mkdir(parents=True)
    cfg = JobConfig(job_name=name, output_dir=str(run), seed=seed, april={"enabled": april}, **settings)
    dump_config(cfg, run / "config.yaml")
    rows = [
        {"step": t, "reward_mean": slope * t + offset, "loss": 1.0 / (t + 1), "wall_seconds": wall * (t + 1)}
        for t in range(STEPS)
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "reward_me'  # killed mid-write
    (run / "metrics.jsonl").write_text(text)
    return run


@pytest.fixture
def four_runs(tmp_path: Path) -> list[Path]:
    """3 seeds of sync (finals 0.50, 0.52, 0.56; wall 8, 12, 16 s) and 1 run with APRIL (final 1.0, wall 4 s)."""
    runs = [
        make_run(tmp_path, f"sync-s{seed}", seed, offset=offset, wall=wall)
        for seed, offset, wall in ((0, 0.0, 1.0), (1, 0.02, 1.5), (2, 0.06, 2.0))
    ]
    return [*runs, make_run(tmp_path, "april-s0", 0, april=True, slope=0.2, wall=0.5)]


def json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_seeds_group_and_the_table_gives_mean_and_std(four_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "plots" / "cmp.png"
    done = subprocess.run(
        [sys.executable, "-m", "slime.cli", "compare", *map(str, four_runs), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json_line(done.stdout)
    assert figures["final_window_steps"] == 5
    sync, april = figures["groups"]
    assert sync["label"] == "april.enabled=false" and april["label"] == "april.enabled=true"
    assert sync["runs"] == ["sync-s0", "sync-s1", "sync-s2"] and sync["n"] == 3
    assert april["runs"] == ["april-s0"] and april["n"] == 1 and "final_reward_mean_std" not in april
    # by hand: finals 0.50, 0.52, 0.56 -> mean 1.58 / 3, sample std sqrt((0.02667^2 + 0.00667^2 + 0.03333^2) / 2)
    assert sync["final_reward_mean"] == pytest.approx(1.58 / 3)
    assert sync["final_reward_mean_std"] == pytest.approx(math.sqrt(0.0018666667 / 2))
    assert sync["wall_seconds"] == pytest.approx(12.0) and sync["wall_seconds_std"] == pytest.approx(4.0)
    assert sync["steps"] == STEPS and sync["steps_std"] == 0  # the torn line is no step
    assert april["final_reward_mean"] == pytest.approx(1.0) and april["wall_seconds"] == pytest.approx(4.0)
    lines = done.stdout.splitlines()
    assert "last 5 steps" in lines[0]
    cells = [re.split(r"\s{2,}", line) for line in lines[1:4]]
    assert cells[0] == ["group", "n", "steps", "wall_seconds", "final reward_mean"]
    assert cells[1] == ["april.enabled=false", "3", "8 ± 0", "12 ± 4", "0.5267 ± 0.031"]
    assert cells[2] == ["april.enabled=true", "1", "8", "4", "1"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_png_has_two_panels_per_metric(four_runs: list[Path], tmp_path: Path, capsys) -> None:
    import matplotlib.image

    one, two = tmp_path / "one.png", tmp_path / "two.png"
    assert main(["compare", *map(str, four_runs), "--out", str(one)]) == 0
    assert (
        main(["compare", *map(str, four_runs), "--metric", "reward_mean", "--metric", "loss", "--out", str(two)]) == 0
    )
    height_one, width_one = matplotlib.image.imread(one).shape[:2]
    height_two, width_two = matplotlib.image.imread(two).shape[:2]
    assert width_one == width_two == 1200  # two panels side by side
    assert height_two - height_one == 360  # a row of panels per metric
    assert set(json_line(capsys.readouterr().out)["groups"][0]) >= {"final_reward_mean", "final_loss"}


def test_seeds_alone_are_one_group_named_by_the_first_run(tmp_path: Path, capsys) -> None:
    """Also one group: another dashboard port and W&B run name, and a run whose config.yaml has the
    checkpoint keys under their names before they moved."""
    runs = [
        make_run(tmp_path / "a", "run0", 0),
        make_run(tmp_path / "b", "run0", 1, dashboard={"port": 9000}),
        make_run(tmp_path / "c", "run0", 2, logging={"wandb": {"project": "p", "name": "seed2"}}),
        make_run(tmp_path / "old", "run", 3),
    ]
    old = yaml.safe_load((runs[3] / "config.yaml").read_text())
    old["checkpoint_every"] = old["checkpoint"].pop("every_steps")
    old["checkpoint_every_seconds"] = old["checkpoint"].pop("every_seconds")
    (runs[3] / "config.yaml").write_text(yaml.safe_dump(old))
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "c.png")]) == 0
    (group,) = json_line(capsys.readouterr().out)["groups"]
    assert group["label"] == "a/run0" and group["runs"] == ["a/run0", "b/run0", "c/run0", "run"]


def one_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("slime: ")
    return err.splitlines()[0]


def test_errors_are_one_line(four_runs: list[Path], tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path / "x.png")]
    assert "is not a run directory: it has no metrics.jsonl" in one_error(capsys, ["compare", str(tmp_path), *out])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 0, "rew\n')
    assert "holds no complete step" in one_error(capsys, ["compare", str(empty), *out])
    line = one_error(capsys, ["compare", str(four_runs[0]), "--metric", "reward_men", *out])
    assert "no run has the metric 'reward_men'" in line and "reward_mean" in line
    assert "needs at least one run directory" in one_error(capsys, ["compare", *out])
    run = str(four_runs[0])
    assert "is named twice" in one_error(capsys, ["compare", run, run + "/", *out])  # one run, not two seeds
    txt = ["--out", str(tmp_path / "x.txt")]
    assert "the plot is an image; name a file ending in .png" in one_error(capsys, ["compare", run, *txt])
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.txt").exists()


def test_labels_tell_the_groups_apart_when_more_keys_differ_than_a_label_shows(tmp_path: Path, capsys) -> None:
    """Three settings, seven differing keys: the labels showed the first five in config order, and two
    groups that differed only in the last (learner.lora, late in config.yaml) had one label."""
    base = {"rollout": {"batch_size": 4, "n_samples_per_prompt": 4, "max_new_tokens": 32, "top_p": 0.9}}
    ppo = {"algorithm": {"name": "ppo"}, "steps": 3, "max_staleness": 2, **base}
    runs = [
        make_run(tmp_path, "grpo", 0),
        make_run(tmp_path, "ppo", 0, **ppo),
        make_run(tmp_path, "ppo_lora", 0, **ppo, learner={"lora": {"rank": 4}}),
    ]
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "c.png")]) == 0
    labels = [g["label"] for g in json_line(capsys.readouterr().out)["groups"]]
    assert len(set(labels)) == 3, labels
    assert "learner.lora" in labels[2] and all(label.endswith("more") for label in labels), labels
