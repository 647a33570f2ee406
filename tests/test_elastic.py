"""Elastic rollout: april's decision (april/elastic.py) on hand-written step sequences, its config
checks, the simulator's elastic async policy, and a real async job whose workers are added when
the buffer runs dry and removed when it fills (slime/fleet.py), losing nothing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from april.elastic import ElasticPolicy
from april.sim import simulate
from april.sim.config import PRESETS, SimConfig
from slime.buffer import JobTelemetry, TrajectoryStore
from slime.config import ConfigError, load_config
from slime.sample import Status, new_id
from slime.tools.simulate import sim_config_from_job
from tests.helpers import wait_for


def _policy(**kw) -> ElasticPolicy:
    settings = dict(min_workers=1, max_workers=3, low_watermark=0.5, high_watermark=1.0, cooldown_steps=2)
    return ElasticPolicy(**(settings | kw))


def _run(policy: ElasticPolicy, workers: int, steps: list[tuple[int, int]], budget: int = 4) -> list[str]:
    """Feed (ready groups, queued samples) per step, carrying each decision out; the actions."""
    actions = []
    for ready, queued in steps:
        d = policy.decide(workers, ready, budget, queued)
        workers = d.workers
        actions.append(d.action)
    return actions


# ---- the decision ---------------------------------------------------------------------------------


def test_the_first_step_holds_however_empty_the_buffer():
    p = _policy(cooldown_steps=0)
    d = p.decide(1, 0, 4, 100)
    assert d.action == "hold" and "first step" in d.reason and d.workers == 1
    assert p.decide(1, 0, 4, 100).action == "add"  # from the second step on, an empty buffer is a signal


def test_dry_buffer_adds_up_to_max_then_holds():
    # Ready groups of 4 (the budget): 0 and 1 -> mean 0.125 <= 0.5, samples queued: add; the
    # cooldown of 2 steps observes the new count before the next decision.
    steps = [(0, 9)] + [(0, 9), (1, 9)] + [(1, 9), (0, 9)] + [(0, 9), (0, 9)]
    assert _run(_policy(), 1, steps) == ["hold", "hold", "add", "hold", "add", "hold", "hold"]


def test_full_buffer_removes_down_to_min():
    steps = [(4, 0)] + [(4, 0), (4, 0)] + [(4, 0), (4, 0)] + [(4, 0), (4, 0)]
    assert _run(_policy(min_workers=1), 3, steps) == ["hold", "hold", "remove", "hold", "remove", "hold", "hold"]


def test_decisions_take_the_mean_fill_of_the_window():
    """A step that waited for its stragglers, then one whose batch was all there: the mean (0.625)
    is between the watermarks, where a single step would have flapped between add and remove."""
    alternating = [(0, 0)] + [(1, 9), (4, 9)] * 4
    assert set(_run(_policy(), 2, alternating)) == {"hold"}
    assert _run(_policy(cooldown_steps=1), 2, alternating)[1:3] == ["add", "remove"]


def test_dry_but_no_sample_waiting_for_a_slot_holds():
    """The learner waits for its long tail: every sample already runs, a worker more would not help."""
    d = _policy(cooldown_steps=1)
    d.decide(1, 0, 4, 0)
    hold = d.decide(1, 0, 4, 0)
    assert hold.action == "hold" and "every sample has an engine slot" in hold.reason
    assert d.decide(1, 0, 4, 1).action == "add"


def test_between_the_watermarks_holds_and_bounds_are_checked():
    assert _run(_policy(cooldown_steps=1), 2, [(0, 0), (3, 9), (3, 9), (3, 9)]) == ["hold"] * 4
    with pytest.raises(ValueError, match="min_workers"):
        _policy(min_workers=4)
    with pytest.raises(ValueError, match="low_watermark"):
        _policy(low_watermark=1.0)
    with pytest.raises(ValueError, match="budget_groups"):
        _policy().decide(1, 0, 0, 0)


# ---- config ---------------------------------------------------------------------------------------


def test_config_refuses_what_elastic_cannot_do():
    on = ["rollout.elastic.enabled=true"]
    load_config(None, [*on, "mode=async"])
    load_config(None, ["mode=sync"])  # disabled: nothing to check
    with pytest.raises(ConfigError, match="mode=async"):
        load_config(None, on)
    with pytest.raises(ConfigError, match="broadcast.*cannot join"):
        load_config(None, [*on, "mode=async", "weights.transport=broadcast"])
    with pytest.raises(ConfigError, match="rollout.num_workers=5 must lie within"):
        load_config(None, [*on, "mode=async", "rollout.num_workers=5"])
    with pytest.raises(ConfigError, match="rollout.elastic: low_watermark=1.0 must be below"):
        load_config(None, [*on, "rollout.elastic.low_watermark=1.0"])


# ---- simulator ------------------------------------------------------------------------------------


def test_simulator_grows_a_rollout_bound_fleet_and_accounts_every_token():
    """The paper preset on 16 GPUs with 4 engines is rollout-bound: elastic adds engines (taking
    GPUs from the learner), throughput rises; every generated token is trained or held."""
    cfg = SimConfig(
        **PRESETS["paper"].model_dump()
        | dict(
            engines=4,
            steps=12,
            gpu_pool=16,
            t_train_per_token=1.6e-4,
            elastic=True,
            elastic_min_engines=2,
            elastic_max_engines=12,
        )
    )
    static = simulate("async_bounded", cfg)
    grown = simulate("async_bounded", cfg, elastic=True)
    assert grown.policy == "async_bounded_s1_elastic"
    assert static.engines_per_step == [4] * 12
    assert grown.engines_per_step[:4] == [4, 4, 5, 5]  # one engine per cooldown window of 2 steps
    assert grown.engines_per_step[-1] > 6 and grown.mean_engines > 5
    assert grown.trained_throughput > 1.1 * static.trained_throughput  # 1.15x
    assert grown.generated_tokens == grown.trained_tokens + grown.held_tokens  # nothing wasted
    assert grown.max_span <= 1


def test_simulator_shrinks_a_learner_bound_fleet():
    """Short responses and a slow learner: the batch is always ready when the learner asks."""
    cfg = SimConfig(
        **PRESETS["cpu_tiny"].model_dump()
        | dict(engines=3, steps=10, t_train0=2.0, elastic=True, elastic_max_engines=3, elastic_cooldown_steps=1)
    )
    r = simulate("async_bounded", cfg, elastic=True)
    assert r.engines_per_step[0] == 3 and r.engines_per_step[-1] == 1
    assert r.generated_tokens == r.trained_tokens + r.held_tokens
    with pytest.raises(ValueError, match="elastic is modelled for async_bounded"):
        simulate("april", cfg, elastic=True)


def test_slime_simulate_takes_the_jobs_elastic_bounds():
    job = load_config(
        None,
        [
            "mode=async",
            "rollout.num_workers=2",
            "rollout.elastic.enabled=true",
            "rollout.elastic.max_workers=5",
            "rollout.elastic.high_watermark=0.9",
        ],
    )
    cfg = sim_config_from_job(job)
    assert cfg.elastic and (cfg.engines, cfg.elastic_min_engines, cfg.elastic_max_engines) == (2, 1, 5)
    assert (cfg.elastic_low_watermark, cfg.elastic_high_watermark, cfg.elastic_cooldown_steps) == (0.5, 0.9, 2)


# ---- a worker leaving, and a real job -------------------------------------------------------------


@pytest.mark.slow
def test_a_retiring_worker_requeues_its_partials_with_every_token(ray_session, tiny_model_dir, redis_url, tmp_path):
    """RolloutWorker.retire mid-generation (what the fleet calls on the worker it removes): nothing
    stays leased, the partials wait first in line with their tokens, and every token the worker
    generated is in the buffer."""
    import ray

    from slime.rollout import RolloutWorker

    job = "elastic-retire"
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path}",
            "rollout.max_new_tokens=64",
            "rollout.chunk_tokens=2",
            "rollout.ignore_eos=true",  # every sample runs long enough to be caught mid-generation
        ],
    )
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    for _ in range(4):
        buffer.add_group([6, 7, 77, 61, 86], 2, 64, {"label": "ababab", "prompt_text": "ab*3="})
    worker = ray.remote(num_cpus=0)(RolloutWorker).remote(cfg, str(tiny_model_dir), redis_url, "w0")
    wait_for(lambda: [s for s in buffer.iter_samples(Status.RUNNING) if s.response_length >= 4], 120, "partial tokens")
    retired = ray.get(worker.retire.remote(), timeout=120)
    ray.kill(worker)
    samples = list(buffer.iter_samples())
    c = buffer.counts()
    assert retired["aborted"] > 0 and c[Status.RUNNING.value] == 0 and c["leases"] == 0
    partials = [s for s in samples if s.status == Status.ABORTED]
    assert len(partials) == retired["aborted"] == c["queue_resume"]
    assert all(s.response_length >= 4 for s in partials)
    assert {s.status for s in samples} <= {Status.ABORTED, Status.PENDING, Status.TRUNCATED}
    assert retired["generated_tokens"] == sum(s.response_length for s in samples) == buffer.stats()["generated_tokens"]
    buffer.delete_job()


STALLED_FROM = 4  # prompts in order, 2 per step: steps 0 and 1 score at once, step 2's reward stalls


@pytest.mark.slow
def test_elastic_job_adds_a_worker_when_dry_removes_it_when_full_and_loses_nothing(
    ray_session, tiny_model_dir, redis_url, tmp_path
):
    """Scripted load: the reward service stalls on the prompts of step 2 on (a stuck judge) until
    this test releases it, which it does once the added worker has joined. So the learner finds
    the buffer dry with samples waiting for a worker (steps 1 and 2: a worker is added), then, the
    reward quick and the learner slow (8 epochs), its batch all there when it asks (steps 3 and 4:
    the worker is removed). Every group is trained or still in the buffer with every token."""
    from fastapi.testclient import TestClient

    from slime.dashboard.app import create_app
    from slime.train import train

    released = tmp_path / "released"
    step0_logged = tmp_path / "step0_logged"
    reward = tmp_path / "scripted_load.py"
    # Step 1's prompts are scored only once step 0 is logged, so the learner asking for step 1 finds
    # them not ready (fill 0) however fast the machine generates.
    reward.write_text(
        "import os, time\n"
        "from envs.repeat import score\n"
        "def wait_for(path):\n"
        "    deadline = time.time() + 100\n"
        "    while not os.path.exists(path) and time.time() < deadline:\n"
        "        time.sleep(0.05)\n"
        "def reward(prompt, response, label, metadata):\n"
        f"    if metadata['record_index'] >= {STALLED_FROM}:\n"
        f"        wait_for({str(released)!r})\n"
        f"    elif metadata['record_index'] >= {STALLED_FROM // 2}:\n"
        f"        wait_for({str(step0_logged)!r})\n"
        "    return score(response, label)\n"
    )
    job = f"elastic-e2e-{new_id()[:6]}"  # no event of an earlier run releases the reward
    telemetry = JobTelemetry.open(redis_url, job)

    def release_when_joined() -> None:
        deadline = time.time() + 150
        while time.time() < deadline and not telemetry.step_history(1):
            time.sleep(0.1)
        step0_logged.touch()
        while time.time() < deadline and not any(e["kind"] == "elastic_joined" for e in telemetry.events(50)):
            time.sleep(0.1)
        released.touch()

    watcher = threading.Thread(target=release_when_joined, daemon=True)
    watcher.start()
    steps = 7
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "mode=async",
                "max_staleness=1",
                f"steps={steps}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=8",
                "rollout.max_running_requests=2",
                "data.num_generated=64",
                "data.shuffle=false",
                f"reward.fn={reward}:reward",
                "reward.max_concurrency=1",
                # the stalled calls wait up to 100 s: an added worker's start on a loaded machine (under
                # two busy loops it took over 25 s, the wait's bound before, and joined after the release)
                "reward.timeout_s=120",
                "learner.ppo_epochs=8",  # a learner slower than the rollout once the reward is quick
                "weights.check_every=1",  # every worker, the added one too, holds the learner's weights
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "rollout.elastic.enabled=true",
                "rollout.elastic.max_workers=2",
            ],
        )
    )
    watcher.join(timeout=5)
    assert len(history) == steps
    workers = [h["rollout_workers"] for h in history]
    events = [e for e in telemetry.events(100)[::-1] if e["kind"].startswith("elastic_")]
    assert [e["kind"] for e in events] == ["elastic_add", "elastic_joined", "elastic_remove", "elastic_removed"], events
    add, joined, remove, removed = (e["detail"] for e in events)
    assert add["step"] == 2 and add["fill"] <= 0.5 and add["queued_samples"] > 0 and add["workers"] == 2
    assert joined["worker"] == add["worker"] and joined["weights_version"] == 2
    assert remove["fill"] >= 1.0 and remove["worker"] == add["worker"] and remove["workers"] == 1
    assert removed["worker"] == add["worker"] and removed["generated_tokens"] > 0  # it did generate
    assert workers[0] == 1 and 2 in workers and workers[-1] == 1
    assert all(h.get("mismatch_fresh_logp_abs_diff", 0.0) < 1e-3 for h in history)

    buffer = TrajectoryStore.open(redis_url, job)
    c = buffer.counts()
    assert c["groups_trained"] == steps * 2  # each trained once
    assert c["groups_dropped"] == c["groups_claimed"] == c[Status.FAILED.value] == 0
    samples = list(buffer.iter_samples())
    assert len(samples) == 2 * c["groups_total"]  # every sample of every group started is still there
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
        assert np.all(np.diff(s.versions) >= 0)  # resumed partials continue from their stored tokens
    stats = buffer.stats()
    assert stats.get("restarted_tokens", 0.0) == 0.0
    assert stats["generated_tokens"] == sum(s.response_length for s in samples)  # every token stored once

    # The dashboard shows the decisions, and no longer the removed worker's engine.
    client = TestClient(create_app(redis_url, job), base_url="http://127.0.0.1")
    shown = [e["kind"] for e in client.get("/api/events", params={"limit": 100}).json()]
    assert {"elastic_add", "elastic_joined", "elastic_remove", "elastic_removed"} <= set(shown)
    assert removed["worker"] not in {e["worker_id"] for e in client.get("/api/engines").json()}
    buffer.delete_job()


def test_kv_resume_totals_keep_what_workers_that_left_or_restarted_counted() -> None:
    """kv_resumes_total summed the workers alive now: an elastic scale-down made it fall."""
    from slime.fleet import WorkerTotals

    totals = WorkerTotals("kv_resumes", "kv_resumed_tokens")
    a, b = {"worker_id": "a"}, {"worker_id": "b"}
    assert totals.update([{**a, "kv_resumes": 2, "kv_resumed_tokens": 20}, {**b, "kv_resumes": 3}]) == {
        "kv_resumes": 5,
        "kv_resumed_tokens": 20,
    }
    assert totals.update([{**a, "kv_resumes": 4, "kv_resumed_tokens": 30}])["kv_resumes"] == 7  # b left with 3
    restarted = totals.update([{**a, "kv_resumes": 1, "kv_resumed_tokens": 5}])  # a restarted: counts from 0
    assert restarted == {"kv_resumes": 8, "kv_resumed_tokens": 35}
