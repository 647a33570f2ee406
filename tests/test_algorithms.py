"""Hand-computed checks of the PPO/GAE, GRPO, KL and schedule math (expected values in plain Python)."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from slime.algorithms import ALGORITHMS, make_algorithm
from slime.algorithms.batch import Batch, Forward, UpdateTensors, collate
from slime.algorithms.core import (
    aggregate_loss,
    entropy_from_logits,
    masked_mean,
    masked_whiten,
    off_policy_mask,
    policy_loss,
    stale_tokens,
)
from slime.algorithms.corrections import Correction, CorrectionInputs, make_correction
from slime.algorithms.grpo import GRPO, broadcast_to_tokens, group_advantages, grpo_loss
from slime.algorithms.kl import kl_penalty
from slime.algorithms.ppo import PPO, gae, ppo_loss, token_level_rewards, value_loss
from slime.algorithms.schedules import AdaptiveClip, AdaptiveKL, lr_factor, staged_kl_coef
from slime.config import AdaptiveClipConfig, AlgorithmConfig, LearnerConfig, StagedKL, load_config
from slime.sample import Sample, Status


def _correction(mode: str, cap: float) -> Correction:
    return make_correction(
        load_config(
            None, [f"algorithm.correction.name={mode}", f"algorithm.correction.tis_cap={cap}"]
        ).algorithm.correction
    )


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, t(expected), rtol=0, atol=1e-9)


# ---------------------------------------------------------------- GAE

GAMMA, LAM = 0.9, 0.8


def test_gae_by_hand() -> None:
    r = [0.1, 0.0, -0.2, 1.0]
    v = [0.5, 0.6, 0.7, 0.8]
    d3 = r[3] + GAMMA * 0.0 - v[3]  # terminal: V(s_4) = 0
    d2 = r[2] + GAMMA * v[3] - v[2]
    d1 = r[1] + GAMMA * v[2] - v[1]
    d0 = r[0] + GAMMA * v[1] - v[0]
    a3 = d3
    a2 = d2 + GAMMA * LAM * a3
    a1 = d1 + GAMMA * LAM * a2
    a0 = d0 + GAMMA * LAM * a1
    adv, ret = gae(t([r]), t([v]), t([[1, 1, 1, 1]]), GAMMA, LAM)
    close(adv, [[a0, a1, a2, a3]])
    close(ret, [[a0 + v[0], a1 + v[1], a2 + v[2], a3 + v[3]]])
    # spot check of the closed form Â_0 = Σ (γλ)^l δ_l
    g = GAMMA * LAM
    assert adv[0, 0].item() == pytest.approx(d0 + g * d1 + g**2 * d2 + g**3 * d3, abs=1e-12)


def test_gae_skips_tool_token_in_the_middle() -> None:
    # position 1 is a tool-output token: its reward and value are ignored and token 2 is "t+1" of token 0
    r = [0.1, 5.0, -0.2, 1.0]
    v = [0.5, 9.9, 0.7, 0.8]
    d3 = r[3] - v[3]
    d2 = r[2] + GAMMA * v[3] - v[2]
    d0 = r[0] + GAMMA * v[2] - v[0]
    a3 = d3
    a2 = d2 + GAMMA * LAM * a3
    a0 = d0 + GAMMA * LAM * a2
    adv, ret = gae(t([r]), t([v]), t([[1, 0, 1, 1]]), GAMMA, LAM)
    close(adv, [[a0, 0.0, a2, a3]])
    close(ret, [[a0 + v[0], 0.0, a2 + v[2], a3 + v[3]]])


def test_gae_bootstraps_unfinished_trajectory() -> None:
    r = [0.0, 0.0, 0.0]
    v = [0.2, 0.3, 0.4]
    v_boot = 0.5
    d2 = r[2] + GAMMA * v_boot - v[2]  # truncated: the last δ uses γ·V(s_stop)
    d1 = r[1] + GAMMA * v[2] - v[1]
    d0 = r[0] + GAMMA * v[1] - v[0]
    a2 = d2
    a1 = d1 + GAMMA * LAM * a2
    a0 = d0 + GAMMA * LAM * a1
    adv, _ = gae(t([r]), t([v]), t([[1, 1, 1]]), GAMMA, LAM, bootstrap_values=t([v_boot]))
    close(adv, [[a0, a1, a2]])


def test_gae_padding_after_the_end_is_zero() -> None:
    r = [0.0, 1.0, 7.0, 7.0]
    v = [0.3, 0.4, 9.0, 9.0]
    d1 = r[1] - v[1]
    d0 = r[0] + GAMMA * v[1] - v[0]
    a1 = d1
    a0 = d0 + GAMMA * LAM * a1
    # second row: same sequence unpadded, batched with the padded one
    adv, ret = gae(t([r, r]), t([v, v]), t([[1, 1, 0, 0], [1, 1, 1, 1]]), GAMMA, LAM)
    close(adv[0], [a0, a1, 0.0, 0.0])
    close(ret[0], [a0 + v[0], a1 + v[1], 0.0, 0.0])


def test_token_level_rewards_places_score_on_last_trainable_token() -> None:
    mask = t([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    kl = torch.full((3, 5), 0.1, dtype=torch.float64)
    beta = 0.5
    prm = t([[0.3, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    rewards = token_level_rewards(t([1.0, 2.0, 3.0]), mask, kl=kl, kl_coef=beta, token_rewards=prm)
    pen = -beta * 0.1
    close(rewards, [[0.3 + pen, pen, 0, 1.0 + pen, 0], [2.0 + pen, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    close(token_level_rewards(t([1.0, 2.0, 3.0]), mask), [[0, 0, 0, 1, 0], [2, 0, 0, 0, 0], [0, 0, 0, 0, 0]])


# ---------------------------------------------------------------- policy loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _logp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return t([[math.log(x) for x in ratios]]), t([[0.0] * len(ratios)])


def test_policy_loss_clip_cases_by_hand() -> None:
    ratios = [1.1, 1.5, 0.5, 0.5, 1.5]
    adv = [1.0, 1.0, -1.0, 1.0, -1.0]
    expected = [
        -1.1,  # inside the range: −r·A
        -(1 + EPS_HIGH),  # A>0, r above 1+ε_high: clipped to −(1+ε_high)·A
        (1 - EPS_LOW),  # A<0, r below 1−ε_low: clipped, −(1−ε_low)·A
        -0.5,  # A>0, r below the range: min picks r·A, unclipped
        1.5,  # A<0, r above the range: min picks r·A, unclipped
    ]
    logp, old = _logp(ratios)
    loss, stats = policy_loss(logp, old, t([adv]), t([[1] * 5]), EPS_LOW, EPS_HIGH, None, "token_mean")
    assert loss.item() == pytest.approx(sum(expected) / 5, abs=1e-12)
    assert stats["clipfrac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 5)
    assert stats["ratio_max"] == pytest.approx(1.5)
    k3 = [(x - 1) - math.log(x) for x in ratios]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 5)


def test_policy_loss_dual_clip() -> None:
    c = 3.0
    logp, old = _logp([5.0, 2.0, 5.0])
    adv = t([[-1.0, -1.0, 1.0]])
    loss, stats = policy_loss(logp, old, adv, t([[1, 1, 1]]), EPS_LOW, EPS_HIGH, c, "token_mean")
    # token 0: PPO loss 5.0 capped at −c·A = 3; token 1: 2.0 < 3 stays; token 2 (A>0): −(1+ε_high)
    assert loss.item() == pytest.approx((3.0 + 2.0 - (1 + EPS_HIGH)) / 3, abs=1e-12)
    assert stats["dual_clipfrac"] == pytest.approx(1 / 3)
    loss_no_dual, _ = policy_loss(logp, old, adv, t([[1, 1, 1]]), EPS_LOW, EPS_HIGH, None, "token_mean")
    assert loss_no_dual.item() == pytest.approx((5.0 + 2.0 - (1 + EPS_HIGH)) / 3, abs=1e-12)


def test_policy_loss_is_weights_scale_tokens() -> None:
    logp, old = _logp([1.0, 1.0])
    adv, mask, w = t([[1.0, 2.0]]), t([[1, 1]]), t([[0.5, 1.0]])
    loss, _ = policy_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH, None, "token_mean", is_weights=w)
    assert loss.item() == pytest.approx((-1.0 * 0.5 - 2.0 * 1.0) / 2)


def test_tis_weights_are_truncated_above() -> None:
    # pi_old / mu per token: 0.25, 0.8, 1.0, 1.5, 3.0; cap 2
    w = torch.tensor([[0.25, 0.8, 1.0, 1.5, 3.0]])
    behaviour = torch.log(torch.tensor([[0.4, 0.5, 0.2, 0.2, 0.1]]))
    old = behaviour + torch.log(w)
    x = CorrectionInputs(old, behaviour, torch.ones(1, 5), torch.zeros(1, 5))
    out = make_correction(load_config(None, ["algorithm.correction.name=tis"]).algorithm.correction)(x)
    assert out.weights.tolist()[0] == pytest.approx([0.25, 0.8, 1.0, 1.5, 2.0])
    assert out.stats["offpolicy_clipped_share"] == pytest.approx(1 / 5)
    for mode in ("none", "mask_stale"):
        assert (
            make_correction(load_config(None, [f"algorithm.correction.name={mode}"]).algorithm.correction)(x).weights
            is None
        )


def test_aggregation_modes_on_ragged_mask() -> None:
    loss_mat = t([[1, 2, 3], [4, 5, 99], [7, 7, 7]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    assert aggregate_loss(loss_mat, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    # the all-masked third row is not a sequence of the mean
    assert aggregate_loss(loss_mat, mask, "seq_mean_token_sum").item() == pytest.approx(((1 + 2 + 3) + (4 + 5)) / 2)
    want = ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2
    assert aggregate_loss(loss_mat, mask, "seq_mean_token_mean").item() == pytest.approx(want)
    # the same modes through policy_loss: ratio 1 everywhere makes ℓ = −A
    logp = torch.zeros(3, 3, dtype=torch.float64)
    for mode, want in [("token_mean", -3.0), ("seq_mean_token_sum", -7.5), ("seq_mean_token_mean", -3.25)]:
        loss, _ = policy_loss(logp, logp, loss_mat, mask, EPS_LOW, EPS_HIGH, None, mode)
        assert loss.item() == pytest.approx(want), mode


def test_policy_loss_gradient_zero_when_clipped() -> None:
    # token 0: r = 1 (unclipped), A = 2; token 1: r = 1.5 > 1+ε_high with A = 1 (clipped); token 2: padding
    logp = t([[0.0, math.log(1.5), 0.3]]).requires_grad_(True)
    old = t([[0.0, 0.0, 0.0]])
    adv = t([[2.0, 1.0, 4.0]])
    loss, _ = policy_loss(logp, old, adv, t([[1, 1, 0]]), EPS_LOW, EPS_HIGH, None, "token_mean")
    loss.backward()
    num_tokens = 2
    close(logp.grad, [[-2.0 / num_tokens, 0.0, 0.0]])


# ---------------------------------------------------------------- value loss


def test_value_loss_clipped_and_unclipped() -> None:
    v, v_old, ret = t([[1.0, 2.0]]), t([[0.5, 2.1]]), t([[2.0, 1.0]])
    mask = t([[1, 1]])
    # token 0: (V−R)² = 1; V_clip = 0.5 + 0.2 = 0.7 -> (0.7−2)² = 1.69 is larger
    # token 1: (V−R)² = 1; V_clip = 2.1 − 0.1 = 2.0 -> 1.0 (not larger)
    loss, stats = value_loss(v, v_old, ret, mask, 0.2, "token_mean")
    assert loss.item() == pytest.approx((0.5 * 1.69 + 0.5 * 1.0) / 2)
    assert stats["vf_clipfrac"] == pytest.approx(0.5)
    assert stats["value_mean"] == pytest.approx(1.5)
    loss, stats = value_loss(v, v_old, ret, mask, None, "token_mean")
    assert loss.item() == pytest.approx((0.5 * 1.0 + 0.5 * 1.0) / 2)
    assert stats["vf_clipfrac"] == 0.0


def test_ppo_and_grpo_loss_compose_the_terms() -> None:
    logp = t([[-1.0, -2.0]])
    mask = t([[1, 1]])
    adv = t([[1.0, -1.0]])
    ent = t([[0.5, 1.5]])
    kl = t([[0.1, 0.3]])
    aux = torch.tensor(2.0, dtype=torch.float64)
    pg = -(1.0 * 1.0) + 1.0  # ratio 1: ℓ = −A -> −1, +1
    vf = 0.5 * ((0.0 - 1.0) ** 2 + (0.0 - 1.0) ** 2) / 2
    kw = dict(
        logp=logp,
        old_logp=logp,
        advantages=adv,
        mask=mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        agg_mode="token_mean",
        entropy=ent,
        entropy_coef=0.1,
        kl=kl,
        kl_coef=0.5,
        router_aux=aux,
        router_aux_coef=0.01,
    )
    loss, stats = grpo_loss(**kw)
    want = pg / 2 - 0.1 * 1.0 + 0.5 * 0.2 + 0.01 * 2.0
    assert loss.item() == pytest.approx(want)
    assert stats["loss"] == pytest.approx(want) and stats["entropy"] == pytest.approx(1.0)
    loss, stats = ppo_loss(
        **kw, values=t([[0.0, 0.0]]), old_values=t([[0.0, 0.0]]), returns=t([[1.0, 1.0]]), value_clip=0.2, vf_coef=0.5
    )
    assert loss.item() == pytest.approx(want + 0.5 * vf)
    keys = {"pg_loss", "clipfrac", "approx_kl", "vf_loss", "vf_clipfrac", "value_mean", "kl", "router_aux"}
    assert keys <= set(stats)


# ---------------------------------------------------------------- GRPO


def test_group_advantages_by_hand() -> None:
    scores = t([1.0, 0.0, 0.0, 0.5, 0.5, 0.1, 0.1, 0.1, 2.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 5, 5, 5, 9])  # non-contiguous ids; group 9 has one member
    eps = 1e-6
    mean = 1 / 3
    std = math.sqrt(((1 - mean) ** 2 + 2 * (0 - mean) ** 2) / 3)  # population std
    hi, lo = (1 - mean) / (std + eps), (0 - mean) / (std + eps)
    adv = group_advantages(scores, groups, std_normalize=True, eps=eps)
    close(adv, [hi, lo, lo, 0, 0, 0, 0, 0, 0])  # 0.1×3 stays exactly 0 despite float round-off
    close(group_advantages(scores, groups, std_normalize=False), [1 - mean, -mean, -mean, 0, 0, 0, 0, 0, 0])
    close(broadcast_to_tokens(t([1.5, -2.0]), t([[1, 0, 1], [1, 1, 0]])), [[1.5, 0, 1.5], [-2.0, -2.0, 0]])


# ---------------------------------------------------------------- the algorithm objects


def _batch(rows: list[tuple[float | None, list[float]]], groups: list[int], token_rewards=None) -> Batch:
    """One sample per (reward, behaviour logprobs); reward None: a failed sample."""
    samples = []
    for i, (reward, logprobs) in enumerate(rows):
        status = Status.FAILED if reward is None else Status.COMPLETED
        s = Sample("g", i, [1, 2], 8, status=status, reward=reward)
        s.append([3] * len(logprobs), logprobs, 0)
        if token_rewards is not None and token_rewards[i] is not None:
            s.token_rewards = torch.tensor(token_rewards[i]).numpy()
        samples.append(s)
    return collate(samples, groups, pad_id=0)


def test_registry_and_critic_are_asked_of_the_algorithm() -> None:
    names = typing.get_args(AlgorithmConfig.model_fields["name"].annotation)
    assert set(ALGORITHMS) == set(names)
    assert make_algorithm(load_config(None, ["algorithm.name=ppo"])).needs_critic
    assert not make_algorithm(load_config(None, ["algorithm.name=grpo"])).needs_critic


def test_grpo_prepare_by_hand() -> None:
    # group 0: rewards 1, 0 and a failed row (no trainable tokens: not part of the group's mean);
    # group 1: rewards 2, 2 (no signal)
    batch = _batch(
        [(1.0, [-1.0, -1.0]), (0.0, [-1.0]), (None, [-1.0, -1.0]), (2.0, [-1.0]), (2.0, [-1.0])], [0, 0, 0, 1, 1]
    )
    grpo = GRPO(AlgorithmConfig(grpo_std_normalize=False), _correction("none", 2.0))
    fixed = grpo.prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    torch.testing.assert_close(fixed.advantages, torch.tensor([[0.5, 0.5], [-0.5, 0], [0, 0], [0, 0], [0, 0]]))
    assert fixed.returns is None and fixed.metrics == {}
    fixed = GRPO(AlgorithmConfig(), _correction("none", 2.0)).prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    assert fixed.advantages[0, 0].item() == pytest.approx(0.5 / (0.5 + 1e-6))  # population std of (1, 0) is 0.5


def test_ppo_prepare_by_hand() -> None:
    """γ = λ = 1: Â_t = Σ_{l≥t} r_l + V_boot − V_t. Row 0: score 1 on its last token and a k1 KL
    reward −β(μ − π_ref) = −0.2·0.5 on its first; row 1 has token rewards (its scalar score 0.4
    is their aggregate, not added again) and goes on: V(s_end) = 0.5."""
    batch = _batch(
        [(1.0, [-1.0, -1.0, -1.0]), (0.4, [-1.0, -1.0, -1.0])], [0, 1], token_rewards=[None, [0.0, 0.4, 0.0]]
    )
    ref_logp = torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]])
    cfg = AlgorithmConfig(
        name="ppo", gamma=1.0, lam=1.0, normalize_advantages=False, kl_mode="reward", kl_estimator="k1"
    )
    fixed = PPO(cfg, _correction("none", 2.0)).prepare(
        batch,
        kl_coef=0.2,
        old_logp=None,
        ref_logp=ref_logp,
        old_values=values,
        bootstrap_values=torch.tensor([0.0, 0.5]),
    )
    rewards = [[-0.1, 0.0, 1.0], [0.0, 0.4, 0.0]]
    boot = [0.0, 0.5]
    want = [[sum(r[t:]) + b - v for t, v in enumerate([0.1, 0.2, 0.3])] for r, b in zip(rewards, boot)]
    torch.testing.assert_close(fixed.advantages, torch.tensor(want))  # [[.8, .8, .7], [.8, .7, .2]]
    torch.testing.assert_close(fixed.returns, fixed.advantages + values)
    assert fixed.metrics["advantage_mean"] == pytest.approx(4.0 / 6)
    assert fixed.metrics["return_mean"] == pytest.approx((4.0 + 1.2) / 6)
    assert fixed.metrics["kl_reward_mean"] == pytest.approx(0.5 / 6)  # KL to π_ref, logged (k1: μ − π_ref)
    whitened = PPO(cfg.model_copy(update={"normalize_advantages": True}), _correction("none", 2.0)).prepare(
        batch,
        kl_coef=0.2,
        old_logp=None,
        ref_logp=ref_logp,
        old_values=values,
        bootstrap_values=torch.tensor([0.0, 0.5]),
    )
    assert whitened.metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-6)


def test_grpo_loss_by_hand_with_tis_and_kl() -> None:
    """One update (π_old = π_θ, ratio 1): ℓ_t = −Â_t·w_t, w_t = min(π_old/μ, cap); β·KL(k1) added."""
    batch = _batch([(1.0, [-1.5, -1.5])], [0])
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    fixed = UpdateTensors(advantages=torch.tensor([[1.0, 1.0]]), ref_logp=torch.tensor([[-1.0, -2.5]]))
    w = [min(math.exp(0.5), 1.5), math.exp(-0.5)]
    grpo = GRPO(AlgorithmConfig(kl_estimator="k1"), _correction("tis", 1.5))
    loss, stats = grpo.loss(batch, fixed, Forward(logp, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    assert stats["pg_loss"] == pytest.approx(-(w[0] + w[1]) / 2, rel=1e-6)
    assert stats["kl"] == pytest.approx(0.25) and loss.item() == pytest.approx(-(w[0] + w[1]) / 2 + 0.1 * 0.25)
    # kl_mode="reward": GRPO has no per-token reward to shape, so no KL term at all
    reward_kl = GRPO(AlgorithmConfig(kl_mode="reward"), _correction("none", 1.5))
    _, stats = reward_kl.loss(batch, fixed, Forward(logp, None, None, None), clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    assert "kl" not in stats and stats["pg_loss"] == pytest.approx(-1.0)


def test_ppo_loss_by_hand() -> None:
    """Ratio 1, Â = 1: pg = −1; V = .5, R = 1, no value clip: c_v·½(V − R)² = .5·.125."""
    batch = _batch([(1.0, [-1.0, -1.0])], [0])
    fixed = UpdateTensors(
        advantages=torch.tensor([[1.0, 1.0]]), returns=torch.tensor([[1.0, 1.0]]), old_values=torch.tensor([[0.5, 0.5]])
    )
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    ppo = PPO(AlgorithmConfig(name="ppo", value_clip=None, vf_coef=0.5), _correction("none", 2.0))
    out = Forward(torch.tensor([[-1.0, -1.0]], requires_grad=True), None, None, values)
    loss, stats = ppo.loss(batch, fixed, out, clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 0.125)
    assert stats["vf_loss"] == pytest.approx(0.125) and stats["value_mean"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.125, -0.125]]))  # c_v·(V − R)/2 tokens


def test_update_tensors_rows_cut_every_tensor() -> None:
    fixed = UpdateTensors(
        advantages=torch.arange(12.0).view(3, 4),
        old_logp=-torch.arange(12.0).view(3, 4),
        metrics={"advantage_mean": 1.0},
    )
    cut = fixed.rows(torch.tensor([2, 0]), 2)
    torch.testing.assert_close(cut.advantages, torch.tensor([[8.0, 9.0], [0.0, 1.0]]))
    torch.testing.assert_close(cut.old_logp, -cut.advantages)
    assert cut.ref_logp is None and cut.metrics == {"advantage_mean": 1.0}


def test_stale_tokens_and_mask_stale() -> None:
    versions = torch.tensor([[0, 1, 2, 2], [2, 2, 1, 0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    stale = stale_tokens(versions, mask, 2)
    assert stale.tolist() == [[True, True, False, False], [False, False, True, False]]  # padding is never stale
    assert off_policy_mask(mask, stale, "mask_stale").tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    assert off_policy_mask(mask, stale, "tis") is mask and off_policy_mask(mask, stale, "none") is mask


# ---------------------------------------------------------------- KL, entropy, helpers


def test_kl_estimators_by_hand() -> None:
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    d = [-1.0 - -1.5, -2.0 - -1.0]  # logp − ref
    close(kl_penalty(logp, ref, "k1"), d)
    close(kl_penalty(logp, ref, "k2"), [0.5 * x * x for x in d])
    k3 = [math.exp(-x) + x - 1 for x in d]  # exp(ref−logp) − (ref−logp) − 1
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="k5"):
        kl_penalty(logp, ref, "k5")  # type: ignore[arg-type]


def test_a_kl_in_the_reward_defaults_to_k1_whose_score_gradient_is_the_kls():
    """A KL in the reward reaches π only through E_a~π[∇log π(a) · k(a)]. Over a 5-way softmax,
    exactly (no sampling): k1 gives ∇KL(π‖π_ref) itself; k3 (the in-loss default) gives
    ∇KL(π‖π_ref) − ∇KL(π_ref‖π), whose first-order terms cancel: here a tenth of the KL's gradient.
    So a KL in the reward defaults to k1."""
    from slime.config import AlgorithmConfig

    g = torch.Generator().manual_seed(0)
    ref_logits = torch.randn(5, generator=g, dtype=torch.float64)
    logits = (ref_logits + 0.3 * torch.randn(5, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits, retain_graph=True)

    def score_gradient(estimator: str) -> torch.Tensor:
        k = kl_penalty(logp.detach(), ref, estimator)  # a reward term: no gradient of its own
        (grad,) = torch.autograd.grad((logp.exp().detach() * logp * k).sum(), logits, retain_graph=True)
        return grad

    torch.testing.assert_close(score_gradient("k1"), true_grad)
    k3 = score_gradient("k3")
    assert k3.norm() < 0.3 * true_grad.norm()
    assert AlgorithmConfig(name="ppo", kl_mode="reward").kl_estimator == "k1"
    assert AlgorithmConfig(name="reinforce_pp").kl_estimator == "k1"
    assert AlgorithmConfig(name="ppo").kl_estimator == "low_var_kl"  # in the loss: verl's choice
    assert AlgorithmConfig(name="ppo", kl_mode="reward", kl_estimator="k3").kl_estimator == "k3"  # as set
    for name in ("grpo", "gspo", "cispo", "rloo", "dr_grpo"):  # one advantage per sequence: nothing to shape
        with pytest.raises(ValueError, match=f"kl_mode=reward: {name} has no per-token reward"):
            AlgorithmConfig(name=name, kl_mode="reward", kl_coef=0.01)


def test_low_var_kl_clamps_and_keeps_gradients_finite() -> None:
    logp = t([0.0, 0.0, 0.0]).requires_grad_(True)
    ref = t([-15.0, 100.0, -0.1])  # k3 = 14 -> 10; k3 = e^100 -> 10; small one untouched
    kl = kl_penalty(logp, ref, "low_var_kl")
    close(kl.detach(), [10.0, 10.0, math.exp(-0.1) + 0.1 - 1])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() == 0.0


def test_entropy_from_logits() -> None:
    V = 7
    close(entropy_from_logits(torch.zeros(2, 3, V, dtype=torch.float64)), [[math.log(V)] * 3] * 2)
    p = [0.5, 0.25, 0.25]
    logits = t([[math.log(x) + 3.0 for x in p]])  # a shift does not change the distribution
    close(entropy_from_logits(logits), [-sum(x * math.log(x) for x in p)])
    close(entropy_from_logits(t([[1000.0, 1000.0, -math.inf]])), [math.log(2)])


def test_masked_mean_and_whiten() -> None:
    x, mask = t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    close(masked_mean(t([[1, 3], [5, 5]]), t([[1, 1], [0, 0]]), dim=-1), [2.0, 0.0])
    s = math.sqrt(2 / 3 + 1e-8)
    close(masked_whiten(x, mask), [[-1 / s, 0.0, 1 / s, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[-1 / s + 2, 2.0, 1 / s + 2, 0.0]])


# ---------------------------------------------------------------- schedules


def test_adaptive_clip_shrinks_grows_and_clamps() -> None:
    cfg = AdaptiveClipConfig(enabled=True, kl_target=0.01, shrink=0.5, grow=2.0, min_clip=0.05, max_clip=0.4)
    clip = AdaptiveClip(cfg, 0.2, 0.28)
    assert clip.update(0.0151) == pytest.approx((0.1, 0.14))  # > 1.5·target: shrink
    assert clip.update(0.015) == pytest.approx((0.1, 0.14))  # the band edges are inside: unchanged
    assert clip.update(0.005) == pytest.approx((0.1, 0.14))
    assert clip.update(0.0049) == pytest.approx((0.2, 0.28))  # < 0.5·target: grow
    assert clip.update(0.0) == pytest.approx((0.4, 0.4))  # 0.56 clamped to max_clip
    state = clip.state_dict()
    for _ in range(6):
        clip.update(1.0)
    assert clip.update(1.0) == pytest.approx((0.05, 0.05))  # min_clip
    clip.load_state_dict(state)
    assert (clip.clip_low, clip.clip_high) == pytest.approx((0.4, 0.4))
    off = AdaptiveClip(AdaptiveClipConfig(enabled=False), 0.2, 0.28)
    assert off.update(1.0) == (0.2, 0.28)


def test_adaptive_kl_moves_beta_by_the_clipped_error_times_samples_over_horizon() -> None:
    kl = AdaptiveKL(0.1, target=0.02, horizon=1000)
    assert kl.update(0.03, 100) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error 0.5 -> clipped to 0.2
    assert kl.coef == pytest.approx(0.102)
    assert kl.update(0.01, 100) == pytest.approx(0.102 * (1 - 0.2 * 0.1))  # error −0.5 -> clipped to −0.2
    state = kl.state_dict()
    assert kl.update(0.021, 1000) == pytest.approx(state["coef"] * 1.05)  # error 0.05, unclipped
    assert kl.update(float("nan"), 100) == pytest.approx(state["coef"] * 1.05)  # no measurement, no move
    kl.load_state_dict(state)
    assert kl.coef == state["coef"]


@pytest.mark.parametrize(
    "settings, want",
    [
        ({}, [1.0] * 6),
        ({"lr_warmup_steps": 3}, [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0]),
        # decay from step W to the last step (5): progress (s − 2) / 3
        ({"lr_warmup_steps": 2, "lr_schedule": "linear"}, [0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0]),
        ({"lr_schedule": "linear", "min_lr_ratio": 0.2}, [1.0, 0.84, 0.68, 0.52, 0.36, 0.2]),
        (
            {"lr_schedule": "cosine", "min_lr_ratio": 0.1},
            [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 5)) for s in range(6)],
        ),
    ],
)
def test_lr_factor_warms_up_then_decays_to_min_lr_ratio_at_the_last_step(settings, want) -> None:
    cfg = LearnerConfig(**settings)
    assert [lr_factor(s, 6, cfg) for s in range(6)] == pytest.approx(want)
    assert lr_factor(9, 6, cfg) == pytest.approx(want[-1])  # past the last step (a resume with more steps)


def test_staged_kl_coef_boundaries() -> None:
    schedule = [StagedKL(until_step=10, coef=0.1), StagedKL(until_step=20, coef=0.01)]
    assert staged_kl_coef(0, schedule, 0.5) == 0.1
    assert staged_kl_coef(9, schedule, 0.5) == 0.1
    assert staged_kl_coef(10, schedule, 0.5) == 0.01
    assert staged_kl_coef(19, schedule, 0.5) == 0.01
    assert staged_kl_coef(20, schedule, 0.5) == 0.01  # past the last stage: its coef stays
    assert staged_kl_coef(1000, schedule, 0.5) == 0.01
    assert staged_kl_coef(3, [], 0.5) == 0.5


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo", "rloo", "dr_grpo", "reinforce_pp_baseline"])
def test_group_baseline_algorithms_refuse_groups_of_one(name):
    with pytest.raises(ValueError, match=f"n_samples_per_prompt must be >= 2 for algorithm.name={name} "):
        load_config(None, [f"algorithm.name={name}", "rollout.n_samples_per_prompt=1"])
    for alone in ("ppo", "reinforce_pp"):  # a critic, or the whole batch, is their baseline
        load_config(None, [f"algorithm.name={alone}", "rollout.n_samples_per_prompt=1"])


@pytest.mark.parametrize(
    ("name", "loss_agg"), [("grpo", "token_mean"), ("grpo", "seq_mean_token_sum"), ("dr_grpo", None)]
)
def test_the_kl_and_entropy_stats_are_per_token_whatever_the_aggregation(name: str, loss_agg: str | None) -> None:
    """The adaptive β reads stats['kl'] as a per-token KL: with KL 0.1 on every token of rows of 200
    and 100 tokens it must read 0.1, not the mean of the rows' sums (15) or Dr. GRPO's sums over C."""
    samples = []
    for i, length in enumerate([200, 100]):
        s = Sample(group_id="g", index=i, prompt_ids=[5, 6], max_new_tokens=400)
        s.append([11] * length, [-1.0] * length, 0)
        s.status, s.reward = Status.COMPLETED, float(i)
        samples.append(s)
    batch = collate(samples, [0, 0], 0)
    logp = torch.full(batch.mask.shape, -1.0)
    settings = {"name": name, "kl_coef": 0.01, "kl_estimator": "k1", "entropy_coef": 0.01}
    algo = make_algorithm(
        load_config(
            None,
            [f"algorithm.{k}={v}" for k, v in settings.items()]
            + ([f"algorithm.loss_agg={loss_agg}"] if loss_agg else []),
        )
    )
    fixed = algo.prepare(batch, kl_coef=0.01, old_logp=logp, ref_logp=logp - 0.1)
    entropy = torch.full(batch.mask.shape, 0.5)
    _, stats = algo.loss(
        batch,
        fixed,
        Forward(logp.clone().requires_grad_(True), entropy, None, None),
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.01,
    )
    assert stats["kl"] == pytest.approx(0.1, abs=1e-5) and stats["entropy"] == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_one_extreme_log_ratio_leaves_the_loss_and_gradient_finite(dual_clip: float | None) -> None:
    """log π_θ/π_old of +94 on one token (exp overflows float32) with a negative advantage: the loss
    and every gradient stay finite, so the step is not skipped; the other tokens keep their gradient."""
    mask = torch.ones(1, 3)
    advantages = torch.tensor([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, -95.0]])
    logp = torch.tensor([[-1.0, -1.2, -1.0]], requires_grad=True)
    loss, _ = policy_loss(logp, old, advantages, mask, 0.2, 0.28, dual_clip, "token_mean")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 2] == 0
