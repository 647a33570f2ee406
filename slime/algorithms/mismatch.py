"""Train-inference mismatch, made visible: how far the engine's logprobs μ of the trained tokens are
from the learner's π_old (the learner's weights before the update) on the same tokens.

Tokens fall in three kinds, by the policy version that sampled them:
  fresh    sampled by the learner's current version, in a response that never changed version:
           any gap here is numerics (kernels, dtype, batch shape) between engine and learner
  resumed  sampled by the current version after the response was resumed from an older one
           (APRIL partials): the engine may still attend to the older version's KV cache
  stale    sampled by an older version: the policy's own change since then

Per kind:  mismatch_<kind>_logp_abs_diff = mean |log π_old − log μ|
           mismatch_<kind>_kl            = mean of k3 = (ρ − 1) − log ρ, ρ = π_old/μ: an unbiased,
                                           non-negative estimate of KL(μ ‖ π_old) from μ's samples
           mismatch_<kind>_tokens        = how many trainable tokens were of that kind
Sums are accumulated over micro-batches and divided once, so the figures are exact batch means.
"""

from __future__ import annotations

import torch

KINDS = ("fresh", "resumed", "stale")


def log_ratio_and_k3(old_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log ρ (clamped to ±20) and k3 = (ρ − 1) − log ρ, ρ = π_old/μ."""
    log_ratio = (old_logp - behaviour_logp).clamp(-20.0, 20.0)
    return log_ratio, torch.expm1(log_ratio) - log_ratio


def probe_kl(pairs: list[tuple[list[float], list[float]]]) -> tuple[float, float]:
    """Responses scored twice, (μ's logprobs, π_old's) per response: (tokens, their mean k3)."""
    k3 = [log_ratio_and_k3(torch.as_tensor(old), torch.as_tensor(behaviour))[1] for behaviour, old in pairs]
    tokens = sum(k.numel() for k in k3)
    return float(tokens), (sum(float(k.sum()) for k in k3) / tokens if tokens else 0.0)


class MismatchMeter:
    def __init__(self) -> None:
        self.sums = {k: [0.0, 0.0, 0.0] for k in KINDS}  # |Δ| sum, k3 sum, tokens

    @torch.no_grad()
    def add(
        self,
        old_logp: torch.Tensor,
        behaviour_logp: torch.Tensor,
        mask: torch.Tensor,
        versions: torch.Tensor,
        policy_version: int,
    ) -> None:
        trainable = mask > 0
        # The oldest version in the response, over its tokens trained or not: a current-version token
        # whose response began under an older version is resumed even when the older tokens are out
        # of the loss (mask_stale, a streaming segment's context, tool tokens). Every position up to
        # the last trainable token is a real token; padding (version 0) only follows the response.
        positions = torch.arange(versions.shape[-1], device=versions.device)
        last = torch.where(trainable, positions, -1).max(-1, keepdim=True).values
        big = torch.iinfo(versions.dtype).max
        row_first = torch.where(positions <= last, versions, big).min(-1, keepdim=True).values
        current = versions >= policy_version
        kinds = {
            "fresh": trainable & current & (row_first >= policy_version),
            "resumed": trainable & current & (row_first < policy_version),
            "stale": trainable & ~current,
        }
        log_ratio, k3 = log_ratio_and_k3(old_logp, behaviour_logp)
        for kind, sel in kinds.items():
            s = self.sums[kind]
            s[0] += float(log_ratio.abs()[sel].sum())
            s[1] += float(k3[sel].sum())
            s[2] += float(sel.sum())

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, (abs_sum, kl_sum, n) in self.sums.items():
            out[f"mismatch_{kind}_tokens"] = n
            if n:
                out[f"mismatch_{kind}_logp_abs_diff"] = abs_sum / n
                out[f"mismatch_{kind}_kl"] = kl_sum / n
        return out


# The weight check scores the first record's label after its prompt, then more records' prompts and
# labels: one short answer routes through a few experts of an MoE only, and an engine that kept one
# expert's old weights passed (3 of 8 experts of a layer in a trial); the data's own text reaches
# the experts training does.
PROBE_RECORDS = 16
PROBE_MAX_TOKENS = 64  # scored every check on both sides (vLLM: full-vocabulary logprobs per position)


def weight_probe(tokenizer, records: list, budget: int) -> list[int]:
    """The tokens the weight check scores after ``records[0]``'s prompt, ``budget`` at most (a
    response's room: the context fits it)."""

    def label_ids(record) -> list[int]:
        return [int(t) for t in tokenizer(str(record.label or "probe"), add_special_tokens=False)["input_ids"]]

    ids = label_ids(records[0]) or [0]
    for record in records[1:PROBE_RECORDS]:
        if len(ids) >= budget:
            break
        ids += [int(t) for t in record.prompt_ids] + label_ids(record)
    return ids[: max(1, min(budget, PROBE_MAX_TOKENS))]
