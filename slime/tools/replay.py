"""`slime replay RUN_DIR [--steps N] [--out FILE] [key=value ...]`: train a fresh learner on the very
batches a run trained, step by step, with no engine, worker or reward call (slime's
`--debug-train-only` with its saved rollouts; here the run's buffer is the saved data).

The run's buffer is opened as `slime dashboard RUN_DIR` opens it (a finished run: a read-only copy
of its AOF). The learner starts from the run's starting weights, under the run's config.yaml with
the given overrides (change the loss, the clip, the learning rate, the micro-batching and see what
the same data does), and at each step takes the groups the run's step took, in the order it
claimed them, with their stored tokens, behaviour logprobs, versions and rewards. It prints each
step's loss and gradient norm beside the run's own, then one JSON line; `--out` writes every
step's metrics as JSONL. With the run's own config the numbers match the run's (up to float
rounding where the micro-batches differ).

What it cannot replay: streaming (segments, not groups, train each step), and the groups whose
trajectories `buffer.keep_trained_steps` deleted (it stops there, naming the step).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from slime.buffer.store import TrajectoryStore
from slime.config import load_config
from slime.dashboard.rundir import open_run_buffer
from slime.errors import UserError
from slime.learner import Learner
from slime.model import ensure_model_dir

SHOWN = ("loss", "grad_norm")  # printed beside the run's own value each step


class ReplayError(UserError, ValueError):
    """A run that `slime replay` cannot replay, or a step whose data is gone."""

    hint = "slime replay RUN_DIR [--steps N] [key=value ...]: RUN_DIR is a finished run's output_dir"


def run_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The run's own metrics per step (the last row of a step a resume redid)."""
    path = run_dir / "metrics.jsonl"
    rows: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return rows


def replay(run_dir: Path, overrides: list[str], steps: int | None = None, out: Path | None = None) -> list[dict]:
    run_dir = run_dir.expanduser().resolve()
    original = run_metrics(run_dir)
    if not original:
        raise ReplayError(f"{run_dir} has no metrics.jsonl: no step of it trained")
    run = open_run_buffer(run_dir)
    try:
        with tempfile.TemporaryDirectory(prefix="slime-replay-") as scratch:
            # The run's job name keys its buffer; nothing is written into the run directory.
            cfg = load_config(run_dir / "config.yaml", [*overrides, f"output_dir={scratch}", "resume=null"])
            if cfg.loop_mode == "streaming":
                raise ReplayError("streaming trains segments, not groups: slime replay covers the other loops")
            store = TrajectoryStore.open(run.url, run.job, password=run.redis_password)
            learner = Learner(cfg, str(ensure_model_dir(cfg.model)), run.url, run.credentials)
            try:
                return _replay_steps(store, learner, original, steps, out)
            finally:
                learner.close()
                store.close()
    finally:
        run.close()


def _replay_steps(
    store: TrajectoryStore, learner: Learner, original: dict[int, dict], steps: int | None, out: Path | None
) -> list[dict]:
    last = max(original) + 1 if steps is None else min(steps, max(original) + 1)
    history: list[dict] = []
    sink = out.open("w") if out is not None else None
    print(f"{'step':>5} {'samples':>8} " + " ".join(f"{k + ' replay':>16} {k + ' run':>14}" for k in SHOWN))
    stats = store.stats()
    # Groups trained through this step left no record (buffer.keep_group_records_steps).
    forgotten = int(stats.get("forgotten_through_step", -1)) if stats.get("forgotten_groups_trained") else -1
    try:
        for step in range(last):
            gids = store.groups_trained_at(step)
            if not gids and step <= forgotten:
                raise ReplayError(
                    f"step {step}: the records of the groups trained through step {forgotten} are deleted "
                    "(buffer.keep_group_records_steps)"
                )
            if not gids:
                continue  # a step the run did not train (every group filtered, or before a resume)
            try:
                groups = store.get_groups(gids)
            except KeyError as exc:
                raise ReplayError(f"step {step}: {exc.args[0]}") from None
            samples = [s for g in groups for s in g]
            # The learner's version at that step: what off-policy lags and corrections measure from.
            learner.version = int(original.get(step, {}).get("policy_version", step + 1)) - 1
            metrics = learner.update(samples, [gi for gi, g in enumerate(groups) for _ in g], step)
            metrics.update(step=step, samples=len(samples))
            for key in SHOWN:
                metrics[f"run_{key}"] = original.get(step, {}).get(key, math.nan)
            history.append(metrics)
            if sink is not None:
                sink.write(json.dumps(metrics, default=float) + "\n")
            shown = " ".join(f"{metrics.get(k, math.nan):>16.6g} {metrics[f'run_{k}']:>14.6g}" for k in SHOWN)
            print(f"{step:>5} {len(samples):>8} {shown}", flush=True)
    finally:
        if sink is not None:
            sink.close()
    if not history:
        raise ReplayError("no step of the run has trained groups in its buffer")
    gaps = [abs(h["loss"] - h["run_loss"]) for h in history if math.isfinite(h["run_loss"])]
    print(
        json.dumps(
            {
                "steps_replayed": len(history),
                "samples_replayed": sum(h["samples"] for h in history),
                "max_loss_abs_diff_vs_run": max(gaps) if gaps else None,
                "final_loss": history[-1]["loss"],
            }
        )
    )
    return history


def main_replay(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="slime replay",
        description="Train a fresh learner on the batches a run trained (no engines): the loss on the same data.",
    )
    parser.add_argument("run_dir", type=Path, help="a finished run's output_dir")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (the loss, the learner)")
    parser.add_argument("--steps", type=int, default=None, help="replay the first N steps (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write every step's metrics here (JSONL)")
    ns = parser.parse_args(argv)
    replay(ns.run_dir, ns.overrides, ns.steps, ns.out)
    return 0
