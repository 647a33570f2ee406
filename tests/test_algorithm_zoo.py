"""GSPO, CISPO, RLOO, REINFORCE++(-baseline), Dr. GRPO and DAPO overlong shaping: hand-computed
advantages, losses and gradients on small batches, exact gradient accumulation through the real
learner, and a 2-step job per algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slime.algorithms import ALGORITHMS, make_algorithm
from slime.algorithms.batch import Batch, Forward, UpdateTensors, collate
from slime.algorithms.cispo import CISPO, cispo_policy_loss
from slime.algorithms.core import policy_loss
from slime.algorithms.corrections import Correction, make_correction
from slime.algorithms.dr_grpo import DrGRPO
from slime.algorithms.grpo_passk import best_of_group_advantages
from slime.algorithms.gspo import GSPO, gspo_policy_loss
from slime.algorithms.opo import length_weighted_baseline_advantages
from slime.algorithms.reinforce_pp import ReinforcePP, ReinforcePPBaseline, discounted_returns
from slime.algorithms.rloo import RLOO, leave_one_out_advantages
from slime.algorithms.shaping import overlong_penalty, shape_scores
from slime.buffer import TrajectoryStore
from slime.config import AlgorithmConfig, CispoConfig, ConfigError, DrGrpoConfig, load_config
from slime.learner import Learner
from slime.sample import Sample, Status
from slime.train import train

NEW = ["gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo"]
# Their own advantages on GRPO's loss: the loss's micro-batching is GRPO's (not tested again).
ADVANTAGES_ON_GRPO = ["opo", "grpo_passk"]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual.to(torch.float64), t(expected), rtol=0, atol=atol)


def _none() -> Correction:
    return make_correction(load_config(None, ["algorithm.correction.name=none"]).algorithm.correction)


def _batch(rows: list[tuple[float | None, int]], groups: list[int], max_new_tokens: int = 8) -> Batch:
    """One sample per (reward, number of response tokens); reward None: a failed sample."""
    samples = []
    for i, (reward, n) in enumerate(rows):
        status = Status.FAILED if reward is None else Status.COMPLETED
        s = Sample("g", i, [1, 2], max_new_tokens, status=status, reward=reward)
        s.append([3] * n, [-1.0] * n, 0)
        samples.append(s)
    return collate(samples, groups, pad_id=0)


def _forward(logp: torch.Tensor, entropy: torch.Tensor | None = None) -> Forward:
    return Forward(logp, entropy, None, None)


# ---------------------------------------------------------------- registry and config


def test_every_algorithm_is_registered_and_criticless() -> None:
    for name in [*NEW, *ADVANTAGES_ON_GRPO]:
        algo = make_algorithm(load_config(None, [f"algorithm.name={name}"]))
        assert isinstance(algo, ALGORITHMS[name]) and not algo.needs_critic


def test_sequence_level_losses_get_a_sequence_weighted_aggregation() -> None:
    # The learner weighs micro-batches by tokens under token_mean: wrong for a mean over sequences.
    assert load_config(None, ["algorithm.name=gspo"]).algorithm.loss_agg == "seq_mean_token_mean"
    assert load_config(None, ["algorithm.name=dr_grpo"]).algorithm.loss_agg == "seq_mean_token_sum"
    ok = load_config(None, ["algorithm.name=dr_grpo", "algorithm.loss_agg=seq_mean_token_mean"])
    assert ok.algorithm.loss_agg == "seq_mean_token_mean"
    for name in ("gspo", "dr_grpo"):
        with pytest.raises(ConfigError, match="loss_agg"):
            load_config(None, [f"algorithm.name={name}", "algorithm.loss_agg=token_mean"])
    assert load_config(None, ["algorithm.name=cispo"]).algorithm.loss_agg == "token_mean"
    cfg = AlgorithmConfig()
    assert (cfg.gspo.clip_low, cfg.gspo.clip_high, cfg.cispo.clip_high) == (3e-4, 4e-4, 0.28)
    assert cfg.overlong_buffer is None and cfg.overlong_penalty == 1.0 and cfg.dr_grpo.norm_tokens is None


# ---------------------------------------------------------------- DAPO overlong shaping


def test_overlong_penalty_by_hand() -> None:
    # L_max = 10, L_cache = 4: free up to 6, then linear to −p at 10, −p beyond
    lengths = torch.tensor([5, 6, 7, 8, 10, 11])
    budget = torch.full((6,), 10)
    close(overlong_penalty(lengths, budget, 4, 1.0), [0, 0, -0.25, -0.5, -1.0, -1.0], atol=1e-7)
    close(overlong_penalty(lengths, budget, 4, 2.0), [0, 0, -0.5, -1.0, -2.0, -2.0], atol=1e-7)
    # per-row budgets: the same length is free under one and penalised under the other
    close(overlong_penalty(torch.tensor([8, 8]), torch.tensor([20, 10]), 4, 1.0), [0, -0.5], atol=1e-7)


def test_shape_scores_and_its_metrics() -> None:
    batch = _batch([(1.0, 6), (1.0, 8), (None, 10), (0.0, 10)], [0, 0, 0, 1], max_new_tokens=10)
    scores, metrics = shape_scores(batch.scores, batch, AlgorithmConfig())
    assert scores is batch.scores and metrics == {}
    scores, metrics = shape_scores(batch.scores, batch, AlgorithmConfig(overlong_buffer=4))
    close(scores, [1.0, 0.5, -1.0, -1.0], atol=1e-7)
    # the failed row (no trainable tokens) is not counted
    assert metrics["overlong_penalty_mean"] == pytest.approx((0 - 0.5 - 1.0) / 3)
    assert metrics["overlong_share"] == pytest.approx(2 / 3)


def test_overlong_shaping_moves_grpo_advantages() -> None:
    # equal rewards, so no signal, until the longer response pays −0.5
    batch = _batch([(1.0, 6), (1.0, 8)], [0, 0], max_new_tokens=10)
    grpo = ALGORITHMS["grpo"]
    off = grpo(AlgorithmConfig(grpo_std_normalize=False), _none()).prepare(
        batch, kl_coef=0.0, old_logp=None, ref_logp=None
    )
    assert off.advantages.abs().sum() == 0 and off.metrics == {}
    on = grpo(AlgorithmConfig(grpo_std_normalize=False, overlong_buffer=4), _none()).prepare(
        batch, kl_coef=0.0, old_logp=None, ref_logp=None
    )
    close(on.advantages[:, :8], [[0.25] * 6 + [0, 0], [-0.25] * 8], atol=1e-7)
    assert on.metrics["overlong_penalty_mean"] == pytest.approx(-0.25)


# grpo_passk: its own test (the best's margin over the runner-up may not move with these scores)
@pytest.mark.parametrize("name", ["grpo", "ppo", *NEW, "opo"])
def test_every_algorithm_reports_the_shaping(name: str) -> None:
    # three distinct shaped scores: REINFORCE++'s whitening would undo a shift of two values
    batch = _batch([(1.0, 3), (0.0, 8), (0.0, 4)], [0, 0, 0], max_new_tokens=8)
    values = torch.zeros_like(batch.mask) if name == "ppo" else None
    advantages = []
    for buffer in (None, 2):
        cfg = AlgorithmConfig(name=name, overlong_buffer=buffer, overlong_penalty=0.5, grpo_std_normalize=False)
        fixed = ALGORITHMS[name](cfg, _none()).prepare(
            batch, kl_coef=0.0, old_logp=None, ref_logp=None, old_values=values
        )
        advantages.append(fixed.advantages)
    assert fixed.metrics["overlong_penalty_mean"] == pytest.approx(-0.5 / 3)  # only length 8 = L_max pays
    assert fixed.metrics["overlong_share"] == pytest.approx(1 / 3)
    assert not torch.allclose(advantages[0], advantages[1])  # the penalty reached the advantages


def test_ppo_refuses_overlong_shaping_of_streamed_segments() -> None:
    batch = _batch([(1.0, 3)], [0])
    ppo = ALGORITHMS["ppo"](AlgorithmConfig(name="ppo", overlong_buffer=2), _none())
    with pytest.raises(ValueError, match="streaming"):
        ppo.prepare(
            batch,
            kl_coef=0.0,
            old_logp=None,
            ref_logp=None,
            old_values=torch.zeros_like(batch.mask),
            bootstrap_values=torch.zeros(1),
        )


# ---------------------------------------------------------------- GSPO

EPS_LOW, EPS_HIGH = 3e-4, 4e-4


def _gspo_case():
    """Three responses (2, 3 and 1 tokens; padding holds junk that must not count):
    row 0: Â = +1, mean log ratio −0.1: s below the range, Â > 0, so min takes s·Â (unclipped);
    row 1: Â = +1, mean log ratio +0.001: s = e^0.001 > 1 + 4e-4, clipped (no gradient);
    row 2: Â = −0.5, log ratio 0.05: s above the range, Â < 0, so min takes s·Â (unclipped)."""
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    old = t([[-1.0, -2.0, 0.0], [-0.5, -0.7, -0.9], [-1.2, 0.0, 0.0]])
    log_ratio = t([[0.1, -0.3, 9.0], [0.002, 0.0, 0.001], [0.05, 9.0, 9.0]])
    adv = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [-0.5, 0.0, 0.0]])
    return mask, old, old + log_ratio, adv


def test_gspo_loss_and_stats_by_hand() -> None:
    mask, old, logp, adv = _gspo_case()
    s = [math.exp(-0.1), math.exp(0.001), math.exp(0.05)]
    loss, stats = gspo_policy_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    want = (-s[0] - (1 + EPS_HIGH) + 0.5 * s[2]) / 3  # mean over sequences of −min(sÂ, clip(s)Â)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert stats["pg_loss"] == pytest.approx(want, abs=1e-12)
    assert stats["seq_ratio_mean"] == pytest.approx(sum(s) / 3)
    assert stats["seq_ratio_max"] == pytest.approx(s[2])
    assert stats["seq_clipfrac"] == pytest.approx(1 / 3)
    token_ratios = [math.exp(x) for x in (0.1, -0.3, 0.002, 0.0, 0.001, 0.05)]
    assert stats["ratio_mean"] == pytest.approx(sum(token_ratios) / 6)  # token ratios, not s_i
    assert stats["ratio_max"] == pytest.approx(math.exp(0.1))


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient() -> None:
    mask, old, logp, adv = _gspo_case()
    logp.requires_grad_(True)
    loss, _ = gspo_policy_loss(logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    s0, s2 = math.exp(-0.1), math.exp(0.05)
    # ∂L/∂logp_{i,t} = −(1/G) Â_i s_i / |y_i| on every token of an unclipped sequence: the same for
    # all its tokens, whatever their own ratio (0.1 and −0.3 in row 0); 0 for the clipped row 1.
    close(logp.grad, [[-s0 / 6, -s0 / 6, 0], [0, 0, 0], [0.5 * s2 / 3, 0, 0]])
    # The same gradient as differentiating the sequence-level objective directly.
    direct_logp = logp.detach().clone().requires_grad_(True)
    seq = torch.exp(((direct_logp - old) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    direct = -torch.minimum(seq * a, seq.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a).mean()
    direct.backward()
    close(logp.grad, direct_logp.grad.tolist(), atol=1e-12)


def test_gspo_algorithm_uses_its_own_clip_and_grpo_advantages() -> None:
    batch = _batch([(1.0, 2), (0.0, 2)], [0, 0])
    gspo = GSPO(AlgorithmConfig(name="gspo", grpo_std_normalize=False), _none())
    fixed = gspo.prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(fixed.advantages, [[0.5, 0.5], [-0.5, -0.5]])
    fixed.old_logp = torch.zeros(2, 2)
    logp = torch.full((2, 2), 0.01, requires_grad=True)  # s = e^0.01 for both rows: outside ±4e-4
    loss, stats = gspo.loss(batch, fixed, _forward(logp), clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    # row 0 (Â > 0) is clipped to 1 + 4e-4; row 1 (Â < 0) takes s: the learner's 0.2/0.28 is not used
    want = (-(1 + EPS_HIGH) * 0.5 + math.exp(0.01) * 0.5) / 2
    assert loss.item() == pytest.approx(want, abs=1e-7)  # float32
    assert stats["seq_clipfrac"] == pytest.approx(0.5) and stats["loss"] == pytest.approx(want, abs=1e-7)


# ---------------------------------------------------------------- CISPO


def test_cispo_loss_and_gradient_by_hand() -> None:
    """ε = 0.28: ratios 0.5, 1, 2 give detached weights 0.5, 1, 1.28; ℓ_t = −w_t Â_t log π_t."""
    logp = t([[-1.0, -2.0, -0.5, 7.0]]).requires_grad_(True)  # the last position is padding
    old = logp.detach() - t([[math.log(0.5), 0.0, math.log(2.0), 0.0]])
    adv = t([[1.0, 1.0, 1.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = cispo_policy_loss(logp, old, adv, mask, 0.28, "token_mean")
    want = (0.5 * 1.0 + 1.0 * 2.0 + 1.28 * 0.5) / 3
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert stats["clipfrac"] == pytest.approx(1 / 3) and stats["ratio_max"] == pytest.approx(2.0)
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 1 + 1.28) / 3)
    loss.backward()
    # every token keeps a gradient, the one whose ratio (2) is above the cap included
    close(logp.grad, [[-0.5 / 3, -1.0 / 3, -1.28 / 3, 0.0]])
    # PPO's clipped surrogate drops that token's gradient (Â > 0, r > 1 + ε)
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo, _ = policy_loss(ppo_logp, old, adv, mask, 0.2, 0.28, None, "token_mean")
    ppo.backward()
    assert ppo_logp.grad[0, 2].item() == 0.0 and logp.grad[0, 2].item() != 0.0


def test_cispo_algorithm_by_hand() -> None:
    batch = _batch([(1.0, 2), (0.0, 1)], [0, 0])
    cispo = CISPO(AlgorithmConfig(name="cispo", grpo_std_normalize=False, cispo=CispoConfig(clip_high=0.5)), _none())
    fixed = cispo.prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(fixed.advantages, [[0.5, 0.5], [-0.5, 0.0]])
    fixed.old_logp = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    logp = torch.tensor([[-1.0 + math.log(3.0), -1.0], [-1.0, 0.0]], requires_grad=True)
    loss, stats = cispo.loss(batch, fixed, _forward(logp), clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    # weights 1.5 (ratio 3, capped at 1 + 0.5), 1, 1; token_mean over the 3 trainable tokens
    want = (-1.5 * 0.5 * (-1.0 + math.log(3.0)) - 1.0 * 0.5 * -1.0 - 1.0 * -0.5 * -1.0) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6) and stats["clipfrac"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- RLOO


def test_leave_one_out_advantages_by_hand() -> None:
    scores = t([1.0, 0.0, 0.5, 2.0, 0.1, 0.1])
    groups = torch.tensor([7, 7, 7, 3, 5, 5])  # group 3 has one member, group 5 is constant
    # Â_i = r_i − mean of the others: 1 − 0.25, 0 − 0.75, 0.5 − 0.5
    close(leave_one_out_advantages(scores, groups), [0.75, -0.75, 0.0, 0.0, 0.0, 0.0])
    # = G/(G−1)·(r_i − mean)
    mean = 0.5
    close(leave_one_out_advantages(scores[:3], groups[:3]), [1.5 * (x - mean) for x in (1.0, 0.0, 0.5)])
    assert leave_one_out_advantages(t([]), torch.tensor([], dtype=torch.long)).numel() == 0


def test_rloo_prepare_and_loss_by_hand() -> None:
    # group 0: rewards 1, 0 and a failed row (not in the baseline); group 1: a single response
    batch = _batch([(1.0, 2), (0.0, 1), (None, 2), (3.0, 1)], [0, 0, 0, 1])
    rloo = RLOO(AlgorithmConfig(name="rloo"), _none())
    fixed = rloo.prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(fixed.advantages, [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    logp = torch.full((4, 2), -1.0, requires_grad=True)
    loss, stats = rloo.loss(batch, fixed, _forward(logp), clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    # ratio 1: ℓ = −Â per trainable token; token mean of −(1 + 1 − 1 + 0) over the 4 trainable tokens
    assert loss.item() == pytest.approx(-(1 + 1 - 1) / 4) and stats["clipfrac"] == 0.0


# ---------------------------------------------------------------- OPO and pass@k


def test_opo_baseline_is_the_length_weighted_group_mean_by_hand() -> None:
    # group 0: r 1 over 2 tokens, r 0 over 6, a failed row; b = (2·1 + 6·0) / 8 = 0.25
    # group 1: equal rewards (0 exactly); group 2: a single response (its own baseline: 0)
    batch = _batch([(1.0, 2), (0.0, 6), (None, 3), (0.5, 1), (0.5, 4), (2.0, 3)], [0, 0, 0, 1, 1, 2])
    opo = ALGORITHMS["opo"](AlgorithmConfig(name="opo"), _none())
    fixed = opo.prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(fixed.advantages[:, 0], [0.75, -0.25, 0.0, 0.0, 0.0, 0.0], atol=1e-7)
    close(fixed.advantages[:2], [[0.75] * 2 + [0.0] * 4, [-0.25] * 6], atol=1e-7)  # Â_i on each token of o_i
    # against GRPO without std: the plain mean 0.5 would give ±0.5
    weights = torch.tensor([2.0, 6.0])
    assert length_weighted_baseline_advantages(t([1.0, 0.0]), weights, torch.tensor([0, 0])).tolist() == [0.75, -0.25]
    logp = torch.full((6, 6), -1.0, requires_grad=True)
    loss, stats = opo.loss(batch, fixed, _forward(logp), clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    # ratio 1: ℓ = −Â per token, token mean over the 16 trainable tokens (failed row: none)
    assert loss.item() == pytest.approx(-(2 * 0.75 - 6 * 0.25) / 16, abs=1e-7) and stats["clipfrac"] == 0.0


def test_passk_reinforces_only_the_best_by_its_margin_by_hand() -> None:
    # group 0: best 0.9 (row 1) over the runner-up 0.5; group 1: tied best: 0; group 2: one response
    scores = t([0.2, 0.9, 0.5, 0.7, 0.7, 0.1, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    close(best_of_group_advantages(scores, groups, std_normalize=False), [0, 0.4, 0, 0, 0, 0, 0], atol=1e-7)
    std = float(np.std([0.2, 0.9, 0.5]))  # population std
    close(best_of_group_advantages(scores, groups), [0, 0.4 / (std + 1e-6), 0, 0, 0, 0, 0], atol=1e-6)
    # any group ids in any order: the same per group
    shuffled = best_of_group_advantages(t([0.5, 0.1, 0.9, 0.2]), torch.tensor([7, 3, 7, 3]), std_normalize=False)
    close(shuffled, [0, 0, 0.4, 0.1], atol=1e-7)


def test_passk_job_side_skips_failed_rows_and_takes_the_shaping() -> None:
    # the failed row (reward None) would be the best; L_max 8, buffer 2: length 8 pays 0.5
    batch = _batch([(1.0, 8), (0.8, 3), (None, 2), (0.0, 4)], [0, 0, 0, 0], max_new_tokens=8)
    for buffer, expected in ((None, 0.2), (2, 0.3)):  # 1 − 0.8; then 0.8 − (1 − 0.5)
        cfg = AlgorithmConfig(name="grpo_passk", overlong_buffer=buffer, overlong_penalty=0.5, grpo_std_normalize=False)
        fixed = ALGORITHMS["grpo_passk"](cfg, _none()).prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
        best = 0 if buffer is None else 1
        expected_rows = [0.0] * 4
        expected_rows[best] = expected
        close(fixed.advantages[:, 0], expected_rows, atol=1e-7)


def test_opo_and_passk_need_groups() -> None:
    for name in ADVANTAGES_ON_GRPO:
        with pytest.raises(ConfigError, match="n_samples_per_prompt must be >= 2"):
            load_config(None, [f"algorithm.name={name}", "rollout.n_samples_per_prompt=1"])


# ---------------------------------------------------------------- REINFORCE++


def test_discounted_returns_skip_tool_tokens() -> None:
    r = [0.1, 5.0, -0.2, 1.0]  # position 1 is a tool token: not a step
    g3 = 1.0
    g2 = -0.2 + 0.9 * g3
    g0 = 0.1 + 0.9 * g2
    close(discounted_returns(t([r]), t([[1, 0, 1, 1]]), 0.9), [[g0, 0.0, g2, g3]])


def _whiten(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_prepare_by_hand(baseline: bool) -> None:
    """γ = 0.9, β = 0.2, k1 KL on the behaviour log-probs (all −1) vs π_ref."""
    batch = _batch([(1.0, 3), (0.0, 2)], [0, 0])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -1.5, 0.0]])  # KL_t = μ − ref: .5 on (0,0) and (1,1)
    cfg = AlgorithmConfig(name="reinforce_pp", gamma=0.9, kl_estimator="k1", kl_mode="loss")
    algo = (ReinforcePPBaseline if baseline else ReinforcePP)(cfg, _none())
    fixed = algo.prepare(batch, kl_coef=0.2, old_logp=None, ref_logp=ref)
    s0, s1 = (0.5, -0.5) if baseline else (1.0, 0.0)  # the baseline centres the group's scores
    r0 = [-0.1, 0.0, s0]
    r1 = [0.0, s1 - 0.1]
    g0 = [r0[0] + 0.9 * r0[1] + 0.81 * r0[2], r0[1] + 0.9 * r0[2], r0[2]]
    g1 = [r1[0] + 0.9 * r1[1], r1[1]]
    adv = _whiten(g0 + g1)
    close(fixed.advantages, [adv[:3], adv[3:] + [0.0]], atol=1e-5)
    assert fixed.metrics["return_mean"] == pytest.approx(sum(g0 + g1) / 5, abs=1e-6)
    assert fixed.metrics["kl_reward_mean"] == pytest.approx(1.0 / 5)
    # the KL was paid in the reward: no KL term in the loss, even with kl_mode="loss"
    assert fixed.ref_logp is None
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, stats = algo.loss(batch, fixed, _forward(logp), clip_low=0.2, clip_high=0.28, kl_coef=0.2)
    assert "kl" not in stats and loss.item() == pytest.approx(-sum(adv) / 5, abs=1e-6)


def test_reinforce_pp_without_kl_and_failed_rows() -> None:
    batch = _batch([(1.0, 2), (None, 2), (0.0, 2)], [0, 0, 0])
    cfg = AlgorithmConfig(name="reinforce_pp", gamma=1.0)
    fixed = ReinforcePP(cfg, _none()).prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    adv = _whiten([1.0, 1.0, 0.0, 0.0])  # γ = 1: every token of a response carries its score
    close(fixed.advantages, [adv[:2], [0.0, 0.0], adv[2:]], atol=1e-5)
    assert "kl_reward_mean" not in fixed.metrics


def test_reinforce_pp_baseline_takes_the_group_mean_off_rows_with_token_rewards() -> None:
    """A row whose reward comes as token rewards (env.turn_rewards, a PRM) keeps them, and the baseline
    variant still subtracts its group's mean score: the same advantages as with scalar rewards when
    the token rewards sum to the score."""
    scalar = _batch([(1.0, 3), (1.0, 3), (0.0, 3), (1.0, 3)], [0, 0, 1, 1])
    per_token = _batch([(1.0, 3), (1.0, 3), (0.0, 3), (1.0, 3)], [0, 0, 1, 1])
    per_token.token_rewards = torch.tensor([[0.0, 0.0, r] for r in (1.0, 1.0, 0.0, 1.0)])
    per_token.token_reward_rows = torch.ones(4, dtype=torch.bool)
    cfg = AlgorithmConfig(name="reinforce_pp_baseline", gamma=1.0)
    want = ReinforcePPBaseline(cfg, _none()).prepare(scalar, kl_coef=0.0, old_logp=None, ref_logp=None)
    got = ReinforcePPBaseline(cfg, _none()).prepare(per_token, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(got.advantages, want.advantages, atol=1e-6)
    close(got.advantages[:2], torch.zeros(2, 3), atol=1e-6)  # a group with equal rewards: nothing to learn
    plain = ReinforcePP(cfg, _none()).prepare(per_token, kl_coef=0.0, old_logp=None, ref_logp=None)
    assert plain.advantages[0, 0] > 0  # plain REINFORCE++ has no group baseline


# ---------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_prepare_centres_without_std() -> None:
    batch = _batch([(1.0, 2), (0.0, 1), (0.0, 1), (5.0, 1)], [0, 0, 0, 1])
    fixed = DrGRPO(AlgorithmConfig(name="dr_grpo"), _none()).prepare(batch, kl_coef=0.0, old_logp=None, ref_logp=None)
    close(fixed.advantages, [[2 / 3, 2 / 3], [-1 / 3, 0], [-1 / 3, 0], [0, 0]], atol=1e-7)


@pytest.mark.parametrize("norm", [None, 4])
def test_dr_grpo_loss_sums_tokens_over_a_constant(norm: int | None) -> None:
    """Ratio 1: ℓ = −Â per token. Row 0 (2 tokens, Â = 1) sums to −2, row 1 (1 token, Â = −1) to
    +1; C = 8 (max_new_tokens) or 4; the mean over the 2 sequences."""
    batch = _batch([(1.0, 2), (0.0, 1)], [0, 0], max_new_tokens=8)
    c = 8 if norm is None else norm
    algo = DrGRPO(AlgorithmConfig(name="dr_grpo", dr_grpo=DrGrpoConfig(norm_tokens=norm), entropy_coef=0.1), _none())
    fixed = UpdateTensors(advantages=torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    entropy = torch.tensor([[1.0, 1.0], [2.0, 9.0]])  # position (1, 1) is padding
    loss, stats = algo.loss(batch, fixed, _forward(logp, entropy), clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    pg = (-2 / c + 1 / c) / 2
    ent = (2 / c + 2 / c) / 2  # the loss's entropy term: each row's sum over C
    assert stats["pg_loss"] == pytest.approx(pg) and stats["entropy"] == pytest.approx(4 / 3)  # per token
    assert loss.item() == pytest.approx(pg - 0.1 * ent) and stats["dr_grpo_norm"] == c
    loss.backward()
    # every token's gradient is −Â/(G·C): no 1/|y_i|, so row 0's tokens weigh what row 1's does
    close(logp.grad, [[-1 / (2 * c)] * 2, [1 / (2 * c), 0.0]], atol=1e-7)


# ---------------------------------------------------------------- the real learner


def _fill(buffer: TrajectoryStore, groups: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for g in range(groups):
        buffer.add_group([6, 7, 77, 61, 86], n, 16, {"task": "repeat", "label": "ababab"})
        for s in buffer.lease(f"w{g}", n):
            length = int(rng.integers(2, 16))
            buffer.append_chunk(s.id, f"w{g}", rng.integers(3, 100, size=length), -rng.random(length), 0)
            buffer.finish(s.id, f"w{g}", Status.COMPLETED, reward=float(rng.random()))


@pytest.mark.parametrize("name", NEW)
def test_gradient_accumulation_equals_one_batch(tiny_model_dir, redis_url, tmp_path, name: str) -> None:
    """Micro-batches of 3 give the gradient of one batch of 8: each algorithm's aggregate and the
    learner's micro-batch weights (tokens or sequences, from loss_agg) fit together."""
    grads = []
    for micro in (32, 3):
        job = f"zoo-accum-{name}-{micro}"
        buffer = TrajectoryStore.open(redis_url, job)
        buffer.delete_job()
        _fill(buffer, groups=2, n=4, seed=11)
        cfg = load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"algorithm.name={name}",
                f"learner.micro_batch_size={micro}",
                "rollout.batch_size=2",
                "algorithm.router_aux_coef=0",
                "algorithm.entropy_coef=0.01",
                "algorithm.overlong_buffer=6",
            ],
        )
        learner = Learner(cfg, str(tiny_model_dir), redis_url)
        m = learner.train_step(0, num_groups=2)
        assert m["samples"] == 8 and np.isfinite(m["loss"])
        grads.append({n: p.grad.clone() for n, p in learner.policy.named_parameters() if p.grad is not None})
        buffer.delete_job()
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in grads[0]:
        assert torch.allclose(grads[0][key], grads[1][key], rtol=1e-4, atol=1e-7), key


# ---------------------------------------------------------------- whole jobs

SMALL = [
    "rollout.batch_size=3",
    "rollout.n_samples_per_prompt=3",
    "rollout.max_new_tokens=40",
    "data.num_generated=64",
    "logging.progress=false",
    "weights.check_every=1",
    # The algorithms run in the learner, the same code under either launcher; local spares each job
    # its actor processes. The Ray path: tests/test_train_e2e.py.
    "cluster.launcher=local",
]
EXPECTED_METRICS = {
    "gspo": {"seq_ratio_mean", "seq_ratio_max", "seq_clipfrac"},
    "cispo": {"is_weight_mean", "clipfrac"},
    "rloo": {"pg_loss", "clipfrac"},
    "reinforce_pp": {"return_mean", "kl_reward_mean"},
    "reinforce_pp_baseline": {"return_mean", "kl_reward_mean"},
    "dr_grpo": {"dr_grpo_norm"},
    "opo": {"pg_loss", "clipfrac"},
    "grpo_passk": {"pg_loss", "clipfrac"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*NEW, *ADVANTAGES_ON_GRPO])
def test_two_step_job(tiny_model_dir, redis_url, tmp_path, name: str) -> None:
    job = f"zoo-e2e-{name}"
    kl = ["algorithm.kl_coef=0.01"] if name.startswith("reinforce_pp") else []
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                *SMALL,
                "steps=2",
                f"algorithm.name={name}",
                "algorithm.overlong_buffer=16",
                *kl,
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1]
    for h in history:
        assert h["trained_tokens"] > 0 and math.isfinite(h["loss"]) and math.isfinite(h["pg_loss"])
        assert EXPECTED_METRICS[name] <= set(h), set(h)
        assert -1.0 <= h["overlong_penalty_mean"] <= 0.0 and 0.0 <= h["overlong_share"] <= 1.0
        assert "vf_loss" not in h
    if name == "dr_grpo":
        assert all(h["dr_grpo_norm"] == 40 for h in history)  # rollout.max_new_tokens
    TrajectoryStore.open(redis_url, job).delete_job()
