"""Bradley-Terry reward model: a local HF causal-LM backbone plus a scalar head.

    rm = RewardModel.from_backbone("path/to/hf_dir")     # fresh head on any local HF causal LM
    train_reward_model(model_dir, "pairs.jsonl", "out/rm", steps=200)   # rewards/training/reward_model.py
    rm = RewardModel.load("out/rm")
    rm.score(["ab*3="], ["ababab"])                       # -> [float]; batched, no grad

Input: the prompt's tokens followed by the response's tokens (each tokenised on its own, without
special tokens, as the policy sees them) and, when the tokenizer has one, EOS. The score is the
head applied to the backbone's last hidden state at the last non-pad token. Sequences longer than
`max_length` keep their last `max_length` tokens.

Training data (JSONL, one object a line): {"prompt": str, "chosen": str, "rejected": str}; loss
−log σ(r_chosen − r_rejected); a held-out `eval_fraction` of the pairs gives pairwise accuracy
(a tie counts as half). A bad line raises `DataError("file:line: why")`. The trainer lives in
rewards/training/ (`slime train-rm`).

Saved directory: the backbone (`save_pretrained`, loadable with `AutoModel`), the tokenizer,
`score_head.safetensors` and `reward_model.json`.

For the reward service: `rm_reward(dir)` returns a native-signature callable
`fn(prompt, response, label, metadata) -> float` that loads the model once (cached per
directory and device) and serialises forward passes with a lock; its `score_batch(prompts,
responses)` scores many at once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from slime.config import ModelConfig
from slime.model import ensure_model_dir, from_pretrained, load_tokenizer

CONFIG_NAME = "reward_model.json"
HEAD_NAME = "score_head.safetensors"
FORMAT_VERSION = 1


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
        backbone = from_pretrained(AutoModel, model_dir, dtype=torch.float32)
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
        backbone = from_pretrained(AutoModel, path, dtype=torch.float32)
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


def resolve_model_dir(model_dir: str | None) -> Path:
    return ensure_model_dir(ModelConfig(path=model_dir))
