"""The tensors an update reads: the learner collates samples into a `Batch`, runs the models, and
hands an algorithm the batch, the frozen quantities (`UpdateTensors`) and each micro-batch's
forward pass (`Forward`). Response-aligned tensors are [N, T]; `mask` is 1 on trainable tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from slime.sample import Sample, Status


@dataclass
class Batch:
    """Right-padded prompt+response rows; response-aligned tensors are [N, T]."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    response_pos: torch.Tensor  # [N, T] index into the logits that predict response token t
    response_ids: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] float: trainable tokens (loss mask, not padding, not failed)
    behaviour_logp: torch.Tensor  # [N, T] engine logprobs
    versions: torch.Tensor  # [N, T]
    scores: torch.Tensor  # [N]
    token_rewards: torch.Tensor | None  # [N, T]
    group_index: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    last_pos: torch.Tensor  # [N] position of the last response token: V there is V(s_end)
    response_len: torch.Tensor  # [N]
    # [N] bool: rows with token_rewards. PPO/GAE uses those alone for such a row (its scalar
    # reward, e.g. a PRM's aggregate, is for GRPO and the metrics), so nothing is counted twice.
    token_reward_rows: torch.Tensor | None = None
    max_new_tokens: torch.Tensor | None = None  # [N] each sample's budget L_max (overlong shaping, Dr. GRPO)
    routing: torch.Tensor | None = None  # [N, T, layers * top_k] uint8 recorded experts (255: none)

    def rows(self, idx: torch.Tensor) -> Batch:
        """The rows `idx`, cut to their own widths (no compute on other rows' padding)."""
        width = int(self.last_pos[idx].max()) + 1
        t_len = max(1, int(self.response_len[idx].max()))

        def pick(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[idx]
            if name in ("input_ids", "attention_mask"):
                return t[:, :width]
            return t[:, :t_len] if t.dim() >= 2 else t

        sub = Batch(**{k: pick(k, v) for k, v in self.__dict__.items()})
        sub.response_pos = sub.response_pos.clamp(max=width - 1)
        return sub

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def collate(samples: list[Sample], group_ids: list[int], pad_id: int) -> Batch:
    n = len(samples)
    width = max(len(s.prompt_ids) + s.response_length for s in samples)
    t_max = max(1, max(s.response_length for s in samples))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_pos = torch.zeros((n, t_max), dtype=torch.long)
    response_ids = torch.zeros((n, t_max), dtype=torch.long)
    mask = torch.zeros((n, t_max))
    behaviour = torch.zeros((n, t_max))
    versions = torch.zeros((n, t_max), dtype=torch.long)
    scores = torch.zeros(n)
    token_rewards = None
    token_reward_rows = torch.zeros(n, dtype=torch.bool)
    widths = {s.routing.shape[1] for s in samples if s.routing is not None}
    if len(widths) > 1:
        raise ValueError(f"routing replay: samples recorded {sorted(widths)} bytes of experts per token")
    routing = torch.full((n, t_max, widths.pop()), 255, dtype=torch.uint8) if widths else None
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_length
        input_ids[i, :p] = torch.from_numpy(s.prompt_ids.astype(np.int64))
        input_ids[i, p : p + r] = torch.from_numpy(s.response_ids.astype(np.int64))
        attention[i, : p + r] = 1
        # Logits at position j predict token j+1; padding rows point at a valid position, masked out.
        response_pos[i] = torch.clamp(torch.arange(t_max) + p - 1, max=width - 1)
        response_ids[i, :r] = input_ids[i, p : p + r]
        # A failed sample, or an episode the env settings keep out of the loss (env.truncated_episodes).
        if s.status != Status.FAILED and not s.metadata.get("loss_masked"):
            mask[i, :r] = torch.from_numpy(s.loss_mask.astype(np.float32))
        # astype copies: arrays that came through Ray's object store are read-only.
        behaviour[i, :r] = torch.from_numpy(s.logprobs.astype(np.float32))
        versions[i, :r] = torch.from_numpy(s.versions.astype(np.int64))
        if routing is not None and s.routing is not None:
            routing[i, :r] = torch.from_numpy(s.routing.copy())
        scores[i] = float(s.reward) if s.reward is not None else 0.0
        if s.token_rewards is not None:
            if token_rewards is None:
                token_rewards = torch.zeros((n, t_max))
            token_rewards[i, :r] = torch.from_numpy(s.token_rewards.astype(np.float32))
            token_reward_rows[i] = True
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=response_ids,
        mask=mask,
        behaviour_logp=behaviour,
        versions=versions,
        scores=scores,
        token_rewards=token_rewards,
        group_index=torch.tensor(group_ids),
        truncated=torch.tensor([s.status == Status.TRUNCATED for s in samples]),
        last_pos=torch.tensor([len(s.prompt_ids) + s.response_length - 1 for s in samples]),
        response_len=torch.tensor([s.response_length for s in samples]),
        token_reward_rows=token_reward_rows if token_rewards is not None else None,
        max_new_tokens=torch.tensor([s.max_new_tokens for s in samples]),
        routing=routing,
    )


@dataclass
class UpdateTensors:
    """What stays fixed for one whole update (no grad), [N, T]; `rows` cuts a micro-batch's share.

    The learner runs the frozen models (old_logp, ref_logp, old_values); the algorithm's
    `prepare` adds its advantages (and returns) and the metrics it reports once per update.
    """

    advantages: torch.Tensor  # Â_t
    old_logp: torch.Tensor | None = None  # log π_old(a_t|s_t); None: the micro-batch's own detached logp
    ref_logp: torch.Tensor | None = None  # log π_ref(a_t|s_t); None: no KL term this step
    returns: torch.Tensor | None = None  # R_t, the critic's regression target
    old_values: torch.Tensor | None = None  # V_old(s_t), the centre of the value clip
    # w_t of a batch-level off-policy correction, computed once per update; None: per micro-batch
    is_weights: torch.Tensor | None = None
    # versions each token's sampler lags the learner (π_old); None: not known, taken as 0
    version_lag: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def rows(self, idx: torch.Tensor, t_len: int) -> UpdateTensors:
        cut = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in cut.items():
            if isinstance(value, torch.Tensor):
                cut[name] = value[idx, :t_len]
        return UpdateTensors(**cut)


@dataclass
class Forward:
    """One micro-batch's forward pass, with grad: what the loss differentiates."""

    logp: torch.Tensor  # log π_θ(a_t|s_t) [n, t]
    entropy: torch.Tensor | None  # H(π_θ(·|s_t)) [n, t]
    router_aux: torch.Tensor | None  # the MoE router's load-balancing loss (scalar)
    values: torch.Tensor | None  # V_φ(s_t) [n, t], when the algorithm has a critic
