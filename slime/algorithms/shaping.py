"""DAPO overlong reward shaping (Yu et al. 2025): a soft length penalty added to the scores.

With L a response's length, L_max its sample's max_new_tokens, L_cache = algorithm.overlong_buffer
and p = algorithm.overlong_penalty:

  R_length(L) = 0                                  if L ≤ L_max − L_cache
              = ((L_max − L_cache) − L) / L_cache · p  if L_max − L_cache < L ≤ L_max
              = −p                                 if L > L_max

Every algorithm's prepare adds R_length to the scores before its advantages (off when
overlong_buffer is None). L counts every response token, env/tool tokens included, since
max_new_tokens caps the whole episode.
"""

from __future__ import annotations

import torch

from slime.algorithms.batch import Batch
from slime.config import AlgorithmConfig


@torch.no_grad()
def overlong_penalty(length: torch.Tensor, max_len: torch.Tensor, buffer: int, penalty: float) -> torch.Tensor:
    """R_length [N] (≤ 0) from response lengths [N] and their budgets L_max [N]."""
    length, max_len = length.to(torch.float32), max_len.to(torch.float32)
    soft_start = max_len - buffer
    ramp = (soft_start - length) / buffer * penalty
    shaped = torch.where(length <= max_len, ramp, torch.full_like(ramp, -penalty))
    return torch.where(length <= soft_start, torch.zeros_like(ramp), shaped)


@torch.no_grad()
def shape_scores(scores: torch.Tensor, batch: Batch, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """scores + R_length when cfg.overlong_buffer is set (else scores unchanged, no metrics).

    metrics, over rows with trainable tokens: overlong_penalty_mean (mean R_length, ≤ 0) and
    overlong_share (share of rows with R_length < 0).
    """
    if cfg.overlong_buffer is None:
        return scores, {}
    if batch.max_new_tokens is None:
        raise ValueError("algorithm.overlong_buffer needs each row's max_new_tokens in the batch (see collate)")
    shaping = overlong_penalty(batch.response_len, batch.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    if not scores.is_floating_point():
        scores = scores.to(torch.float32)
    shaping = shaping.to(device=scores.device, dtype=scores.dtype)
    valid = batch.mask.sum(-1) > 0
    counted = shaping[valid]
    metrics = {
        "overlong_penalty_mean": counted.mean().item() if counted.numel() else 0.0,
        "overlong_share": (counted < 0).float().mean().item() if counted.numel() else 0.0,
    }
    return scores + shaping, metrics
