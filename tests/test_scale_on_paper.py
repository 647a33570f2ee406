"""benchmarks/scale_on_paper.py: the Redis load it derives from a fleet's token rate, the bytes an
append costs on a real redis-server, and the simulator's sync-vs-APRIL ordering on a small cluster."""

from __future__ import annotations

import pytest

from benchmarks.scale_on_paper import append_call_bytes, best_ratio, predict, redis_load
from slime.buffer.store import TrajectoryStore


def test_redis_load_from_a_token_rate_by_hand() -> None:
    load = redis_load(
        tokens_per_s=16_000,
        ends_per_s=256,
        decode_steps_per_s=500,
        mean_batch=64,
        train_steps_per_s=0.01,
        groups_per_step=64,
        engines=8,
        chunk_tokens=16,
        call_overhead_bytes=200,
        lease_seconds=10,
    )
    # 16,000 / 16 full chunks, plus 15/32 of a chunk per response end: 256 * 15 / 32 = 120
    assert load.chunk_appends_per_s == pytest.approx(1120)
    # 13 bytes per token (int32 token, float32 logprob, int32 version, int8 mask) + 200 per call
    assert load.bytes_per_s == pytest.approx(13 * 16_000 + 200 * 1120)
    assert load.groups_claimed_per_s == pytest.approx(0.64)
    # 500 steps x (1 - (15/16)^64) append pipelines + 2 x 256 leases/finishes + 0.01 x (1 + 2 x 64)
    # claims + 8 workers x 2 per 10/3 s + the driver's 150
    assert load.round_trips_per_s == pytest.approx(491.96 + 512 + 1.29 + 4.8 + 150, abs=0.05)
    # no response ends: exactly one append per chunk of tokens
    assert redis_load(16_000, 0, 500, 64, 0.01, 64, 8, 16, 200, 10).chunk_appends_per_s == 1000


def test_best_ratio_is_the_smallest_within_one_percent_and_sync_is_ratio_one() -> None:
    assert best_ratio({1.5: 9.95, 2.0: 10.0, 3.0: 10.02}, sync=5.0) == (1.5, 9.95)
    assert best_ratio({1.5: 9.0, 2.0: 10.0}, sync=5.0) == (2.0, 10.0)
    assert best_ratio({2.0: 4.0}, sync=5.0) == (1.0, 5.0)


def test_append_bytes_grow_by_13_per_token(buffer: TrajectoryStore) -> None:
    short, long = append_call_bytes(buffer, 16, rounds=20), append_call_bytes(buffer, 64, rounds=20)
    # 48 more tokens of 13 bytes; RESP's length prefixes of three arrays gain a digit ($64 -> $256)
    assert long - short == pytest.approx(48 * 13 + 3, abs=2)
    assert 13 * 16 < short < 13 * 16 + 600  # the call's own overhead: script, ids, key, lengths


def test_april_beats_sync_on_a_small_cluster() -> None:
    short = dict(median_tokens=128.0, max_tokens=2048, prompt_tokens=16, t_train0=0.5, t_sync=0.5)
    p = predict(2, ratios=(2.0,), shares=(0.5,), steps=6, **short)
    assert p["config"].batch_size == 2 * 64 // 8  # one response per slot of every GPU
    # the long tail idles sync's engines; APRIL keeps them full (the simulator says ~1.7x here)
    assert p["april_samples_per_s"][2.0] > 1.3 * p["sync_samples_per_s"]
    assert p["best_ratio"] == 2.0 and p["best_samples_per_s"] == p["april_samples_per_s"][2.0]
    assert p["best_split_rollout_gpus"] == 1 and p["split_samples_per_s"][1] > 0
