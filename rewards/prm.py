"""Process reward model (PRM): one score in [0, 1] per reasoning step.

Same structure as the reward model (`rewards.reward_model`): a local HF backbone + a scalar head,
here read at the token where each step ends and passed through a sigmoid.

Steps. A response is split on `delimiter` (default "\\n"); segments that are empty or only
whitespace are not steps. Step i spans response characters [start_i, end_i) (the delimiter
excluded); its *end character* is end_i − 1, the step's last character.

Step end → token index (the rule used both to score and to place token-level rewards): the step
ends on the first token whose character span reaches past the end character, i.e. the token that
contains it (or, if no token covers it, the next token). Token character spans come from
  * a fast tokenizer's offset mapping, when tokenising text ourselves;
  * else (slow tokenizer) cumulative counts of re-tokenised prefixes: index = len(tok(text[:end_i])) − 1,
    clamped and kept non-decreasing;
  * for token ids already sampled by the policy (`token_rewards(..., response_ids=...)`), the
    lengths of decoded prefixes: token t ends at len(decode(ids[:t+1])) (special tokens skipped),
    and the steps are split from decode(ids).
With a character-level tokenizer all three are exact: step i's reward lands on the token of its
last character.

`token_rewards` returns a float32 array with one entry per response token: each step's score on
its end token (added, should two steps end on one token), zero elsewhere. Every response token of
a single-turn sample is trainable, which `slime.algorithms.ppo.token_level_rewards` requires.

For outcome-style algorithms (GRPO) `aggregate(scores, how)` reduces the step scores to one
number: `min | last | mean | product` (0.0 for a response without steps).

Training data (JSONL): {"prompt": str, "steps": [str, ...], "labels": [0|1, ...]}; the response
is `delimiter.join(steps)`, so a step may not contain the delimiter or be blank. BCE on each step's
logit; a held-out `eval_fraction` of the examples gives step-level accuracy (p > 0.5 vs label).
The trainer lives in rewards/training/prm.py (`slime train-prm`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rewards.reward_model import (
    ScalarHeadModel,
    cached_load,
)

AGGREGATIONS = ("min", "last", "mean", "product")


# ----------------------------------------------------------------------------- steps and tokens


def step_spans(response: str, delimiter: str = "\n") -> list[tuple[int, int]]:
    """Character spans [start, end) of the non-blank segments of `response` split on `delimiter`."""
    if not delimiter:
        raise ValueError("delimiter must be a non-empty string")
    spans, start = [], 0
    while True:
        j = response.find(delimiter, start)
        end = len(response) if j < 0 else j
        if response[start:end].strip():
            spans.append((start, end))
        if j < 0:
            return spans
        start = j + len(delimiter)


def _first_token_past(token_ends: Sequence[int], char: int) -> int:
    """Index of the first token whose end offset is > char (the token containing char)."""
    return min(bisect.bisect_right(token_ends, char), len(token_ends) - 1)


def tokenize_with_step_ends(tokenizer, text: str, end_chars: Sequence[int]) -> tuple[list[int], list[int]]:
    """(ids of `text` without special tokens, token index where each end character lies)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        ends, running = [], 0
        for _, b in enc["offset_mapping"]:
            running = max(running, int(b))
            ends.append(running)
        return ids, [_first_token_past(ends, c) for c in end_chars] if ids else []
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        return ids, []
    out, prev = [], 0
    for c in end_chars:
        n = len(tokenizer(text[: c + 1], add_special_tokens=False)["input_ids"])
        prev = max(prev, min(len(ids) - 1, max(0, n - 1)))
        out.append(prev)
    return ids, out


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def step_end_tokens_of_ids(tokenizer, ids: Sequence[int], end_chars: Sequence[int]) -> list[int]:
    """For already-sampled ids: first t with len(decode(ids[:t+1])) > char (binary search per step)."""
    ids = list(ids)
    cache: dict[int, int] = {}

    def end_of(t: int) -> int:
        if t not in cache:
            cache[t] = len(_decode(tokenizer, ids[: t + 1]))
        return cache[t]

    out = []
    for c in end_chars:
        lo, hi = 0, len(ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if end_of(mid) > c:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out


def aggregate(scores: Sequence[float], how: str = "min") -> float:
    """Step scores -> one reward: min | last | mean | product; 0.0 when there are no steps."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    if len(scores) == 0:
        return 0.0
    if how == "min":
        return float(min(scores))
    if how == "last":
        return float(scores[-1])
    if how == "mean":
        return float(sum(scores) / len(scores))
    return float(math.prod(scores))


def place_step_rewards(length: int, token_indices: Sequence[int], scores: Sequence[float]) -> np.ndarray:
    out = np.zeros(length, dtype=np.float32)
    for t, s in zip(token_indices, scores):
        out[t] += s
    return out


@dataclass
class StepRewards:
    steps: list[str]  # step texts
    scores: list[float]  # PRM probability per step
    token_indices: list[int]  # response token index where each step ends
    token_rewards: np.ndarray  # float32 [len(response_ids)]
    response_ids: list[int]


# ----------------------------------------------------------------------------- model


class ProcessRewardModel(ScalarHeadModel):
    kind = "process_reward_model"

    @classmethod
    def from_backbone(cls, model_dir, seed: int = 0, device: str = "cpu", delimiter: str = "\n", **meta: Any):
        if not delimiter:
            raise ValueError("delimiter must be a non-empty string")
        return super().from_backbone(model_dir, seed=seed, device=device, delimiter=delimiter, **meta)

    @property
    def delimiter(self) -> str:
        return self.meta.get("delimiter", "\n")

    def encode(self, prompt: str, response: str) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(prompt+response ids, positions of step ends in them, step spans)."""
        spans = step_spans(response, self.delimiter)
        prompt_ids = self._ids(prompt)
        resp_ids, idx = tokenize_with_step_ends(self.tokenizer, response, [e - 1 for _, e in spans])
        seq = prompt_ids + resp_ids
        positions = [len(prompt_ids) + t for t in idx]
        max_len = int(self.meta["max_length"])
        if len(seq) > max_len:
            cut = len(seq) - max_len
            if cut > len(prompt_ids):
                raise ValueError(f"response is {len(resp_ids)} tokens; the PRM reads at most {max_len}")
            seq = seq[cut:]
            positions = [p - cut for p in positions]
        return seq, positions, spans

    @torch.no_grad()
    def step_scores(self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 32) -> list[list[float]]:
        """Per-step probabilities for each (prompt, response)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses)]
        out: list[list[float]] = []
        with self.lock:
            was_training = self.training
            self.eval()
            try:
                for i in range(0, len(encoded), batch_size):
                    chunk = encoded[i : i + batch_size]
                    logits = self.logits_at([s for s, _, _ in chunk], [p for _, p, _ in chunk])
                    out.extend(torch.sigmoid(v).float().cpu().tolist() for v in logits)
            finally:
                self.train(was_training)
        return out

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], how: str = "min", batch_size: int = 32
    ) -> list[float]:
        return [aggregate(s, how) for s in self.step_scores(prompts, responses, batch_size)]

    def token_rewards(
        self,
        prompt: str,
        response: str | None = None,
        response_ids: Sequence[int] | None = None,
        tokenizer=None,
    ) -> StepRewards:
        """Step scores placed on the response token where each step ends (see the module docstring).

        Give `response_ids` (the policy's sampled tokens, decoded with `tokenizer`, default the PRM's)
        or `response` text (tokenised with `tokenizer`)."""
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if response_ids is not None:
            ids = [int(t) for t in response_ids]
            text = _decode(tok, ids)
            spans = step_spans(text, self.delimiter)
            idx = step_end_tokens_of_ids(tok, ids, [e - 1 for _, e in spans]) if ids else []
        elif response is not None:
            text = response
            spans = step_spans(text, self.delimiter)
            ids, idx = tokenize_with_step_ends(tok, text, [e - 1 for _, e in spans])
        else:
            raise ValueError("give response or response_ids")
        scores = self.step_scores([prompt], [text])[0]
        assert len(scores) == len(spans) == len(idx)
        return StepRewards(
            steps=[text[a:b] for a, b in spans],
            scores=scores,
            token_indices=idx,
            token_rewards=place_step_rewards(len(ids), idx, scores),
            response_ids=ids,
        )


# ----------------------------------------------------------------------------- reward service


class PRMReward:
    """Native-signature reward: the aggregated step scores of a saved PRM (see `prm_reward`)."""

    def __init__(
        self,
        model_dir: str | Path,
        aggregation: str = "min",
        device: str = "cpu",
        batch_size: int = 32,
        token_level: bool = False,
    ):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.model: ProcessRewardModel = cached_load(ProcessRewardModel, model_dir, device)  # type: ignore[assignment]
        self.aggregation = aggregation
        self.batch_size = batch_size
        self.token_level = token_level
        self.__name__ = f"prm_reward({model_dir}, {aggregation})"

    def __call__(self, prompt: str, response: str, label: Any = None, metadata: dict | None = None) -> float | dict:
        """The aggregated score; with token_level, {"score", "step_scores", "step_ends"} where
        step_ends[i] is the index of step i's last character (the rollout worker puts step i's
        score on the token holding it, as `token_rewards` does)."""
        scores = self.model.step_scores([prompt], [response])[0]
        score = aggregate(scores, self.aggregation)
        if not self.token_level:
            return score
        ends = [end - 1 for _, end in step_spans(response, self.model.delimiter)]
        return {"score": score, "step_scores": scores, "step_ends": ends}

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return self.model.score(prompts, responses, self.aggregation, self.batch_size)

    def step_scores(self, prompts: Sequence[str], responses: Sequence[str]) -> list[list[float]]:
        return self.model.step_scores(prompts, responses, self.batch_size)

    def token_rewards(self, prompt: str, response_ids: Sequence[int], tokenizer=None) -> StepRewards:
        return self.model.token_rewards(prompt, response_ids=response_ids, tokenizer=tokenizer)


def prm_reward(
    model_dir: str | Path,
    aggregation: str = "min",
    device: str = "cpu",
    batch_size: int = 32,
    token_level: bool = False,
) -> PRMReward:
    """`fn(prompt, response, label, metadata)`: aggregated step scores of the PRM in `model_dir`;
    with token_level=True also the per-step scores, which PPO/GAE then gets on step-end tokens."""
    return PRMReward(model_dir, aggregation, device, batch_size, token_level)
