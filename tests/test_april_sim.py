"""The rollout simulator (april/sim*.py, the CLI in slime/tools/simulate.py): exact small cases, the APRIL mechanism, accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from april.sim import PRESETS, SimConfig, WaveRollout, compare, plot, simulate
from april.sim.engine import Engine, Group, LengthSampler, Request
from slime.config import load_config
from slime.tools.simulate import main_simulate, sim_config_from_job

# A small cluster: 2 engines x 16 slots, B*n = 32 requests (= the slots), GPU-like step costs.
SMALL = dict(
    engines=2,
    slots=16,
    kv_tokens=100_000,
    batch_size=8,
    n_samples=4,
    prompt_tokens=32,
    max_tokens=1024,
    median_tokens=128.0,
    sigma_prompt=0.6,
    sigma_sample=0.5,
    t0=0.006,
    k=5e-5,
    t_kv=0.0,
    p=2e-5,
    t_sync=0.5,
    t_train0=0.5,
    t_train_per_token=2e-5,
    steps=12,
)


def small(**overrides) -> SimConfig:
    return SimConfig(**{**SMALL, **overrides})


def test_hand_checked_single_slot():
    # 1 engine, 1 slot, one sample of L tokens: L decode steps of t0 = 1 s (k = 0, no prefill cost),
    # then training t_train0 + t_train_per_token * (prompt + L), then the weight sync.
    L, prompt, t_train0, per_token, t_sync = 10, 4, 3.0, 0.5, 2.0
    cfg = SimConfig(
        engines=1,
        slots=1,
        kv_tokens=100,
        batch_size=1,
        n_samples=1,
        prompt_tokens=prompt,
        max_tokens=50,
        lengths=[L],
        t0=1.0,
        k=0.0,
        t_kv=0.0,
        p=0.0,
        t_sync=t_sync,
        t_train0=t_train0,
        t_train_per_token=per_token,
        steps=3,
    )
    r = simulate("sync", cfg)
    t_train = t_train0 + per_token * (prompt + L)  # 3 + 7 = 10 s
    step = L * 1.0 + t_train + t_sync  # 10 + 10 + 2 = 22 s
    assert r.step_times == pytest.approx([step] * 3)
    assert r.throughput == pytest.approx(L / step)  # 10 / 22 tok/s
    assert r.engine_stepping == pytest.approx(L / step)
    assert r.engine_busy == pytest.approx(L / step)
    assert r.learner_busy == pytest.approx(t_train / step)
    assert r.generated_tokens == r.trained_tokens == 3 * L


def test_deterministic_with_seed():
    cfg = small(steps=5)
    assert simulate("april", cfg, seed=3) == simulate("april", cfg, seed=3)
    assert simulate("sync", cfg, seed=3) != simulate("sync", cfg, seed=4)


def test_no_tail_april_equals_sync():
    cfg = small(lengths=[300])
    sync, april = simulate("sync", cfg), simulate("april", cfg, oversample=2.0)
    assert abs(april.throughput / sync.throughput - 1) < 0.05
    assert april.off_policy_share < 0.02  # only requests admitted a step late get cut off


def test_long_tail_april_beats_sync_and_wastes_nothing():
    cfg = small()
    sync = simulate("sync", cfg)
    april = simulate("april", cfg, oversample=2.0)
    assert april.throughput > 1.15 * sync.throughput
    assert april.step_s < sync.step_s
    assert april.engine_busy > sync.engine_busy
    # every generated token is trained or still held (partials, complete-but-untrained groups)
    assert april.wasted_tokens == 0
    assert april.generated_tokens == april.trained_tokens + april.held_tokens
    assert april.partials > 0 and april.held_tokens > 0
    assert april.off_policy_share > 0
    # without recycling, over-provisioning throws work away
    drop = simulate("april_drop", cfg, oversample=2.0)
    assert drop.wasted_tokens > 0
    assert drop.generated_tokens == drop.trained_tokens + drop.wasted_tokens + drop.held_tokens


def test_kept_kv_resume_skips_the_prefill_of_partials_on_their_engine():
    # One engine: every partial comes back to the engine that kept its cache. Prefill cost made
    # large so that the difference shows in time too.
    one = dict(engines=1, slots=32, p=2e-4)
    recompute = simulate("april", small(**one), oversample=2.0)
    kept = simulate("april", small(**one, resume_from_kept_kv=True), oversample=2.0)
    sync = simulate("sync", small(**one))
    # with a kept cache only new prompts are prefilled: as many prefix tokens as sync would pay
    # per started group, none for resumed partials
    assert kept.partials > 0
    assert kept.prefill_tokens < recompute.prefill_tokens
    assert kept.throughput > recompute.throughput
    assert kept.prefill_tokens % small().prompt_tokens == 0  # prompts only (32 tokens each)
    assert sync.prefill_tokens % small().prompt_tokens == 0
    # two engines: a partial dispatched to the other engine prefills there; fewer than without caches
    two_kept = simulate("april", small(resume_from_kept_kv=True), oversample=2.0)
    two_recompute = simulate("april", small(), oversample=2.0)
    assert two_kept.prefill_tokens < two_recompute.prefill_tokens


def test_a_groups_samples_share_their_prompts_prefill():
    # One engine with room for a whole step: sync admits every group's n fresh samples together,
    # so each group pays its prompt once (as the built-in engine and vLLM/SGLang prefix caches do).
    one = dict(engines=1, slots=32, steps=3)
    shared = simulate("sync", small(**one))
    apart = simulate("sync", small(**one, shared_prompt_prefill=False))
    groups = small(**one).steps * small().batch_size
    assert shared.prefill_tokens == groups * small().prompt_tokens
    assert apart.prefill_tokens == groups * small().n_samples * small().prompt_tokens
    assert shared.throughput > apart.throughput


def test_version_accounting_per_policy():
    cfg = small(steps=8)
    sync = simulate("sync", cfg)
    assert sync.off_policy_share == 0.0 and sync.max_span == 0 and sync.wasted_tokens == 0
    assert set(sync.span_histogram) == {0}
    one = simulate("one_step_async", cfg)
    assert one.max_span == 1 and one.wasted_tokens == 0
    assert one.span_histogram[0] == cfg.batch_size * cfg.n_samples  # only the first batch is on-policy
    for s in (1, 2):
        bounded = simulate("async_bounded", cfg, max_staleness=s)
        assert bounded.max_span <= s
        assert bounded.wasted_tokens == 0
        assert bounded.generated_tokens == bounded.trained_tokens + bounded.held_tokens
    # every trained sample appears once in the histogram
    assert sum(sync.span_histogram.values()) == cfg.steps * cfg.batch_size * cfg.n_samples


def test_preemption_when_kv_is_small_costs_throughput():
    roomy = simulate("sync", small(kv_tokens=100_000))
    tight = simulate("sync", small(kv_tokens=1_500))
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.prefill_tokens > roomy.prefill_tokens  # preempted requests re-prefill their prefix
    assert tight.throughput < roomy.throughput
    assert tight.trained_tokens == roomy.trained_tokens  # same work, just slower


def test_empirical_lengths_are_used_as_given():
    cfg = small(lengths=[3, 7, 5000], max_tokens=1024)
    sampler = LengthSampler(cfg, seed=0)
    drawn = [n for _ in range(200) for n in sampler.group()]
    assert set(drawn) == {3, 7, 1024}  # sampled with replacement, capped at max_tokens
    one_length = simulate("sync", small(lengths=[40], steps=3))
    assert one_length.trained_tokens == 3 * 8 * 4 * 40


def test_engine_step_boundaries_with_kv_term():
    cfg = small(t_kv=1e-4)
    e = Engine(cfg)
    g = Group(0)
    e.running = [Request(g, 10, 50), Request(g, 10, 80)]
    e.kv = 20
    end = e.plan(0.0)
    assert e.n == 50 and e.extra == 0
    # brute force: step j lasts t0 + k*b + t_kv*(kv + j*b)
    t, ends = 0.0, []
    for j in range(50):
        t += cfg.t0 + cfg.k * 2 + cfg.t_kv * (20 + 2 * j)
        ends.append(t)
    assert end == pytest.approx(ends[-1])
    for j in (0, 9, 30):
        assert e.steps_done(ends[j]) == j + 1
        assert e.steps_done(ends[j] - 1e-6) == j
    mid = (ends[9] + ends[10]) / 2
    assert e.cut(mid) == pytest.approx(ends[10])  # finishes the step in progress
    assert e.n == 11


def test_compare_and_plot(tmp_path):
    results = compare(small(steps=4))
    names = [r.policy for r in results]
    assert names == [
        "sync",
        "april_x1.5",
        "april_x2",
        "april_x3",
        "one_step_async",
        "async_bounded_s1",
        "async_bounded_s2",
    ]
    out = plot(results, tmp_path / "sim.png")
    assert out.stat().st_size > 1000


def test_sim_config_from_job():
    job = load_config(
        None,
        [
            "rollout.batch_size=16",
            "rollout.n_samples_per_prompt=8",
            "rollout.max_new_tokens=64",
            "rollout.num_workers=2",
            "rollout.max_running_requests=32",
            "april.oversample=3",
        ],
    )
    cfg = sim_config_from_job(job, {"steps": 5})
    assert (cfg.batch_size, cfg.n_samples, cfg.max_tokens, cfg.engines, cfg.slots) == (16, 8, 64, 2, 32)
    assert cfg.oversample == 3.0 and cfg.steps == 5
    assert cfg.t0 == PRESETS["cpu_tiny"].t0  # a CPU job gets the CPU engine's timings


def test_cli_sim_yaml_and_job_yaml(tmp_path, capsys):
    sim_yaml = tmp_path / "sim.yaml"
    sim_yaml.write_text(yaml.safe_dump({"sim": {"preset": "cpu_tiny", "steps": 4}}))
    assert main_simulate([str(sim_yaml), "batch_size=4", f"out={tmp_path / 'a.png'}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    ratios = json.loads(lines[-1])
    aprils = {"april_x1.5", "april_x2", "april_x3"}
    assert set(ratios) == aprils | {f"{p}_trained_per_rollout_s" for p in aprils} | {
        "one_step_async",
        "async_bounded_s1",
        "async_bounded_s2",
    }
    assert (tmp_path / "a.png").exists()
    assert any(line.startswith("sync") for line in lines)

    job_yaml = Path(__file__).resolve().parents[1] / "examples" / "repeat_grpo.yaml"
    assert main_simulate([str(job_yaml), "rollout.batch_size=4", "sim.steps=3", f"out={tmp_path / 'b.png'}"]) == 0
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert main_simulate(["cpu_tiny", "no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert main_simulate(["not_a_preset"]) == 2


def _run_wave(cfg: SimConfig, oversample: float | None, seed: int = 0):

    sim = WaveRollout(cfg, seed, oversample)
    sim.run()
    return sim, sim.result(oversample, None)


def test_filter_drops_the_same_groups_in_every_policy_and_counts_their_tokens():
    cfg = small(filter_rate=0.4, steps=6)
    sync_sim, sync = _run_wave(cfg, None)
    april_sim, april = _run_wave(cfg, 2.0)
    shared = min(len(sync_sim.groups), len(april_sim.groups))
    assert [g.filtered for g in sync_sim.groups[:shared]] == [g.filtered for g in april_sim.groups[:shared]]
    for sim, res in ((sync_sim, sync), (april_sim, april)):
        trained = [g for g in sim.groups if g.state == "trained"]
        assert len(trained) == cfg.steps * cfg.batch_size  # the filter never shrinks a batch
        assert not any(g.filtered for g in trained)
        assert all(g.state == "filtered" for g in sim.groups if g.filtered and g.complete)
        assert res.filtered_tokens == sum(g.generated for g in sim.groups if g.state == "filtered") > 0
        assert res.wasted_tokens == 0  # refill=group replaces a filtered group with one new group
    # sync with the filter starts exactly one replacement per filtered group
    assert len(sync_sim.groups) == cfg.steps * cfg.batch_size + sum(g.state == "filtered" for g in sync_sim.groups)


def test_slime_refill_submits_whole_chunks_and_its_sync_discards_what_is_left():
    cfg = small(filter_rate=0.4, steps=6, refill="batch")
    sync_sim, sync = _run_wave(cfg, None)
    april_sim, april = _run_wave(cfg, 2.0)
    assert len(sync_sim.groups) % cfg.batch_size == 0  # chunks of B
    assert len(sync_sim.groups) > cfg.steps * cfg.batch_size + sum(g.state == "filtered" for g in sync_sim.groups)
    assert sync.wasted_tokens > 0 and sync.held_tokens == 0  # aborted at the end, thrown away
    assert april.wasted_tokens == 0 and april.partials > 0  # aborted, kept, resumed
    new_groups = len(april_sim.groups)
    assert new_groups <= (cfg.steps + 1) * 2 * cfg.batch_size
    for sim in (sync_sim, april_sim):
        assert len([g for g in sim.groups if g.state == "trained"]) == cfg.steps * cfg.batch_size
    assert sync.rollout_s is not None and april.trained_rollout_throughput is not None


def test_async_policies_refuse_what_they_do_not_model():
    with pytest.raises(ValueError, match="filter_rate"):
        simulate("async_bounded", small(filter_rate=0.3))
    assert [r.policy for r in compare(small(refill="batch", steps=3))] == ["sync", "april_x1.5", "april_x2", "april_x3"]


def test_paper_runs_preset_lands_in_the_papers_range():
    # The APRIL paper reports +17% to +44% rollout throughput with slime's loop and the DAPO filter.
    cfg = PRESETS["paper_runs"]
    sync, april = simulate("sync", cfg), simulate("april", cfg, oversample=2.0)
    assert 1.17 <= april.trained_rollout_throughput / sync.trained_rollout_throughput <= 1.44
    assert april.wasted_tokens == 0 < sync.wasted_tokens
