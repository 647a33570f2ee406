"""Bradley-Terry reward model: a local HF causal-LM backbone plus a scalar head.

    rm = RewardModel.from_backbone("path/to/hf_dir")     # fresh head on any local HF causal LM
    train_reward_model(model_dir, "pairs.jsonl", "out/rm", steps=200)
    rm = RewardModel.load("out/rm")
    rm.score(["ab*3="], ["ababab"])                       # -> [float]; batched, no grad

Input: the prompt's tokens followed by the response's tokens (each tokenised on its own, without
special tokens, as the policy sees them) and, when the tokenizer has one, EOS. The score is the
head applied to the backbone's last hidden state at the last non-pad token. Sequences longer than
`max_length` keep their last `max_length` tokens.

Training data (JSONL, one object a line): {"prompt": str, "chosen": str, "rejected": str}; loss
−log σ(r_chosen − r_rejected); a held-out `eval_fraction` of the pairs gives pairwise accuracy
(a tie counts as half). A bad line raises `DataError("file:line: why")`.

Saved directory: the backbone (`save_pretrained`, loadable with `AutoModel`), the tokenizer,
`score_head.safetensors` and `reward_model.json`.

For the reward service: `rm_reward(dir)` returns a native-signature callable
`fn(prompt, response, label, metadata) -> float` that loads the model once (cached per
directory and device) and serialises forward passes with a lock; its `score_batch(prompts,
responses)` scores many at once.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from slime.config import ModelConfig
from slime.model import ensure_model_dir, load_tokenizer

CONFIG_NAME = "reward_model.json"
HEAD_NAME = "score_head.safetensors"
FORMAT_VERSION = 1


class DataError(ValueError):
    """A malformed training-data line; the message starts with `file:line:`."""


# ----------------------------------------------------------------------------- data


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


def _check_text(obj: dict[str, Any], key: str) -> str | None:
    if key not in obj:
        return f"missing key {key!r} (have {sorted(obj)})"
    if not isinstance(obj[key], str):
        return f"{key!r} must be a string, got {type(obj[key]).__name__}"
    if key != "prompt" and not obj[key].strip():
        return f"{key!r} is empty"
    return None


def check_preference(obj: dict[str, Any]) -> str | None:
    for key in ("prompt", "chosen", "rejected"):
        why = _check_text(obj, key)
        if why:
            return why
    if not obj["prompt"].strip():
        return "'prompt' is empty"
    if obj["chosen"] == obj["rejected"]:
        return "'chosen' and 'rejected' are identical"
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


# ----------------------------------------------------------------------------- model


class ScalarHeadModel(torch.nn.Module):
    """Backbone (`AutoModel`) + Linear(hidden, 1); shared by the RM and the PRM."""

    kind = "scalar_head"

    def __init__(self, backbone: torch.nn.Module, tokenizer, head: torch.nn.Linear, meta: dict[str, Any]):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.tokenizer = tokenizer
        self.meta = dict(meta)
        self.lock = threading.Lock()

    # -- construction / persistence

    @classmethod
    def from_backbone(cls, model_dir: str | Path, seed: int = 0, device: str = "cpu", **meta: Any):
        """A fresh (randomly initialised from `seed`) head on the HF model in `model_dir`."""

        model_dir = Path(model_dir).expanduser()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}: no config.json (expected a local HF model directory)")
        backbone = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = load_tokenizer(model_dir)
        hidden = int(backbone.config.hidden_size)
        head = torch.nn.Linear(hidden, 1)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            torch.nn.init.normal_(head.weight, std=hidden**-0.5, generator=g)
            head.bias.zero_()
        max_len = int(getattr(backbone.config, "max_position_embeddings", 2048) or 2048)
        defaults = {
            "kind": cls.kind,
            "format_version": FORMAT_VERSION,
            "hidden_size": hidden,
            "append_eos": tokenizer.eos_token_id is not None,
            "max_length": max_len,
            "base_model": str(model_dir),
        }
        defaults.update(meta)
        model = cls(backbone, tokenizer, head, defaults)
        model.eval()
        return model.to(device)

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu"):

        path = Path(path).expanduser()
        cfg_file = path / CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (not a saved reward model; train one first)")
        meta = json.loads(cfg_file.read_text())
        if meta.get("kind") != cls.kind:
            raise ValueError(f"{path}: holds a {meta.get('kind')!r}, expected a {cls.kind!r}")
        backbone = AutoModel.from_pretrained(str(path), dtype=torch.float32)
        tokenizer = load_tokenizer(path)
        head = torch.nn.Linear(int(meta["hidden_size"]), 1)
        head.load_state_dict(load_file(str(path / HEAD_NAME)))
        model = cls(backbone, tokenizer, head, meta)
        model.eval()
        return model.to(device)

    def save(self, path: str | Path) -> Path:

        path = Path(path).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}, str(path / HEAD_NAME))
        (path / CONFIG_NAME).write_text(json.dumps(self.meta, indent=2, sort_keys=True))
        return path

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    # -- encoding / forward

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _pad(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(len(s) for s in seqs))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            attn[i, : len(s)] = 1
        return ids.to(self.device), attn.to(self.device)

    def logits_at(self, seqs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Head outputs at the given token positions of each (right-padded) sequence."""
        ids, attn = self._pad(seqs)
        hidden = self.backbone(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H]
        values = self.head(hidden).squeeze(-1)  # [B, T]
        return [
            values[i, torch.as_tensor(list(p), dtype=torch.long, device=values.device)] for i, p in enumerate(positions)
        ]


class RewardModel(ScalarHeadModel):
    """Scalar reward on the last token of prompt + response (+ EOS)."""

    kind = "reward_model"

    def encode(self, prompt: str, response: str) -> list[int]:
        seq = self._ids(prompt) + self._ids(response)
        if self.meta.get("append_eos") and self.tokenizer.eos_token_id is not None:
            seq.append(self.tokenizer.eos_token_id)
        return seq[-int(self.meta["max_length"]) :]

    def forward_scores(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] scores (with grad) of encoded sequences."""
        return torch.stack([v[0] for v in self.logits_at(seqs, [[len(s) - 1] for s in seqs])])

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 32) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = [self.encode(p, r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        with self.lock:
            was_training = self.training
            self.eval()
            try:
                for i in range(0, len(seqs), batch_size):
                    out.extend(self.forward_scores(seqs[i : i + batch_size]).float().cpu().tolist())
            finally:
                self.train(was_training)
        return out


# ----------------------------------------------------------------------------- training


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


# ----------------------------------------------------------------------------- reward service


_CACHE: dict[tuple[str, str, str], ScalarHeadModel] = {}
_CACHE_LOCK = threading.Lock()


def cached_load(cls: type[ScalarHeadModel], path: str | Path, device: str = "cpu") -> ScalarHeadModel:
    """One loaded model per (class, resolved dir, device) in this process."""
    key = (cls.kind, str(Path(path).expanduser().resolve()), device)
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = cls.load(path, device=device)
        return _CACHE[key]


class RMReward:
    """Native-signature reward backed by a saved RM (see `rm_reward`)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", batch_size: int = 32):
        self.model: RewardModel = cached_load(RewardModel, model_dir, device)  # type: ignore[assignment]
        self.batch_size = batch_size
        self.__name__ = f"rm_reward({model_dir})"

    def __call__(self, prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float:
        return self.model.score([prompt], [response])[0]

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return self.model.score(prompts, responses, self.batch_size)


def rm_reward(model_dir: str | Path, device: str = "cpu", batch_size: int = 32) -> RMReward:
    """`fn(prompt, response, label, metadata) -> float` scoring with the RM saved in `model_dir`."""
    return RMReward(model_dir, device, batch_size)


# ----------------------------------------------------------------------------- CLI


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


def resolve_model_dir(model_dir: str | None) -> Path:
    return ensure_model_dir(ModelConfig(path=model_dir))


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


def main_train_rm(args: list[str]) -> int:
    """`slime train-rm --data pairs.jsonl --out DIR [--model-dir HF_DIR] [--steps N] [--lr LR] ...`"""
    parser = common_parser("slime train-rm", "Train a Bradley-Terry reward model on prompt/chosen/rejected JSONL.")
    return run_cli(train_reward_model, parser, args)
