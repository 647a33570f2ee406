"""APRIL vs sync on the long-tail example task, side by side in one run; and the simulator's prediction.

Every setting is one real job (driver, Redis buffer, Ray learner + 1 rollout worker, tiny MoE with
the default warm start, the repeat task) with the same seeds; only `april.*` differs:

    sync            the synchronous baseline (APRIL off)
    april2          APRIL, oversample 2.0, no staleness budget
    april2_budget2  APRIL, oversample 2.0, april.max_version_span=2 (beyond_budget=restart)
    april1.5 / april3   optional (--extra)

Then the simulator (`april/sim.py`, preset `cpu_tiny`) is calibrated from this machine: the engine's
decode step time at several batch sizes (-> t0, k), prefill time per token (-> p), training time per
step/token and the weight-sync/driver overhead from the sync run's metrics, and the sync run's real
response lengths as the empirical length distribution. It predicts sync and APRIL x2 and is
compared with the measured ratios.

Prints a human table, then LAST one JSON line (names carry units).

    python benchmarks/april_vs_sync.py [--steps 30] [--extra] [--out outputs/bench-april-vs-sync]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from slime.config import JobConfig, load_config  # noqa: E402

# The long-tail shape: 16 groups x 8 samples, 96-token cap, T=1; 256 engine slots so that
# 2x over-provisioned groups (32 x 8 = 256 requests) really run concurrently.
SHAPE = [
    "rollout.num_workers=1", "rollout.batch_size=16", "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=96", "rollout.temperature=1.0", "rollout.max_running_requests=256",
    "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
]
SETTINGS: dict[str, list[str]] = {
    "sync": ["april.enabled=false"],
    "april2": ["april.enabled=true", "april.oversample=2.0"],
    "april2_budget2": ["april.enabled=true", "april.oversample=2.0", "april.max_version_span=2",
                       "april.beyond_budget=restart"],
}
EXTRA_SETTINGS: dict[str, list[str]] = {
    "april1.5": ["april.enabled=true", "april.oversample=1.5"],
    "april3": ["april.enabled=true", "april.oversample=3.0"],
}


# --------------------------------------------------------------------------- one real job


def run_setting(name: str, overrides: list[str], args, redis_url: str) -> dict:
    import ray

    from slime.sample import Status
    from slime.train import RunningJob, sync_loop

    cfg = load_config(None, [
        f"job_name=bench-april-{name}", f"output_dir={args.out}/{name}", f"steps={args.steps}",
        f"seed={args.seed}", f"data.seed={args.seed}", f"buffer.url={redis_url}", *SHAPE, *overrides,
    ])
    started = time.time()
    with RunningJob(cfg) as job:
        setup_s = time.time() - started
        before = ray.get([w.health.remote() for w in job.workers])
        gen_before = job.buffer.stats().get("generated_tokens", 0.0)
        t0 = time.time()
        sync_loop(job)
        loop_wall = time.time() - t0
        after = ray.get([w.health.remote() for w in job.workers])
        gen_after = job.buffer.stats().get("generated_tokens", 0.0)
        # The real response-length distribution: every finished response in the buffer.
        finished = [s for s in job.buffer.iter_samples() if s.status in (Status.COMPLETED, Status.TRUNCATED)]
        lengths = [int(s.response_length) for s in finished]
        prompt_tokens = float(np.mean([len(s.prompt_ids) for s in finished])) if finished else 6.0
        history = list(job.logger.history)
    return {
        "name": name,
        "cfg": cfg,
        "history": history,
        "setup_s": setup_s,
        "loop_wall_s": loop_wall,
        "engine_busy_s": sum(a["busy_seconds"] - b["busy_seconds"] for a, b in zip(after, before)),
        "generated_total": gen_after - gen_before,
        "lengths": lengths,
        "prompt_tokens": prompt_tokens,
        "job_s": time.time() - started,
    }


def summarize(run: dict) -> dict:
    h = run["history"]
    gen = sum(m["generated_tokens"] for m in h)
    rollout_s = sum(m["rollout_seconds"] for m in h)
    step_s = sum(m["step_seconds"] for m in h)
    learner_s = sum(m["learner_seconds"] for m in h)
    spans = [int(k.split("/", 1)[1]) for m in h for k, v in m.items() if k.startswith("version_span_hist/") and v > 0]
    # Share of all trained (response) tokens that an older policy produced, over the run.
    resp_tokens = [m.get("response_len_mean", 0.0) * m.get("samples", 0.0) for m in h]
    off = sum(m.get("off_policy_token_share", 0.0) * t for m, t in zip(h, resp_tokens)) / max(1.0, sum(resp_tokens))
    rewards = [m.get("reward_mean", float("nan")) for m in h]
    return {
        "steps": len(h),
        "generated_tokens": gen,
        "rollout_s": rollout_s,
        "step_s_total": step_s,
        "rollout_tok_s": gen / max(rollout_s, 1e-9),
        "wall_tok_s": gen / max(step_s, 1e-9),
        "step_s_mean": step_s / max(1, len(h)),
        "rollout_s_mean": rollout_s / max(1, len(h)),
        "learner_s_mean": learner_s / max(1, len(h)),
        "sync_s_mean": statistics.mean(m.get("weight_sync_seconds", 0.0) for m in h),
        "engine_busy": run["engine_busy_s"] / max(run["loop_wall_s"], 1e-9),
        "engine_busy_cum_metric": h[-1].get("engine_busy_fraction", float("nan")),
        "learner_busy": learner_s / max(run["loop_wall_s"], 1e-9),
        "off_policy": off,
        "max_span": max(spans, default=0),
        "resumed_per_step": statistics.mean(m.get("resumed_samples", 0.0) for m in h),
        "aborted_per_step": statistics.mean(m.get("aborted_samples", 0.0) for m in h),
        "wasted_tokens": h[-1].get("wasted_tokens_total", 0.0),
        "rewards": rewards,
        "len_p50": statistics.mean(m.get("response_len_p50", 0.0) for m in h),
        "len_p99": statistics.mean(m.get("response_len_p99", 0.0) for m in h),
        "loop_wall_s": run["loop_wall_s"],
        "generated_total": run["generated_total"],
    }


# --------------------------------------------------------------------------- calibration


def measure_engine(model_dir: str, threads: int, prompt_len: int, repeats: int = 3) -> dict:
    """Decode step time at batch 1/8/32/64/128/256 (best of `repeats` runs of 20 steps) and
    prefill time per token; least squares t(b) = t0 + k*b."""
    import torch

    from slime.engine import GenerationRequest, RolloutEngine, SamplingParams
    from slime.model import load_model

    torch.set_num_threads(threads)
    model = load_model(model_dir)
    prompt = [10 + (i % 40) for i in range(prompt_len)]
    params = SamplingParams(temperature=1.0, max_new_tokens=60)
    step_s: dict[int, float] = {}
    for b in (1, 8, 32, 64, 128, 256):
        best = math.inf
        for r in range(repeats):
            engine = RolloutEngine(model, max_running_requests=b, seed=r)
            for i in range(b):
                engine.add_request(GenerationRequest(f"{r}-{i}", prompt, params))
            engine.step()  # prefill
            for _ in range(3):
                engine.step()
            t = time.perf_counter()
            for _ in range(20):
                engine.step()
            best = min(best, (time.perf_counter() - t) / 20)
        step_s[b] = best
    bs = np.array(sorted(step_s), dtype=float)
    ts = np.array([step_s[int(b)] for b in bs])
    k, t0 = np.polyfit(bs, ts, 1)
    # Prefill: admit 64 resumed-like requests of ~40 context tokens in one step, minus a decode step.
    ctx = prompt + [11] * 34
    best = math.inf
    for r in range(repeats):
        engine = RolloutEngine(model, max_running_requests=64, seed=r)
        for i in range(64):
            engine.add_request(GenerationRequest(f"p{r}-{i}", ctx, params))
        t = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - t)
    p = max(0.0, (best - step_s[64]) / (64 * len(ctx)))
    return {"step_s": step_s, "t0": float(max(t0, 0.0)), "k": float(max(k, 0.0)), "p": float(p)}


def calibrate_and_simulate(runs: dict[str, dict], sums: dict[str, dict], engine: dict, args) -> dict:
    from april.sim import sim_config_from_job, simulate

    sync = runs["sync"]
    h = sync["history"]
    prompt_tokens = sync["prompt_tokens"]
    # Training cost: learner_seconds = t_train0 + t_train_per_token * (prompt + response tokens).
    tokens = np.array([m["samples"] * prompt_tokens + m["response_len_mean"] * m["samples"] for m in h])
    learn = np.array([m["learner_seconds"] for m in h])
    per_token, fixed = np.polyfit(tokens, learn, 1) if len(h) >= 3 and np.ptp(tokens) > 0 else (0.0, learn.mean())
    if per_token < 0:  # noise: fall back to a pure per-token cost
        per_token, fixed = float(learn.sum() / tokens.sum()), 0.0
    # Everything in a sync step that is neither rollout nor training: weight sync + driver calls.
    overhead = float(np.mean([m["step_seconds"] - m["rollout_seconds"] - m["learner_seconds"] for m in h]))
    cfg = sync["cfg"]
    sim_cfg = sim_config_from_job(cfg, {
        "t0": engine["t0"], "k": engine["k"], "t_kv": 0.0, "p": engine["p"],
        "t_train0": float(max(fixed, 0.0)), "t_train_per_token": float(per_token), "t_sync": max(overhead, 0.0),
        "lengths": sync["lengths"], "prompt_tokens": int(round(prompt_tokens)), "steps": args.steps,
        "kv_tokens": cfg.rollout.max_running_requests * (int(round(prompt_tokens)) + cfg.rollout.max_new_tokens),
    })
    sim = {"sync": simulate("sync", sim_cfg, seed=args.seed),
           "april2": simulate("april", sim_cfg, oversample=2.0, seed=args.seed)}

    def rollout_tok_s(r) -> float:
        rollout = r.wall_s - r.learner_busy * r.wall_s - r.steps * sim_cfg.t_sync
        return r.generated_tokens / max(rollout, 1e-9)

    pred_wall = sim["april2"].throughput / sim["sync"].throughput
    pred_rollout = rollout_tok_s(sim["april2"]) / rollout_tok_s(sim["sync"])
    meas_wall = sums["april2"]["wall_tok_s"] / sums["sync"]["wall_tok_s"]
    meas_rollout = sums["april2"]["rollout_tok_s"] / sums["sync"]["rollout_tok_s"]
    return {
        "cfg": sim_cfg, "sim": sim, "train_fixed_s": float(fixed), "train_per_token_s": float(per_token),
        "overhead_s": overhead,
        "pred_wall": pred_wall, "pred_rollout": pred_rollout, "meas_wall": meas_wall, "meas_rollout": meas_rollout,
        "err_wall_pct": 100 * (pred_wall - meas_wall) / meas_wall,
        "err_rollout_pct": 100 * (pred_rollout - meas_rollout) / meas_rollout,
        "sim_rollout_s": {k: (r.wall_s - r.learner_busy * r.wall_s - r.steps * sim_cfg.t_sync) / r.steps
                          for k, r in sim.items()},
    }


# --------------------------------------------------------------------------- report


def moving(values: list[float], n: int = 5) -> tuple[float, float]:
    v = [x for x in values if math.isfinite(x)]
    return (float(np.mean(v[:n])) if v else float("nan"), float(np.mean(v[-n:])) if v else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", action="store_true", help="also run APRIL at oversample 1.5 and 3.0")
    ap.add_argument("--out", default="outputs/bench-april-vs-sync")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the calibration (jobs use cluster.torch_threads)")
    args = ap.parse_args()
    bench_started = time.time()

    import ray

    from slime.model import ensure_model_dir
    from slime.redis_server import LocalRedisServer

    base_cfg: JobConfig = load_config(None, [])
    t = time.time()
    model_dir = str(ensure_model_dir(base_cfg.model))
    model_s = time.time() - t
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)

    settings = dict(SETTINGS)
    if args.extra:
        settings.update(EXTRA_SETTINGS)
    server = LocalRedisServer(out / "redis", aof=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    runs: dict[str, dict] = {}
    try:
        for name, overrides in settings.items():
            runs[name] = run_setting(name, overrides, args, server.url)
            print(f"[{time.time() - bench_started:6.1f}s] {name}: {args.steps} steps in {runs[name]['loop_wall_s']:.1f}s "
                  f"(job {runs[name]['job_s']:.1f}s)", flush=True)
    finally:
        ray.shutdown()
        server.stop()
    t = time.time()
    engine = measure_engine(model_dir, args.threads, int(round(runs["sync"]["prompt_tokens"])))
    calib_s = time.time() - t
    sums = {name: summarize(r) for name, r in runs.items()}
    cal = calibrate_and_simulate(runs, sums, engine, args)

    base = sums["sync"]
    cols = list(sums)
    print()
    print(f"APRIL vs sync: repeat task, tiny MoE (warm start), 1 rollout worker, batch 16 x 8, 96-token cap, "
          f"T=1, 256 slots, {args.steps} steps, seed {args.seed}")
    w = 16
    print(f"{'':34s}" + "".join(f"{c:>{w}s}" for c in cols))

    def row(label: str, fn, fmt: str = "{:.2f}") -> None:
        print(f"{label:34s}" + "".join(f"{fmt.format(fn(sums[c])):>{w}s}" for c in cols))

    row("generated tokens / rollout s", lambda s: s["rollout_tok_s"], "{:.0f}")
    row("  ratio vs sync", lambda s: s["rollout_tok_s"] / base["rollout_tok_s"], "{:.2f}x")
    row("generated tokens / wall s", lambda s: s["wall_tok_s"], "{:.0f}")
    row("  ratio vs sync", lambda s: s["wall_tok_s"] / base["wall_tok_s"], "{:.2f}x")
    row("step time, mean s", lambda s: s["step_s_mean"], "{:.3f}")
    row("  ratio vs sync", lambda s: s["step_s_mean"] / base["step_s_mean"], "{:.2f}x")
    row("  rollout s / step", lambda s: s["rollout_s_mean"], "{:.3f}")
    row("  learner s / step", lambda s: s["learner_s_mean"], "{:.3f}")
    row("  weight sync s / step", lambda s: s["sync_s_mean"], "{:.3f}")
    row("generated tokens / step", lambda s: s["generated_tokens"] / s["steps"], "{:.0f}")
    row("engine busy (busy s / wall)", lambda s: 100 * s["engine_busy"], "{:.1f}%")
    row("learner busy (learn s / wall)", lambda s: 100 * s["learner_busy"], "{:.1f}%")
    row("off-policy token share", lambda s: 100 * s["off_policy"], "{:.1f}%")
    row("max version span", lambda s: s["max_span"], "{:d}")
    row("resumed samples / step", lambda s: s["resumed_per_step"], "{:.1f}")
    row("aborted samples / step", lambda s: s["aborted_per_step"], "{:.1f}")
    row("wasted tokens (total)", lambda s: s["wasted_tokens"], "{:.0f}")
    row("response len p50 / step (mean)", lambda s: s["len_p50"], "{:.1f}")
    row("response len p99 / step (mean)", lambda s: s["len_p99"], "{:.1f}")
    row("reward, first 5 steps", lambda s: moving(s["rewards"])[0], "{:.3f}")
    row("reward, last 5 steps", lambda s: moving(s["rewards"])[1], "{:.3f}")
    row("reward, mean over run", lambda s: float(np.nanmean(s["rewards"])), "{:.3f}")
    row("reward, std of step means", lambda s: float(np.nanstd(s["rewards"])), "{:.3f}")
    print()
    print("reward curve (5-step moving average, every 5th step):")
    for c in cols:
        r = sums[c]["rewards"]
        ma = [float(np.nanmean(r[max(0, i - 4): i + 1])) for i in range(len(r))]
        print(f"  {c:16s}" + " ".join(f"{ma[i]:.2f}" for i in range(4, len(ma), 5)))

    e, sc = engine, cal["cfg"]
    print()
    print("simulator (april/sim.py, cpu_tiny) calibrated on this machine:")
    print("  decode step ms at batch " + ", ".join(f"{b}: {1e3 * s:.2f}" for b, s in e["step_s"].items())
          + f"  -> t0 {1e3 * e['t0']:.2f} ms, k {1e6 * e['k']:.1f} us/request; prefill p {1e6 * e['p']:.1f} us/token")
    print(f"  training {cal['train_fixed_s']:.3f} s + {1e6 * cal['train_per_token_s']:.1f} us/token; "
          f"sync + driver overhead {cal['overhead_s']:.3f} s/step; {len(sc.lengths)} empirical lengths "
          f"(p50 {np.percentile(sc.lengths, 50):.0f}, p99 {np.percentile(sc.lengths, 99):.0f}), prompt {sc.prompt_tokens} tokens")
    s_sync, s_apr = cal["sim"]["sync"], cal["sim"]["april2"]
    print(f"  {'':30s}{'predicted':>12s}{'measured':>12s}{'error':>10s}")
    print(f"  {'april2/sync tok/s (wall)':30s}{cal['pred_wall']:>11.2f}x{cal['meas_wall']:>11.2f}x{cal['err_wall_pct']:>9.1f}%")
    print(f"  {'april2/sync tok/s (rollout)':30s}{cal['pred_rollout']:>11.2f}x{cal['meas_rollout']:>11.2f}x{cal['err_rollout_pct']:>9.1f}%")
    print(f"  {'sync step s':30s}{s_sync.step_s:>12.3f}{base['step_s_mean']:>12.3f}"
          f"{100 * (s_sync.step_s - base['step_s_mean']) / base['step_s_mean']:>9.1f}%")
    print(f"  {'april2 step s':30s}{s_apr.step_s:>12.3f}{sums['april2']['step_s_mean']:>12.3f}"
          f"{100 * (s_apr.step_s - sums['april2']['step_s_mean']) / sums['april2']['step_s_mean']:>9.1f}%")
    for k in ("sync", "april2"):
        meas = sums[k]["rollout_s_mean"]
        print(f"  {k + ' rollout s / step':30s}{cal['sim_rollout_s'][k]:>12.3f}{meas:>12.3f}"
              f"{100 * (cal['sim_rollout_s'][k] - meas) / meas:>9.1f}%")
    print(f"  {'april2 off-policy share':30s}{100 * s_apr.off_policy_share:>11.1f}%{100 * sums['april2']['off_policy']:>11.1f}%")
    print(f"  {'april2 max span':30s}{s_apr.max_span:>12d}{sums['april2']['max_span']:>12d}")
    total_s = time.time() - bench_started
    print(f"\nbenchmark wall {total_s:.0f} s (model dir {model_s:.1f} s, calibration {calib_s:.1f} s)")

    def ratio(a: str, key: str) -> float:
        return round(sums[a][key] / base[key], 3)

    result = {
        "steps": args.steps,
        "sync_rollout_tokens_per_s": round(base["rollout_tok_s"], 1),
        "sync_wall_tokens_per_s": round(base["wall_tok_s"], 1),
        "sync_step_time_s": round(base["step_s_mean"], 3),
    }
    for c in cols:
        if c == "sync":
            continue
        result[f"{c}_over_sync_rollout_tokens_per_s_ratio"] = ratio(c, "rollout_tok_s")
        result[f"{c}_over_sync_wall_tokens_per_s_ratio"] = ratio(c, "wall_tok_s")
        result[f"{c}_over_sync_step_time_ratio"] = ratio(c, "step_s_mean")
    for c in cols:
        s = sums[c]
        result[f"{c}_engine_busy_fraction"] = round(s["engine_busy"], 3)
        result[f"{c}_learner_busy_fraction"] = round(s["learner_busy"], 3)
        result[f"{c}_reward_last5_mean"] = round(moving(s["rewards"])[1], 3)
        if c != "sync":
            result[f"{c}_off_policy_token_share"] = round(s["off_policy"], 3)
            result[f"{c}_max_version_span"] = int(s["max_span"])
            result[f"{c}_resumed_samples_per_step"] = round(s["resumed_per_step"], 2)
            result[f"{c}_wasted_tokens"] = int(s["wasted_tokens"])
    result.update(
        sync_reward_first5_mean=round(moving(base["rewards"])[0], 3),
        sim_predicted_april2_ratio=round(cal["pred_wall"], 3),
        measured_april2_ratio=round(cal["meas_wall"], 3),
        sim_error_pct=round(cal["err_wall_pct"], 1),
        sim_predicted_april2_rollout_ratio=round(cal["pred_rollout"], 3),
        sim_rollout_error_pct=round(cal["err_rollout_pct"], 1),
        calib_t0_s=round(e["t0"], 5), calib_k_s_per_request=round(e["k"], 7), calib_prefill_s_per_token=round(e["p"], 8),
        calib_train_s_per_token=round(cal["train_per_token_s"], 7), calib_train_fixed_s=round(cal["train_fixed_s"], 4),
        calib_overhead_s_per_step=round(cal["overhead_s"], 4),
        benchmark_wall_s=round(total_s, 1),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
