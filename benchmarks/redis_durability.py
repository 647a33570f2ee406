"""What durability costs the buffer, and how long a Redis restart takes.

Arms (the job's own redis-server, `LocalRedisServer`): AOF off, AOF with `appendfsync everysec`
(the default), AOF with `appendfsync always`. Each run starts a fresh server in a fresh directory
and writes chunks the way a rollout worker does:
  - pipelined: rounds of `send_append_chunks` for 8 leased samples, 16 tokens each, then `wait()`
    (the worker's per-step write), `--rounds` rounds: chunk appends per second;
  - single: `--singles` lone `append_chunk` calls: p50 and p99 latency.
Then the server is SIGKILLed and started again over its data (the AOF replayed): seconds until it
answers PING (AOF arms only), and whether every acknowledged token is still there.
Runs alternate between the arms (ABCABC...), `--repeats` per arm; mean and spread per arm, and
ratios to AOF off.

Prints a table, then LAST one JSON line.   python benchmarks/redis_durability.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spread import mean_sd  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.buffer.store import TrajectoryStore  # noqa: E402

ARMS = {"aof_off": (False, "everysec"), "everysec": (True, "everysec"), "always": (True, "always")}
SAMPLES, CHUNK = 8, 16


def one_run(arm: str, directory: Path, rounds: int, singles: int) -> dict:
    aof, fsync = ARMS[arm]
    server = LocalRedisServer(directory, aof=aof, appendfsync=fsync)
    store = TrajectoryStore.open(server.url, "bench", 600.0)
    try:
        for _ in range(SAMPLES // 4):
            store.add_group([1, 2, 3], n=4, max_new_tokens=1 << 20, metadata={})
        samples = store.lease("w", SAMPLES)
        stored = {s.id: 0 for s in samples}
        lps, vers = np.full(CHUNK, -0.5), np.zeros(CHUNK, dtype=np.int64)
        started = time.perf_counter()
        for r in range(rounds):
            chunks = [(s.id, np.arange(CHUNK) + r, lps, vers, stored[s.id]) for s in samples]
            for s, result in zip(samples, store.send_append_chunks("w", chunks).wait()):
                stored[s.id] = int(result)
        pipelined_s = time.perf_counter() - started
        first = samples[0].id
        latencies = []
        for _ in range(singles):
            t0 = time.perf_counter()
            stored[first] = store.append_chunk(first, "w", np.arange(CHUNK), lps, vers, stored_length=stored[first])
            latencies.append(time.perf_counter() - t0)
        store.close()
        restart_s, kept = None, None
        if aof:
            os.kill(json.loads((server.data_dir / "server.json").read_text())["pid"], signal.SIGKILL)
            t0 = time.perf_counter()
            server = LocalRedisServer(directory, aof=True, appendfsync=fsync)
            restart_s = time.perf_counter() - t0
            store = TrajectoryStore.open(server.url, "bench", 600.0)
            kept = all(store.get_sample(s.id).response_length == stored[s.id] for s in samples)
            store.close()
        latencies.sort()
        return {
            "chunks_per_s": rounds * SAMPLES / pipelined_s,
            "single_p50_ms": 1e3 * latencies[len(latencies) // 2],
            "single_p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
            "restart_s": restart_s,
            "acknowledged_kept": kept,
            "tokens": sum(stored.values()),
        }
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--singles", type=int, default=1000)
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    ns = ap.parse_args()
    if ns.smoke:
        ns.repeats, ns.rounds, ns.singles = 1, 5, 10
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(ns.repeats):
            for arm in ARMS:  # alternating: every arm sees the same machine state in turn
                runs[arm].append(one_run(arm, Path(tmp) / f"{arm}-{repeat}", ns.rounds, ns.singles))
    figures: dict[str, float | bool | int] = {**({"smoke": True} if ns.smoke else {}), "repeats_per_arm": ns.repeats}
    print(f"{'arm':<10} {'chunks/s':>16} {'single p50 ms':>15} {'single p99 ms':>15} {'restart s':>12}")
    for arm, rs in runs.items():
        cps, cps_sd = mean_sd([r["chunks_per_s"] for r in rs])
        p50, p50_sd = mean_sd([r["single_p50_ms"] for r in rs])
        p99, _ = mean_sd([r["single_p99_ms"] for r in rs])
        restart = f"{statistics.mean(r['restart_s'] for r in rs):.3f}" if rs[0]["restart_s"] is not None else "-"
        print(f"{arm:<10} {cps:>9.0f} ± {cps_sd:<4.0f} {p50:>8.3f} ± {p50_sd:<4.3f} {p99:>15.3f} {restart:>12}")
        figures[f"{arm}_chunks_per_s"] = round(cps, 1)
        figures[f"{arm}_single_append_p50_ms"] = round(p50, 3)
        figures[f"{arm}_single_append_p99_ms"] = round(p99, 3)
        if rs[0]["restart_s"] is not None:
            figures[f"{arm}_restart_s"] = round(statistics.mean(r["restart_s"] for r in rs), 3)
            figures[f"{arm}_acknowledged_kept_all_runs"] = all(r["acknowledged_kept"] for r in rs)
    base = statistics.mean(r["chunks_per_s"] for r in runs["aof_off"])
    for arm in ("everysec", "always"):
        ratio = statistics.mean(r["chunks_per_s"] for r in runs[arm]) / base
        figures[f"{arm}_vs_aof_off_throughput_ratio"] = round(ratio, 3)
        print(f"{arm} / aof_off chunk throughput: {ratio:.2f}x")
    figures["tokens_per_run"] = runs["always"][0]["tokens"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
