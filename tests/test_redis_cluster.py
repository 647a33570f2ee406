"""The buffer on a real Redis Cluster (slime/buffer/redis_cluster.py: 3 masters, a replica each,
`redis-server --cluster-enabled yes` on loopback): every key of a job in one slot, a job trained on
it, replica acknowledgement as a switch, and a master SIGKILLed mid-write with its replica promoted
and nothing acknowledged lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slime.buffer import BufferQueries, JobTelemetry, ReplicaAckError, TrajectoryStore
from slime.buffer.connection import JobConnection
from slime.buffer.redis_cluster import LocalRedisCluster
from slime.config import load_config
from slime.sample import Status
from tests.helpers import APRIL_SMALL_JOB

PASSWORD = "pw-cluster"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with LocalRedisCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1, password=PASSWORD) as running:
        yield running


def _open(cluster: LocalRedisCluster, job: str, **kwargs) -> TrajectoryStore:
    return TrajectoryStore(JobConnection(cluster.url, job, password=PASSWORD, **kwargs), lease_seconds=60)


def test_a_job_lies_in_one_slot_and_the_buffer_means_the_same(cluster: LocalRedisCluster) -> None:
    store = _open(cluster, "one-slot")
    assert store.prefix == "slime:{one-slot}:"
    gid = store.add_group([5, 6, 7], n=2, max_new_tokens=4, metadata={"task": "t"})
    first, second = store.lease("w", 2)
    assert store.append_chunks("w", [(first.id, [1, 2], [-0.5, -0.25], [0, 0], 0)]) == [2]
    store.release(first.id, "w")  # aborted: kept token-exact, first in the resume queue
    (resumed,) = store.lease("w2", 1)
    assert resumed.id == first.id and resumed.response_ids.tolist() == [1, 2]
    store.append_chunk(resumed.id, "w2", [3], [-0.1], 1, stored_length=2)
    assert store.finish(resumed.id, "w2", Status.COMPLETED, reward=1.0) is False
    assert store.finish(second.id, "w", Status.TRUNCATED, reward=0.0) is True  # the group is complete
    (group,) = store.claim_groups(4, step=0)
    assert [s.response_ids.tolist() for s in group] == [[1, 2, 3], []]
    assert group[0].versions.tolist() == [0, 0, 1] and group[0].group_id == gid
    assert store.commit_step(0) == 1 and store.counts()["groups_trained"] == 1
    # The dashboard's summary pipeline (a script inside it) runs on the slot's master.
    facts = BufferQueries(store.connection).summary_facts()
    assert facts.generated_tokens == 3 and facts.server_time > 0
    # Every key the scripts wrote hashes to the job's one slot, on one master.
    node = cluster.nodes[0].client(PASSWORD)
    keys = [k.decode() for k in store.redis.scan_iter(match=store.prefix + "*")]
    assert len(keys) > 10
    slots = {node.execute_command("CLUSTER KEYSLOT", k) for k in keys}
    assert len(slots) == 1
    # Jobs spread over the masters: other names land on other slots and masters.
    masters = {cluster.master_of(f"slime:{{job-{i}}}:anchor").port for i in range(12)}
    assert len(masters) == 3
    assert store.delete_job() == len(keys)


def test_replica_acknowledgement_that_cannot_be_met_names_the_cause(cluster: LocalRedisCluster) -> None:
    # One replica per master: asking for two can never be met, so no write counts as stored.
    store = _open(cluster, "two-acks", replica_acks=2, reconnect_timeout_s=1)
    with pytest.raises(ReplicaAckError, match=r"1 of the 2 replicas required \(buffer.replica_acks\)"):
        store.add_group([1], n=1, max_new_tokens=2, metadata={})
    ok = _open(cluster, "one-ack", replica_acks=1)
    gid = ok.add_group([1], n=1, max_new_tokens=2, metadata={})
    assert ok.counts()["groups_total"] == 1 and gid
    ok.delete_job()


@pytest.mark.slow
def test_a_job_trains_on_the_cluster(cluster: LocalRedisCluster, tiny_model_dir, tmp_path: Path) -> None:
    from slime.train import train

    job = "on-cluster"
    url = cluster.url.replace("://", f"://:{PASSWORD}@")  # the password inside the URL
    history = train(
        load_config(
            None,
            [
                f"job_name={job}",
                f"output_dir={tmp_path}",
                f"model.path={tiny_model_dir}",
                f"buffer.url={url}",
                "buffer.replica_acks=1",
                *APRIL_SMALL_JOB,  # over-provisioned: aborted partials resumed through the cluster
                "steps=2",
                "rollout.max_new_tokens=16",
                "cluster.launcher=local",  # the same buffer clients as under Ray, without actor processes
            ],
        )
    )
    assert len(history) == 2 and all(h["groups"] == 3 for h in history)
    store = _open(cluster, job)
    assert store.counts()["groups_trained"] == 6
    # Every generated token is stored: trained, or held by a group still open.
    assert store.stats()["generated_tokens"] == sum(s.response_length for s in store.iter_samples())
    store.delete_job()


@pytest.mark.slow
def test_a_killed_master_loses_nothing_acknowledged(cluster: LocalRedisCluster) -> None:
    """A writer appends without pause while the master that holds its job is SIGKILLed; the
    other parts' commands wait out the failover. Runs last: the slot stays on the promoted replica."""
    store = _open(cluster, "failover", replica_acks=1, reconnect_timeout_s=30)
    telemetry = JobTelemetry(store.connection)
    store.add_group([1, 2], n=4, max_new_tokens=1 << 30, metadata={})
    samples = store.lease("w", 4)
    acknowledged: dict[str, list[int]] = {s.id: [] for s in samples}
    steps = [0]
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            while not done.is_set():
                step = steps[0]
                chunks = [
                    (s.id, [step, step + 1, step + 2], [-0.1] * 3, [step] * 3, len(acknowledged[s.id])) for s in samples
                ]
                for s, reply in zip(samples, store.append_chunks("w", chunks)):
                    if isinstance(reply, Exception):
                        raise reply
                    acknowledged[s.id] += [step, step + 1, step + 2]  # stored: the call returned
                steps[0] += 1
        except BaseException as exc:  # re-raised in the test
            errors.append(exc)

    def wait_for_steps(n: int) -> None:
        deadline = time.monotonic() + 60
        while steps[0] < n and not errors and time.monotonic() < deadline:
            time.sleep(0.01)

    writer = threading.Thread(target=write)
    writer.start()
    wait_for_steps(30)
    old = cluster.kill_master_of(store.connection.anchor)  # a batch is in flight: the writer never pauses
    at_kill = steps[0]
    # Plain commands and pipelines (telemetry, counts) wait out the failover instead of failing.
    telemetry.log_event("probe", {"during": "failover"})
    assert store.counts()["running"] == 4
    new = cluster.wait_for_new_master(store.connection.anchor, old)
    assert new.port != old.port
    # The promoted replica has no replica of its own: writes wait (WAIT 1) until the killed node
    # is back, which rejoins as its replica.
    cluster.restart(old)
    wait_for_steps(at_kill + 30)
    done.set()
    writer.join(timeout=60)
    assert not writer.is_alive() and not errors, [repr(e) + str(e) for e in errors]
    assert steps[0] >= at_kill + 30 and cluster.master_of(store.connection.anchor).port == new.port
    for s in samples:
        stored = store.get_sample(s.id)
        # token-exact: every acknowledged chunk, nothing twice, nothing unacknowledged
        assert stored.response_ids.tolist() == acknowledged[s.id] and len(acknowledged[s.id]) == 3 * steps[0]
        assert stored.versions.tolist() == [v for step in range(steps[0]) for v in [step] * 3]
    assert telemetry.events(5)[0]["detail"] == {"during": "failover"}
    # The promoted master carries on: the buffer's state changes still work.
    assert store.finish(samples[0].id, "w", Status.COMPLETED, reward=1.0) is False
    store.delete_job()
