"""The automatic off-policy controller (slime/algorithms/offpolicy_controller.py,
`algorithm.correction.auto`): hand-fed measurements give the decisions of its rule (tighter above
the target KL, looser below, one version and one factor per step, never past a cap or under a
floor, the same every time), its state survives a checkpoint, the learner takes the cap it sets,
and, slow, a real job runs it in its loop, writes its metrics and resumes it from a checkpoint."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from slime.algorithms.offpolicy_controller import Measurement, OffPolicyController, Reason
from slime.buffer import JobTelemetry, TrajectoryStore
from slime.config import AutoOffPolicyConfig, ConfigError, load_config
from slime.metrics import flatten
from slime.train import train
from tests.helpers import APRIL_SMALL_JOB, TINY_JOB

# smoothing 0: each decision reads that step's KL alone, so the sequences below are easy to follow
SETTINGS = AutoOffPolicyConfig(
    enabled=True,
    target_kl=0.02,
    loosen_below=0.5,
    smoothing=0.0,
    max_clipped_share=0.2,
    min_staleness=1,
    max_staleness=4,
    min_tis_cap=1.25,
    max_tis_cap=4.0,
    tis_cap_step=1.25,
)


def tiny_local_job(job: str, tmp_path, model_dir, redis_url: str, overrides: list[str]):
    """The tiny whole job on the local launcher, with these overrides."""
    common = [f"job_name={job}", "cluster.launcher=local", f"output_dir={tmp_path}", f"model.path={model_dir}"]
    return load_config(None, [*common, f"buffer.url={redis_url}", *TINY_JOB, *overrides])


def measured(
    kl: float, max_lag: int = 9, clipped: float = 0.0, tokens: float = 100.0, held: float = 0.5
) -> Measurement:
    return Measurement(
        tokens=tokens, kl=kl, spread=math.sqrt(2 * kl), clipped_share=clipped, max_lag=max_lag, held_share=held
    )


def controller(staleness: int | None = 2, tis_cap: float | None = 2.0, **settings) -> OffPolicyController:
    knob = "max_staleness" if staleness is not None else "none"
    return OffPolicyController(SETTINGS.model_copy(update=settings), knob, staleness, tis_cap)


def run(c: OffPolicyController, kls: list[float], **kw) -> list[tuple[str, int | None, float | None]]:
    return [(c.observe(measured(kl, **kw)).name, c.staleness, c.tis_cap) for kl in kls]


def test_above_the_target_it_tightens_one_version_and_one_factor_per_step_down_to_the_floors() -> None:
    c = controller(staleness=3, tis_cap=2.0)
    steps = run(c, [0.1, 0.05, 0.03, 0.5, 0.9])
    assert [reason for reason, _, _ in steps] == ["TIGHTEN"] * 5
    assert [s for _, s, _ in steps] == [2, 1, 1, 1, 1]  # min_staleness=1
    assert [cap for _, _, cap in steps] == pytest.approx([1.6, 1.28, 1.25, 1.25, 1.25])  # min_tis_cap=1.25


def test_below_the_target_it_loosens_one_step_at_a_time_up_to_the_hard_caps() -> None:
    c = controller(staleness=2, tis_cap=2.0)
    steps = run(c, [0.001] * 6)
    assert [reason for reason, _, _ in steps] == ["LOOSEN"] * 6
    assert [s for _, s, _ in steps] == [3, 4, 4, 4, 4, 4]  # max_staleness=4
    assert [cap for _, _, cap in steps] == pytest.approx([2.5, 3.125, 3.90625, 4.0, 4.0, 4.0])  # max_tis_cap=4


def test_aprils_span_is_never_tightened_only_its_band_and_it_loosens_when_restarts_held_it() -> None:
    # APRIL's knob: a tighter span restarts partials (tokens thrown away), so tightening moves the cap alone
    c = OffPolicyController(SETTINGS, "max_version_span", 2, 2.0)
    assert [(c.observe(measured(0.05)).name, c.staleness, c.tis_cap) for _ in range(3)] == [
        ("TIGHTEN", 2, pytest.approx(1.6)),
        ("TIGHTEN", 2, pytest.approx(1.28)),
        ("TIGHTEN", 2, 1.25),
    ]
    assert (c.observe(measured(0.001, held=0.3)), c.staleness) == (Reason.LOOSEN, 3)  # 30% of the tokens restarted
    assert (c.observe(measured(0.001, held=0.0)), c.staleness) == (Reason.LOOSEN, 3)


def test_the_staleness_grows_only_when_the_budget_held_the_rollout_back() -> None:
    c = controller(staleness=2, tis_cap=2.0)  # min_held_share 0.05
    assert c.observe(measured(0.001, held=0.0)) == Reason.LOOSEN
    assert (c.staleness, c.tis_cap) == (2, 2.5)  # the rollout never waited on the budget: only the cap moves
    c.observe(measured(0.001, held=0.05))
    assert (c.staleness, c.tis_cap) == (2, 3.125)  # at the threshold: not above it
    c.observe(measured(0.001, held=0.3))
    assert (c.staleness, c.tis_cap) == (3, 3.90625)
    assert c.observe(measured(0.05, held=0.0)) == Reason.TIGHTEN  # tightening does not ask
    assert c.staleness == 2


def test_inside_the_band_a_heavy_tail_or_no_measurement_it_holds() -> None:
    c = controller(staleness=2, tis_cap=2.0)
    assert c.observe(measured(0.015)) == Reason.HOLD_IN_BAND  # 0.01 <= kl <= 0.02
    assert c.observe(measured(0.02)) == Reason.HOLD_IN_BAND  # at the target: not above it
    assert c.observe(measured(0.001, clipped=0.3)) == Reason.HOLD_CLIPPED
    assert c.observe(measured(0.5, tokens=0)) == Reason.HOLD_NO_MEASUREMENT
    assert c.observe(measured(float("nan"))) == Reason.HOLD_NO_MEASUREMENT
    assert (c.staleness, c.tis_cap) == (2, 2.0)
    assert c.kl_smoothed == 0.001  # what it acted on last; the empty and the nan steps left it alone


def test_smoothing_acts_on_an_exponential_mean_of_the_kl() -> None:
    c = controller(smoothing=0.5)
    c.observe(measured(0.001))  # the first measurement is taken as it is
    assert c.kl_smoothed == pytest.approx(0.001) and c.reason == Reason.LOOSEN
    c.observe(measured(0.035))  # one spike: 0.018, inside the band
    assert c.kl_smoothed == pytest.approx(0.018) and c.reason == Reason.HOLD_IN_BAND
    c.observe(measured(0.035))  # it persists: 0.0265, above the target
    assert c.kl_smoothed == pytest.approx(0.0265) and c.reason == Reason.TIGHTEN


def test_the_caps_hold_and_the_decisions_are_the_same_every_time() -> None:
    sequence = [0.001, 0.2, 0.0, 0.03, 0.012, 0.5, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.04, 0.019]
    first = run(controller(smoothing=0.3), sequence, max_lag=4)
    again = run(controller(smoothing=0.3), sequence, max_lag=4)
    assert first == again
    for _, staleness, cap in first:
        assert 1 <= staleness <= 4 and 1.25 <= cap <= 4.0
    pairs = list(zip([(2, 2.0)] + [(s, c) for _, s, c in first], [(s, c) for _, s, c in first]))
    for (s0, c0), (s1, c1) in pairs:  # one version and one factor per step at most
        assert abs(s1 - s0) <= 1 and 1 / 1.25 - 1e-12 <= c1 / c0 <= 1.25 + 1e-12


def test_a_job_without_a_knob_or_a_cap_keeps_it_off() -> None:
    c = controller(staleness=None, tis_cap=None)
    run(c, [0.5, 0.001])
    assert c.staleness is None and c.tis_cap is None
    assert flatten(c.metrics()).keys() == {
        "offpolicy_auto/reason",
        "offpolicy_auto/kl_target",
        "offpolicy_auto/kl_smoothed",
        "offpolicy_auto/kl",
        "offpolicy_auto/kl_gap",
        "offpolicy_auto/logp_spread",
        "offpolicy_auto/max_lag",
        "offpolicy_auto/held_share",
    }


def gapped(kl: float, fresh_kl: float, fresh_tokens: float) -> Measurement:
    """A step whose fresh tokens carry ``fresh_kl`` (the engine's gap) and whose mean over all tokens is ``kl``."""
    m = measured(kl)
    return Measurement(**{**m.__dict__, "fresh_tokens": fresh_tokens, "fresh_kl": fresh_kl})


def test_it_steers_the_kl_that_staleness_adds_not_the_engines_gap() -> None:
    # a perturbed engine: fresh tokens alone carry 0.025, above the target; the stale ones add 0.005.
    # On the total (0.03) it would tighten every step; on the excess it loosens
    c = controller(staleness=2, tis_cap=2.0)
    assert c.observe(gapped(0.03, fresh_kl=0.025, fresh_tokens=40)) == Reason.LOOSEN
    assert c.gap_kl == pytest.approx(0.025) and c.kl_smoothed == pytest.approx(0.005)
    assert (c.staleness, c.tis_cap) == (3, 2.5)
    # the policy's own drift on top of the same gap still tightens
    assert c.observe(gapped(0.06, fresh_kl=0.025, fresh_tokens=40)) == Reason.TIGHTEN
    assert c.kl_smoothed == pytest.approx(0.035)
    # a gap the learner and engine do not have (fresh 0) leaves the rule as it was: the total
    c0 = controller(staleness=2, tis_cap=2.0)
    assert c0.observe(gapped(0.03, fresh_kl=0.0, fresh_tokens=40)) == Reason.TIGHTEN


def test_the_gap_carries_over_steps_without_fresh_tokens_and_is_token_weighted() -> None:
    # async: the first step is all fresh, every later batch is stale, and the gap measured first holds
    c = controller(staleness=2, tis_cap=2.0, smoothing=0.5)
    c.observe(gapped(0.02, fresh_kl=0.02, fresh_tokens=1000))
    assert c.gap_kl == pytest.approx(0.02)
    for _ in range(3):
        c.observe(measured(0.024))  # no fresh tokens: excess 0.004 each step
        assert c.gap_kl == pytest.approx(0.02)
    assert c.kl_smoothed == pytest.approx(0.004 * (1 - 0.5**3)) and c.reason == Reason.LOOSEN  # from 0 at step 1
    # a few fresh tokens move it a little: (0.5 * 1000 * 0.02 + 10 * 0.0) / (0.5 * 1000 + 10)
    c.observe(gapped(0.024, fresh_kl=0.0, fresh_tokens=10))
    assert c.gap_kl == pytest.approx(10.0 / 510.0)


def test_after_steps_without_fresh_tokens_it_asks_for_a_gap_probe_and_folds_it_in() -> None:
    # async with a gap that drifts: measured at 0.02 on the first batch, then only stale batches
    c = controller(staleness=2, tis_cap=2.0, smoothing=0.5, gap_probe_every=3)
    c.observe(gapped(0.02, fresh_kl=0.02, fresh_tokens=100))
    asked = []
    for _ in range(4):
        c.observe(measured(0.05))
        asked.append(c.wants_gap_probe())
    assert asked == [False, False, True, True]  # 3 steps in a row without fresh tokens, and it still wants one
    # the probe: 50 tokens at 0.08, folded as fresh tokens are: (0.5 * 100 * 0.02 + 50 * 0.08) / (0.5 * 100 + 50)
    c.observe_gap_probe(50.0, 0.08)
    assert c.gap_kl == pytest.approx(0.05) and not c.wants_gap_probe()
    out = c.metrics()["offpolicy_auto"]
    assert (out["gap_probe_tokens"], out["gap_probe_kl"], out["kl_gap_next"]) == (50.0, 0.08, pytest.approx(0.05))
    # it takes effect at the next decision: 0.05 is all gap now, no excess, so the smoothed KL halves
    # (it was 0.03 · (1 − 0.5⁴) after four steps of 0.05 − 0.02)
    assert c.observe(measured(0.05)) == Reason.HOLD_IN_BAND
    assert c.kl_smoothed == pytest.approx(0.5 * 0.03 * (1 - 0.5**4))
    assert "gap_probe_kl" not in c.metrics()["offpolicy_auto"]
    # a probe that sampled nothing changes no estimate but restarts the count; fresh tokens restart it too
    before = c.gap_kl
    c.observe_gap_probe(0.0, 0.0)
    assert c.gap_kl == before and c.steps_without_fresh == 0
    c.observe(measured(0.05))
    c.observe(gapped(0.05, fresh_kl=0.05, fresh_tokens=10))
    assert c.steps_without_fresh == 0
    # off: never asks
    off = controller(gap_probe_every=0)
    for _ in range(20):
        off.observe(measured(0.05))
    assert not off.wants_gap_probe()


def test_its_state_round_trips_through_json_and_goes_on_the_same() -> None:
    c = controller(smoothing=0.5)
    run(c, [0.001, 0.04, 0.03])
    c.observe(gapped(0.03, fresh_kl=0.01, fresh_tokens=50))
    state = json.loads(json.dumps(c.state_dict()))  # as driver_state.json keeps it
    restored = controller(smoothing=0.5)
    restored.load_state_dict(state)
    assert restored.state_dict() == c.state_dict()
    assert restored.gap_kl == pytest.approx(0.01)
    assert run(restored, [0.002, 0.1, 0.001]) == run(c, [0.002, 0.1, 0.001])


def test_a_restored_state_is_clamped_into_this_jobs_bounds_and_a_bad_one_is_named() -> None:
    c = controller()
    c.load_state_dict({"staleness": 9, "tis_cap": 10.0, "kl_smoothed": None, "reason": 3, "steps": 4})
    assert (c.staleness, c.tis_cap, c.reason, c.steps) == (4, 4.0, Reason.LOOSEN, 4)
    with pytest.raises(ValueError, match=r"offpolicy_auto\.tis_cap"):
        c.load_state_dict({"staleness": 1, "tis_cap": -1.0, "kl_smoothed": None, "reason": 0, "steps": 0})
    with pytest.raises(ValueError, match=r"offpolicy_auto\.extra"):
        c.load_state_dict({"staleness": 1, "tis_cap": 2.0, "kl_smoothed": None, "reason": 0, "steps": 0, "extra": 1})


def test_the_measurement_is_read_from_the_learners_metrics() -> None:
    metrics = {
        "mismatch_fresh_tokens": 30.0,
        "mismatch_fresh_kl": 0.0,
        "mismatch_fresh_logp_abs_diff": 0.0,
        "mismatch_resumed_tokens": 0.0,
        "mismatch_stale_tokens": 10.0,
        "mismatch_stale_kl": 0.08,
        "mismatch_stale_logp_abs_diff": 0.4,
        "offpolicy_clipped_share": 0.25,
        "version_lag_hist": {"0": 5, "3": 1, "1": 2},
        "staleness_budget_held_share": 0.4,
    }
    m = Measurement.from_metrics(metrics)
    assert m == Measurement(
        tokens=40.0,
        kl=pytest.approx(0.02),
        spread=pytest.approx(0.1),
        clipped_share=0.25,
        max_lag=3,
        fresh_tokens=30.0,
        fresh_kl=0.0,
        held_share=0.4,
    )
    assert Measurement.from_metrics({}).tokens == 0.0  # an empty step: nothing measured


@pytest.mark.parametrize(
    "overrides,knob,staleness,tis_cap",
    [
        (["mode=async", "max_staleness=2"], "max_staleness", 2, 2.0),
        (["mode=async", "max_staleness=9"], "max_staleness", 4, 2.0),  # clamped into the bounds
        (["april.enabled=true"], "max_version_span", 4, 2.0),  # no span (unbounded): the hard cap
        (["april.enabled=true", "april.max_version_span=0"], "max_version_span", 1, 2.0),
        (["algorithm.correction.name=tis", "algorithm.correction.tis_cap=1.5"], "none", None, 1.5),
        (["mode=async", "algorithm.correction.name=icepop"], "max_staleness", 1, None),
    ],
)
def test_it_starts_from_the_jobs_own_settings(overrides, knob, staleness, tis_cap) -> None:
    cfg = load_config(None, ["algorithm.correction.auto.enabled=true", *overrides])
    c = OffPolicyController.for_job(cfg)
    assert (c.knob, c.staleness, c.tis_cap, c.reason) == (knob, staleness, tis_cap, Reason.START)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.correction.auto.min_staleness=3", "algorithm.correction.auto.max_staleness=2"], "min_staleness=3"),
        (["algorithm.correction.auto.min_tis_cap=3", "algorithm.correction.auto.max_tis_cap=2"], "min_tis_cap=3"),
        (["algorithm.correction.auto.min_tis_cap=0.9"], "algorithm.correction.auto.min_tis_cap"),
        (["algorithm.correction.auto.target_kl=0"], "algorithm.correction.auto.target_kl"),
        (
            ["algorithm.correction.auto.enabled=true", "algorithm.correction.name=icepop"],
            "nothing to tune: algorithm.correction.name=icepop",
        ),
        (
            ["algorithm.correction.auto.enabled=true", "mode=async", "algorithm.correction.auto.min_staleness=0"],
            "algorithm.correction.auto.min_staleness must be >= 1 when mode=async",
        ),
    ],
)
def test_bad_settings_fail_at_load_naming_the_field(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_without_it_the_driver_changes_nothing() -> None:
    """algorithm.correction.auto off (the default): no controller, and tune_offpolicy returns at once."""
    from slime.job import RunningJob

    assert load_config(None, []).algorithm.correction.auto.enabled is False
    job = RunningJob(load_config(None, []))
    metrics = {"reward_mean": 0.5, "mismatch_fresh_tokens": 10.0, "mismatch_fresh_kl": 1.0}
    job.tune_offpolicy(0, metrics)  # no fleet, learner or telemetry: any use of them would raise
    job.probe_gap(0, metrics)
    assert job.offpolicy is None and metrics == {
        "reward_mean": 0.5,
        "mismatch_fresh_tokens": 10.0,
        "mismatch_fresh_kl": 1.0,
    }


def test_the_learner_takes_the_cap_and_at_the_configured_cap_the_update_is_bit_for_bit(
    tiny_model_dir, redis_url, tmp_path
) -> None:
    """set_correction_cap(c) with the job's own tis_cap gives the very update of a learner never told;
    another cap reaches the correction (the update moves)."""
    from slime.learner import Learner
    from tests.test_offpolicy_options import _batch_samples

    def update(name: str, cap: float | None) -> tuple[dict, dict]:
        cfg = load_config(
            None, [f"job_name=auto-cap-{name}", f"output_dir={tmp_path / name}", "algorithm.correction.name=tis"]
        )
        learner = Learner(cfg, str(tiny_model_dir), redis_url)
        learner.version = 3
        if cap is not None:
            learner.set_correction_cap(cap)
        samples = _batch_samples(stale_logprob=-6.0)[0]  # stale tokens whose sampler was far off
        metrics = learner.update(samples, [0] * len(samples), step=0)
        weights = {k: v.detach().clone() for k, v in learner.policy.named_parameters()}
        learner.buffer.close()
        return metrics, weights

    never, w_never = update("never", None)
    same, w_same = update("same", 2.0)
    _, w_other = update("other", 1.05)
    assert all(torch.equal(w_never[k], w_same[k]) for k in w_never)

    # every figure (json: nan equals nan there), the clock's aside
    def figures(m: dict) -> str:
        return json.dumps({k: v for k, v in m.items() if k != "learner_seconds"}, sort_keys=True)

    assert figures(never) == figures(same)
    assert any(not torch.equal(w_never[k], w_other[k]) for k in w_never)  # the stale tokens' weights: min(rho, c)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_a_job_runs_the_controller_in_its_loop_writes_its_metrics_and_resumes_it(
    ray_session, tiny_model_dir, redis_url, tmp_path, launcher
) -> None:
    """APRIL in the sync loop (the knob is april.max_version_span, set on the workers), on Ray's
    actors and on threads. A target no measurement reaches makes every decision a loosening: tis_cap 2 ->
    2.5 -> 3.125 -> 3.906. The third value after a resume from step 2's checkpoint proves the state
    came back (a fresh controller would say 2.5 again)."""
    job = f"auto-offpolicy-e2e-{launcher}"
    common = [
        f"job_name={job}",
        f"cluster.launcher={launcher}",
        f"output_dir={tmp_path}",
        f"model.path={tiny_model_dir}",
        f"buffer.url={redis_url}",
        *APRIL_SMALL_JOB,
        *TINY_JOB,
        "checkpoint.every_steps=1",
        "algorithm.correction.auto.enabled=true",
        "algorithm.correction.auto.target_kl=1000",
        "algorithm.correction.auto.max_clipped_share=1.0",
    ]
    history = train(load_config(None, [*common, "steps=2"]))
    assert [h["offpolicy_auto/tis_cap"] for h in history] == pytest.approx([2.5, 3.125])
    for h in history:
        assert h["offpolicy_auto/reason"] == Reason.LOOSEN
        assert 1 <= h["offpolicy_auto/max_version_span"] <= 4
        kinds = [k for k in ("fresh", "resumed", "stale") if h[f"mismatch_{k}_tokens"] > 0]
        tokens = sum(h[f"mismatch_{k}_tokens"] for k in kinds)
        kl = sum(h[f"mismatch_{k}_kl"] * h[f"mismatch_{k}_tokens"] for k in kinds) / tokens
        assert h["offpolicy_auto/kl"] == pytest.approx(kl)  # what it read: the learner's own KL, all tokens
        # APRIL's budget holds the rollout back by the tokens it throws away (restarted partials)
        assert 0.0 <= h["staleness_budget_held_share"] <= 1.0
        assert h["offpolicy_auto/held_share"] == h["staleness_budget_held_share"]
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "driver_state.json").read_text())
    assert state["offpolicy_auto"]["tis_cap"] == pytest.approx(3.125) and state["offpolicy_auto"]["steps"] == 2

    history = train(load_config(None, [*common, "steps=3", "resume=auto"]))
    assert [h["step"] for h in history] == [0, 1, 2]
    assert history[-1]["offpolicy_auto/tis_cap"] == pytest.approx(3.90625)
    # each change of a setting is an event of the job's (the dashboard's events list), with its reason
    events = [e["detail"] for e in JobTelemetry.open(redis_url, job).events() if e["kind"] == "offpolicy_auto"]
    assert [(e["step"], e["reason"], e["tis_cap"]) for e in reversed(events)] == [
        (0, "loosen", 2.5),
        (1, "loosen", 3.125),
        (2, "loosen", 3.90625),
    ]
    TrajectoryStore.open(redis_url, job).delete_job()


@pytest.mark.slow
def test_an_async_job_admits_under_the_controllers_budget(tiny_model_dir, redis_url, tmp_path, monkeypatch) -> None:
    """mode=async: the knob is max_staleness (the fleet's admission); the learner drops only beyond the
    hard cap, so a tightening never throws away a group admitted before it. The first batch is all
    fresh: its KL is the engine's numerics, taken as the gap, so nothing is tightened (the cap
    loosens; the budget only if admission waited on it). A later batch may be fresh too (the rollout
    outran the learner), but once a stale one puts the policy's own change above the tiny target, the
    slow smoothing (0.9) keeps the KL above it: from then on every decision tightens. After each
    batch without fresh tokens (gap_probe_every=1) the engine samples a gap probe right after the push
    and the learner scores it at the same version: in float32 on CPU its KL is numerics only.
    Replaying the logged measurements through a fresh controller gives the logged decisions: the job
    acted on what it measured, gap, probes and held share included.

    Step 0's update waits until the next batch is complete, so step 1 trains tokens of version 0
    (stale) whatever the machine's speed: on a loaded machine the learner could otherwise outrun the
    rollout at every step and no batch would hold a stale token."""
    from slime.learner import Learner

    train_claimed = Learner.train_claimed

    def step_0_outrun_by_the_rollout(self, claimed: dict, step: int, commit: bool = True) -> dict:
        deadline = time.monotonic() + 120
        while step == 0 and len(self.buffer.ready_group_ids()) < len(claimed["groups"]):
            assert time.monotonic() < deadline, "the rollout made no second batch in 120 s"
            time.sleep(0.05)
        return train_claimed(self, claimed, step, commit)

    monkeypatch.setattr(Learner, "train_claimed", step_0_outrun_by_the_rollout)
    job = "auto-offpolicy-async"
    cfg = tiny_local_job(
        job,
        tmp_path,
        tiny_model_dir,
        redis_url,
        [
            "steps=4",
            "mode=async",
            "max_staleness=2",
            "algorithm.correction.auto.enabled=true",
            "algorithm.correction.auto.target_kl=1e-6",
            "algorithm.correction.auto.smoothing=0.9",
            "algorithm.correction.auto.gap_probe_every=1",
        ],
    )
    history = train(cfg)
    assert history[0]["mismatch_fresh_tokens"] > 0 and history[0]["mismatch_stale_tokens"] == 0
    assert history[0]["offpolicy_auto/kl_gap"] == pytest.approx(history[0]["mismatch_fresh_kl"])
    for before, h in zip(history, history[1:]):  # a batch without fresh tokens: the gap as the last probe left it
        if h["mismatch_fresh_tokens"] == 0:
            assert h["offpolicy_auto/kl_gap"] == before.get(
                "offpolicy_auto/kl_gap_next", before["offpolicy_auto/kl_gap"]
            )
    # which batches hold fresh tokens depends on timing (the rollout may outrun the learner); the
    # probe's own figures are checked deterministically in the next test
    probed = ["offpolicy_auto/gap_probe_tokens" in h for h in history]
    assert probed == [h["mismatch_fresh_tokens"] == 0 for h in history]
    for h in history:
        if "offpolicy_auto/gap_probe_tokens" in h:  # engine and learner at the version just pushed
            assert h["offpolicy_auto/gap_probe_tokens"] > 0 and 0.0 <= h["offpolicy_auto/gap_probe_kl"] < 1e-6
    assert all(0.0 <= h["staleness_budget_held_share"] <= 1.0 for h in history)
    reasons = [h["offpolicy_auto/reason"] for h in history]
    first_stale = next((i for i, h in enumerate(history) if h["mismatch_stale_tokens"] > 0), None)
    assert first_stale is not None, "no batch of the async job held a stale token"
    assert reasons == [Reason.LOOSEN] * first_stale + [Reason.TIGHTEN] * (len(history) - first_stale)
    assert history[-1]["offpolicy_auto/max_staleness"] < history[first_stale - 1]["offpolicy_auto/max_staleness"]

    replay = OffPolicyController.for_job(cfg)
    for h in history:
        replay.observe(Measurement.from_metrics(h))
        if "offpolicy_auto/gap_probe_tokens" in h:
            replay.observe_gap_probe(h["offpolicy_auto/gap_probe_tokens"], h["offpolicy_auto/gap_probe_kl"])
        assert replay.gap_kl == pytest.approx(h.get("offpolicy_auto/kl_gap_next", h["offpolicy_auto/kl_gap"]))
        assert (replay.reason, replay.staleness, replay.tis_cap) == (
            h["offpolicy_auto/reason"],
            h["offpolicy_auto/max_staleness"],
            pytest.approx(h["offpolicy_auto/tis_cap"]),
        )
    assert all(h["dropped_stale_groups"] == 0 for h in history)
    TrajectoryStore.open(redis_url, job).delete_job()


@pytest.mark.slow
def test_a_gap_probe_samples_and_scores_at_the_pushed_version_and_feeds_the_next_decision(
    tiny_model_dir, redis_url, tmp_path, monkeypatch
) -> None:
    """A probe due at every step (the condition forced; when it is due is the unit tests' part): after
    each push the engine samples gap_probe_samples answers and the learner scores them. Both hold the
    version just pushed, so in float32 on CPU the KL is numerics only; the estimate the next decision
    reads is the one the probe left, and a replay of the logged measurements and probes agrees."""
    monkeypatch.setattr(OffPolicyController, "wants_gap_probe", lambda self: True)
    job = "auto-offpolicy-probe"
    cfg = tiny_local_job(
        job,
        tmp_path,
        tiny_model_dir,
        redis_url,
        [
            "steps=2",
            "algorithm.correction.auto.enabled=true",
            "algorithm.correction.auto.gap_probe_samples=3",
        ],
    )
    history = train(cfg)
    replay = OffPolicyController.for_job(cfg)
    assert len(history) == 2
    for h in history:
        assert h["offpolicy_auto/gap_probe_tokens"] > 0 and 0.0 <= h["offpolicy_auto/gap_probe_kl"] < 1e-6
        assert h["offpolicy_auto/gap_probe_seconds"] > 0
        replay.observe(Measurement.from_metrics(h))
        assert replay.gap_kl == pytest.approx(h["offpolicy_auto/kl_gap"])  # what this step's decision read
        replay.observe_gap_probe(h["offpolicy_auto/gap_probe_tokens"], h["offpolicy_auto/gap_probe_kl"])
        assert replay.gap_kl == pytest.approx(h["offpolicy_auto/kl_gap_next"])  # what the next one reads
    TrajectoryStore.open(redis_url, job).delete_job()
