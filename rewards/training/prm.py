"""Training a process reward model (`slime train-prm`): JSONL lines {"prompt", "steps": [str],
"labels": [0|1]}, BCE on each step's logit at its end token, step accuracy on a held-out share.
The model and its reward function: rewards/prm.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rewards.prm import ProcessRewardModel
from rewards.reward_model import CONFIG_NAME
from rewards.training.common import common_parser, fit, read_jsonl, run_cli, split_eval


def make_check_steps(delimiter: str):
    def check(obj: dict[str, Any]) -> str | None:
        for key in ("prompt", "steps", "labels"):
            if key not in obj:
                return f"missing key {key!r} (have {sorted(obj)})"
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            return "'prompt' must be a non-empty string"
        steps, labels = obj["steps"], obj["labels"]
        if not isinstance(steps, list) or not steps:
            return "'steps' must be a non-empty list of strings"
        if not isinstance(labels, list) or len(labels) != len(steps):
            n = len(labels) if isinstance(labels, list) else type(labels).__name__
            return f"'labels' must be a list with one label per step ({len(steps)} steps, labels: {n})"
        for i, s in enumerate(steps):
            if not isinstance(s, str) or not s.strip():
                return f"steps[{i}] is empty or not a string"
            if delimiter in s:
                return f"steps[{i}] contains the step delimiter {delimiter!r}"
        for i, y in enumerate(labels):
            if isinstance(y, bool) or (isinstance(y, (int, float)) and y in (0, 1)):
                continue
            return f"labels[{i}] must be 0 or 1, got {y!r}"
        return None

    return check


def _step_accuracy(model: ProcessRewardModel, rows: list[dict[str, Any]], batch_size: int) -> float | None:
    if not rows:
        return None
    d = model.delimiter
    scores = model.step_scores([r["prompt"] for r in rows], [d.join(r["steps"]) for r in rows], batch_size)
    hits = total = 0
    for r, s in zip(rows, scores):
        for p, y in zip(s, r["labels"]):
            hits += int((p > 0.5) == bool(y))
            total += 1
    return hits / total


def train_prm(
    model_dir: str | Path,
    data_path: str | Path,
    out_dir: str | Path,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 16,
    eval_fraction: float = 0.1,
    seed: int = 0,
    device: str = "cpu",
    delimiter: str = "\n",
    warmup_steps: int = 10,
    log_every: int = 0,
) -> dict[str, Any]:
    """Train a PRM (BCE on step labels) from the HF model (or a saved PRM) in `model_dir`; save to `out_dir`.

    When continuing from a saved PRM, its delimiter is used."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError("steps and batch_size must be >= 1 and lr > 0")
    if (Path(model_dir).expanduser() / CONFIG_NAME).is_file():
        model = ProcessRewardModel.load(model_dir, device=device)
    else:
        model = ProcessRewardModel.from_backbone(model_dir, seed=seed, device=device, delimiter=delimiter)
    rows = read_jsonl(data_path, make_check_steps(model.delimiter))
    train, held = split_eval(rows, eval_fraction, seed)
    started = time.time()
    acc_before = _step_accuracy(model, held, batch_size)
    encoded = []
    for r in train:
        seq, pos, spans = model.encode(r["prompt"], model.delimiter.join(r["steps"]))
        assert len(spans) == len(r["steps"])
        encoded.append((seq, pos, [float(y) for y in r["labels"]]))

    def step_loss(batch: list) -> tuple[torch.Tensor, float]:
        logits = torch.cat(model.logits_at([b[0] for b in batch], [b[1] for b in batch]))
        target = torch.tensor([y for b in batch for y in b[2]], device=logits.device)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
        return loss, ((logits > 0).float() == target).float().mean().item()

    losses, accs = fit(model, encoded, step_loss, steps, lr, batch_size, seed, warmup_steps, log_every, "prm")
    acc_after = _step_accuracy(model, held, batch_size)
    model.meta["trained"] = {"data": str(data_path), "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed}
    model.save(out_dir)
    tail = max(1, min(10, len(losses)))
    return {
        "out_dir": str(out_dir),
        "train_examples": len(train),
        "eval_examples": len(held),
        "eval_steps": sum(len(r["steps"]) for r in held),
        "steps": steps,
        "first_loss": losses[0],
        "final_loss": sum(losses[-tail:]) / tail,
        "final_train_step_accuracy": sum(accs[-tail:]) / tail,
        "eval_step_accuracy_before": acc_before,
        "eval_step_accuracy": acc_after,
        "seconds": round(time.time() - started, 2),
    }


def _unescape(s: str) -> str:
    return s.encode("utf-8").decode("unicode_escape") if "\\" in s else s


def main_train_prm(args: list[str]) -> int:
    """`slime train-prm --data steps.jsonl --out DIR [--delimiter '|'] [--model-dir HF_DIR] [--steps N] ...`"""
    parser = common_parser("slime train-prm", "Train a process reward model on prompt/steps/labels JSONL.")
    parser.add_argument(
        "--delimiter", default="\n", type=_unescape, help="step delimiter; backslash escapes allowed (default: newline)"
    )
    return run_cli(train_prm, parser, args, extra=("delimiter",))
