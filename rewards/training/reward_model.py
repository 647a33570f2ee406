"""Training a Bradley-Terry reward model (`slime train-rm`): JSONL lines {"prompt", "chosen",
"rejected"}, loss -log sigmoid(r_chosen - r_rejected), pairwise accuracy on a held-out share
(a tie counts as half). The model and its reward function: rewards/reward_model.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rewards.reward_model import CONFIG_NAME, RewardModel
from rewards.training.common import check_text, common_parser, fit, read_jsonl, run_cli, split_eval


def check_preference(obj: dict[str, Any]) -> str | None:
    for key in ("prompt", "chosen", "rejected"):
        why = check_text(obj, key)
        if why:
            return why
    if not obj["prompt"].strip():
        return "'prompt' is empty"
    if obj["chosen"] == obj["rejected"]:
        return "'chosen' and 'rejected' are identical"
    return None


def _pairwise_accuracy(model: RewardModel, rows: list[dict[str, Any]], batch_size: int) -> float | None:
    if not rows:
        return None
    rc = model.score([r["prompt"] for r in rows], [r["chosen"] for r in rows], batch_size)
    rr = model.score([r["prompt"] for r in rows], [r["rejected"] for r in rows], batch_size)
    return sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(rc, rr)) / len(rows)


def train_reward_model(
    model_dir: str | Path,
    data_path: str | Path,
    out_dir: str | Path,
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 16,
    eval_fraction: float = 0.1,
    seed: int = 0,
    device: str = "cpu",
    warmup_steps: int = 10,
    log_every: int = 0,
) -> dict[str, Any]:
    """Train a Bradley-Terry RM on `data_path` from the HF model (or saved RM) in `model_dir`; save to `out_dir`."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError("steps and batch_size must be >= 1 and lr > 0")
    rows = read_jsonl(data_path, check_preference)
    train, held = split_eval(rows, eval_fraction, seed)
    if (Path(model_dir).expanduser() / CONFIG_NAME).is_file():
        model = RewardModel.load(model_dir, device=device)
    else:
        model = RewardModel.from_backbone(model_dir, seed=seed, device=device)
    started = time.time()
    acc_before = _pairwise_accuracy(model, held, batch_size)
    encoded = [(model.encode(r["prompt"], r["chosen"]), model.encode(r["prompt"], r["rejected"])) for r in train]

    def pair_loss(batch: list) -> tuple[torch.Tensor, float]:
        scores = model.forward_scores([c for c, _ in batch] + [r for _, r in batch])
        margin = scores[: len(batch)] - scores[len(batch) :]
        return -torch.nn.functional.logsigmoid(margin).mean(), (margin > 0).float().mean().item()

    losses, accs = fit(model, encoded, pair_loss, steps, lr, batch_size, seed, warmup_steps, log_every, "rm")
    model.eval()
    acc_after = _pairwise_accuracy(model, held, batch_size)
    model.meta["trained"] = {"data": str(data_path), "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed}
    model.save(out_dir)
    tail = max(1, min(10, len(losses)))
    return {
        "out_dir": str(out_dir),
        "train_pairs": len(train),
        "eval_pairs": len(held),
        "steps": steps,
        "first_loss": losses[0],
        "final_loss": sum(losses[-tail:]) / tail,
        "final_train_accuracy": sum(accs[-tail:]) / tail,
        "eval_accuracy_before": acc_before,
        "eval_accuracy": acc_after,
        "seconds": round(time.time() - started, 2),
    }


def main_train_rm(args: list[str]) -> int:
    """`slime train-rm --data pairs.jsonl --out DIR [--model-dir HF_DIR] [--steps N] [--lr LR] ...`"""
    parser = common_parser("slime train-rm", "Train a Bradley-Terry reward model on prompt/chosen/rejected JSONL.")
    return run_cli(train_reward_model, parser, args)
