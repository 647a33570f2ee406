"""A Redis restart mid-run (issue 20, item 3): the parts retry with backoff instead of crashing, a
script whose reply was lost is never applied twice, no acknowledged chunk is lost when the server
is killed, and writes lost with the AOF's unsynced second (a crash of the machine) are detected,
the trajectory resumed token-exactly from what was stored."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from slime.buffer import ChunksLostError, TrajectoryStore
from slime.buffer.aof import open_transaction_start
from slime.buffer.connection import JobConnection
from slime.buffer.redis_server import PARENT_DEATH_SIGNAL, LocalRedisServer
from slime.sample import Status

PROMPT = [5, 6, 7]


def _kill(server: LocalRedisServer) -> None:
    os.kill(json.loads((server.data_dir / "server.json").read_text())["pid"], signal.SIGKILL)


def _aof_tail_file(data_dir: Path) -> Path:
    """The file Redis appends to: Redis 7's newest incremental AOF, or Redis 6's appendonly.aof."""
    incremental = sorted((data_dir / "appendonlydir").glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3]))
    return incremental[-1] if incremental else data_dir / "appendonly.aof"


def _drop_last_transactions(aof: Path, count: int) -> None:
    """Cut the AOF before its last `count` MULTI blocks (one per script run): what a crash of the
    machine leaves when the last writes were not fsynced yet."""
    data, starts, i = aof.read_bytes(), [], 0
    while i < len(data):
        start, end = i, data.index(b"\r\n", i)
        argc, i = int(data[i + 1 : end]), end + 2
        for k in range(argc):
            end = data.index(b"\r\n", i)
            size, i = int(data[i + 1 : end]), end + 2
            if k == 0 and data[i : i + size].upper() == b"MULTI":
                starts.append(start)
            i += size + 2
    aof.write_bytes(data[: starts[-count]])


def test_a_script_sent_twice_changes_the_buffer_once(buffer: TrajectoryStore) -> None:
    # A reply lost on the way (Redis restarted after running the script) makes the client send the
    # same call again; it gets the first run's reply and nothing is applied twice.
    raw = buffer.redis
    for script in (buffer._add_group, buffer._append, buffer._release):
        script.load()
    call = buffer._add_group.call_args([buffer.prefix, "g1", 2, 8, b"\x05\x00\x00\x00", "{}", "", "", "s1", "s2"])
    assert raw.evalsha(buffer._add_group.sha, *call) == raw.evalsha(buffer._add_group.sha, *call) == 1
    assert len(list(buffer.iter_samples())) == 2 and 0 < raw.ttl(call[1]) <= buffer.connection.reply_ttl_s
    # A fresh call (a new request id) is a new request: the group exists already.
    with pytest.raises(ValueError, match="already exists"):
        buffer.add_group(PROMPT, n=2, max_new_tokens=8, metadata={}, group_id="g1")
    first, second = buffer.lease("w", 2)
    # The chunk append stores no reply: the stored length it carries recognises a resend.
    tokens, lps, versions, mask = np.array([1, 2]), np.array([-0.5, -0.25]), np.array([0, 0]), np.array([1, 1])
    append = buffer._append.call_args(buffer._append_args(first.id, "w", tokens, lps, versions, mask, 0))
    assert raw.evalsha(buffer._append.sha, *append) == raw.evalsha(buffer._append.sha, *append) == [0, 2]
    assert buffer.get_sample(first.id).response_ids.tolist() == [1, 2]
    with pytest.raises(ChunksLostError, match="has 2 tokens stored, 4 were acknowledged"):
        buffer.append_chunk(first.id, "w", [3], [-0.1], 0, stored_length=4)
    with pytest.raises(RuntimeError, match="another writer appended"):
        buffer.append_chunk(first.id, "w", [3], [-0.1], 0, stored_length=0)
    release = buffer._release.call_args([buffer.prefix, second.id, "w"])
    assert raw.evalsha(buffer._release.sha, *release) == raw.evalsha(buffer._release.sha, *release)
    assert buffer.counts()["queue_resume"] == 1  # released once, queued once


def test_a_killed_redis_restarts_and_every_acknowledged_chunk_is_kept(tmp_path: Path) -> None:
    # always: Redis fsyncs before it replies. With everysec a SIGKILL under disk load can take the
    # last acknowledged writes too (the test of ChunksLostError below covers that path).
    server = LocalRedisServer(tmp_path / "redis", aof=True, password="pw", appendfsync="always")
    restarts: list[str] = []
    server.keep_alive(restarts.append)
    store = TrajectoryStore(JobConnection(server.url, "restart", password="pw", reconnect_timeout_s=30), 30.0)
    try:
        store.add_group(PROMPT, n=4, max_new_tokens=10_000, metadata={})
        samples = store.lease("w", 4)
        acknowledged = {s.id: [] for s in samples}
        errors: list[BaseException] = []
        stop = threading.Event()

        def write() -> None:  # a rollout worker's chunk writes, pipelined, with the stored length
            token = 0
            try:
                while not stop.is_set():
                    chunks = []
                    for s in samples:
                        ids = [token, token + 1]
                        token += 2
                        chunks.append((s.id, ids, [-0.5, -0.5], [0, 0], len(acknowledged[s.id])))
                    for (sid, ids, *_), result in zip(chunks, store.send_append_chunks("w", chunks).wait()):
                        if isinstance(result, Exception):
                            raise result
                        acknowledged[sid].extend(ids)
                        assert result == len(acknowledged[sid])
            except BaseException as exc:
                errors.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        for _ in range(2):
            time.sleep(0.5)
            _kill(server)
            deadline = time.time() + 30
            while len(restarts) < _ + 1 and time.time() < deadline:
                time.sleep(0.05)
        time.sleep(0.5)
        stop.set()
        writer.join(timeout=60)
        assert not errors, errors
        assert len(restarts) == 2 and "restarted on port" in restarts[0], restarts
        for s in samples:
            stored = store.get_sample(s.id)
            assert stored.response_ids.tolist() == acknowledged[s.id], "a chunk was lost or applied twice"
            assert stored.status == Status.RUNNING and len(acknowledged[s.id]) > 20
        assert store.stats()["generated_tokens"] == sum(len(v) for v in acknowledged.values())
    finally:
        store.close()
        server.stop()


def test_a_client_gives_up_with_the_cause_after_its_reconnect_timeout(tmp_path: Path) -> None:
    server = LocalRedisServer(tmp_path / "redis", aof=False)
    store = TrajectoryStore(JobConnection(server.url, "gone", reconnect_timeout_s=1.0))
    server.stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        store.counts()
    with pytest.raises(redis.ConnectionError):
        store.append_chunks("w", [("s", [1], [-0.1], [0], 0)])
    assert time.monotonic() - started < 30


def test_a_client_gives_up_on_a_server_that_accepts_and_never_answers(tmp_path: Path) -> None:
    """A stopped redis-server (or a blackholed path) accepts connections and never replies: with no
    read timeout the job hung in read_counts for good, deaf to SIGTERM."""
    server = LocalRedisServer(tmp_path / "redis", aof=False)
    store = TrajectoryStore(JobConnection(server.url, "stopped", reconnect_timeout_s=2.0))
    assert store.counts()["running"] == 0
    pid = server._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        outcome: list[BaseException | dict] = []

        def count() -> None:
            try:
                outcome.append(store.counts())
            except BaseException as exc:  # noqa: BLE001 - the outcome is what the test reads
                outcome.append(exc)

        reader = threading.Thread(target=count, daemon=True)  # a hang must fail the test, not stall it
        reader.start()
        reader.join(timeout=30)  # one read timeout (5 s here), then past the reconnect deadline: no retry
        assert not reader.is_alive(), "the read on a stopped server never returned"
        assert isinstance(outcome[0], (redis.TimeoutError, redis.ConnectionError)), outcome
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()


def test_writes_lost_with_the_unsynced_second_are_detected_and_resumed_from_what_is_stored(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    server = LocalRedisServer(data_dir, aof=True)
    store = TrajectoryStore.open(server.url, "crash", 60.0)
    store.add_group(PROMPT, n=1, max_new_tokens=64, metadata={})
    (sample,) = store.lease("w", 1)
    for k in range(4):  # four chunks acknowledged to the worker
        store.append_chunk(sample.id, "w", [10 * k, 10 * k + 1], [-0.1, -0.2], k, stored_length=2 * k)
    store.close()
    _kill(server)
    _drop_last_transactions(_aof_tail_file(data_dir), 2)  # the machine crashed: the last two never reached disk
    server = LocalRedisServer(data_dir, aof=True)  # replays what is on disk
    store = TrajectoryStore.open(server.url, "crash", 60.0)
    try:
        with pytest.raises(ChunksLostError, match="has 4 tokens stored, 8 were acknowledged") as lost:
            store.append_chunk(sample.id, "w", [40, 41], [-0.1, -0.2], 4, stored_length=8)
        assert lost.value.stored_length == 4
        # Nothing was appended after the gap; the worker releases it and it resumes from the prefix.
        store.release(sample.id, "w")
        (resumed,) = store.lease("w2", 1)
        assert resumed.id == sample.id and resumed.response_ids.tolist() == [0, 1, 10, 11]
        assert resumed.versions.tolist() == [0, 0, 1, 1]
        assert store.append_chunk(sample.id, "w2", [20, 21], [-0.1, -0.2], 2, stored_length=4) == 6
    finally:
        store.close()
        server.stop()


@pytest.mark.parametrize("cut", ["inside its last command", "before its EXEC"])
def test_a_block_cut_by_a_kill_is_not_replayed_beside_its_resend(tmp_path: Path, cut: str) -> None:
    """A server killed while writing a script's MULTI block to the AOF: Redis 7.0 loads the file
    without the block but keeps its complete commands in the file, still open, and the resend's
    block lands after them; the next restart replayed both (the chunk stored twice, seen in CI).
    The server's start cuts the open block first."""
    data_dir = tmp_path / "redis"
    server = LocalRedisServer(data_dir, aof=True, appendfsync="always")
    store = TrajectoryStore.open(server.url, "cut", 60.0)
    store.add_group(PROMPT, n=1, max_new_tokens=64, metadata={})
    (sample,) = store.lease("w", 1)
    store.append_chunk(sample.id, "w", [1, 2], [-0.1, -0.2], 0, stored_length=0)
    store.append_chunk(sample.id, "w", [3, 4], [-0.1, -0.2], 0, stored_length=2)  # its reply lost with the kill
    store.close()
    _kill(server)
    aof = _aof_tail_file(data_dir)
    data = aof.read_bytes()
    exec_at = data.rindex(b"*1\r\n$4\r\nEXEC\r\n")
    aof.write_bytes(data[: exec_at - 5 if cut == "inside its last command" else exec_at])
    for restart in (1, 2):
        server = LocalRedisServer(data_dir, aof=True, appendfsync="always")
        store = TrajectoryStore.open(server.url, "cut", 60.0)
        try:
            if restart == 1:
                assert "unfinished transaction" in server.log_path.read_text()
                assert store.get_sample(sample.id).response_ids.tolist() == [1, 2]
                assert store.append_chunk(sample.id, "w", [3, 4], [-0.1, -0.2], 0, stored_length=2) == 4  # resent
            else:
                assert store.get_sample(sample.id).response_ids.tolist() == [1, 2, 3, 4]
                assert store.stats()["generated_tokens"] == 4
        finally:
            store.close()
            _kill(server) if restart == 1 else server.stop()


def _resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def test_the_aof_repair_finds_the_open_block_and_no_other() -> None:
    block = _resp(b"MULTI") + _resp(b"APPEND", b"k", b"ab") + _resp(b"EXEC")
    done = _resp(b"SET", b"a", b"1") + block
    assert open_transaction_start(done) is None  # ends cleanly: nothing to cut
    assert open_transaction_start(done + block[:-3]) == len(done)  # cut inside EXEC
    assert open_transaction_start(done + block[: len(_resp(b"MULTI")) + 4]) == len(done)  # inside APPEND
    assert open_transaction_start(done + _resp(b"SET", b"b", b"2")[:-4]) == len(done)  # a cut plain command
    # MULTI's bytes inside a stored value are not a block's start: the real one before them is.
    trap = _resp(b"MULTI") + _resp(b"APPEND", b"k", _resp(b"MULTI") + b"x")
    assert open_transaction_start(done + trap[:-2]) == len(done)
    assert open_transaction_start(done + trap + _resp(b"EXEC")) is None


def test_a_finish_over_a_lost_tail_is_refused(buffer: TrajectoryStore) -> None:
    """The last chunks can be lost after the last append (the sample was being scored): the finish
    carries the length the worker knows is stored, and a shorter stored response is not final."""
    from slime.buffer import Finish

    buffer.add_group(PROMPT, n=1, max_new_tokens=8, metadata={})
    (sample,) = buffer.lease("w", 1)
    buffer.append_chunk(sample.id, "w", [1, 2, 3, 4], [-0.1] * 4, 0, stored_length=0)
    (lost,) = buffer.finish_many("w", [Finish(sample.id, Status.COMPLETED, reward=1.0, stored_length=6)])
    assert isinstance(lost, ChunksLostError) and lost.stored_length == 4
    assert buffer.stats()["lost_chunk_tokens"] == 2  # counted where it is found, for every writer
    assert buffer.get_sample(sample.id).status == Status.RUNNING  # not final: the worker releases it
    assert buffer.finish_many("w", [Finish(sample.id, Status.COMPLETED, reward=1.0, stored_length=4)]) == [True]


def test_a_fresh_start_takes_another_port_when_the_probed_one_is_taken(tmp_path: Path, monkeypatch) -> None:
    """The free port can be taken between probing and binding: the next try probes a new one (a
    restart, by contrast, must keep its port, which the clients know)."""
    import socket

    import slime.buffer.redis_server as redis_server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real_free_port = redis_server._free_port
    monkeypatch.setattr(redis_server, "_free_port", lambda: ports.pop() if ports else real_free_port())
    try:
        server = LocalRedisServer(tmp_path / "redis", aof=False)
        assert server.port != taken.getsockname()[1] and server.running
        server.stop()
    finally:
        taken.close()


@pytest.mark.skipif(not PARENT_DEATH_SIGNAL, reason="setpriv (util-linux) is Linux's")
def test_a_job_killed_with_sigkill_takes_its_redis_server_with_it(tmp_path: Path) -> None:
    """A SIGKILLed driver (the OOM killer, kill -9) left its redis-server running until the next run
    in the same output_dir stopped it as a leftover; another output_dir never did."""
    import subprocess
    import sys

    script = (
        "import os, signal, sys\n"
        "from slime.buffer.redis_server import LocalRedisServer\n"
        f"server = LocalRedisServer({str(tmp_path / 'redis')!r}, aof=True)\n"
        "server.keep_alive()\n"
        "print(server._process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)
    assert "ready to exit" in (tmp_path / "redis" / "redis-server.log").read_text()  # SIGTERM: a clean shutdown


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_claim_lost_with_the_unsynced_second_is_not_trained_twice(tmp_path: Path) -> None:
    """The learner claims a group and trains it; the machine crashes before the claim reached disk,
    so after the replay the group is ready again and the next step claims it. The learner's store
    knows it trained that group: it keeps the first claim's step (committed by the checkpoint that
    covers it) and fills the step with other groups."""
    data_dir = tmp_path / "redis"
    server = LocalRedisServer(data_dir, aof=True)
    store = TrajectoryStore(JobConnection(server.url, "lostclaim", reconnect_timeout_s=30), 60.0)
    try:
        gids = [store.add_group(PROMPT, n=1, max_new_tokens=8, metadata={}) for _ in range(2)]
        for s in store.lease("w", 2):
            store.append_chunk(s.id, "w", [1, 2], [-0.1, -0.2], version=0, stored_length=0)
            store.finish(s.id, "w", Status.COMPLETED, reward=1.0)
        assert [g[0].group_id for g in store.claim_groups(1, step=0)] == gids[:1]  # trained at step 0
        _kill(server)
        server._process.wait()
        _drop_last_transactions(_aof_tail_file(data_dir), 1)  # the claim was not fsynced yet
        server._start(30.0, port=server.port)  # what keep_alive does: same port, the AOF replayed
        assert store.counts()["groups_ready"] == 2  # the claim is lost
        assert [g[0].group_id for g in store.claim_groups(2, step=1)] == gids[1:]
        assert store.stats()["reclaimed_groups"] == 1
        store.commit_through(0)
        counts = store.counts()
        assert (counts["groups_trained"], counts["groups_claimed"], counts["groups_ready"]) == (1, 1, 0)
    finally:
        store.close()
        server.stop()
