"""Chunk appends per second from N writer processes: one Redis server against a 3-master Redis
Cluster (a replica per master), and what replica acknowledgement (`buffer.replica_acks=1`) costs.

Each writer is a process of its own with its own connection, writing the way a rollout worker
does: rounds of `send_append_chunks` for 8 leased samples, 16 tokens each, then `wait()`, for
`--seconds`. All writers start together; the figure is the chunks all of them appended per second.

Arms (servers started once, a fresh job name per run):
  - single: one `redis-server` (AOF everysec, as a job's own server);
  - cluster: the 3-master cluster (AOF everysec on every node);
  - cluster_acks: the same cluster, every batch acknowledged by its replica (WAIT 1).
Layouts: `one_job` (every writer in one job: one hash tag, so one master serves them all) and
`job_per_writer` (N jobs, spread over the masters by their hash tags).
Runs alternate between the arms (ABCABC...), `--repeats` per arm and writer count; mean and spread.

Everything runs on this machine: on 2 cores the writers, the servers and their replicas share two
CPUs, so the cluster's extra masters cannot add CPU here; the numbers say what one box does.

Prints a table, then LAST one JSON line.   python benchmarks/buffer_scale.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spread import mean_sd  # noqa: E402
from slime.buffer.connection import JobConnection  # noqa: E402
from slime.buffer.redis_cluster import LocalRedisCluster  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.buffer.store import TrajectoryStore  # noqa: E402

SAMPLES, CHUNK = 8, 16
ARMS = ("single", "cluster", "cluster_acks")
LAYOUTS = ("one_job", "job_per_writer")


def writer(url: str, job: str, worker: str, acks: int, start_at: float, seconds: float, out: mp.Queue) -> None:
    store = TrajectoryStore(JobConnection(url, job, replica_acks=acks), lease_seconds=600.0)
    for _ in range(SAMPLES // 4):
        store.add_group([1, 2, 3], n=4, max_new_tokens=1 << 30, metadata={})
    samples = store.lease(worker, SAMPLES)
    stored = {s.id: 0 for s in samples}
    lps, vers = np.full(CHUNK, -0.5), np.zeros(CHUNK, dtype=np.int64)
    time.sleep(max(0.0, start_at - time.time()))
    appended, r = 0, 0
    end = time.time() + seconds
    while time.time() < end:
        chunks = [(s.id, np.arange(CHUNK) + r, lps, vers, stored[s.id]) for s in samples]
        for s, result in zip(samples, store.send_append_chunks(worker, chunks).wait()):
            if isinstance(result, Exception):
                raise result
            stored[s.id] = int(result)
        appended += len(samples)
        r += 1
    out.put(appended)
    store.close()


def one_run(url: str, acks: int, layout: str, writers: int, seconds: float, tag: str, lead_s: float) -> float:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + lead_s
    procs = [
        ctx.Process(
            target=writer,
            args=(url, f"{tag}-{i if layout == 'job_per_writer' else 0}", f"w{i}", acks, start_at, seconds, out),
        )
        for i in range(writers)
    ]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.exitcode != 0:
            raise RuntimeError(f"a writer exited with {p.exitcode}")
    return total / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--writers", default="1,4", help="writer counts, comma-separated")
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    ns = ap.parse_args()
    lead_s = 4.0  # every writer has connected and leased by then (spawn is slow)
    if ns.smoke:
        ns.repeats, ns.seconds, ns.writers, lead_s = 1, 0.2, "1", 1.0
    counts = [int(n) for n in ns.writers.split(",")]
    results: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedisServer(Path(tmp) / "single", aof=True)
        cluster = LocalRedisCluster(Path(tmp) / "cluster", masters=3, replicas=1)
        urls = {"single": (server.url, 0), "cluster": (cluster.url, 0), "cluster_acks": (cluster.url, 1)}
        try:
            run = 0
            for repeat in range(ns.repeats):
                for layout in LAYOUTS:
                    for writers in counts:
                        for arm in ARMS:  # alternating: each arm in turn on the same machine state
                            url, acks = urls[arm]
                            run += 1
                            rate = one_run(url, acks, layout, writers, ns.seconds, f"b{run}", lead_s)
                            results.setdefault((arm, layout, writers), []).append(rate)
                            print(
                                f"  repeat {repeat} {layout:<15} {writers}w {arm:<13} {rate:9.0f} chunks/s", flush=True
                            )
        finally:
            cluster.stop()
            server.stop()
    figures: dict[str, float | int | str] = {"repeats_per_arm": ns.repeats, "seconds_per_run": ns.seconds}
    if ns.smoke:
        figures = {"smoke": True, **figures}
    figures["cpus"] = os.cpu_count() or 0
    print(f"\n{'layout':<15} {'writers':>7} " + " ".join(f"{arm + ' chunks/s':>24}" for arm in ARMS))
    for layout in LAYOUTS:
        for writers in counts:
            cells = []
            for arm in ARMS:
                mean, sd = mean_sd(results[(arm, layout, writers)])
                cells.append(f"{mean:>15.0f} ± {sd:<6.0f}")
                figures[f"{arm}_{layout}_{writers}w_chunks_per_s"] = round(mean, 1)
                figures[f"{arm}_{layout}_{writers}w_chunks_per_s_sd"] = round(sd, 1)
            print(f"{layout:<15} {writers:>7} " + " ".join(cells))
            single = np.mean(results[("single", layout, writers)])
            cluster_rate = np.mean(results[("cluster", layout, writers)])
            acks_rate = np.mean(results[("cluster_acks", layout, writers)])
            figures[f"cluster_over_single_{layout}_{writers}w_ratio"] = round(float(cluster_rate / single), 3)
            figures[f"acks_over_no_acks_{layout}_{writers}w_ratio"] = round(float(acks_rate / cluster_rate), 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
