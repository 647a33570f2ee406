"""The learner's formulas against verl's (verl/trainer/ppo/core_algos.py, read at commit b178a3c),
re-derived here in float64 (the `_v_*` helpers), on a batch of 6 rows with a multi-turn gap; and
what a verl user's keys do at load: refused with the key that stands for them, or named in a warning
when the algorithm does not read them. docs/learner.md "The formulas against verl's" lists where the
two differ on purpose; those tests pin the difference, not an agreement."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from slime.algorithms import ALGORITHMS
from slime.algorithms.batch import Batch, Forward
from slime.algorithms.core import aggregate_loss, entropy_from_logits, masked_whiten, policy_loss
from slime.algorithms.corrections import make_correction
from slime.algorithms.grpo import group_advantages
from slime.algorithms.gspo import gspo_policy_loss
from slime.algorithms.kl import kl_penalty
from slime.algorithms.ppo import explained_variance, gae, token_level_rewards, value_loss
from slime.algorithms.reinforce_pp import discounted_returns
from slime.algorithms.rloo import leave_one_out_advantages
from slime.config import AlgorithmConfig, ConfigError, CorrectionConfig, load_config

D = torch.float64


# ----------------------------------------------------------------------------- verl, re-derived
def _mm(x, m):
    return (x * m).sum() / m.sum()


def _v_whiten(x, m):  # verl_F.masked_whiten: unbiased (Bessel) variance over the mask
    mu = _mm(x, m)
    n = m.sum()
    var = _mm((x - mu) ** 2, m) * n / (n - 1)
    return (x - mu) * torch.rsqrt(var + 1e-8)


def _v_grpo(scores, index, m, std=True, eps=1e-6):
    out = scores.clone()
    for g in index.unique():
        sel = index == g
        s = scores[sel]
        mu, sd = (s.mean(), s.std()) if sel.sum() > 1 else (torch.tensor(0.0, dtype=D), torch.tensor(1.0, dtype=D))
        out[sel] = (s - mu) / (sd + eps) if std else s - mu
    return out[:, None] * m


def _v_rloo(scores, index, m):
    out = scores.clone()
    for g in index.unique():
        sel = index == g
        n = int(sel.sum())
        if n > 1:
            out[sel] = (scores[sel] - scores[sel].mean()) * n / (n - 1)
    return out[:, None] * m


def _v_gae_raw(r, v, m, gamma, lam):
    nv = torch.zeros(r.shape[0], dtype=D)
    lg = torch.zeros(r.shape[0], dtype=D)
    adv = []
    for t in reversed(range(r.shape[1])):
        d = r[:, t] + gamma * nv - v[:, t]
        lg_ = d + gamma * lam * lg
        nv = v[:, t] * m[:, t] + (1 - m[:, t]) * nv
        lg = lg_ * m[:, t] + (1 - m[:, t]) * lg
        adv.append(lg)
    adv = torch.stack(adv[::-1], 1)
    return adv, adv + v


def _v_agg(L, m, mode):
    if mode == "token_mean":
        return (L * m).sum() / m.sum()
    sm = (m.sum(-1) > 0).to(D)
    if mode == "seq_mean_token_sum":
        return ((L * m).sum(-1) * sm).sum() / sm.sum()
    return (((L * m).sum(-1) / (m.sum(-1) + 1e-8)) * sm).sum() / sm.sum()


def _v_pg(old, logp, A, m, lo, hi, c, mode):
    ratio = (logp - old).clamp(-20, 20).exp()
    l1, l2 = -A * ratio, -A * ratio.clamp(1 - lo, 1 + hi)
    cl1 = torch.maximum(l1, l2)
    l3 = -A * c
    L = torch.where(A < 0, torch.minimum(l3, cl1), cl1)
    clipfrac = _mm((l2 > l1).to(D), m)
    lower = _mm(((cl1 > l3) & (A < 0)).to(D), m)
    return _v_agg(L, m, mode), clipfrac, lower


def _v_vf(vpred, ret, v, m, clip, mode):
    vc = torch.max(torch.min(vpred, v + clip), v - clip)
    a, b = (vpred - ret) ** 2, (vc - ret) ** 2
    return 0.5 * _v_agg(torch.max(a, b), m, mode), _mm((b > a).to(D), m)


def _v_kl(lp, rf, kind):
    if kind == "k1":
        return lp - rf
    if kind == "k2":
        return 0.5 * (lp - rf) ** 2
    k = (rf - lp).clamp(-20, 20)  # verl's "low_var_kl" and "k3" (both clamped to [-10, 10])
    return (k.exp() - k - 1).clamp(-10, 10)


def _v_gspo(old, logp, A, m, lo, hi):
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    r = (logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0).exp()
    return _v_agg(torch.maximum(-A * r, -A * r.clamp(1 - lo, 1 + hi)), m, "seq_mean_token_mean")


# ----------------------------------------------------------------------------- the tiny batch
@pytest.fixture
def tb():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 1, 1],  # multi-turn: positions 2-3 are observation tokens (mask 0)
            [1, 1, 1, 1, 0, 0, 0],
        ],
        dtype=D,
    )
    B, T = mask.shape
    logp = -torch.rand(B, T, generator=g, dtype=D) * 2
    return dict(
        mask=mask,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 0.0], dtype=D),
        index=torch.tensor([0, 0, 0, 1, 1, 1]),
        logp=logp,
        old=logp + torch.randn(B, T, generator=g, dtype=D) * 0.4,
        ref=logp + torch.randn(B, T, generator=g, dtype=D) * 0.5,
        values=torch.randn(B, T, generator=g, dtype=D) * 0.5,
        new_values=None,
        gen=g,
    )


# ----------------------------------------------------------------------------- matches
def test_match_rloo_and_drgrpo_advantages(tb):
    m, s, i = tb["mask"], tb["scores"], tb["index"]
    assert (leave_one_out_advantages(s, i)[:, None] * m - _v_rloo(s, i, m)).abs().max() < 1e-12
    assert (group_advantages(s, i, std_normalize=False)[:, None] * m - _v_grpo(s, i, m, std=False)).abs().max() < 1e-12


def test_match_grpo_up_to_the_documented_population_std(tb):
    m, s, i = tb["mask"], tb["scores"], tb["index"]
    ours = group_advantages(s, i)[:, None] * m
    assert (ours - _v_grpo(s, i, m)).abs().max() > 0.2  # documented: population std, sqrt(G/(G-1)) larger
    assert (ours * math.sqrt(2 / 3) - _v_grpo(s, i, m)).abs().max() < 1e-5  # G = 3; only eps placement differs


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95)])
def test_match_gae_with_observation_tokens(tb, gamma, lam):
    m = tb["mask"]
    r = token_level_rewards(tb["scores"], m)
    adv, ret = gae(r, tb["values"], m, gamma, lam)
    vadv, vret = _v_gae_raw(r, tb["values"], m, gamma, lam)
    assert (adv * m - vadv * m).abs().max() < 1e-12
    assert (ret * m - vret * m).abs().max() < 1e-12
    # whitening: population variance here, Bessel in verl; equal after the sqrt(n/(n-1)) factor
    n = m.sum()
    assert (masked_whiten(adv, m) * m - _v_whiten(vadv, m) * m * torch.sqrt(n / (n - 1))).abs().max() < 1e-6


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_match_clipped_surrogate_dual_clip_and_stats(tb, agg, dual):
    m = tb["mask"]
    A = _v_grpo(tb["scores"], tb["index"], m)
    old = tb["old"].clone()
    old[1, 0] = tb["logp"][1, 0] - 3.0  # ratio e^3 on a negative-advantage token: the dual clip bites
    loss, st = policy_loss(tb["logp"], old, A, m, 0.2, 0.28, dual, agg)
    vl, vcf, vlow = _v_pg(old, tb["logp"], A, m, 0.2, 0.28, dual or 1e30, agg)
    assert abs(float(loss - vl)) < 1e-8
    assert abs(st["clipfrac"] - float(vcf)) < 1e-12
    assert abs(st["dual_clipfrac"] - (float(vlow) if dual else 0.0)) < 1e-12


def test_match_value_loss_and_clipfrac(tb):
    m = tb["mask"]
    _, R = gae(token_level_rewards(tb["scores"], m), tb["values"], m, 1.0, 0.95)
    newv = tb["values"] + torch.randn(m.shape, generator=tb["gen"], dtype=D) * 0.3
    for agg in ("token_mean", "seq_mean_token_mean"):
        loss, st = value_loss(newv, tb["values"], R, m, 0.2, agg)
        vl, vcf = _v_vf(newv, R, tb["values"], m, 0.2, agg)
        assert abs(float(loss - vl)) < 1e-8 and abs(st["vf_clipfrac"] - float(vcf)) < 1e-12


@pytest.mark.parametrize("est", ["k1", "k2", "low_var_kl"])
def test_match_kl_estimators(tb, est):
    m = tb["mask"]
    far = tb["ref"].clone()
    far[0, 0] = tb["logp"][0, 0] + 15  # k3 ~ e^15 there: the clamp at 10 matters
    for ref in (tb["ref"], far):
        assert (kl_penalty(tb["logp"], ref, est) * m - _v_kl(tb["logp"], ref, est) * m).abs().max() < 1e-12


def test_match_gspo_loss_and_gradient(tb):
    m = tb["mask"]
    A = _v_grpo(tb["scores"], tb["index"], m)
    a = tb["logp"].clone().requires_grad_(True)
    b = tb["logp"].clone().requires_grad_(True)
    la, _ = gspo_policy_loss(a, tb["old"], A, m, 3e-4, 4e-4)
    lb = _v_gspo(tb["old"], b, A, m, 3e-4, 4e-4)
    (ga,), (gb,) = torch.autograd.grad(la, a), torch.autograd.grad(lb, b)
    assert abs(float(la.detach() - lb.detach())) < 1e-8 and (ga - gb).abs().max() < 1e-8


def test_match_entropy():
    logits = torch.randn(3, 4, 11, dtype=D)
    assert (entropy_from_logits(logits) + (logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)).abs().max() < 1e-12


def test_match_reinforce_pp_single_turn_rows(tb):
    m = tb["mask"]
    rows = torch.tensor([True, True, True, True, False, True])  # the row with observation tokens: see below
    r = token_level_rewards(tb["scores"], m)
    for gamma in (1.0, 0.9):
        ours = discounted_returns(r, m, gamma)
        ret, run = torch.zeros_like(r), torch.zeros(r.shape[0], dtype=D)
        for t in reversed(range(r.shape[1])):  # verl: running return reset where mask is 0
            run = r[:, t] + gamma * run
            ret[:, t] = run
            run = run * m[:, t]
        assert ((ours - ret) * m)[rows].abs().max() < 1e-12
        # Multi-turn: verl's reset at an observation token cuts the tokens before it off the outcome;
        # here the return flows across it (the observation is part of the next state), which is right.
        assert ((ours - ret) * m)[4].abs().max() > 0.5


def _batch(m, scores, index, beh):
    B, T = m.shape
    return Batch(
        input_ids=torch.zeros(B, T + 2, dtype=torch.long),
        attention_mask=torch.ones(B, T + 2, dtype=torch.long),
        response_pos=torch.arange(T).expand(B, T) + 1,
        response_ids=torch.zeros(B, T, dtype=torch.long),
        mask=m,
        behaviour_logp=beh,
        versions=torch.zeros(B, T, dtype=torch.long),
        scores=scores.float(),  # as collate makes them (GRPO.prepare's [N] buffer is float32)
        token_rewards=None,
        group_index=index,
        truncated=torch.zeros(B, dtype=torch.bool),
        last_pos=torch.full((B,), T + 1),
        response_len=torch.full((B,), T),
        max_new_tokens=torch.full((B,), T),
    )


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_match_full_algorithm_loss(tb, name, agg):
    """prepare + loss (correction none) = verl's pg (dual clip 3) − c_H·agg(H) + β·agg(low_var_kl) [+ c_v·vf]."""
    m = tb["mask"]
    ent = torch.rand(m.shape, generator=tb["gen"], dtype=D)
    newv = tb["values"] + torch.randn(m.shape, generator=tb["gen"], dtype=D) * 0.3
    cfg = AlgorithmConfig(
        name=name,
        loss_agg=agg,
        entropy_coef=0.01,
        dual_clip=3.0,
        kl_coef=0.05,
        correction=CorrectionConfig(name="none"),
    )
    algo = ALGORITHMS[name](cfg, make_correction(cfg.correction, (cfg.clip_low, cfg.clip_high)))
    batch = _batch(m, tb["scores"], tb["index"], tb["old"].clone())
    fixed = algo.prepare(
        batch, kl_coef=0.05, old_logp=tb["old"], ref_logp=tb["ref"], old_values=tb["values"] if name == "ppo" else None
    )
    out = Forward(tb["logp"], ent, None, newv if name == "ppo" else None)
    loss, _ = algo.loss(batch, fixed, out, clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    A = fixed.advantages
    want = _v_pg(tb["old"], tb["logp"], A, m, 0.2, 0.28, 3.0, agg)[0] - 0.01 * _v_agg(ent, m, agg)
    want = want + 0.05 * _v_agg(_v_kl(tb["logp"], tb["ref"], "low_var_kl"), m, agg)
    if name == "ppo":
        want = want + cfg.vf_coef * _v_vf(newv, fixed.returns, tb["values"], m, cfg.value_clip, agg)[0]
    assert abs(float(loss) - float(want)) < 1e-6


def test_match_dr_grpo_constant_normaliser(tb):
    """mean_i Σ_t ℓ/C (the paper's 1/G and TRL's); verl's seq-mean-token-sum-norm has no 1/G (x B larger)."""
    m = tb["mask"]
    L = torch.randn(m.shape, generator=tb["gen"], dtype=D)
    C = 7.0
    ours = aggregate_loss(L / C, m, "seq_mean_token_sum")
    verl = (L * m).sum() / C
    assert abs(float(ours * m.shape[0] - verl)) < 1e-12


# ----------------------------------------------------------------------------- findings (fail today)


def test_vf_explained_var_is_one_minus_the_residuals_share_of_the_returns_variance():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    values = torch.tensor([[1.5, 2.0, -9.0], [2.5, 4.0, 5.5]])
    # over the 5 trainable tokens: Var(R) = 2.0; residuals -0.5, 0, 0.5, 0, -0.5 (mean -0.1): Var = 0.14
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 0.14 / 2.0)
    assert explained_variance(torch.zeros(2, 3), returns, mask) == pytest.approx(0.0)  # the value head at start
    assert math.isnan(explained_variance(values, torch.ones(2, 3), mask))  # returns that do not vary


def _cfg(caplog, *overrides):
    caplog.set_level(logging.WARNING, logger="slime.config")
    caplog.clear()
    cfg = load_config("examples/repeat_grpo.yaml", list(overrides))
    return cfg, [r.getMessage() for r in caplog.records]


def test_reinforce_pp_with_kl_mode_loss_says_the_kl_goes_in_the_reward(caplog):
    cfg, said = _cfg(caplog, "algorithm.name=reinforce_pp", "algorithm.kl_mode=loss", "algorithm.kl_coef=0.01")
    assert (cfg.algorithm.kl_mode, cfg.algorithm.kl_estimator) == ("reward", "k1")
    assert any("algorithm.name=reinforce_pp puts the KL in the reward" in m for m in said)
    # its own config.yaml, read back (a resume), says reward and warns no more
    again, said = _cfg(
        caplog,
        *(f"algorithm.{k}={v}" for k, v in cfg.algorithm.model_dump(include={"name", "kl_mode", "kl_coef"}).items()),
    )
    assert again.algorithm.kl_mode == "reward" and not said


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algorithm.name=cispo", "algorithm.dual_clip=3"], "algorithm.dual_clip=3.0"),
        (
            ["algorithm.name=grpo", "algorithm.lam=0.9", "algorithm.vf_coef=1.0"],
            "algorithm.lam=0.9, algorithm.vf_coef=1.0",
        ),
        (["algorithm.name=rloo", "algorithm.grpo_std_normalize=false"], "algorithm.grpo_std_normalize=False"),
        (["algorithm.name=grpo", "algorithm.gamma=0.99"], "algorithm.gamma=0.99"),
    ],
)
def test_a_key_the_algorithm_does_not_read_is_named_in_a_warning(caplog, overrides, named):
    _, said = _cfg(caplog, *overrides)
    assert [m for m in said if "does not use" in m] == [
        f"algorithm.name={overrides[0].split('=')[1]} does not use {named}: ignored (docs/learner.md says which "
        "algorithm reads what)"
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.name=ppo", "algorithm.lam=0.9", "algorithm.dual_clip=3"],
        ["algorithm.name=reinforce_pp", "algorithm.gamma=0.9"],
        ["algorithm.name=gspo", "algorithm.grpo_std_normalize=false", "algorithm.loss_agg=seq_mean_token_mean"],
        ["algorithm.name=grpo", "algorithm.lam=0.95"],  # the default, as a run's config.yaml writes it
    ],
)
def test_keys_the_algorithm_reads_give_no_warning(caplog, overrides):
    _, said = _cfg(caplog, *overrides)
    assert not [m for m in said if "does not use" in m or "puts the KL" in m]


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("algorithm.clip_ratio_c=3", "algorithm.dual_clip"),
        ("algorithm.norm_adv_by_std_in_grpo=false", "algorithm.grpo_std_normalize"),
        ("algorithm.use_kl_loss=true", "algorithm.kl_mode=loss"),
        ("algorithm.loss_agg_mode=token-mean", "algorithm.loss_agg"),
        ("learner.ppo_mini_batch_size=8", "learner.num_minibatches"),
    ],
)
def test_verls_key_names_are_refused_with_the_key_that_stands_for_them(override, meant):
    with pytest.raises(ConfigError, match="is verl's key; here: ") as err:
        load_config("examples/repeat_grpo.yaml", [override])
    assert meant in str(err.value)
