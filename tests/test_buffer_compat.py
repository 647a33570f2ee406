"""A job written by the old single-file buffer (slime/buffer.py of commit 0e398c7) is read by the
split one: same key layout, same facts, and the job goes on (leases requeue, claims exactly once).

tests/data/buffer_v1.json holds every key of that job as DUMP payload + PTTL, with the value as
plain data too (see tests/data/make_buffer_v1_fixture.py, which wrote it with Redis 6.2). Each test
RESTOREs the keys into the session's real redis-server under a job name of its own; a server that
refuses the payload's RDB version gets the keys rebuilt from the plain values instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from slime.buffer.connection import JobConnection
from slime.buffer.queries import BufferQueries
from slime.buffer.store import LeaseLostError, TrajectoryStore
from slime.buffer.telemetry import JobTelemetry
from slime.dashboard.reader import BufferReader, TrajectoryFilter
from slime.sample import Sample, Status, new_id

FIXTURE = Path(__file__).with_name("data") / "buffer_v1.json"
OLD_PREFIX = "slime:buffer-v1:"


@pytest.fixture(scope="module")
def v1() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _b(text: str) -> bytes:
    return base64.b64decode(text)


def rebuild_from_plain(client: redis.Redis, name: str, entry: dict[str, Any]) -> None:
    value = entry["value"]
    kind = entry["type"]
    if kind == "string":
        client.set(name, _b(value))
    elif kind == "hash":
        client.hset(name, mapping={_b(k): _b(v) for k, v in value.items()})
    elif kind == "list":
        client.rpush(name, *(_b(v) for v in value))
    elif kind == "set":
        client.sadd(name, *(_b(v) for v in value))
    elif kind == "zset":
        client.zadd(name, {_b(m): score for m, score in value})
    else:
        raise ValueError(f"{name}: unexpected type {kind}")
    if entry["pttl"] > 0:
        client.pexpire(name, entry["pttl"])


def restore(client: redis.Redis, v1: dict[str, Any], job: str, plain: bool = False) -> str:
    """The fixture's keys under `slime:<job>:`; returns how they were written ('restore'|'plain')."""
    how = "plain" if plain else "restore"
    for old_name, entry in v1["keys"].items():
        name = f"slime:{job}:" + old_name.removeprefix(OLD_PREFIX)
        if how == "restore":
            try:
                client.restore(name, max(entry["pttl"], 0), _b(entry["dump"]))
                continue
            except redis.ResponseError as exc:  # a server that cannot read this RDB version
                if "payload version" not in str(exc):
                    raise
                how = "plain"
        rebuild_from_plain(client, name, entry)
    return how


@pytest.fixture
def connection(redis_url: str, v1: dict[str, Any]) -> Iterator[JobConnection]:
    connection = JobConnection(redis_url, f"compat-{new_id()}")
    restore(connection.redis, v1, connection.job)
    yield connection
    TrajectoryStore(connection).delete_job()
    connection.close()


def as_fact(s: Sample) -> dict[str, Any]:
    return {
        "id": s.id,
        "group_id": s.group_id,
        "index": s.index,
        "status": s.status.value,
        "prompt_ids": s.prompt_ids.tolist(),
        "max_new_tokens": s.max_new_tokens,
        "response_ids": s.response_ids.tolist(),
        "logprobs": s.logprobs.tolist(),
        "versions": s.versions.tolist(),
        "loss_mask": s.loss_mask.tolist(),
        "reward": s.reward,
        "token_rewards": s.token_rewards.tolist() if s.token_rewards is not None else None,
        "failure": s.failure,
        "metadata": s.metadata,
        "created_at": s.created_at,
        "updated_at": s.updated_at,
    }


def test_the_fixture_covers_every_stage_and_restores_key_for_key(connection: JobConnection, v1: dict) -> None:
    assert v1["written_by"]["commit"] == "0e398c7" and v1["written_by"]["redis_version"].startswith("6.2")
    names = {
        k.decode().removeprefix(connection.prefix) for k in connection.redis.scan_iter(match=connection.prefix + "*")
    }
    assert names == {k.removeprefix(OLD_PREFIX) for k in v1["keys"]}
    stages = {g["fields"]["status"] for g in v1["facts"]["groups"].values()}
    assert stages == {"open", "ready", "claimed", "trained", "dropped"}
    statuses = {s["status"] for s in v1["facts"]["samples"]}
    assert statuses == {s.value for s in Status}


def test_the_store_reads_every_trajectory_as_the_old_code_did(connection: JobConnection, v1: dict) -> None:
    facts = v1["facts"]
    store = TrajectoryStore(connection)
    samples = [s for gid in facts["group_ids"] for s in store.get_group(gid)]
    assert [as_fact(s) for s in samples] == facts["samples"]  # token arrays, versions, masks, rewards, metadata
    for s in samples:
        assert s.response_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert s.versions.dtype == np.int32 and s.loss_mask.dtype == np.int8
    assert {s.id for s in store.iter_samples()} == {s["id"] for s in facts["samples"]}
    assert store.counts() == facts["counts"]
    assert store.stats() == facts["stats"]
    assert store.get_policy_version() == facts["policy_version"] == 3
    assert store.running_ids() == facts["running_ids"]
    assert store.ready_group_ids() == facts["ready_group_ids"]
    live = store.get_sample(facts["roles"]["live"])
    assert live.loss_mask.tolist() == [1, 1, 1, 0, 0] and live.versions.tolist() == [1, 2, 3, 3, 3]


def test_leases_still_held_go_on_and_expired_ones_requeue_with_their_tokens(
    connection: JobConnection, v1: dict
) -> None:
    roles = v1["facts"]["roles"]
    store = TrajectoryStore(connection)
    # w-live's lease was taken for 10**8 s: it still holds it, and appends continue the old arrays.
    assert store.renew_leases("w-live", [roles["live"]]) == []
    assert store.append_chunk(roles["live"], "w-live", [100], [-0.5], version=4) == 6
    assert store.get_sample(roles["live"]).versions.tolist() == [1, 2, 3, 3, 3, 4]
    # w-dead's lease expired long ago: reaped, ABORTED with its tokens, first in line.
    assert store.reap_expired_leases() == [roles["crashed"]]
    with pytest.raises(LeaseLostError):
        store.append_chunk(roles["crashed"], "w-dead", [1], [-1.0], version=4)
    crashed, aborted = store.lease("w-new", 2)  # resume queue before new prompts
    assert (crashed.id, aborted.id) == (roles["crashed"], roles["aborted"])
    assert crashed.response_ids.tolist() == [68, 69, 70] and crashed.remaining_tokens == 13
    assert aborted.response_ids.tolist() == [66, 67] and aborted.versions.tolist() == [2, 2]
    assert {s.group_id for s in store.lease("w-new", 10)} == {roles["pending"]}  # then new prompts
    # The open group completes when its last three members finish (one finished under the old code).
    assert not store.finish(roles["live"], "w-live", Status.COMPLETED, reward=1.0)
    assert not store.finish(crashed.id, "w-new", Status.TRUNCATED, reward=0.0)
    assert store.finish(aborted.id, "w-new", Status.COMPLETED, reward=0.5)
    assert store.ready_group_ids() == [roles["ready"], roles["open"]]


def test_a_restarted_job_requeues_every_leased_trajectory(connection: JobConnection, v1: dict) -> None:
    store = TrajectoryStore(connection)
    assert store.requeue_all_leased() == 4
    counts = store.counts()
    assert counts["running"] == 0 and counts["leases"] == 0 and counts["aborted"] == 5 and counts["queue_resume"] == 5


def test_groups_are_claimed_exactly_once_and_commit_through_the_checkpoint(connection: JobConnection, v1: dict) -> None:
    roles = v1["facts"]["roles"]
    store = TrajectoryStore(connection)
    assert store.wait_for_ready_signal(0.01) is True  # raised by the old code when `ready` completed
    assert store.wait_for_ready_signal(0.01) is False
    # A resume from the checkpoint of step 1: step 2's claim was not in it, so it goes back first.
    assert store.requeue_uncommitted(after_step=2) == 0
    assert store.requeue_uncommitted(after_step=1) == 1
    claimed = store.claim_groups(10, step=3)
    assert [g[0].group_id for g in claimed] == [roles["claimed"], roles["ready"]]
    assert [s.status for s in claimed[1]] == [Status.TRUNCATED, Status.FAILED]
    assert claimed[1][0].token_rewards.tolist() == [0.25, 0.25, 0.25] and claimed[1][0].metadata["turns"] == 2
    assert claimed[1][1].failure == "reward timed out after 5.0 s"
    assert store.claim_groups(10, step=4) == []  # trained, dropped and open groups are never claimed
    assert store.commit_through(3) == 2
    counts = store.counts()
    assert counts["groups_trained"] == 3 and counts["groups_claimed"] == 0 and counts["groups_dropped"] == 1
    assert store.requeue_uncommitted() == 0


def test_streaming_continues_from_the_trained_segment(connection: JobConnection, v1: dict) -> None:
    roles = v1["facts"]["roles"]
    store = TrajectoryStore(connection)
    assert store.count_segments(2, 0) == 0  # 5 tokens, 4 of them trained under the old code
    [(sample, start, final)] = store.claim_segments(1, 10, 0)
    assert (sample.id, start, final, sample.response_length) == (roles["streamed"], 4, False, 5)


def test_telemetry_reads_events_health_steps_info_controls_and_expert_load(connection: JobConnection, v1: dict) -> None:
    facts = v1["facts"]
    telemetry = JobTelemetry(connection)
    assert telemetry.events(100) == facts["events"]
    assert [e["kind"] for e in telemetry.events(2)] == ["oversample", "rollout_paused"]
    assert telemetry.engine_health() == facts["engine_health"]
    assert telemetry.step_history() == facts["step_history"] and telemetry.step_history()[-1]["step"] == 2
    assert telemetry.job_info() == facts["job_info"]
    assert telemetry.get_control() == facts["control"] == {"paused": "1", "oversample": "1.5"}
    assert telemetry.expert_load().tolist() == facts["expert_load"] == [[3, 0, 1], [0, 2, 5]]
    # The dashboard's writes land beside the old records.
    telemetry.log_event("resume", {"by": "dashboard"})
    telemetry.record_step(3, {"reward_mean": 1.0})
    assert [e["kind"] for e in telemetry.events(3)] == ["resume", "oversample", "rollout_paused"]
    assert [s["step"] for s in telemetry.step_history()] == [1, 2, 3]


def test_dashboard_controls_act_on_old_trajectories(connection: JobConnection, v1: dict) -> None:
    roles = v1["facts"]["roles"]
    store, telemetry = TrajectoryStore(connection), JobTelemetry(connection)
    telemetry.force_requeue(roles["live"])
    assert store.get_sample(roles["live"]).status is Status.ABORTED
    with pytest.raises(LeaseLostError):
        store.append_chunk(roles["live"], "w-live", [1], [-1.0], version=4)
    pending = store.get_group(roles["pending"])[0].id
    assert telemetry.drop_sample(pending, "looked wrong") == "pending"
    with pytest.raises(ValueError, match="completed"):
        telemetry.drop_sample(roles["done"], "finished already")
    assert store.stats()["dropped_samples:dashboard"] == 1.0
    assert store.drop_ready_group(roles["ready"], "zero_variance")
    assert store.stats()["dropped_groups:zero_variance"] == 2.0


def test_the_dashboard_queries_read_what_the_old_code_listed(connection: JobConnection, v1: dict) -> None:
    facts = v1["facts"]
    queries = BufferQueries(connection)
    assert queries.group_count() == len(facts["group_ids"])
    assert queries.group_ids_by_rank(0, -1) == facts["group_ids"]
    rows = queries.group_rows(facts["group_ids"])
    assert {gid: {"fields": f, "sample_ids": s} for gid, (f, s) in zip(facts["group_ids"], rows)} == facts["groups"]
    assert queries.sample_rows([s["id"] for s in facts["samples"]]) == facts["sample_rows"]
    assert queries.scan_rows(1 << 40, 0, 1000, 1000)[0] == facts["scan_rows"]
    assert sorted(queries.first_versions(256)) == facts["first_versions"]
    assert queries.counts() == facts["counts"] and queries.get_policy_version() == 3

    reader = BufferReader(queries, JobTelemetry(connection))
    summary = reader.summary()
    assert summary.paused is True and summary.oversample == 1.5 and summary.step == 2 and summary.total_steps == 10
    assert summary.policy_version == 3 and summary.generated_tokens == facts["stats"]["generated_tokens"]
    assert summary.samples_by_status == {s.value: facts["counts"][s.value] for s in Status}
    assert summary.staleness_max == 2  # first versions 1, 1, 2, 3 of unfinished work; policy 3
    listed = reader.trajectories(TrajectoryFilter(), 100, None, 1000)["items"]
    assert sorted(r["id"] for r in listed) == sorted(s["id"] for s in facts["samples"])
    aborted = reader.trajectories(TrajectoryFilter(statuses=frozenset({Status.ABORTED})), 100, None, 1000)["items"]
    assert [r["id"] for r in aborted] == [facts["roles"]["aborted"]]
    stages = {g.id: g.stage for g in reader.groups(frozenset(), 50, None).items}
    assert stages == {gid: g["fields"]["status"] for gid, g in facts["groups"].items()}
    assert [s["step"] for s in reader.steps(10)] == [1, 2]
    assert {e.worker_id: e.alive for e in reader.engines()} == {"w0": True, "w1": False}
    assert reader.experts().counts == [[3, 0, 1], [0, 2, 5]]
    trajectory = reader.trajectory(facts["roles"]["live"])  # no tokenizer at the old model_dir: ids shown
    assert [t.id for t in trajectory.tokens] == [63, 64, 65, 9, 9] and trajectory.row.version_span == 2


def test_plain_values_rebuild_the_same_job(redis_url: str, v1: dict) -> None:
    """The fallback for a server that cannot RESTORE this RDB version writes the same data."""
    client = redis.Redis.from_url(redis_url)
    jobs = {how: f"compat-{how}-{new_id()}" for how in ("restore", "plain")}
    try:
        assert restore(client, v1, jobs["restore"]) == "restore"
        assert restore(client, v1, jobs["plain"], plain=True) == "plain"
        for old_name, entry in v1["keys"].items():
            rest = old_name.removeprefix(OLD_PREFIX)
            names = {how: f"slime:{job}:{rest}" for how, job in jobs.items()}
            assert {client.type(n).decode() for n in names.values()} == {entry["type"]}
            contents = [_contents(client, n, entry["type"]) for n in names.values()]
            assert contents[0] == contents[1], rest
    finally:
        for job in jobs.values():
            TrajectoryStore.open(redis_url, job).delete_job()


def _contents(client: redis.Redis, name: str, kind: str) -> Any:
    if kind == "string":
        return client.get(name)
    if kind == "hash":
        return client.hgetall(name)
    if kind == "list":
        return client.lrange(name, 0, -1)
    if kind == "set":
        return client.smembers(name)
    return client.zrange(name, 0, -1, withscores=True)
