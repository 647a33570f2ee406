"""The built-in engine's token sampler: every row of a step at once, on the logits' device.

Per row: temperature, top-k and top-p come as tensors [rows] (greedy rows flagged), so a batch of
mixed settings is one set of kernels with no per-row host work and no host sync; the engine
copies the step's tokens and logprobs to the host once (`BuiltinEngine._record`). The flags
``all_greedy`` / ``any_top_k`` / ``any_top_p`` skip the sort when no row needs it.

``perturbation`` (rollout.behaviour_perturbation): a train-inference gap on purpose. The sampled
rows draw from a perturbed policy, and their logprobs are those of the distribution actually
sampled, so the learner's mismatch and the corrections see the true gap:
  bf16_logits        the logits rounded to bfloat16 before the temperature and the softmax
  temperature_noise  each row's temperature times exp(scale * z), z ~ N(0, 1) drawn per token
Greedy rows are never perturbed (held-out greedy scores stay the policy's own).
"""

from __future__ import annotations

from typing import Literal

import torch

PerturbationKind = Literal["none", "bf16_logits", "temperature_noise"]
PERTURBATIONS: tuple[PerturbationKind, ...] = ("none", "bf16_logits", "temperature_noise")


def sample_tokens(
    logits: torch.Tensor,
    temp: torch.Tensor,
    greedy: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    all_greedy: bool,
    any_top_k: bool,
    any_top_p: bool,
    generator: torch.Generator,
    perturbation: PerturbationKind = "none",
    perturbation_scale: float = 0.0,
    row_generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], behaviour logprobs [B]).

    logprob = log_softmax(logits / T)[token] over the full tempered distribution (T = 1 for
    greedy rows), i.e. before top-k/top-p truncation; under a perturbation, of the perturbed
    logits and temperature the row was sampled with. ``row_generators``: per row, None or the
    generator of a request with a seed of its own, which draws that row's race (one small draw
    per such row and step; the batch's own draw is unchanged).
    """
    logits = logits.float()
    if all_greedy:
        tok = logits.argmax(-1)
        lp = logits.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
        return tok, lp
    exact = logits
    if perturbation == "bf16_logits":
        logits = torch.where(greedy[:, None], logits, logits.to(torch.bfloat16).float())
    elif perturbation == "temperature_noise":
        z = torch.randn(temp.shape, generator=generator, device=temp.device, dtype=temp.dtype)
        temp = torch.where(greedy, temp, temp * torch.exp(perturbation_scale * z))
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    probs = logp.exp()
    if any_top_k or any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)
        if any_top_k:
            drop |= (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
        if any_top_p:
            kept = sorted_p.masked_fill(drop, 0.0)
            kept = kept / kept.sum(-1, keepdim=True)
            # Drop a token once the mass strictly before it already reaches top_p.
            before = kept.cumsum(-1) - kept
            drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # no rounding drops at 1
        drop[:, 0] = False  # always keep the most likely token
        probs = probs.masked_fill(drop.scatter(1, order, drop), 0.0)
    # Exponential race: argmax(p / E), E ~ Exp(1), samples from p (no host sync, seeded).
    # E = -log(U), U ~ U[0, 1): in (0, inf], never 0; 5x cheaper on CPU than exponential_.
    race = torch.empty_like(probs).uniform_(generator=generator).log_().neg_()
    for row, row_generator in enumerate(row_generators or ()):  # requests with a seed of their own
        if row_generator is not None:
            race[row].uniform_(generator=row_generator).log_().neg_()
    tok = (probs / race).argmax(-1)
    tok = torch.where(greedy, exact.argmax(-1), tok)
    lp = logp.gather(1, tok[:, None]).squeeze(1)
    return tok, lp
