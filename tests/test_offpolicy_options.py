"""The off-policy options hold to their word, through the real parts:

- async admission (`mode=async`, `max_staleness`): no trained sample's oldest token is more than
  `max_staleness` versions older than the learner that trains it, read back from the buffer's
  claimed groups and the learner's own lag histogram (a group admission let through over the
  bound, overtaken by shorter ones, is dropped by the learner, never trained);
- `algorithm.correction.name=mask_stale`: the real Learner's collate + off_policy_mask zero the loss mask
  exactly on the tokens an older policy made (env/tool tokens stay 0), and those tokens then carry
  no gradient;
- `april.chunk_sampler`: the temperature the hook returns after a chunk is the one the engine
  samples the NEXT chunk with (first token included), also after an abort and resume; checked
  against the behaviour logprobs the worker stored.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from slime.buffer import TrajectoryStore
from slime.config import load_config
from slime.engines.builtin import BuiltinEngine
from slime.model import load_model
from slime.sample import Sample, Status
from slime.train import train
from tests.helpers import wait_for

PROMPTS = [[6, 7, 77, 61, 86], [8, 77, 62, 64, 86]]


# ---- 1. async admission: the lag itself ---------------------------------------------------------


@pytest.mark.slow
def test_async_admission_never_trains_a_token_older_than_max_staleness(
    ray_session, tiny_model_dir, redis_url, tmp_path
):
    """Admission starts group k only if it would be trained at step k // B, within the bound, and
    async claims train the groups in the order they started (claim_in_order.lua), so that premise
    holds: no group reaches the learner over the bound (before, a long group overtaken by shorter
    ones did, and the learner dropped it: generated, never trained). What is trained never lags more
    than max_staleness. Read from the buffer (every claimed group, every token's version) and from
    the learner's lag histogram of what it trained."""
    job, max_staleness = "offpolicy-async-lag", 1
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={redis_url}",
                "rollout.batch_size=3",
                "rollout.n_samples_per_prompt=3",
                "rollout.max_new_tokens=40",
                "data.num_generated=64",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "steps=4",
                "mode=async",
                f"max_staleness={max_staleness}",
                # Over-provisioned: more groups in flight than a batch, so older tokens do reach the learner.
                "april.enabled=true",
                "april.oversample=2.0",
            ],
        )
    )
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    trained_by = {int(h["step"]): int(h["policy_version"]) - 1 for h in history}  # the version that trained it

    # Every group the learner claimed, by step: its members' lags (learner version - oldest token's version).
    buffer = TrajectoryStore.open(redis_url, job)
    claimed: dict[int, list[list[int]]] = {}
    members_of: dict[int, int] = {}
    for gid, step in buffer.redis.zrange(buffer._key("trained"), 0, -1, withscores=True):
        members = buffer.get_group(gid.decode())
        lags = [trained_by[int(step)] - s.min_version for s in members if s.min_version is not None]
        claimed.setdefault(int(step), []).append(lags)
        members_of[id(lags)] = len(members)
    buffer.delete_job()

    assert sorted(claimed) == [0, 1, 2, 3]
    trained_lags = []
    for h in history:
        groups = claimed[int(h["step"])]
        over = [g for g in groups if max(g, default=0) > max_staleness]
        kept = [g for g in groups if max(g, default=0) <= max_staleness]
        # No group reached the learner over the bound (the learner would have dropped it).
        assert over == [] and h["dropped_stale_groups"] == 0, (h["step"], groups)
        assert len(kept) == h["groups"] and sum(members_of[id(g)] for g in kept) == h["samples"]
        lags = [lag for g in kept for lag in g]
        assert all(0 <= lag <= max_staleness for lag in lags), (h["step"], groups)
        # The learner's record of what it trained (version_lag_hist) says the same, lag by lag.
        recorded = {int(k.split("/", 1)[1]): int(v) for k, v in h.items() if k.startswith("version_lag_hist/") and v}
        assert recorded == {lag: lags.count(lag) for lag in set(lags)}, (h["step"], recorded, groups)
        trained_lags += lags
    assert max(trained_lags) >= 1, "no sample was trained by a newer policy: the bound was never exercised"


# ---- 2. mask_stale: exactly the stale tokens ----------------------------------------------------


def _sample(gid: str, index: int, versions: list[int], mask: list[int], reward: float, rng) -> Sample:
    n = len(versions)
    return Sample(
        group_id=gid,
        index=index,
        prompt_ids=np.array(PROMPTS[0]),
        max_new_tokens=32,
        response_ids=rng.integers(10, 60, size=n),
        logprobs=rng.uniform(-3.0, -0.1, size=n),
        versions=np.array(versions),
        loss_mask=np.array(mask),
        status=Status.COMPLETED,
        reward=reward,
    )


def _batch_samples(stale_logprob: float | None = None) -> tuple[list[Sample], list[np.ndarray]]:
    """Three samples of one group, trained at learner version 3: the loss mask mask_stale must leave."""
    rng = np.random.default_rng(0)
    samples = [
        # A resumed partial: two chunks by versions 1 and 2, then the current one; env/tool tokens
        # (mask 0) both inside the stale prefix and after it.
        _sample("g", 0, [1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3], [1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1], 1.0, rng),
        _sample("g", 1, [3] * 8, [1] * 8, 0.0, rng),  # fresh: nothing stale
        _sample("g", 2, [2, 2, 2, 3, 3, 3], [1] * 6, 0.5, rng),  # one version behind
    ]
    expected = [
        np.array([0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1]),
        np.array([1] * 8),
        np.array([0, 0, 0, 1, 1, 1]),
    ]
    if stale_logprob is not None:  # what the older policies reported for their tokens: irrelevant once masked
        for s in samples:
            s.logprobs = np.where(s.versions < 3, np.float32(stale_logprob), s.logprobs).astype(np.float32)
    return samples, expected


def _update_with_spy(tiny_model_dir, redis_url, tmp_path, off_policy: str, samples: list[Sample]):
    """One real Learner.update at version 3; returns the loss mask it trained with and the new weights."""
    from slime.learner import Learner

    cfg = load_config(
        None,
        [
            f"job_name=offpolicy-mask-{off_policy}",
            f"output_dir={tmp_path / off_policy}",
            f"algorithm.correction.name={off_policy}",
        ],
    )
    learner = Learner(cfg, str(tiny_model_dir), redis_url)
    learner.version = 3
    seen = {}
    prepare = learner._prepare

    def spy(batch, kl_coef, unfinished):  # the batch after collate + off_policy_mask, as the loss gets it
        seen["mask"], seen["versions"] = batch.mask.clone(), batch.versions.clone()
        return prepare(batch, kl_coef, unfinished)

    learner._prepare = spy
    metrics = learner.update(samples, [0] * len(samples), step=0)
    weights = {k: v.detach().clone() for k, v in learner.policy.named_parameters()}
    learner.buffer.close()
    return seen, metrics, weights


def test_mask_stale_masks_exactly_the_stale_tokens(tiny_model_dir, redis_url, tmp_path):
    samples, expected = _batch_samples()
    seen, metrics, weights = _update_with_spy(tiny_model_dir, redis_url, tmp_path, "mask_stale", samples)
    mask = seen["mask"]
    for i, (s, want) in enumerate(zip(samples, expected)):
        n = s.response_length
        assert mask[i, :n].tolist() == want.astype(float).tolist(), i
        assert not mask[i, n:].any()  # padding
        # 0 exactly where an older version made a trainable token, or where the token is env/tool's.
        stale = (s.versions < 3) & (s.loss_mask > 0)
        assert np.array_equal(mask[i, :n].numpy() == 0, stale | (s.loss_mask == 0)), i
    assert metrics["off_policy_token_share"] == pytest.approx(8 / 26)  # stale trainable / response tokens

    # The same batch under tis keeps every trainable token in the loss (the mask is the stored one).
    seen_tis, _, _ = _update_with_spy(tiny_model_dir, redis_url, tmp_path, "tis", _batch_samples()[0])
    for i, s in enumerate(samples):
        assert seen_tis["mask"][i, : s.response_length].tolist() == s.loss_mask.astype(float).tolist()

    # Masked means no gradient: the stale tokens' behaviour logprobs do not change the update at all.
    other, _ = _batch_samples(stale_logprob=-9.0)
    _, _, weights_other = _update_with_spy(tiny_model_dir, redis_url, tmp_path, "mask_stale", other)
    assert all(torch.equal(weights[k], weights_other[k]) for k in weights)
    # ... while under tis they do (the importance weights of those tokens change).
    _, _, w_tis = _update_with_spy(tiny_model_dir, redis_url, tmp_path, "tis", _batch_samples()[0])
    _, _, w_tis_other = _update_with_spy(tiny_model_dir, redis_url, tmp_path, "tis", other)
    assert any(not torch.equal(w_tis[k], w_tis_other[k]) for k in w_tis)


# ---- 3. chunk_sampler: the hook's temperature reaches the next chunk -------------------------------

HOT = 0.37  # distinctive: far from the base temperature 1.0
CHUNK = 4


def _chunk_sampler_run(tiny_model_dir, redis_url, tmp_path, job: str, abort_every_s: float | None):
    from slime.rollout import RolloutWorker

    hook = tmp_path / f"{job}_hook.py"
    hook.write_text(
        "CALLS = []\n"
        "def temperature(state):\n"
        "    CALLS.append(state['response_length'])\n"
        f"    return {HOT} if state['response_length'] >= {CHUNK} else None\n"
    )
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path / job}",
            "rollout.temperature=1.0",
            "rollout.ignore_eos=true",
            "rollout.max_new_tokens=20",
            f"rollout.chunk_tokens={CHUNK}",
            "rollout.max_running_requests=8",
            f"april.chunk_sampler={hook}:temperature",
        ],
    )
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    groups = [buffer.add_group(p, 3, 20, {"label": "x", "prompt_text": "x"}) for p in PROMPTS]
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w0")
    aborts = 0
    try:
        if abort_every_s is None:
            wait_for(lambda: buffer.counts()["groups_ready"] == len(groups), 60, "the groups to complete")
        else:
            rng = np.random.default_rng(1)
            deadline = time.time() + 60
            while buffer.counts()["groups_ready"] < len(groups):
                assert time.time() < deadline, "the groups did not complete"
                time.sleep(float(rng.uniform(0.0, abort_every_s)))
                aborts += worker.abort_all()
                worker.resume()
        calls = list(worker.chunk_sampler.__globals__["CALLS"])
    finally:
        worker.stop()
    samples = [s for gid in groups for s in buffer.get_group(gid)]
    buffer.delete_job()
    return samples, calls, aborts


def _check_temperatures(tiny_model_dir, samples: list[Sample]) -> None:
    """Token i was sampled at 1.0 in the first chunk and at HOT from the second chunk on: its stored
    behaviour logprob is log_softmax(logits / T)[token] at that T, recomputed here (same weights)."""
    engine = BuiltinEngine(load_model(tiny_model_dir), max_running_requests=1)
    discriminating = 0
    for s in samples:
        assert s.status == Status.TRUNCATED and s.response_length == 20
        prompt, response = s.prompt_ids.tolist(), s.response_ids.tolist()
        at_base = np.asarray(engine.score_logprobs(prompt, response, 1.0))
        at_hot = np.asarray(engine.score_logprobs(prompt, response, HOT))
        expected = np.where(np.arange(len(response)) < CHUNK, at_base, at_hot)
        np.testing.assert_allclose(s.logprobs, expected, atol=2e-3, err_msg=f"sample {s.id}")
        # The first token of the second chunk: the one a hook applied one engine step late would miss.
        discriminating += abs(at_base[CHUNK] - at_hot[CHUNK]) > 0.05
    assert discriminating >= 2, "the two temperatures give the same logprobs: the check would prove nothing"


@pytest.mark.slow
def test_chunk_sampler_temperature_reaches_the_next_chunk(tiny_model_dir, redis_url, tmp_path):
    samples, calls, _ = _chunk_sampler_run(tiny_model_dir, redis_url, tmp_path, "offpolicy-chunk", None)
    # Called once per chunk boundary, with the length including the chunk just made.
    assert calls and all(n % CHUNK == 0 and 0 < n < 20 for n in calls)
    _check_temperatures(tiny_model_dir, samples)


@pytest.mark.slow
def test_chunk_sampler_temperature_survives_abort_and_resume(tiny_model_dir, redis_url, tmp_path):
    samples, _, aborts = _chunk_sampler_run(tiny_model_dir, redis_url, tmp_path, "offpolicy-chunk-abort", 0.03)
    assert aborts >= 3
    _check_temperatures(tiny_model_dir, samples)


@pytest.mark.parametrize("returned", ["1e-45", "float('nan')", "'hot'"])
def test_a_chunk_sampler_temperature_no_engine_takes_stops_the_worker_naming_the_hook(
    tiny_model_dir, redis_url, tmp_path, returned
):
    """1e-45 (or NaN) went straight to the engine: NaN probabilities, token 0 and a non-finite logprob."""
    from slime.rollout import RolloutWorker

    hook = tmp_path / "bad_hook.py"
    hook.write_text(f"def temperature(state):\n    return {returned} if state['response_length'] else None\n")
    job = "offpolicy-chunk-bad"
    cfg = load_config(
        None,
        [
            f"job_name={job}",
            f"output_dir={tmp_path / job}",
            "rollout.ignore_eos=true",
            f"rollout.chunk_tokens={CHUNK}",
            f"april.chunk_sampler={hook}:temperature",
        ],
    )
    buffer = TrajectoryStore.open(redis_url, job)
    buffer.delete_job()
    buffer.add_group(PROMPTS[0], 2, 20, {"label": "x"})
    worker = RolloutWorker(cfg, str(tiny_model_dir), redis_url, "w0")
    try:
        wait_for(lambda: worker.error is not None, 60, "the worker to stop on the hook's temperature")
    finally:
        worker.stop()
    assert f"april.chunk_sampler {hook}:temperature returned" in worker.error
    assert "a temperature is 0 (greedy) or a number in [1e-06, 100]" in worker.error
    buffer.delete_job()


@pytest.mark.parametrize("off_policy", ["tis", "icepop"])
def test_token_shares_do_not_depend_on_the_micro_batching(tiny_model_dir, redis_url, tmp_path, off_policy):
    """A share of the batch's trainable tokens (masked, clipped) or their mean ratio is the same
    whether the batch goes through in one micro-batch or one row at a time: the micro-batches'
    values are weighted by their tokens, not averaged as equals. Rows of 12, 8 and 6 tokens."""
    from slime.learner import Learner

    metrics = {}
    for micro in (64, 1):
        cfg = load_config(
            None,
            [
                f"job_name=shares-{off_policy}-{micro}",
                f"output_dir={tmp_path / str(micro)}",
                f"algorithm.correction.name={off_policy}",
                "algorithm.correction.tis_cap=1.5",
                "algorithm.correction.icepop_band=[0.7,1.4]",
                f"learner.micro_batch_size={micro}",
            ],
        )
        learner = Learner(cfg, str(tiny_model_dir), redis_url)
        learner.version = 3
        metrics[micro] = learner.update(_batch_samples()[0], [0, 0, 0], step=0)
        learner.buffer.close()
    keys = [k for k in metrics[64] if k.startswith("offpolicy_") and not k.endswith("_max")]
    assert keys and any(metrics[64][k] not in (0.0, 1.0) for k in keys), metrics[64]
    for k in keys:
        assert metrics[1][k] == pytest.approx(metrics[64][k], rel=1e-5, abs=1e-7), k
