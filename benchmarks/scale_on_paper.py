"""Scale on paper: what the APRIL simulator (april/sim/run.py) predicts for 8, 64 and 512 GPUs, and the
Redis load that implies.

For each GPU count, with the assumptions below (a Qwen3-30B-A3B-class MoE, one engine per H200,
the simulator's long-tailed log-normal lengths, one step's responses = one full set of slots):
  - sync (over-provisioning ratio 1) and APRIL at each ratio, colocated (every GPU rolls out, then
    trains): throughput in the steady state (steps after the first), the best ratio, its gain;
  - a rollout/training split (R GPUs run engines, N - R train) with the async loop at staleness 1,
    the only loop in which a split overlaps rollout and training; the best R;
  - the Redis load of the best colocated APRIL: chunk appends/s, bytes/s into Redis (13 bytes per
    token plus the per-call overhead, measured on a real redis-server), groups claimed/s and round
    trips/s, during the rollout phase (the peak); and, given a measured append capacity
    (benchmarks/buffer_scale.py), the GPU count at which one server saturates.
Above 64 GPUs the sweep narrows to the previous size's best ratio and the one below it, and its best
split with the grid's neighbours (`--full-grid` sweeps everything); simulations run on `--workers`
processes. A few minutes on 2 cores.

Prints the tables, then LAST one JSON line.
    python benchmarks/scale_on_paper.py [--server-appends-per-s X] [--cluster-appends-per-s Y]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from april.sim import SimConfig, SimResult, simulate  # noqa: E402
from april.sim.engine import LengthSampler  # noqa: E402
from slime.buffer.records import WIRE_LOGPROB, WIRE_MASK, WIRE_TOKEN, WIRE_VERSION  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.buffer.store import TrajectoryStore  # noqa: E402
from slime.config import BufferConfig, RolloutConfig  # noqa: E402

# ---- assumptions (not measured here; docs/scale.md says where each comes from)
MODEL = "Qwen3-30B-A3B-class MoE (30B total, 3B active; 48 layers x 4 KV heads x 128 dims = 96 KB bf16 KV/token)"
GPU = "H200 (141 GB HBM at 4.8 TB/s, ~1 PFLOP/s dense bf16), one engine per GPU"
ENGINE = dict(
    slots=64,  # max running requests per engine
    kv_tokens=600_000,  # ~60 GB of KV pool after 61 GB of weights and activations
    t0=0.006,  # s per decode step: non-expert weights, launches, sampling
    k=1.5e-4,  # s per running request: the experts its tokens activate, read from HBM (saturates near 64)
    t_kv=2e-8,  # s per cached token per step: 96 KB of KV at 4.8 TB/s
    p=1.5e-5,  # s per prefill token: 6 GFLOP at ~40% MFU
)
LEARNER_TOKENS_PER_S_PER_GPU = 6000.0  # ~40 GFLOP/token (fwd+bwd, old/ref log-probs, recompute) at ~25% MFU
LEARNER = dict(t_train0=10.0, t_sync=5.0)  # s per step: optimizer, offload/onload; weight update
N_SAMPLES = 8
WORKLOAD = dict(  # the simulator's log-normal (the `paper` preset's parameters)
    n_samples=N_SAMPLES, prompt_tokens=512, max_tokens=16_384, median_tokens=2048.0, sigma_prompt=0.6, sigma_sample=0.5
)
RATIOS = (1.25, 1.5, 2.0, 3.0)  # APRIL's over-provisioning; ratio 1 is sync
ROLLOUT_SHARES = (0.25, 0.375, 0.5, 0.625, 0.75)  # of the GPUs running engines, in a split
MAX_STALENESS = 1  # the async loop's default (JobConfig.max_staleness)
BEST_WITHIN = 0.01  # the best ratio: the smallest one within 1% of the highest throughput
# The driver's wait loop (slime/fleet.py): every 20 ms a counts read, a ready-signal BLPOP and the
# scheduler's counts read.
DRIVER_ROUND_TRIPS_PER_S = 3 / 0.02
BYTES_PER_TOKEN = sum(np.dtype(t).itemsize for t in (WIRE_TOKEN, WIRE_LOGPROB, WIRE_VERSION, WIRE_MASK))


def steps_for(gpus: int) -> int:
    """Simulated training steps: fewer where a step holds more responses (its time varies less)."""
    return 12 if gpus <= 8 else 6 if gpus <= 64 else 3


def cluster_config(gpus: int, rollout_gpus: int, learner_gpus: int, steps: int, **overrides) -> SimConfig:
    """N GPUs as the simulator sees them: `rollout_gpus` engines, a learner as fast as `learner_gpus`
    GPUs; B*n = one response per slot of every GPU (the per-GPU load is the same at every N)."""
    fields = {**ENGINE, **LEARNER, **WORKLOAD, **overrides}
    return SimConfig(
        engines=rollout_gpus,
        batch_size=gpus * fields["slots"] // fields["n_samples"],
        t_train_per_token=1.0 / (LEARNER_TOKENS_PER_S_PER_GPU * learner_gpus),
        steps=steps,
        **fields,
    )


def length_stats(cfg: SimConfig, groups: int = 20_000) -> dict[str, float]:
    """The simulator's own length sampler, drawn `groups` times."""
    sampler = LengthSampler(cfg, seed=123)
    lengths = np.array([n for _ in range(groups) for n in sampler.group()])
    return {
        "mean": float(lengths.mean()),
        "p50": float(np.percentile(lengths, 50)),
        "p99": float(np.percentile(lengths, 99)),
        "at_cap_share": float((lengths >= cfg.max_tokens).mean()),
    }


def steady_samples_per_s(result: SimResult, samples_per_step: int) -> float:
    """Trained responses per second over the steps after the first (APRIL's first step has no
    partials to resume; its last leaves partials held, so whole-run figures understate it)."""
    times = result.step_times[1:] or result.step_times
    return samples_per_step / float(np.mean(times))


@dataclass(frozen=True)
class RedisLoad:
    chunk_appends_per_s: float
    bytes_per_s: float
    groups_claimed_per_s: float
    round_trips_per_s: float


def redis_load(
    tokens_per_s: float,
    ends_per_s: float,
    decode_steps_per_s: float,
    mean_batch: float,
    train_steps_per_s: float,
    groups_per_step: int,
    engines: int,
    chunk_tokens: int,
    call_overhead_bytes: float,
    lease_seconds: float,
) -> RedisLoad:
    """The buffer traffic of a fleet, from the rollout worker's write pattern (slime/rollout/worker.py).

    A worker writes a chunk per `chunk_tokens` tokens of a response, aligned to multiples of it, plus
    one short last chunk whenever a response ends or is aborted: (c - 1) / (2c) of a chunk more per
    end on average. The chunks due after one decode step go in one pipeline (a round trip when at
    least one is due: 1 - (1 - 1/c)^batch); a lease and a finish batch at most once per response end.
    The learner claims a step's groups with one script, then reads each group (2 round trips). Every
    worker renews and reaps its leases every lease_seconds / 3; the driver polls (DRIVER_ROUND_TRIPS_PER_S).
    """
    c = chunk_tokens
    appends = tokens_per_s / c + ends_per_s * (c - 1) / (2 * c)
    append_pipelines = decode_steps_per_s * (1 - (1 - 1 / c) ** mean_batch)
    leases_and_finishes = 2 * min(ends_per_s, decode_steps_per_s)
    claims = train_steps_per_s * (1 + 2 * groups_per_step)
    renewals = engines * 2 / (lease_seconds / 3)
    return RedisLoad(
        chunk_appends_per_s=appends,
        bytes_per_s=BYTES_PER_TOKEN * tokens_per_s + call_overhead_bytes * appends,
        groups_claimed_per_s=train_steps_per_s * groups_per_step,
        round_trips_per_s=append_pipelines + leases_and_finishes + claims + renewals + DRIVER_ROUND_TRIPS_PER_S,
    )


def load_of(result: SimResult, cfg: SimConfig, step_s: float, chunk_tokens: int, call_bytes: float) -> RedisLoad:
    """Redis load while the engines generate (wave policies: the rollout phase, the peak)."""
    rollout_total_s = result.rollout_s * result.steps if result.rollout_s else result.wall_s
    tokens_per_s = result.generated_tokens / rollout_total_s
    ends = result.steps * cfg.batch_size * cfg.n_samples + result.partials
    mean_batch = result.engine_busy * cfg.slots / max(result.engine_stepping, 1e-9)  # while stepping
    return redis_load(
        tokens_per_s=tokens_per_s,
        ends_per_s=ends / rollout_total_s,
        decode_steps_per_s=tokens_per_s / max(mean_batch, 1.0),
        mean_batch=mean_batch,
        train_steps_per_s=1.0 / step_s,
        groups_per_step=cfg.batch_size,
        engines=cfg.engines,
        chunk_tokens=chunk_tokens,
        call_overhead_bytes=call_bytes,
        lease_seconds=BufferConfig.model_fields["lease_seconds"].default,
    )


def append_call_bytes(store: TrajectoryStore, chunk_tokens: int, rounds: int = 100) -> float:
    """Bytes a single redis-server receives per chunk append, sent as the worker sends them (pipelines
    of 8 leased samples, each chunk with its stored length), from INFO's total_net_input_bytes."""
    for _ in range(2):
        store.add_group([1, 2, 3], n=4, max_new_tokens=1 << 20, metadata={})
    samples = store.lease("w100-a1b2c3", 8)
    stored = {s.id: 0 for s in samples}
    lps, versions = np.full(chunk_tokens, -0.5), np.full(chunk_tokens, 7)
    before = 0
    for r in range(rounds + 1):  # round 0 loads the script (NOSCRIPT, then SCRIPT LOAD): not counted
        if r == 1:
            before = store.redis.info("stats")["total_net_input_bytes"]
        chunks = [(s.id, np.arange(chunk_tokens) + r, lps, versions, stored[s.id]) for s in samples]
        for s, length in zip(samples, store.append_chunks("w100-a1b2c3", chunks)):
            stored[s.id] = int(length)
    after = store.redis.info("stats")["total_net_input_bytes"]
    return (after - before) / (rounds * len(samples))


def best_ratio(rows: dict[float, float], sync: float) -> tuple[float, float]:
    """(ratio, samples/s): the smallest ratio within BEST_WITHIN of the highest; sync is ratio 1."""
    everything = {1.0: sync, **rows}
    top = max(everything.values())
    ratio = min(r for r, v in everything.items() if v >= (1 - BEST_WITHIN) * top)
    return ratio, everything[ratio]


def neighbours(grid: tuple[float, ...], best: float) -> tuple[float, ...]:
    """`best` and the grid values either side of it (a narrower sweep at the largest sizes)."""
    i = grid.index(best) if best in grid else 0
    return grid[max(0, i - 1) : i + 2]


def run_all(runs: list[tuple[str, SimConfig, float | None, int | None]], workers: int) -> list[SimResult]:
    """simulate(policy, cfg, oversample, max_staleness) for each run, on `workers` processes."""
    if workers <= 1:
        return [simulate(*run) for run in runs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(simulate, *zip(*runs)))


def predict(
    gpus: int, ratios: tuple[float, ...], shares: tuple[float, ...], steps: int, workers: int = 1, **overrides
) -> dict:
    """Every simulation at one GPU count; figures per second in the steady state."""
    colocated = cluster_config(gpus, gpus, gpus, steps, **overrides)
    samples_per_step = colocated.batch_size * colocated.n_samples
    rollout_gpus = sorted({min(gpus - 1, max(1, round(share * gpus))) for share in shares})
    runs = [("sync", colocated, None, None)] + [("april", colocated, r, None) for r in ratios]
    for rollout in rollout_gpus:
        cfg = cluster_config(gpus, rollout, gpus - rollout, steps, **overrides)
        runs.append(("async_bounded", cfg, None, MAX_STALENESS))
    results = run_all(runs, workers)
    sync, april = results[0], dict(zip(ratios, results[1 : 1 + len(ratios)]))
    splits = dict(zip(rollout_gpus, results[1 + len(ratios) :]))
    sync_rate = steady_samples_per_s(sync, samples_per_step)
    april_rates = {r: steady_samples_per_s(res, samples_per_step) for r, res in april.items()}
    split_rates = {g: steady_samples_per_s(res, samples_per_step) for g, res in splits.items()}
    ratio, rate = best_ratio(april_rates, sync_rate)
    split_gpus = max(split_rates, key=split_rates.get)
    return {
        "config": colocated,
        "sync": sync,
        "sync_samples_per_s": sync_rate,
        "april": april,
        "april_samples_per_s": april_rates,
        "best_ratio": ratio,
        "best_samples_per_s": rate,
        "best_result": april.get(ratio, sync),
        "split_samples_per_s": split_rates,
        "best_split_rollout_gpus": split_gpus,
        "best_split_samples_per_s": split_rates[split_gpus],
    }


def _k(x: float) -> str:
    return f"{x / 1e3:,.1f}k" if x >= 1e4 else f"{x:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--chunk-tokens", type=int, default=RolloutConfig.model_fields["chunk_tokens"].default)
    parser.add_argument(
        "--server-appends-per-s", type=float, default=None, help="one redis-server's measured chunk appends/s"
    )
    parser.add_argument(
        "--cluster-appends-per-s", type=float, default=None, help="a 3-master cluster's, all jobs together"
    )
    parser.add_argument("--full-grid", action="store_true", help="sweep every ratio and split at every size")
    parser.add_argument("--workers", type=int, default=2, help="processes running simulations")
    parser.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = parser.parse_args()
    if args.smoke:
        args.gpus = [8]
    started = time.time()

    stats = length_stats(cluster_config(8, 8, 8, 1))
    mean_len = stats["mean"]
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalRedisServer(Path(tmp), aof=False)
        store = TrajectoryStore.open(server.url, "scale-on-paper", 600.0)
        try:
            call_bytes = append_call_bytes(store, args.chunk_tokens)
        finally:
            store.close()
            server.stop()
    overhead = call_bytes - BYTES_PER_TOKEN * args.chunk_tokens

    def step_time(batch: int, context: float) -> float:
        return ENGINE["t0"] + ENGINE["k"] * batch + ENGINE["t_kv"] * batch * context

    full = ENGINE["slots"] / step_time(ENGINE["slots"], 3000)
    print(f"model: {MODEL}\nGPU: {GPU}")
    print(
        f"per GPU: decode {full:,.0f} tok/s at {ENGINE['slots']} requests of 3k cached tokens, "
        f"{1 / step_time(1, 3000):,.0f} tok/s for one request alone; learner {LEARNER_TOKENS_PER_S_PER_GPU:,.0f} "
        f"tok/s (prompt + response); {LEARNER['t_train0']:g} s fixed per step, {LEARNER['t_sync']:g} s weight sync"
    )
    print(
        f"lengths: simulator log-normal, median {WORKLOAD['median_tokens']:g}, sigma {WORKLOAD['sigma_prompt']} per "
        f"prompt / {WORKLOAD['sigma_sample']} per sample, cap {WORKLOAD['max_tokens']}: mean {mean_len:,.0f}, "
        f"p50 {stats['p50']:,.0f}, p99 {stats['p99']:,.0f}, {100 * stats['at_cap_share']:.2f}% at the cap; "
        f"prompts {WORKLOAD['prompt_tokens']} tokens"
    )
    print(
        f"Redis: {args.chunk_tokens}-token chunks, {call_bytes:.0f} bytes per append call measured "
        f"({BYTES_PER_TOKEN} x {args.chunk_tokens} per-token + {overhead:.0f} overhead)\n"
    )

    figures: dict[str, float | int | None] = {
        **({"smoke": True} if args.smoke else {}),
        "response_mean_tokens": round(mean_len),
        "response_p99_tokens": round(stats["p99"]),
        "append_call_bytes": round(call_bytes, 1),
        "chunk_tokens": args.chunk_tokens,
    }
    summary, loads, previous = [], [], None
    for gpus in args.gpus:
        steps = steps_for(gpus)
        ratios, shares = RATIOS, ROLLOUT_SHARES
        if previous is not None and gpus > 64 and not args.full_grid:
            # the best ratio and the one below it (above the best, more in flight changed nothing)
            best = previous["best_ratio"]
            ratios = tuple(r for r in neighbours((1.0, *RATIOS), best) if 1 < r <= best) or RATIOS[:1]
            share = previous["best_split_rollout_gpus"] / previous["gpus"]
            shares = neighbours(ROLLOUT_SHARES, min(ROLLOUT_SHARES, key=lambda s: abs(s - share)))
        t = time.time()
        p = predict(gpus, ratios, shares, steps, args.workers)
        p["gpus"] = gpus
        previous = p
        cfg, best = p["config"], p["best_result"]
        samples_per_step = cfg.batch_size * cfg.n_samples
        print(
            f"{gpus} GPUs: B = {cfg.batch_size} groups x {cfg.n_samples} ({samples_per_step:,} responses per step), "
            f"{steps} steps simulated ({time.time() - t:.0f} s)"
        )
        sync = p["sync_samples_per_s"]
        rows = [("sync (ratio 1)", sync, "")]
        for r, rate in p["april_samples_per_s"].items():
            res = p["april"][r]
            capped = " (capped by the steps simulated)" if res.max_span >= res.steps - 1 else ""
            note = f"off-policy {100 * res.off_policy_share:.0f}%, max span {res.max_span}{capped}"
            rows.append((f"april x{r:g}", rate, note))
        for g, rate in p["split_samples_per_s"].items():
            rows.append((f"split {g} rollout + {gpus - g} train", rate, f"async, staleness {MAX_STALENESS}"))
        for label, rate, note in rows:
            line = f"  {label:<30} {rate * mean_len:>11,.0f} tok/s {rate:>8.2f} samples/s {rate / sync:>6.2f}x   {note}"
            print(line.rstrip())
        step_s = samples_per_step / p["best_samples_per_s"]
        load = load_of(best, cfg, step_s, args.chunk_tokens, call_bytes)
        summary.append((gpus, p, step_s))
        loads.append((gpus, load, best, cfg, step_s))
        key = f"gpus_{gpus}_"
        figures |= {
            key + "sync_tokens_per_s": round(sync * mean_len),
            key + "sync_samples_per_s": round(sync, 3),
            key + "best_oversample_ratio": p["best_ratio"],
            key + "april_tokens_per_s": round(p["best_samples_per_s"] * mean_len),
            key + "april_samples_per_s": round(p["best_samples_per_s"], 3),
            key + "april_gain_over_sync_ratio": round(p["best_samples_per_s"] / sync, 3),
            key + "april_off_policy_token_share": round(best.off_policy_share, 3),
            key + "best_split_rollout_gpus": p["best_split_rollout_gpus"],
            key + "best_split_tokens_per_s": round(p["best_split_samples_per_s"] * mean_len),
            key + "redis_chunk_appends_per_s": round(load.chunk_appends_per_s),
            key + "redis_bytes_per_s": round(load.bytes_per_s),
            key + "redis_groups_claimed_per_s": round(load.groups_claimed_per_s, 2),
            key + "redis_round_trips_per_s": round(load.round_trips_per_s),
        }

    print("\nPredicted throughput (steady state; colocated: every GPU rolls out, then trains)")
    print(
        f"{'GPUs':>5} {'sync tok/s':>11} {'best ratio':>10} {'APRIL tok/s':>12} {'samples/s':>9} {'vs sync':>7} "
        f"{'tok/s/GPU':>9} {'step s':>7} {'best split (async)':>20} {'split tok/s':>11}"
    )
    for gpus, p, step_s in summary:
        rate, split = p["best_samples_per_s"], p["best_split_rollout_gpus"]
        print(
            f"{gpus:>5} {p['sync_samples_per_s'] * mean_len:>11,.0f} {'x' + format(p['best_ratio'], 'g'):>10} "
            f"{rate * mean_len:>12,.0f} {rate:>9.2f} {rate / p['sync_samples_per_s']:>6.2f}x "
            f"{rate * mean_len / gpus:>9,.0f} {step_s:>7.1f} {f'{split} + {gpus - split}':>20} "
            f"{p['best_split_samples_per_s'] * mean_len:>11,.0f}"
        )

    print("\nRedis load of the best colocated APRIL, while the engines generate (the peak)")
    print(
        f"{'GPUs':>5} {'tok/s in':>10} {'appends/s':>10} {'MB/s in':>8} {'groups claimed/s':>16} "
        f"{'round trips/s':>13} {'appends/s/GPU':>13} {'stored GB/step':>14}"
    )
    per_gpu = []
    for gpus, load, best, cfg, _ in loads:
        rollout_total_s = best.rollout_s * best.steps if best.rollout_s else best.wall_s
        stored_gb = cfg.batch_size * cfg.n_samples * (mean_len * BYTES_PER_TOKEN + cfg.prompt_tokens * 4) / 1e9
        per_gpu.append(load.chunk_appends_per_s / gpus)
        print(
            f"{gpus:>5} {_k(best.generated_tokens / rollout_total_s):>10} {_k(load.chunk_appends_per_s):>10} "
            f"{load.bytes_per_s / 1e6:>8.1f} {load.groups_claimed_per_s:>16.2f} {_k(load.round_trips_per_s):>13} "
            f"{load.chunk_appends_per_s / gpus:>13.0f} {stored_gb:>14.2f}"
        )
        figures[f"gpus_{gpus}_redis_stored_gb_per_step"] = round(stored_gb, 3)
    appends_per_gpu = max(per_gpu)
    gpus, _, best, cfg, step_s = loads[-1]
    by_chunk = {c: load_of(best, cfg, step_s, c, call_bytes).chunk_appends_per_s / gpus for c in (16, 64, 256)}
    print("appends/s per GPU by rollout.chunk_tokens: " + ", ".join(f"{c}: {v:.0f}" for c, v in by_chunk.items()))
    figures |= {f"redis_appends_per_s_per_gpu_chunk_{c}": round(v, 1) for c, v in by_chunk.items()}
    for name, capacity in (("one server", args.server_appends_per_s), ("3-master cluster", args.cluster_appends_per_s)):
        if capacity is None:
            print(f"{name}: capacity not measured (pass --{name.split()[-1]}-appends-per-s)")
            continue
        print(
            f"{name}: {capacity:,.0f} appends/s -> saturates at ~{capacity / appends_per_gpu:,.0f} GPUs "
            f"of {args.chunk_tokens}-token chunks"
            + (" (all jobs together; one job's keys live on one master)" if "cluster" in name else "")
        )
    figures["redis_appends_per_s_per_gpu"] = round(appends_per_gpu, 1)
    figures["server_saturation_gpus"] = (
        None if args.server_appends_per_s is None else round(args.server_appends_per_s / appends_per_gpu)
    )
    figures["cluster_saturation_gpus_all_jobs"] = (
        None if args.cluster_appends_per_s is None else round(args.cluster_appends_per_s / appends_per_gpu)
    )
    figures["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
