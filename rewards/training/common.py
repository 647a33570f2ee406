"""What the reward-model and PRM trainers share: JSONL reading with line-numbered errors, the
held-out split, the training loop (AdamW, warm-up then linear decay, clipped gradients) and the
command line (`slime train-rm`, `slime train-prm`)."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rewards.reward_model import resolve_model_dir


class DataError(ValueError):
    """A malformed training-data line; the message starts with `file:line:`."""


def read_jsonl(path: str | Path, check: Callable[[dict[str, Any]], str | None]) -> list[dict[str, Any]]:
    """Objects of a JSONL file; blank lines are skipped. `check(obj)` returns why a line is bad, or None."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            why = check(obj)
            if why:
                raise DataError(f"{path}:{lineno}: {why}")
            rows.append(obj)
    if not rows:
        raise DataError(f"{path}: no examples")
    return rows


def check_text(obj: dict[str, Any], key: str) -> str | None:
    if key not in obj:
        return f"missing key {key!r} (have {sorted(obj)})"
    if not isinstance(obj[key], str):
        return f"{key!r} must be a string, got {type(obj[key]).__name__}"
    if key != "prompt" and not obj[key].strip():
        return f"{key!r} is empty"
    return None


def split_eval(rows: list[Any], eval_fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Shuffled (train, eval); eval has round(n*fraction) rows, at least 1 when fraction > 0 and n > 1."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_eval = round(len(rows) * eval_fraction)
    if eval_fraction > 0 and len(rows) > 1:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, len(rows) - 1)
    return rows[n_eval:], rows[:n_eval]


def _set_lr(optim: torch.optim.Optimizer, lr: float, step: int, steps: int, warmup: int) -> None:
    scale = min(1.0, (step + 1) / max(1, warmup)) * (1.0 - step / max(1, steps))
    for g in optim.param_groups:
        g["lr"] = lr * scale


def fit(
    model: torch.nn.Module,
    encoded: list,
    batch_loss,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    warmup: int,
    log_every: int,
    tag: str,
) -> tuple[list[float], list[float]]:
    """The RM/PRM training loop: random batches of `encoded`, `batch_loss(batch) -> (loss, accuracy)`,
    AdamW with warm-up and linear decay. Returns the per-step losses and accuracies."""
    rng = random.Random(seed + 1)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, accs = [], []
    for step in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        loss, acc = batch_loss(batch)
        _optimizer_step(model, optim, loss, lr, step, steps, warmup)
        losses.append(loss.item())
        accs.append(acc)
        if log_every and (step + 1) % log_every == 0:
            print(f"{tag} step {step + 1}/{steps} loss {loss.item():.4f} acc {acc:.3f}", flush=True)
    model.eval()
    return losses, accs


def _optimizer_step(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    loss: torch.Tensor,
    lr: float,
    step: int,
    steps: int,
    warmup: int,
) -> None:
    """Warm-up + linear-decay lr, backward, clip to 1.0, step: one update of the RM/PRM trainers."""
    _set_lr(optim, lr, step, steps, warmup)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)


def common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model-dir", default=None, help="local HF causal LM dir (default: the built-in tiny MoE)")
    p.add_argument("--data", required=True, help="training JSONL")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-every", type=int, default=20)
    return p


def run_cli(
    train_fn: Callable[..., dict[str, Any]], parser: argparse.ArgumentParser, args: list[str], extra: Sequence[str] = ()
) -> int:
    ns = parser.parse_args(args)
    try:
        model_dir = resolve_model_dir(ns.model_dir)
        kwargs = {k: getattr(ns, k) for k in extra}
        result = train_fn(
            model_dir,
            ns.data,
            ns.out,
            steps=ns.steps,
            lr=ns.lr,
            batch_size=ns.batch_size,
            eval_fraction=ns.eval_fraction,
            seed=ns.seed,
            device=ns.device,
            log_every=ns.log_every,
            **kwargs,
        )
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", flush=True)
        return 2
    print(json.dumps(result, indent=2), flush=True)
    return 0
