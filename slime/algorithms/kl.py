"""Per-token estimators of KL(π_θ ‖ π_ref), from the log-probs of tokens sampled by the policy.

With log r = log π_ref(a|s) − log π_θ(a|s) (Schulman, "Approximating KL divergence", 2020):

  k1 = −log r = logp − ref_logp            unbiased, high variance, can be negative per token
  k2 = ½ (log r)²                          biased, low variance, always ≥ 0
  k3 = (r − 1) − log r                     unbiased, low variance, always ≥ 0 (GRPO's choice)
  low_var_kl = clamp(k3, −10, 10)          k3 with its tail cut, so one token far off π_ref
                                           cannot dominate the loss (verl's name for it)
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate, same shape as logp; differentiable in logp."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    log_r = ref_logp - logp
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1.0
    if estimator == "low_var_kl":
        # Clamping log r first changes no value (k3 ≥ 19 at |log r| = 20, past the ±10 clamp)
        # but keeps exp() finite, so the backward pass never sees 0·inf = nan.
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2, k3 or low_var_kl")
