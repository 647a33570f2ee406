"""Off-policy corrections held to their formulas (slime/algorithms/corrections), the loss that applies
them, the learner's batch-level and proximal-policy paths, the train-inference mismatch meter, and a
short APRIL job per correction.

Probabilities are powers of two where a test sits exactly on a band edge: their logarithms are
multiples of float32(ln 2) with no rounding, so ρ = π_old/μ hits the edge exactly in float32 too.
"""

from __future__ import annotations

import json
import math
import typing

import numpy as np
import pytest
import torch

from slime.algorithms.batch import Forward, UpdateTensors, collate
from slime.algorithms.core import off_policy_mask, stale_tokens
from slime.algorithms.corrections import CorrectionInputs, CorrectionOutput, make_correction
from slime.algorithms.corrections.m2po import M2PO
from slime.algorithms.grpo import GRPO
from slime.algorithms.mismatch import MismatchMeter
from slime.buffer import TrajectoryStore
from slime.config import AlgorithmConfig, CorrectionConfig, TinyModelConfig, load_config
from slime.learner import Learner
from slime.model import build_tiny_moe
from slime.sample import Sample, Status
from slime.train import train

NAMES = typing.get_args(CorrectionConfig.model_fields["name"].annotation)
TINY = 1e-6  # μ of a padding token: its ρ would be 10⁶ if padding were ever counted


def correction(name: str, *overrides: str):
    return make_correction(load_config(None, [f"algorithm.correction.name={name}", *overrides]).algorithm.correction)


def inputs(old_p, mu_p, mask=None, adv=None) -> CorrectionInputs:
    """log π_old and log μ from explicit probabilities, float32 as in the learner."""
    old = torch.log(torch.tensor(old_p, dtype=torch.float32))
    mu = torch.log(torch.tensor(mu_p, dtype=torch.float32))
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32)
    adv = torch.zeros_like(old) if adv is None else torch.tensor(adv, dtype=torch.float32)
    return CorrectionInputs(old, mu, mask, adv)


def log_inputs(log_ratio, mask=None, adv=None) -> CorrectionInputs:
    """log μ = log 0.5 everywhere and log π_old = log μ + the given log ratio."""
    lr = torch.tensor(log_ratio, dtype=torch.float32)
    mu = torch.full_like(lr, math.log(0.5))
    mask = torch.ones_like(lr) if mask is None else torch.tensor(mask, dtype=torch.float32)
    adv = torch.zeros_like(lr) if adv is None else torch.tensor(adv, dtype=torch.float32)
    return CorrectionInputs(mu + lr, mu, mask, adv)


def check(out: CorrectionOutput, weights, mean: float, max_: float, masked: float, clipped: float) -> None:
    if weights is None:
        assert out.weights is None
    else:
        torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-6, atol=0)
    assert out.stats == pytest.approx(
        {
            "offpolicy_ratio_mean": mean,
            "offpolicy_ratio_max": max_,
            "offpolicy_masked_share": masked,
            "offpolicy_clipped_share": clipped,
        },
        rel=1e-6,
    )


# ---------------------------------------------------------------- one correction at a time, by hand

# Two rows; the last token of row 0 is padding with π_old/μ = 1/10⁻⁶.
#   ρ row 0: 0.5/0.25 = 2, 0.25/0.5 = 0.5, (pad)      row 1: 0.5/0.5 = 1, 1/0.25 = 4, 1/0.5 = 2
# Over the five trainable tokens: mean (2 + .5 + 1 + 4 + 2)/5 = 1.9, max 4.
SHARED = dict(
    old_p=[[0.5, 0.25, 1.0], [0.5, 1.0, 1.0]],
    mu_p=[[0.25, 0.5, TINY], [0.5, 0.25, 0.5]],
    mask=[[1, 1, 0], [1, 1, 1]],
)


def test_none_weighs_every_token_one() -> None:
    check(correction("none")(inputs(**SHARED)), None, 1.9, 4.0, 0.0, 0.0)


def test_mask_stale_drops_stale_tokens_from_the_mask_only() -> None:
    # The learner drops the stale tokens (sampled by version 1, policy at 2) from the mask before
    # the correction runs: row 0 keeps ρ = 2, row 1 keeps ρ = 1 and 4. Mean 7/3, max 4; no weights.
    x = inputs(**SHARED)
    versions = torch.tensor([[2, 1, 0], [2, 2, 1]])
    stale = stale_tokens(versions, x.mask, policy_version=2)
    assert stale.tolist() == [[False, True, False], [False, False, True]]  # padding is never stale
    x.mask = off_policy_mask(x.mask, stale, "mask_stale")
    assert x.mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    check(correction("mask_stale")(x), None, 7 / 3, 4.0, 0.0, 0.0)


def test_tis_truncates_above_the_cap_only() -> None:
    # cap 2: w = min(ρ, 2) = [2, .5, pad 0], [1, 2 (4 truncated), 2 (at the cap, not truncated)].
    # One of five trainable tokens is truncated; padding gets no weight and no count.
    check(correction("tis")(inputs(**SHARED)), [[2.0, 0.5, 0.0], [1.0, 2.0, 2.0]], 1.9, 4.0, 0.0, 1 / 5)


# ρ = .25/1, .25/.5, .5/.5, .5/.25, 1/.25 = 0.25, 0.5, 1, 2, 4 and a padding token; then a row with
# no trainable token. Trainable: mean (.25 + .5 + 1 + 2 + 4)/5 = 1.55, max 4.
EDGES = dict(
    old_p=[[0.25, 0.25, 0.5, 0.5, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]],
    mu_p=[[1.0, 0.5, 0.5, 0.25, 0.25, TINY], [TINY, TINY, TINY, TINY, TINY, TINY]],
    mask=[[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]],
)


def test_mis_token_masks_outside_the_inclusive_band() -> None:
    # cap 2: band [1/2, 2], both edges kept: w = 0, .5, 1, 2, 0; 2 of 5 masked; nothing clipped.
    out = correction("mis_token")(inputs(**EDGES))
    check(out, [[0.0, 0.5, 1.0, 2.0, 0.0, 0.0], [0.0] * 6], 1.55, 4.0, 2 / 5, 0.0)


def test_decoupled_weighs_by_the_full_ratio_and_masks_above_the_cap() -> None:
    # cap 2 (AReaL's behav_imp_weight_cap): w = ρ with no lower bound, 0 above 2; ρ = 2 is kept.
    out = correction("decoupled")(inputs(**EDGES))
    check(out, [[0.25, 0.5, 1.0, 2.0, 0.0, 0.0], [0.0] * 6], 1.55, 4.0, 1 / 5, 0.0)


def test_icepop_keeps_the_calibrated_ratio_inside_the_band() -> None:
    # band [.5, 4]: ρ = .25, .5, 1, 2, 4, 8 (1/.125) -> w = 0, .5, 1, 2, 4, 0 (both edges kept).
    # 2 of 6 masked; mean (.25 + .5 + 1 + 2 + 4 + 8)/6 = 2.625, max 8.
    x = inputs([[0.25, 0.25, 0.5, 0.5, 1.0, 1.0, 1.0]], [[1.0, 0.5, 0.5, 0.25, 0.25, 0.125, TINY]])
    x.mask[0, -1] = 0
    out = correction("icepop", "algorithm.correction.icepop_band=[0.5, 4.0]")(x)
    check(out, [[0.0, 0.5, 1.0, 2.0, 4.0, 0.0, 0.0]], 2.625, 8.0, 2 / 6, 0.0)
    with pytest.raises(ValueError, match="band"):
        correction("icepop", "algorithm.correction.icepop_band=[1.5, 4.0]")  # a band that excludes ρ = 1


def test_mis_seq_uses_the_product_over_the_row() -> None:
    # cap 2, one weight per row, ρ_i = Π_t ρ_t over its trainable tokens:
    #   row 0: 2·2·.5 = 2      on the edge: kept, w = 2 on each token
    #   row 1: 2·2 = 4         masked, although each token alone is inside [1/2, 2] (pad not in Π)
    #   row 2: 4·.25·1 = 1     kept, w = 1, although two of its tokens alone are outside the band
    #   row 3: no trainable token: w = 0, not counted
    # 8 trainable tokens, 2 masked; mean (2+2+.5 + 2+2 + 4+.25+1)/8 = 13.75/8, max 4.
    x = inputs(
        [[0.5, 0.5, 0.25], [0.5, 0.5, 1.0], [1.0, 0.25, 0.5], [1.0, 1.0, 1.0]],
        [[0.25, 0.25, 0.5], [0.25, 0.25, TINY], [0.25, 1.0, 0.5], [TINY, TINY, TINY]],
        mask=[[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]],
    )
    out = correction("mis_seq")(x)
    check(out, [[2.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3], 13.75 / 8, 4.0, 2 / 8, 0.0)
    token_level = correction("mis_token")(x).weights
    assert token_level[1].tolist() == [2.0, 2.0, 0.0] and token_level[2].tolist() == [0.0, 0.0, 1.0]


def test_geo_reject_keeps_rows_by_their_geometric_mean_ratio() -> None:
    # band [.5, 2]; g_i = exp(mean_t log ρ_t) over the row's trainable tokens:
    #   row 0: ρ 2, 2      g = 2          upper edge: kept
    #   row 1: ρ 4, 1      g = 2          kept (the product 4 would not matter here)
    #   row 2: ρ .25, 1    g = .5         lower edge: kept
    #   row 3: ρ 4, pad    g = 4          rejected (counting the padding would give g = 2)
    #   row 4: ρ .25, .5   g = √.125      rejected
    #   row 5: no trainable token
    # 9 trainable tokens, 3 masked; mean (2+2 + 4+1 + .25+1 + 4 + .25+.5)/9 = 15/9, max 4.
    x = inputs(
        [[0.5, 0.5], [1.0, 0.5], [0.25, 0.5], [1.0, 1.0], [0.25, 0.25], [1.0, 1.0]],
        [[0.25, 0.25], [0.25, 0.5], [1.0, 0.5], [0.25, TINY], [1.0, 0.5], [TINY, TINY]],
        mask=[[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [0, 0]],
    )
    out = correction("geo_reject", "algorithm.correction.geo_band=[0.5, 2.0]")(x)
    check(out, [[1, 1], [1, 1], [1, 1], [0, 0], [0, 0], [0, 0]], 15 / 9, 4.0, 3 / 9, 0.0)


def test_opsm_drops_negative_advantage_tokens_of_divergent_rows() -> None:
    # δ = ln 2; D_i = mean_t log(μ/π_old) over trainable tokens; drop a token iff Â_t < 0 and D_i > δ.
    #   row 0: ρ .25, .25  Â −1      D = 2 ln 2 > δ: both dropped
    #   row 1: ρ .25, .25  Â +1      kept: positive advantages are never dropped
    #   row 2: ρ .5, .5    Â −1      D = ln 2 = δ: kept (strictly above δ is dropped)
    #   row 3: ρ .25, .25  Â −1, +1  only the negative token dropped
    #   row 4: ρ .25, pad  Â −1      D = 2 ln 2 over its one token: dropped (with the pad: ln 2, kept)
    #   row 5: ρ 4, 4      Â −1      D = −2 ln 2: kept (π_old prefers these tokens)
    #   row 6: ρ .25, .25  Â 0       kept
    # 13 trainable tokens, 4 dropped; ρ sum .5+.5+1+.5+.25+8+.5 = 11.25, max 4.
    q, h = 0.25, 0.5
    x = inputs(
        [[q, q], [q, q], [h, h], [q, q], [q, 1.0], [1.0, 1.0], [q, q]],
        [[1, 1], [1, 1], [1, 1], [1, 1], [1, TINY], [q, q], [1, 1]],
        mask=[[1, 1]] * 4 + [[1, 0]] + [[1, 1]] * 2,
        adv=[[-1, -1], [1, 1], [-1, -1], [-1, 1], [-1, 0], [-1, -1], [0, 0]],
    )
    out = correction("opsm", f"algorithm.correction.opsm_delta={math.log(2)!r}")(x)
    check(out, [[0, 0], [1, 1], [1, 1], [0, 1], [0, 0], [1, 1], [1, 1]], 11.25 / 13, 4.0, 4 / 13, 0.0)


def test_m2po_masks_nothing_under_the_threshold() -> None:
    # τ = .04: (log ρ)² = .01, .01, 0, .0225 -> mean .010625 ≤ τ: w = ρ everywhere. The padding
    # token's log ρ = 20 ((log ρ)² = 400) would push the mean over τ if it counted.
    lr = [[0.1, -0.1, 0.0], [0.15, 20.0, 0.0]]
    out = correction("m2po")(log_inputs(lr, mask=[[1, 1, 1], [1, 0, 0]]))
    w = [[math.exp(0.1), math.exp(-0.1), 1.0], [math.exp(0.15), 0.0, 0.0]]
    mean = (math.exp(0.1) + math.exp(-0.1) + 1.0 + math.exp(0.15)) / 4
    check(out, w, mean, math.exp(0.15), 0.0, 0.0)


def test_m2po_masks_the_fewest_largest_tokens() -> None:
    # τ = .04, log ρ = 1, .5, .2 | −.1, 0, .1 (+ padding at 5): (log ρ)² = 1, .25, .04, .01, 0, .01
    #   k = 0: 1.31/6 = .218 > τ;   k = 1: .31/5 = .062 > τ;   k = 2: .06/4 = .015 ≤ τ
    # so the two largest are masked and the rest keep w = ρ.
    lr = [[1.0, 0.5, 0.2, 5.0], [-0.1, 0.0, 0.1, 5.0]]
    x = log_inputs(lr, mask=[[1, 1, 1, 0], [1, 1, 1, 0]])
    out = correction("m2po")(x)
    e = math.exp
    w = [[0.0, 0.0, e(0.2), 0.0], [e(-0.1), 1.0, e(0.1), 0.0]]
    mean = (e(1.0) + e(0.5) + e(0.2) + e(-0.1) + 1.0 + e(0.1)) / 6
    check(out, w, mean, e(1.0), 2 / 6, 0.0)
    # k is minimal and what remains is under τ (float64 over the float32 log ratios)
    squares = x.log_ratio.double()[x.mask > 0] ** 2
    kept = out.weights[x.mask > 0] > 0
    assert squares[kept].mean() <= 0.04
    back = torch.cat([squares[kept], squares[~kept].min().reshape(1)])  # one fewer masked
    assert back.mean() > 0.04


def test_m2po_threshold_is_met_exactly_despite_huge_ratios() -> None:
    # log ρ = 20 and 0.1, τ = .010001: masking the 20 leaves .1² = .01 ≤ τ, so k = 1. Subtracting
    # the masked square from the float32 total (400.01 − 400 = .0100098 > τ) used to mask both.
    out = M2PO(0.010001)(log_inputs([[20.0, 0.1]]))
    check(out, [[0.0, math.exp(0.1)]], (math.exp(20.0) + math.exp(0.1)) / 2, math.exp(20.0), 1 / 2, 0.0)


def test_m2po_minimal_k_on_random_batches() -> None:
    """Against a float64 search over every k, on batches with a share of huge log ratios."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 60, (), generator=gen))
        lr = torch.randn(1, n, generator=gen) * float(torch.rand((), generator=gen)) * 2
        lr[0, : int(torch.randint(0, n + 1, (), generator=gen))] *= 100 if trial % 2 else 1
        tau = 0.001 + 0.1 * float(torch.rand((), generator=gen))
        x = log_inputs(lr.tolist())
        out = M2PO(tau)(x)
        assert torch.isfinite(out.weights).all()
        squares = x.log_ratio.double()[0] ** 2
        ordered = squares.sort(descending=True).values
        k = next((j for j in range(n) if ordered[j:].mean() <= tau), n)
        assert int((out.weights == 0).sum()) == k, trial


def test_m2po_huge_ratios_stay_finite() -> None:
    # μ underflows (log μ = −inf, −1000) or π_old does: log ρ is clamped to ±20 before exp.
    # (log ρ)² = 400, 400, 400, .01, .01, 0 with τ = .04 -> the three clamped ones are masked
    # (k = 3: .02/3 ≤ τ; k = 2: 400.02/4 > τ). Padding has log μ = −inf too.
    old = torch.tensor([[0.0, 0.0, -1000.0, 0.1, -0.1, 0.0, 0.0]])
    mu = torch.tensor([[-math.inf, -1000.0, 0.0, 0.0, 0.0, 0.0, -math.inf]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0]])
    out = M2PO(0.04)(CorrectionInputs(old, mu, mask, torch.zeros_like(mask)))
    e = math.exp
    mean = (2 * e(20.0) + e(-20.0) + e(0.1) + e(-0.1) + 1.0) / 6
    check(out, [[0.0, 0.0, 0.0, e(0.1), e(-0.1), 1.0, 0.0]], mean, e(20.0), 3 / 6, 0.0)
    # A threshold that keeps them all: the weights are large, but finite.
    assert torch.isfinite(M2PO(1000.0)(CorrectionInputs(old, mu, mask, torch.zeros_like(mask))).weights).all()


@pytest.mark.parametrize("name", NAMES)
def test_every_correction_is_finite_and_ignores_padding(name: str) -> None:
    # A −inf behaviour logprob on a padding token (and on a trainable one) must not make a nan:
    # inf·0 on padding used to give log ρ = nan there, then nan weights, then a nan loss.
    # Row 0 is near on-policy (ρ = e^.2, e^−.1) with the −inf on its padding; row 1 has it on a
    # trainable token (ρ clamped at e^20).
    old = torch.tensor([[-1.0, -0.5, -0.5], [0.0, -2.0, -0.5]])
    mu = torch.tensor([[-1.2, -0.4, -math.inf], [-math.inf, -2.0, -0.4]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]])
    out = correction(name)(CorrectionInputs(old, mu, mask, adv))
    assert all(math.isfinite(v) for v in out.stats.values())
    assert out.stats["offpolicy_ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    if out.weights is not None:
        assert torch.isfinite(out.weights).all() and out.weights[0, 2] == 0  # padding: no weight
        assert (out.weights[0, :2] > 0).all()  # row 0 is inside every band
    # Padding of any value changes neither weights nor stats.
    mu2 = mu.clone()
    mu2[0, 2] = 5.0
    again = correction(name)(CorrectionInputs(old, mu2, mask, adv))
    assert again.stats == out.stats
    if out.weights is not None:
        assert torch.equal(again.weights, out.weights)


def test_registry_names_and_batch_level() -> None:
    for name in NAMES:
        c = correction(name)
        assert c.name == name and c.batch_level == (name == "m2po")


# ---------------------------------------------------------------- the loss applies the weights


def two_row_batch():
    """Two responses sampled with μ = .5, .125, .25 and μ = .5 (then two padding positions)."""
    samples = []
    for i, mu in enumerate([[0.5, 0.125, 0.25], [0.5]]):
        s = Sample("g", i, [1, 2], 8, status=Status.COMPLETED, reward=1.0)
        s.append([3] * len(mu), np.log(mu), 0)
        samples.append(s)
    return collate(samples, [0, 1], pad_id=0)


def test_masked_token_adds_nothing_but_counts_in_the_token_mean() -> None:
    """IcePop [.5, 4] in GRPO's loss. Row 0: ρ = .5/.5 = 1, 1/.125 = 8 (masked), .5/.25 = 2; row 1:
    ρ = .25/.5 = .5 (lower edge, kept), then two padding positions. r = π_θ/π_old = 1.1, 1.5, 1, .95;
    Â = 1, 1, 1 | −2. ε = .2/.28, all r inside the range except the masked 1.5 (clipped to 1.28).
    ℓ_t = −min(r Â, clip(r) Â) = −1.1, −1.28, −1 | +1.9;  times w = 1, 0, 2 | .5:  −1.1, 0, −2 | .95
    token_mean over all 4 trainable tokens, the masked one included: (−1.1 − 2 + .95)/4 = −.5375
    d loss/d log π_θ = −Â·r·w/4 = −.275, 0, −.5 | +.2375 (exactly 0 on the masked token)."""
    batch = two_row_batch()
    old = torch.log(torch.tensor([[0.5, 1.0, 0.5], [0.25, 1.0, 1.0]]))
    r = torch.tensor([[1.1, 1.5, 1.0], [0.95, 1.0, 1.0]])
    logp = (old + torch.log(r)).requires_grad_(True)
    fixed = UpdateTensors(advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]]), old_logp=old)
    grpo = GRPO(AlgorithmConfig(), correction("icepop", "algorithm.correction.icepop_band=[0.5, 4.0]"))
    loss, stats = grpo.loss(batch, fixed, Forward(logp, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
    assert loss.item() == pytest.approx((-1.1 - 2.0 + 0.95) / 4, rel=1e-6)
    assert stats["pg_loss"] == pytest.approx(-0.5375, rel=1e-6)
    assert stats["offpolicy_masked_share"] == 1 / 4
    assert stats["offpolicy_ratio_mean"] == pytest.approx((1 + 8 + 2 + 0.5) / 4, rel=1e-6)
    assert stats["offpolicy_ratio_max"] == pytest.approx(8.0, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.1 / 4, 0.0, -2.0 / 4], [2 * 0.95 * 0.5 / 4, 0.0, 0.0]]), rtol=1e-6, atol=0
    )
    assert logp.grad[0, 1].item() == 0.0  # the masked token: exactly no gradient


def test_behaviour_clip_reports_how_many_tokens_start_outside_the_clip_range() -> None:
    # ε = .2/.28: ρ = 2, .5 | 1, 4, 2 -> outside [.8, 1.28]: 2, .5, 4, 2, four of five; no weights.
    check(correction("behaviour_clip")(inputs(**SHARED)), None, 1.9, 4.0, 0.0, 4 / 5)


def test_behaviour_clip_takes_the_surrogates_ratio_against_the_sampler() -> None:
    """GRPO with the clip around μ, π_old not recomputed (one step per batch: π_old = π_θ).
    Row 0: μ = .5, .125, .25 and π_θ = .5, .25, .3, so r = π_θ/μ = 1, 2, 1.2 with Â = 1; row 1:
    μ = .5, π_θ = .35, r = .7 with Â = −2, then two padding positions.
    ℓ_t = −min(r Â, clip(r, .8, 1.28) Â) = −1, −1.28 (clipped), −1.2 | +1.6 (clipped: r < .8, Â < 0)
    token_mean: (−1 − 1.28 − 1.2 + 1.6)/4 = −.47;  d loss/d log π_θ = −Â·r/4 where not clipped:
    −.25, 0, −.3 | 0. Against π_old (every other correction) r would be 1 everywhere, no clip."""
    batch = two_row_batch()
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.3], [0.35, 1.0, 1.0]])).requires_grad_(True)
    fixed = UpdateTensors(advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]]), old_logp=None)
    grpo = GRPO(AlgorithmConfig(), correction("behaviour_clip"))
    loss, stats = grpo.loss(batch, fixed, Forward(logp, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
    assert loss.item() == pytest.approx((-1.0 - 1.28 - 1.2 + 1.6) / 4, rel=1e-6)
    assert stats["clipfrac"] == 0.5 and stats["ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert stats["offpolicy_ratio_mean"] == pytest.approx((1 + 2 + 1.2 + 0.7) / 4, rel=1e-6)
    assert stats["offpolicy_clipped_share"] == 0.5  # 2 and .7 start outside [.8, 1.28]
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 0.0, -0.3], [0.0, 0.0, 0.0]]), rtol=1e-6, atol=1e-7)
    # The same batch under TIS: the ratio is against π_old = π_θ, so nothing is clipped.
    _, tis_stats = GRPO(AlgorithmConfig(), correction("tis")).loss(
        batch, fixed, Forward(logp.detach(), None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0
    )
    assert tis_stats["clipfrac"] == 0.0 and tis_stats["ratio_max"] == 1.0


def test_behaviour_clip_band_widens_one_ppo_step_per_version_the_sampler_lags() -> None:
    """ε = .2/.28, band for a token k versions old: [.8^(k+1), 1.28^(k+1)].
    Row 0, k = 1 (band up to 1.6384), Â = +1: μ = .25 ×3, r = π_θ/μ = 1.5, 1.7, .7
      ℓ = −min(r, clip(r)) = −1.5, −1.6384 (clipped), −.7 (the lower edge never bites for Â > 0)
    Row 1, Â = −1: k = 2, 2, 0 (a resumed response: its last token fresh), μ = .5 ×3,
      r = .55 (inside: .8³ = .512), .5 (clipped), .85 (inside [.8, 1.28])
      ℓ = +max(r, clip(r)) = .55, .512, .85
    token_mean: (−1.5 − 1.6384 − .7 + .55 + .512 + .85)/6;  d loss/d log π_θ = −Â·r/6 where not clipped.
    Under a fixed band the 1.5 and the .55 would be clipped too."""
    samples = []
    for i, (mu, version) in enumerate([([0.25] * 3, [4, 4, 4]), ([0.5] * 3, [3, 3, 5])]):
        s = Sample("g", i, [1, 2], 8, status=Status.COMPLETED, reward=1.0)
        for m, v in zip(mu, version):
            s.append([3], np.log([m]), v)
        samples.append(s)
    batch = collate(samples, [0, 1], pad_id=0)
    lag = (5 - batch.versions).clamp_min(0)
    r = torch.tensor([[1.5, 1.7, 0.7], [0.55, 0.5, 0.85]])
    logp = (batch.behaviour_logp + torch.log(r)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    fixed = UpdateTensors(advantages=adv, old_logp=None, version_lag=lag)
    grpo = GRPO(AlgorithmConfig(), correction("behaviour_clip"))
    loss, stats = grpo.loss(batch, fixed, Forward(logp, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
    assert loss.item() == pytest.approx((-1.5 - 1.28**2 - 0.7 + 0.55 + 0.8**3 + 0.85) / 6, rel=1e-5)
    loss.backward()
    expected = torch.tensor([[-1.5, 0.0, -0.7], [0.55, 0.0, 0.85]]) / 6
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert stats["clipfrac"] == pytest.approx(2 / 6)

    fixed_band = GRPO(
        AlgorithmConfig(), correction("behaviour_clip", "algorithm.correction.clip_band_per_version=false")
    )
    logp2 = logp.detach().clone().requires_grad_(True)
    fixed_band.loss(batch, fixed, Forward(logp2, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)[
        0
    ].backward()
    expected_fixed = torch.tensor([[0.0, 0.0, -0.7], [0.0, 0.0, 0.85]]) / 6
    torch.testing.assert_close(logp2.grad, expected_fixed, rtol=1e-5, atol=1e-7)


def test_behaviour_clip_band_stops_widening_at_the_cap() -> None:
    """c = 2: a token 5 versions old gets [.5, 2], not [.8⁶, 1.28⁶] = [.26, 4.4]; one 1 version
    old gets [.64, 1.6384]. ρ = 1.9 sits inside [.5, 2]; ρ = .45 is outside on the side its
    negative advantage bites; ρ = 1 is inside. The ratio's base is μ on every trainable token."""
    x = inputs([[0.95, 0.225, 0.5]], [[0.5, 0.5, 0.5]], adv=[[1.0, -1.0, 1.0]])
    x.lag = torch.tensor([[5, 5, 1]])
    out = correction("behaviour_clip")(x)
    torch.testing.assert_close(out.ratio_base, x.behaviour_logp)
    assert out.weights is None
    eps_low, eps_high = out.band.bounds(0.2, 0.28)
    torch.testing.assert_close(1 - eps_low, torch.tensor([[0.5, 0.5, 0.64]]))
    torch.testing.assert_close(1 + eps_high, torch.tensor([[2.0, 2.0, 1.28**2]]))
    assert out.stats["offpolicy_clipped_share"] == pytest.approx(1 / 3)
    # the band follows the ε the update clips with (an adaptive clip), within the same cap
    eps_low, eps_high = out.band.bounds(0.1, 0.1)
    torch.testing.assert_close(1 + eps_high, torch.tensor([[1.1**6, 1.1**6, 1.1**2]]))


def test_behaviour_clip_band_leaves_the_dual_clip_and_sequence_level_losses_their_own_bounds() -> None:
    """Dual clip c = 3 for Â < 0 bounds r = π_θ/μ at 3 whatever the lag (a 1-version-old token with
    r = 2.8 keeps its gradient −Â·r/N). GSPO (sequence ratio, its own tiny band) and CISPO (weight
    capped at 1 + ε) give the same loss and gradient with and without lags: only token-level PPO
    clips widen."""
    from slime.algorithms.cispo import CISPO
    from slime.algorithms.gspo import GSPO

    batch = two_row_batch()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    lag = torch.tensor([[2, 1, 0], [1, 0, 0]])
    logp = batch.behaviour_logp + torch.log(torch.tensor([[1.1, 1.5, 0.9], [2.8, 1.0, 1.0]]))
    results = {}
    for name, algo in [
        ("grpo", GRPO(AlgorithmConfig(dual_clip=3.0), correction("behaviour_clip"))),
        ("gspo", GSPO(AlgorithmConfig(), correction("behaviour_clip"))),
        ("cispo", CISPO(AlgorithmConfig(), correction("behaviour_clip"))),
    ]:
        for with_lag in (False, True):
            x = logp.clone().requires_grad_(True)
            fixed = UpdateTensors(advantages=adv, old_logp=None, version_lag=lag if with_lag else None)
            loss, _ = algo.loss(batch, fixed, Forward(x, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
            loss.backward()
            results[name, with_lag] = (loss.item(), x.grad)
    # GRPO, lags: r = 1.1 (k 2, inside), 1.5 (k 1, inside 1.6384), .9 (k 0, inside); row 1 r = 2.8, Â = −1:
    # above the band's top, so PPO's max picks r; the dual clip (3) does not bite: −Â·r/4 = .7
    torch.testing.assert_close(
        results["grpo", True][1], torch.tensor([[-1.1, -1.5, -0.9], [2.8, 0.0, 0.0]]) / 4, rtol=1e-5, atol=1e-7
    )
    for name in ("gspo", "cispo"):
        assert results[name, True][0] == pytest.approx(results[name, False][0])
        torch.testing.assert_close(results[name, True][1], results[name, False][1])


def test_gspo_under_behaviour_clip_takes_the_fresh_tokens_ratio_against_pi_old() -> None:
    """A sync batch (lag 0) whose engine logprobs differ from the learner's by bf16-sized noise:
    log(π_old/μ) = .002, −.001, .003 | −.002. Against μ both sequences' ratios, 1.0013 (Â = +1) and
    .998 (Â = −1), lie outside GSPO's band [1 − 3e-4, 1 + 4e-4] on the side that bites, so they got
    no gradient. Against π_old (ratio 1): d loss/d log π_θ = −Â·s_i/(G·|y_i|) = −1/6 ×3 | +1/2, as
    with no correction. Tokens an older version sampled (lag 1) keep μ and stay clipped."""
    from slime.algorithms.gspo import GSPO

    batch = two_row_batch()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    logp = batch.behaviour_logp + torch.tensor([[0.002, -0.001, 0.003], [-0.002, 0.0, 0.0]])
    gspo = GSPO(AlgorithmConfig(), correction("behaviour_clip"))
    grads = {}
    for lag in (0, 1):
        x = logp.clone().requires_grad_(True)
        fixed = UpdateTensors(advantages=adv, old_logp=None, version_lag=torch.full_like(batch.versions, lag))
        loss, stats = gspo.loss(batch, fixed, Forward(x, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
        loss.backward()
        grads[lag] = (x.grad, stats["seq_clipfrac"])
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.5, 0.0, 0.0]])
    torch.testing.assert_close(grads[0][0], expected, rtol=1e-5, atol=1e-7)
    assert grads[0][1] == 0.0
    torch.testing.assert_close(grads[1][0], torch.zeros_like(expected))
    assert grads[1][1] == 1.0


def test_behaviour_clip_on_fresh_tokens_is_ppos_clip_around_the_sampler() -> None:
    """Lag 0 everywhere: the same loss, gradient and figures as with no lag given (the band is PPO's)."""
    batch = two_row_batch()
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.3], [0.35, 1.0, 1.0]]))
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    grpo = GRPO(AlgorithmConfig(), correction("behaviour_clip"))
    results = []
    for lag in (None, torch.zeros_like(batch.versions)):
        x = logp.clone().requires_grad_(True)
        fixed = UpdateTensors(advantages=adv, old_logp=None, version_lag=lag)
        loss, stats = grpo.loss(batch, fixed, Forward(x, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0)
        loss.backward()
        results.append((loss.item(), x.grad, stats["offpolicy_clipped_share"]))
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]
    torch.testing.assert_close(results[0][1], results[1][1])


# ---------------------------------------------------------------- the learner's two paths

VOCAB = 48


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    tiny = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        num_experts=4,
        experts_per_token=2,
        expert_hidden_size=32,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("corrections-model")
    build_tiny_moe(tiny, VOCAB, seed=5).save_pretrained(path)
    return path


def _samples() -> list[Sample]:
    """Six responses in two groups; odd rows start with two tokens of version 1 (the learner is at 2)."""
    rng = np.random.default_rng(11)
    out = []
    for i, reward in enumerate([1.0, 0.0, 0.5, 0.2, 0.9, 0.4]):
        s = Sample(f"g{i // 3}", i % 3, rng.integers(3, VOCAB, size=3 + i % 3), 32, status=Status.COMPLETED)
        length = 3 + (4 * i) % 7
        old = 2 if i % 2 else 0
        if old:
            s.append(rng.integers(3, VOCAB, size=old), -3.8 + 0.3 * rng.standard_normal(old), 1)
        s.append(rng.integers(3, VOCAB, size=length - old), -3.8 + 0.3 * rng.standard_normal(length - old), 2)
        s.reward = reward
        out.append(s)
    return out


def _update(model_dir, redis_url, tmp_path, job: str, *overrides: str, per_micro_batch: bool = False):
    """One learner update on _samples(). Returns its metrics and the policy's parameters before and
    after and the (clipped) gradient of the step, each flattened into one float64 vector."""
    cfg = load_config(
        None,
        [
            f"job_name=corr-{job}",
            f"output_dir={tmp_path}",
            "rollout.n_samples_per_prompt=3",
            "learner.lr=0.01",
            "algorithm.router_aux_coef=0",  # the MoE balance loss is not additive over micro-batches
            *overrides,
        ],
    )
    learner = Learner(cfg, str(model_dir), redis_url)
    learner.version = 2
    if per_micro_batch:  # what the learner would do if it treated the correction as per-token
        learner.algorithm.correction.batch_level = False
    params = list(learner.policy.parameters())
    before = torch.cat([p.detach().double().flatten() for p in params])
    try:
        m = learner.update(_samples(), [0, 0, 0, 1, 1, 1], 0)
    finally:
        learner.buffer.delete_job()
        learner.close()
    after = torch.cat([p.detach().double().flatten() for p in params])
    grad = torch.cat([p.grad.double().flatten() for p in params if p.grad is not None])
    return m, before, after, grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_decoupled_first_forward_is_the_proximal_policy(small_model_dir, redis_url, tmp_path):
    """ppo_epochs = num_minibatches = 1: π_prox taken from the update's own first forward (detached)
    is the same update as π_old recomputed by a separate forward before it."""
    common = ["algorithm.correction.name=decoupled", "algorithm.correction.tis_cap=1.2", "learner.micro_batch_size=2"]
    m1, before, own, g1 = _update(small_model_dir, redis_url, tmp_path, "dec-own", *common)
    m2, _, recomputed, g2 = _update(
        small_model_dir, redis_url, tmp_path, "dec-re", *common, "learner.recompute_old_logprobs=true"
    )
    assert 0 < m1["offpolicy_masked_share"] < 1  # the cap does mask some tokens (ρ > 1.2)
    assert _rel(own, before) > 1e-3  # the update moved the weights
    assert _rel(own, recomputed) < 1e-6 and _rel(g1, g2) < 1e-6
    for k in ("pg_loss", "offpolicy_ratio_mean", "offpolicy_ratio_max", "offpolicy_masked_share"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5), k


def test_m2po_mask_is_computed_on_the_whole_batch(small_model_dir, redis_url, tmp_path):
    """micro_batch_size 2 gives the update of micro_batch_size 6 (the whole batch), because the mask
    is computed once on the whole batch. Computed per micro-batch it would differ.

    The gradients agree to float round-off (accumulated in three parts or summed at once). Adam's
    first step is about lr·g/(|g| + ε), which blows that round-off up on the few near-zero
    gradients, so the parameters are compared at 1e-5."""
    m2po = ["algorithm.correction.name=m2po", "learner.micro_batch_size=2"]
    m_small, before, small, g_small = _update(small_model_dir, redis_url, tmp_path, "m2-2", *m2po)
    m_whole, _, whole, g_whole = _update(
        small_model_dir, redis_url, tmp_path, "m2-6", "algorithm.correction.name=m2po", "learner.micro_batch_size=6"
    )
    stats = ("offpolicy_ratio_mean", "offpolicy_ratio_max", "offpolicy_masked_share", "offpolicy_clipped_share")
    for k in stats:
        assert k in m_small and m_small[k] == pytest.approx(m_whole[k], rel=1e-6), k
    assert 0 < m_small["offpolicy_masked_share"] < 1
    assert _rel(g_small, g_whole) < 1e-6 and _rel(small, whole) < 1e-5
    _, _, per_micro, g_per_micro = _update(small_model_dir, redis_url, tmp_path, "m2-pm", *m2po, per_micro_batch=True)
    # a mask per micro-batch is another update: this test would see it
    assert _rel(g_per_micro, g_whole) > 1e-2 and _rel(per_micro - before, whole - before) > 1e-3


# ---------------------------------------------------------------- train-inference mismatch


def test_mismatch_meter_splits_fresh_resumed_stale_by_hand() -> None:
    """Policy version 2. log π_old − log μ per token (padding and masked tokens in brackets):
      row 0  v 2 2 2        fresh  .1 −.2 0
      row 1  v 1 1 2        stale  .5 −.5, then resumed .3 (its response began under version 1)
      row 2  v 2 2 (pad 0)  fresh  .05 −.05 [9]: the padding's version 0 does not make it resumed
      row 3  v 1 2 2        [7], then resumed .2 −.1: the masked version-1 token still began it
    mean |Δ|: fresh .4/5 = .08, resumed .6/3 = .2, stale 1/2 = .5
    k3 = e^Δ − 1 − Δ, averaged the same way. Rows go in as two micro-batches: the sums are exact."""
    lr = torch.tensor([[0.1, -0.2, 0.0], [0.5, -0.5, 0.3], [0.05, -0.05, 9.0], [7.0, 0.2, -0.1]])
    versions = torch.tensor([[2, 2, 2], [1, 1, 2], [2, 2, 0], [1, 2, 2]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0], [0, 1, 1]])
    mu = torch.full_like(lr, math.log(0.3))
    meter = MismatchMeter()
    for rows in (slice(0, 2), slice(2, 4)):
        meter.add(mu[rows] + lr[rows], mu[rows], mask[rows], versions[rows], 2)

    def k3(xs):
        return sum(math.exp(x) - 1 - x for x in xs) / len(xs)

    fresh, resumed, stale = [0.1, -0.2, 0.0, 0.05, -0.05], [0.3, 0.2, -0.1], [0.5, -0.5]
    want = {
        "mismatch_fresh_tokens": 5,
        "mismatch_resumed_tokens": 3,
        "mismatch_stale_tokens": 2,
        "mismatch_fresh_logp_abs_diff": 0.08,
        "mismatch_resumed_logp_abs_diff": 0.2,
        "mismatch_stale_logp_abs_diff": 0.5,
        "mismatch_fresh_kl": k3(fresh),
        "mismatch_resumed_kl": k3(resumed),
        "mismatch_stale_kl": k3(stale),
    }
    got = meter.metrics()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=2e-5, abs=1e-7), k
    # A kind without tokens reports its count (0) and no figures.
    only_fresh = MismatchMeter()
    only_fresh.add(mu[:1] + lr[:1], mu[:1], mask[:1], versions[:1], 2)
    assert only_fresh.metrics()["mismatch_stale_tokens"] == 0 and "mismatch_stale_kl" not in only_fresh.metrics()


# ---------------------------------------------------------------- a short APRIL job per correction

E2E = [
    "rollout.batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=24",
    "data.num_generated=32",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "weights.check_every=0",
    "steps=2",
    "april.enabled=true",
    "april.oversample=2",
    # The corrections run in the learner, the same code under either launcher; local spares each
    # of the eleven jobs its actor processes (~4 s apiece). The Ray path: tests/test_train_e2e.py.
    "cluster.launcher=local",
]
OFFPOLICY = ("offpolicy_ratio_mean", "offpolicy_ratio_max", "offpolicy_masked_share", "offpolicy_clipped_share")
KIND_COUNTS = ("mismatch_fresh_tokens", "mismatch_resumed_tokens", "mismatch_stale_tokens")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_april_job_trains_with_each_correction(tiny_model_dir, redis_url, tmp_path, name):
    job = f"corr-e2e-{name}"
    overrides = [f"job_name={job}", f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", f"buffer.url={redis_url}"]
    try:
        history = train(load_config(None, [*overrides, *E2E, f"algorithm.correction.name={name}"]))
    finally:
        TrajectoryStore.open(redis_url, job).delete_job()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [r["step"] for r in lines] == [0, 1]
    assert history[0]["trained_tokens"] > 0  # step 0: every token fresh
    for h, line in zip(history, lines):
        assert all(k in h and k in line for k in KIND_COUNTS)
        if h["trained_tokens"] == 0:  # mask_stale can leave nothing to train on a step
            assert name == "mask_stale"
            continue
        assert math.isfinite(h["loss"]) and math.isfinite(line["loss"])
        assert all(k in h and k in line and math.isfinite(h[k]) for k in OFFPOLICY), name
        assert 0 <= h["offpolicy_masked_share"] <= 1 and h["offpolicy_ratio_max"] >= h["offpolicy_ratio_mean"] > 0
        assert sum(h[k] for k in KIND_COUNTS) == h["trained_tokens"]  # each trained token of one kind
    # APRIL: at version 1, step 1 trains groups that version 0 generated, at least in part.
    if name == "mask_stale":
        assert history[1]["mismatch_stale_tokens"] == 0  # dropped from the loss mask
    else:
        assert history[1]["mismatch_stale_tokens"] > 0
