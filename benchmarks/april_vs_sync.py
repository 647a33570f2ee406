"""APRIL vs sync on the long-tail example task, side by side in one run; and the simulator's prediction.

Every setting is one real job (driver, Redis buffer, Ray learner + 1 rollout worker, tiny MoE with
the default warm start, the repeat task) with the same seeds; only `april.*` (and the learner) differ:

    sync            the synchronous baseline (APRIL off)
    april2          APRIL, oversample 2.0, no staleness budget
    april2_budget2  APRIL, oversample 2.0, april.max_version_span=2 (beyond_budget=restart)
    ppo_sync        PPO + critic (GAE), APRIL off: the baseline of the streaming variant
    ppo_streaming   GLM-5's streaming variant: PPO trains every trajectory each 16 new tokens while
                    the engine keeps generating; the critic bootstraps unfinished returns
    sync_frozen, april2_frozen   sync and APRIL x2 with the policy frozen (learner.lr=1e-12): the same
                    workload for both, what the mechanism alone buys; the simulator is compared here
    sync_repeat, april2_repeat, april1.5, april3   when time allows (--extra auto: if the projected total
                    fits --budget-s); with both repeats the headline ratio is also pooled over two runs each

Then the simulator (`april/sim.py`, preset `cpu_tiny`) is calibrated from this machine: the engine's
decode step time at several batch sizes (-> t0, k), prefill time per token (-> p), training time per
step/token and the weight-sync/driver overhead from the sync run's metrics, and the sync run's real
response lengths as the empirical length distribution. It predicts sync and APRIL x2 and is
compared with the measured ratios.

Prints a human table, then LAST one JSON line (names carry units).

    python benchmarks/april_vs_sync.py [--steps 30] [--extra auto|yes|no] [--budget-s 450]
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

from slime.config import load_config

# The long-tail shape: 16 groups x 8 samples, 96-token cap, T=1; 256 engine slots so that
# 2x over-provisioned groups (32 x 8 = 256 requests) really run concurrently. The learning rate of
# the examples (examples/repeat_grpo.yaml, repeat_april.yaml): at the default 1e-3 any off-policy
# data (APRIL's partials, and one-step async as well) costs this tiny model reward (docs/benchmarks.md).
SHAPE = [
    "rollout.num_workers=1",
    "rollout.batch_size=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=96",
    "rollout.temperature=1.0",
    "rollout.max_running_requests=256",
    "learner.lr=5e-4",
    "logging.tensorboard=false",
    "logging.plot=false",
    "logging.progress=false",
]
SETTINGS: dict[str, list[str]] = {
    "sync": ["april.enabled=false"],
    "april2": ["april.enabled=true", "april.oversample=2.0"],
    "april2_budget2": [
        "april.enabled=true",
        "april.oversample=2.0",
        "april.max_version_span=2",
        "april.beyond_budget=restart",
    ],
    "ppo_sync": ["april.enabled=false", "algorithm.name=ppo", "algorithm.gamma=1.0", "algorithm.lam=0.95"],
    "ppo_streaming": [
        "april.enabled=false",
        "algorithm.name=ppo",
        "algorithm.gamma=1.0",
        "algorithm.lam=0.95",
        "april.streaming_chunk_tokens=16",
        "rollout.chunk_tokens=8",
    ],
    # The rollout mechanism alone, on the same workload: a learning rate far below float32's
    # resolution of the weights (Adam moves each by ~lr), so the policy, and with it the length
    # distribution, stays the warm start's in both; the learner still does all its work. With real
    # training the two policies drift apart (APRIL's often to longer answers), and so do the
    # workloads the rows above compare. The simulator is compared with this pair.
    "sync_frozen": ["april.enabled=false", "learner.lr=1e-12"],
    "april2_frozen": ["april.enabled=true", "april.oversample=2.0", "learner.lr=1e-12"],
}
FROZEN_PAIR = ("sync_frozen", "april2_frozen")
# Compared with each other in their own block (same algorithm), besides the table against GRPO sync.
STREAMING_PAIR = ("ppo_sync", "ppo_streaming")
EXTRA_SETTINGS: dict[str, list[str]] = {
    # The baseline again: run-to-run noise of every figure (the worker's sampling seed differs per run).
    "sync_repeat": ["april.enabled=false"],
    # APRIL x2 again: the headline ratio is also given pooled over two runs of each arm.
    "april2_repeat": ["april.enabled=true", "april.oversample=2.0"],
    "april1.5": ["april.enabled=true", "april.oversample=1.5"],
    "april3": ["april.enabled=true", "april.oversample=3.0"],
}


# --------------------------------------------------------------------------- one real job


def run_setting(name: str, overrides: list[str], args, redis_url: str) -> dict:
    import ray

    from slime.sample import Status
    from slime.train import RunningJob, streaming_loop, sync_loop

    cfg = load_config(
        None,
        [
            f"job_name=bench-april-{name}",
            f"output_dir={args.out}/{name}",
            f"steps={args.steps}",
            f"seed={args.seed}",
            f"data.seed={args.seed}",
            f"buffer.url={redis_url}",
            *SHAPE,
            *args.set,
            *overrides,
        ],
    )
    started = time.time()
    with RunningJob(cfg) as job:
        setup_s = time.time() - started
        before = ray.get([w.health.remote() for w in job.workers])
        gen_before = job.buffer.stats().get("generated_tokens", 0.0)
        t0 = time.time()
        (streaming_loop if cfg.april.streaming_chunk_tokens else sync_loop)(job)
        loop_wall = time.time() - t0
        after = ray.get([w.health.remote() for w in job.workers])
        grown = lambda key: sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))  # over the loop
        gen_after = job.buffer.stats().get("generated_tokens", 0.0)
        # The real response-length distribution: every finished response in the buffer.
        finished = [s for s in job.buffer.iter_samples() if s.status in (Status.COMPLETED, Status.TRUNCATED)]
        lengths = [int(s.response_length) for s in finished]
        prompt_tokens = float(np.mean([len(s.prompt_ids) for s in finished])) if finished else 6.0
        history = list(job.logger.history)
        # Each step's batch, group by group: (prompt, response) lengths. Rows x widest row is what
        # the learner's padded forward pass costs; the groups give the real within-group correlation.
        steps_groups: dict[int, list[list[tuple[int, int]]]] = {}
        for gid, step in job.buffer.redis.zrange(job.buffer._key("trained"), 0, -1, withscores=True):
            group = job.buffer.get_group(gid.decode())
            steps_groups.setdefault(int(step), []).append([(len(s.prompt_ids), s.response_length) for s in group])
        padded = {st: sum(len(g) for g in gs) * max(p + r for g in gs for p, r in g) for st, gs in steps_groups.items()}
        group_lengths = [[r for _, r in g] for gs in steps_groups.values() for g in gs]
        latest = job.run_dir / "checkpoints" / "latest"
        policy_dir = job.run_dir / "checkpoints" / latest.read_text().strip() / "policy" if latest.exists() else None
    return {
        "name": name,
        "cfg": cfg,
        "history": history,
        "setup_s": setup_s,
        "loop_wall_s": loop_wall,
        "engine_busy_s": grown("busy_seconds"),
        "worker_admit_s": grown("admit_seconds"),
        "worker_absorb_s": grown("absorb_seconds"),
        "decode_steps": grown("decode_steps"),
        "decode_rows": grown("decode_rows"),
        "generated_total": gen_after - gen_before,
        "lengths": lengths,
        "prompt_tokens": prompt_tokens,
        "padded_tokens": padded,
        "group_lengths": group_lengths,
        "policy_dir": policy_dir,
        "job_s": time.time() - started,
    }


def summarize(run: dict, warmup: int) -> dict:
    """Time figures over the steps after `warmup`; rewards over every step."""
    all_h = run["history"]
    h = all_h[warmup:]
    gen = sum(m["generated_tokens"] for m in h)
    rollout_s = sum(m["rollout_seconds"] for m in h)
    step_s = sum(m["step_seconds"] for m in h)
    learner_s = sum(m["learner_seconds"] for m in h)
    spans = [
        int(k.split("/", 1)[1]) for m in all_h for k, v in m.items() if k.startswith("version_span_hist/") and v > 0
    ]
    lags = [int(k.split("/", 1)[1]) for m in all_h for k, v in m.items() if k.startswith("version_lag_hist/") and v > 0]
    # Share of all trained response tokens that an older policy produced, over the run.
    resp = [m.get("response_len_mean", 0.0) * m.get("samples", 0.0) for m in all_h]
    off = sum(m.get("off_policy_token_share", 0.0) * t for m, t in zip(all_h, resp)) / max(1.0, sum(resp))
    # The streaming variant has no rollout phase (the engine never waits for the learner): its
    # per-rollout-second figures are undefined.
    streaming = run["cfg"].april.streaming_chunk_tokens is not None
    return {
        "steps": len(h),
        "generated_tokens": gen,
        "rollout_tok_s": math.nan if streaming else gen / max(rollout_s, 1e-9),
        "wall_tok_s": gen / max(step_s, 1e-9),
        "trained_tok_s": sum(m.get("trained_tokens", 0.0) for m in h) / max(step_s, 1e-9),
        "step_s_mean": step_s / len(h),
        "rollout_s_mean": rollout_s / len(h),
        "learner_s_mean": learner_s / len(h),
        "other_s_mean": (step_s - rollout_s - learner_s) / len(h),
        "sync_s_mean": statistics.mean(m.get("weight_sync_seconds", 0.0) for m in h),
        "engine_busy": run["engine_busy_s"] / run["loop_wall_s"],
        "mean_decode_batch": run["decode_rows"] / max(1, run["decode_steps"]),
        "decode_steps_per_step": run["decode_steps"] / max(1, len(all_h)),
        "engine_busy_in_rollout": math.nan
        if streaming
        else run["engine_busy_s"] / sum(m["rollout_seconds"] for m in all_h),
        # The rollout thread's buffer I/O between engine steps (leases and finishes; chunk writes).
        "buffer_io_in_rollout": math.nan
        if streaming
        else (run["worker_admit_s"] + run["worker_absorb_s"]) / sum(m["rollout_seconds"] for m in all_h),
        "learner_busy": sum(m["learner_seconds"] for m in all_h) / run["loop_wall_s"],
        "off_policy": off,
        "max_span": max(spans, default=0),
        "max_lag": max(lags, default=0),
        "resumed_per_step": statistics.mean(m.get("resumed_samples", 0.0) for m in all_h),
        "aborted_per_step": statistics.mean(m.get("aborted_samples", 0.0) for m in all_h),
        "wasted_tokens": all_h[-1].get("wasted_tokens_total", 0.0),
        "rewards": [m.get("reward_mean", float("nan")) for m in all_h],
        "len_mean": statistics.mean(m.get("response_len_mean", 0.0) for m in all_h),
        "padded_per_step": statistics.mean(run["padded_tokens"].get(int(m["step"]), 0) for m in h),
        "trained_tokens_per_step": statistics.mean(m.get("trained_tokens", 0.0) for m in h),
        "padded": [run["padded_tokens"].get(int(m["step"]), 0) for m in h],
        "learner_s": [m["learner_seconds"] for m in h],
    }


# --------------------------------------------------------------------------- calibration


def measure_engine(model_dir: str, threads: int, prompt_len: int, repeats: int = 3) -> dict:
    """Decode step time at batch 1..256 (best of `repeats` interleaved runs of 15 steps, fair under
    background load), least squares t(b) = t0 + k*b over batch 1/8/32/64; prefill time per token
    from admitting 128 requests of 30 context tokens (the size of a resumed partial)."""
    import torch

    from slime.engines.builtin import BuiltinEngine
    from slime.engines.contract import GenerationRequest, SamplingParams
    from slime.model import load_model

    torch.set_num_threads(threads)
    model = load_model(model_dir)
    # A distinct context per request: the engine feeds identical contexts once (a group's shared
    # prompt), which would hide the per-token prefill cost measured here.
    rng = np.random.default_rng(0)
    context = lambda n: rng.integers(10, 50, size=n).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=60)
    batches = (1, 8, 32, 64, 128, 256)
    step_s = {b: math.inf for b in batches}
    prefill = math.inf
    for r in range(repeats):
        for b in batches:
            engine = BuiltinEngine(model, max_running_requests=b, seed=r)
            for i in range(b):
                engine.add_request(GenerationRequest(f"{r}-{i}", context(prompt_len), params))
            for _ in range(4):  # prefill + warm-up
                engine.step()
            t = time.perf_counter()
            for _ in range(15):
                engine.step()
            step_s[b] = min(step_s[b], (time.perf_counter() - t) / 15)
        engine = BuiltinEngine(model, max_running_requests=128, seed=r)
        for i in range(128):
            engine.add_request(GenerationRequest(f"p{r}-{i}", context(prompt_len), params, context(30 - prompt_len)))
        t = time.perf_counter()
        engine.step()  # prefill of 128 x 30 tokens, then one decode step of 128
        prefill = min(prefill, time.perf_counter() - t)
    fit = [1, 8, 32, 64]
    k, t0 = np.polyfit(fit, [step_s[b] for b in fit], 1)
    p = max(0.0, (prefill - step_s[128]) / (128 * 30))
    return {"step_s": step_s, "t0": float(max(t0, 0.0)), "k": float(max(k, 0.0)), "p": p}


def evaluate(model_dir: str, policy_dir: Path | None, prompts: list[dict], threads: int) -> float:
    """Mean reward of a policy, greedy, on held-out prompts of the repeat task (no selection bias)."""
    import torch

    from envs import repeat
    from slime.engines.builtin import BuiltinEngine
    from slime.engines.contract import GenerationRequest, SamplingParams
    from slime.model import load_model, load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(model_dir)
    model = load_model(policy_dir or model_dir)
    engine = BuiltinEngine(model, max_running_requests=len(prompts))
    params = SamplingParams(temperature=0.0, max_new_tokens=96, stop_token_ids=[tok.eos_token_id])
    reqs = [
        GenerationRequest(str(i), tok(p["prompt"], add_special_tokens=False)["input_ids"], params)
        for i, p in enumerate(prompts)
    ]
    out = engine.generate(reqs)
    scores = []
    for i, p in enumerate(prompts):
        ids = [t for t in out[str(i)].token_ids if t != tok.eos_token_id]
        scores.append(repeat.score(tok.decode(ids, skip_special_tokens=True), p["label"]))
    return float(np.mean(scores))


def lognormal_fit(groups: list[list[int]]) -> dict:
    """median, sigma_prompt, sigma_sample of log-lengths: between-group and within-group spread."""
    logs = [np.log(np.maximum(np.asarray(g, float), 1.0)) for g in groups if g]
    means = np.array([x.mean() for x in logs])
    within = np.concatenate([x - x.mean() for x in logs])
    n = np.mean([len(x) for x in logs])
    return {
        "median_tokens": float(np.exp(np.median(means))),
        "sigma_prompt": float(means.std()),
        "sigma_sample": float(within.std() * math.sqrt(n / max(n - 1, 1))),
    }


def calibrate_and_simulate(runs: dict[str, dict], sums: dict[str, dict], engine: dict, args) -> dict:
    from april.sim import simulate
    from slime.simulate import sim_config_from_job

    S, A = FROZEN_PAIR if all(k in runs for k in FROZEN_PAIR) else ("sync", "april2")
    sync, warm = runs[S], args.warmup_steps
    h = sync["history"][warm:]
    prompt_tokens = sync["prompt_tokens"]
    # Training cost, as the simulator models it: t_train0 + t_train_per_token * (prompt + response tokens).
    tokens = np.array([m["samples"] * (prompt_tokens + m["response_len_mean"]) for m in h])
    learn = np.array([m["learner_seconds"] for m in h])
    per_token, fixed = np.polyfit(tokens, learn, 1)
    if per_token < 0 or fixed < 0:  # noise: a pure per-token cost
        per_token, fixed = float(learn.sum() / tokens.sum()), 0.0
    # What the real learner costs: rows x widest row (right padding), fitted on the same sync steps.
    pad_coef = float(np.sum(learn) / max(1, sum(sums[S]["padded"])))
    # Everything in a sync step that is neither rollout nor training: weight sync and driver calls.
    overhead = sums[S]["other_s_mean"]
    cfg = sync["cfg"]
    common = {
        "t0": engine["t0"],
        "k": engine["k"],
        "t_kv": 0.0,
        "p": engine["p"],
        "t_train0": float(fixed),
        "t_train_per_token": float(per_token),
        "t_sync": max(overhead, 0.0),
        "prompt_tokens": round(prompt_tokens),
        "steps": args.steps,
        "kv_tokens": cfg.rollout.max_running_requests * (round(prompt_tokens) + cfg.rollout.max_new_tokens),
    }
    empirical = sim_config_from_job(cfg, {**common, "lengths": sync["lengths"]})
    grouped = sim_config_from_job(cfg, {**common, **lognormal_fit(sync["group_lengths"])})
    out = {
        "pair": (S, A),
        "cfg": empirical,
        "train_fixed_s": float(fixed),
        "train_per_token_s": float(per_token),
        "pad_coef": pad_coef,
        "overhead_s": overhead,
        "lognormal": lognormal_fit(sync["group_lengths"]),
    }
    # The sync run's own engine time: busy seconds per step, and the rollout time outside the engine.
    steps_all = len(sync["history"])
    real_busy = sync["engine_busy_s"] / steps_all
    outside = sum(m["rollout_seconds"] for m in sync["history"]) / steps_all - real_busy
    variants = [("empirical", empirical), ("grouped", grouped), ("overhead", None), ("calibrated", None)]
    for label, sc in variants:
        extra_rollout = 0.0  # per-step rollout time the variant puts in t_sync (added back to "rollout")
        if label == "overhead":
            # The sync rollout time the engine model does not explain (worker Redis writes, lease
            # polling, driver polling, reward round trips) as a fixed per-step cost: sync then matches
            # by construction, and what is left of the APRIL error is the engine model's.
            extra_rollout = sums[S]["rollout_s_mean"] - out["empirical"]["per_step"]["sync"]["rollout"]
            out["rollout_overhead_s"] = extra_rollout
            sc = sim_config_from_job(
                cfg, {**common, "lengths": sync["lengths"], "t_sync": max(overhead + extra_rollout, 0.0)}
            )
        elif label == "calibrated":
            # Two terms measured on the sync run, none on APRIL: (1) the engine runs slower inside the
            # job than alone (other threads and processes, Redis writes between steps): t0, k and p
            # scaled so that the simulated sync engine time equals the real one (busy seconds);
            # (2) the rollout time outside engine steps (leasing, chunk writes, reward round trips,
            # the driver noticing a full batch) as a fixed per-step cost.
            s_sync = out["empirical"]["sim"]["sync"]
            sim_busy = s_sync.engine_stepping * s_sync.wall_s / s_sync.steps  # one engine
            alpha = real_busy / max(sim_busy, 1e-9)
            out["engine_scale"], out["outside_engine_s"] = alpha, outside
            extra_rollout = max(outside, 0.0)
            sc = sim_config_from_job(
                cfg,
                {
                    **common,
                    "lengths": sync["lengths"],
                    "t0": alpha * engine["t0"],
                    "k": alpha * engine["k"],
                    "p": alpha * engine["p"],
                    "t_sync": max(overhead, 0.0) + extra_rollout,
                },
            )
        res = {
            "sync": simulate("sync", sc, seed=args.seed),
            "april2": simulate("april", sc, oversample=2.0, seed=args.seed),
        }
        per_step = {}
        for k, r in res.items():
            learner = r.learner_busy * r.wall_s / r.steps
            rollout = r.step_s - learner - sc.t_sync + extra_rollout
            per_step[k] = {
                "step": r.step_s,
                "rollout": rollout,
                "learner": learner,
                "rollout_tok_s": r.generated_tokens / (rollout * r.steps),
            }
        out[label] = {
            "sim": res,
            "per_step": per_step,
            "pred_wall": res["april2"].throughput / res["sync"].throughput,
            "pred_rollout": per_step["april2"]["rollout_tok_s"] / per_step["sync"]["rollout_tok_s"],
        }
    out["meas_wall"] = sums[A]["wall_tok_s"] / sums[S]["wall_tok_s"]
    out["meas_rollout"] = sums[A]["rollout_tok_s"] / sums[S]["rollout_tok_s"]
    for label, _ in variants:
        out[label]["err_wall_pct"] = 100 * (out[label]["pred_wall"] - out["meas_wall"]) / out["meas_wall"]
        out[label]["err_rollout_pct"] = 100 * (out[label]["pred_rollout"] - out["meas_rollout"]) / out["meas_rollout"]
    return out


# --------------------------------------------------------------------------- report


POOLED = {"sync": ("sync", "sync_repeat"), "april2": ("april2", "april2_repeat")}


def pooled_pair(sums: dict[str, dict]) -> dict[str, dict[str, float]] | None:
    """Each arm's tokens per rollout / wall second over both of its runs (total tokens over total
    seconds), when both repeats ran: one run of the baseline varies by 10-20% on this machine."""
    if not all(c in sums for arm in POOLED.values() for c in arm):
        return None
    out = {}
    for arm, names in POOLED.items():
        tokens = sum(sums[c]["generated_tokens"] for c in names)
        out[arm] = {
            key: tokens / sum(sums[c]["generated_tokens"] / sums[c][key] for c in names)
            for key in ("rollout_tok_s", "wall_tok_s")
        }
    return out


def first_last(values: list[float], n: int = 5) -> tuple[float, float]:
    v = [x for x in values if math.isfinite(x)]
    return (float(np.mean(v[:n])), float(np.mean(v[-n:]))) if v else (math.nan, math.nan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the time figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--extra",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also run APRIL at oversample 1.5 and 3.0 (auto: if the projected total fits --budget-s)",
    )
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock the whole benchmark should stay under")
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every setting, e.g. --set learner.lr=5e-4 (repeatable)",
    )
    ap.add_argument("--out", default="outputs/bench-april-vs-sync")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of calibration/eval (= cluster.torch_threads)"
    )
    args = ap.parse_args()
    if args.steps <= args.warmup_steps + 2:
        ap.error("--steps must exceed --warmup-steps by at least 3")
    bench_started = time.time()

    import ray

    from envs import repeat
    from slime.buffer.redis_server import LocalRedisServer
    from slime.model import ensure_model_dir

    t = time.time()
    model_dir = str(ensure_model_dir(load_config(None, []).model))
    model_s = time.time() - t
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    load_before = os.getloadavg()

    settings = {**SETTINGS, **(EXTRA_SETTINGS if args.extra != "no" else {})}
    # One Redis and one Ray for all settings (each job has its own key prefix and actors).
    server = LocalRedisServer(out / "redis", aof=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    runs: dict[str, dict] = {}
    try:
        for name, overrides in settings.items():
            if name in EXTRA_SETTINGS and args.extra == "auto":
                per_job = statistics.mean(r["job_s"] for r in runs.values())
                projected = time.time() - bench_started + per_job * 1.2 + 40.0  # + calibration and eval
                if projected > args.budget_s:
                    print(f"skipping {name}: projected {projected:.0f}s > --budget-s {args.budget_s:.0f}", flush=True)
                    continue
            runs[name] = run_setting(name, overrides, args, server.url)
            print(
                f"[{time.time() - bench_started:6.1f}s] {name}: {args.steps} steps in {runs[name]['loop_wall_s']:.1f}s "
                f"(job {runs[name]['job_s']:.1f}s, load avg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    finally:
        ray.shutdown()
        server.stop()
    t = time.time()
    engine = measure_engine(model_dir, args.threads, round(runs["sync"]["prompt_tokens"]))
    calib_s = time.time() - t
    t = time.time()
    held_out = repeat.make_dataset(args.eval_prompts, seed=10_000 + args.seed)
    evals = {"initial": evaluate(model_dir, None, held_out, args.threads)}
    evals.update({name: evaluate(model_dir, r["policy_dir"], held_out, args.threads) for name, r in runs.items()})
    eval_s = time.time() - t
    sums = {name: summarize(r, args.warmup_steps) for name, r in runs.items()}
    cal = calibrate_and_simulate(runs, sums, engine, args)

    base, cols, w = sums["sync"], list(sums), 16
    print()
    print(
        f"APRIL vs sync: repeat task, tiny MoE (default warm start), 1 rollout worker, batch 16 x 8, "
        f"96-token cap, T=1, 256 slots, lr 5e-4, {args.steps} steps (time figures: steps {args.warmup_steps}..{args.steps - 1}), "
        f"seed {args.seed}" + (f", overrides {' '.join(args.set)}" if args.set else "")
    )
    print(f"{'':36s}" + "".join(f"{c:>{w}s}" for c in cols))

    def row(label: str, fn, fmt: str = "{:.2f}") -> None:
        def cell(c: str) -> str:
            value = fn(sums[c], c)
            return "n/a" if isinstance(value, float) and math.isnan(value) else fmt.format(value)

        print(f"{label:36s}" + "".join(f"{cell(c):>{w}s}" for c in cols))

    row("generated tok / rollout s", lambda s, c: s["rollout_tok_s"], "{:.0f}")
    row("  ratio vs sync", lambda s, c: s["rollout_tok_s"] / base["rollout_tok_s"], "{:.2f}x")
    row("generated tok / wall s", lambda s, c: s["wall_tok_s"], "{:.0f}")
    row("  ratio vs sync", lambda s, c: s["wall_tok_s"] / base["wall_tok_s"], "{:.2f}x")
    row("trained tok / wall s", lambda s, c: s["trained_tok_s"], "{:.0f}")
    row("  ratio vs sync", lambda s, c: s["trained_tok_s"] / base["trained_tok_s"], "{:.2f}x")
    row("step time, mean s", lambda s, c: s["step_s_mean"], "{:.3f}")
    row("  ratio vs sync", lambda s, c: s["step_s_mean"] / base["step_s_mean"], "{:.2f}x")
    row("  rollout s / step", lambda s, c: s["rollout_s_mean"], "{:.3f}")
    row("  learner s / step", lambda s, c: s["learner_s_mean"], "{:.3f}")
    row("  other s / step (sync, driver)", lambda s, c: s["other_s_mean"], "{:.3f}")
    row("generated tok / step", lambda s, c: s["generated_tokens"] / s["steps"], "{:.0f}")
    row("trained tok / step", lambda s, c: s["trained_tokens_per_step"], "{:.0f}")
    row("learner padded tok / step", lambda s, c: s["padded_per_step"], "{:.0f}")
    row("engine busy (busy s / wall)", lambda s, c: 100 * s["engine_busy"], "{:.1f}%")
    row("engine busy during rollout", lambda s, c: 100 * s["engine_busy_in_rollout"], "{:.1f}%")
    row("worker buffer I/O in rollout", lambda s, c: 100 * s["buffer_io_in_rollout"], "{:.1f}%")
    row("engine decode steps / step", lambda s, c: s["decode_steps_per_step"], "{:.1f}")
    row("  mean decode batch (rows)", lambda s, c: s["mean_decode_batch"], "{:.1f}")
    row("learner busy (learn s / wall)", lambda s, c: 100 * s["learner_busy"], "{:.1f}%")
    row("off-policy token share", lambda s, c: 100 * s["off_policy"], "{:.1f}%")
    row("max version span (in a sample)", lambda s, c: s["max_span"], "{:d}")
    row("max version lag (trainer - oldest)", lambda s, c: s["max_lag"], "{:d}")
    row("resumed samples / step", lambda s, c: s["resumed_per_step"], "{:.1f}")
    row("aborted samples / step", lambda s, c: s["aborted_per_step"], "{:.1f}")
    row("wasted tokens (total)", lambda s, c: s["wasted_tokens"], "{:.0f}")
    row("trained response len, mean", lambda s, c: s["len_mean"], "{:.1f}")
    row("train reward, first 5 steps", lambda s, c: first_last(s["rewards"])[0], "{:.3f}")
    row("train reward, last 5 steps", lambda s, c: first_last(s["rewards"])[1], "{:.3f}")
    row("train reward, std of step means", lambda s, c: float(np.nanstd(s["rewards"])), "{:.3f}")
    row(f"held-out reward ({args.eval_prompts}, greedy)", lambda s, c: evals[c], "{:.3f}")
    print(f"  (held-out reward of the initial warm-started model: {evals['initial']:.3f})")
    print()
    print("train reward curve (5-step moving average, every 5th step):")
    for c in cols:
        r = sums[c]["rewards"]
        ma = [float(np.nanmean(r[max(0, i - 4) : i + 1])) for i in range(len(r))]
        print(f"  {c:16s}" + " ".join(f"{ma[i]:.3f}" for i in range(4, len(ma), 5)))

    if all(c in sums for c in STREAMING_PAIR):
        sb, st = (sums[c] for c in STREAMING_PAIR)
        print()
        print("streaming variant (PPO, trains each 16 new tokens; engine never pauses for the learner) vs sync PPO:")
        print(
            f"  generated tok / wall s   {st['wall_tok_s']:8.0f} vs {sb['wall_tok_s']:8.0f}   "
            f"{st['wall_tok_s'] / sb['wall_tok_s']:.2f}x"
        )
        print(
            f"  trained tok / wall s     {st['trained_tok_s']:8.0f} vs {sb['trained_tok_s']:8.0f}   "
            f"{st['trained_tok_s'] / sb['trained_tok_s']:.2f}x"
        )
        print(f"  engine busy (of wall)    {100 * st['engine_busy']:7.1f}% vs {100 * sb['engine_busy']:7.1f}%")
        print(
            f"  off-policy token share   {100 * st['off_policy']:7.1f}% vs {100 * sb['off_policy']:7.1f}%; "
            f"max version lag {st['max_lag']} vs {sb['max_lag']}"
        )
        print(
            f"  train reward first5->last5  {first_last(st['rewards'])[0]:.3f}->{first_last(st['rewards'])[1]:.3f} vs "
            f"{first_last(sb['rewards'])[0]:.3f}->{first_last(sb['rewards'])[1]:.3f}"
        )

    if all(c in sums for c in FROZEN_PAIR):
        fb, fa = (sums[c] for c in FROZEN_PAIR)
        print("\nfrozen policy (learner.lr=1e-12, the same workload for both): april2_frozen vs sync_frozen")
        for label, key in (
            ("generated tok / rollout s", "rollout_tok_s"),
            ("generated tok / wall s", "wall_tok_s"),
            ("trained tok / wall s", "trained_tok_s"),
        ):
            print(f"  {label:28s} {fa[key]:7.0f} vs {fb[key]:7.0f}   {fa[key] / fb[key]:.2f}x")
        print(
            f"  generated tok / step         {fa['generated_tokens'] / fa['steps']:7.0f} vs "
            f"{fb['generated_tokens'] / fb['steps']:7.0f}"
        )
        print(
            f"  rollout s / step             {fa['rollout_s_mean']:7.3f} vs {fb['rollout_s_mean']:7.3f}; decode steps / step "
            f"{fa['decode_steps_per_step']:.1f} vs {fb['decode_steps_per_step']:.1f} (mean batch "
            f"{fa['mean_decode_batch']:.1f} vs {fb['mean_decode_batch']:.1f})"
        )
        print(
            f"  off-policy token share       {100 * fa['off_policy']:6.1f}%; max version span {fa['max_span']}; "
            f"wasted tokens {int(fa['wasted_tokens'])}"
        )

    e = engine
    pooled = pooled_pair(sums)
    if pooled:
        print("\ntwo runs of each arm (sync + sync_repeat, april2 + april2_repeat), pooled over both:")
        for key, label in (("rollout_tok_s", "generated tok / rollout s"), ("wall_tok_s", "generated tok / wall s")):
            runs = {arm: " / ".join(f"{sums[c][key]:.0f}" for c in names) for arm, names in POOLED.items()}
            print(
                f"  {label:28s}{pooled['april2'][key]:8.0f} vs {pooled['sync'][key]:8.0f}   "
                f"{pooled['april2'][key] / pooled['sync'][key]:.2f}x   (april2 runs {runs['april2']}; sync runs {runs['sync']})"
            )

    print()
    S, A = cal["pair"]
    print(
        f"simulator (april/sim.py, preset cpu_tiny) calibrated on this machine and the {S} run, "
        f"compared with {A} / {S}:"
    )
    print("  engine decode step, ms at batch " + ", ".join(f"{b}: {1e3 * v:.2f}" for b, v in e["step_s"].items()))
    print(
        f"    -> t0 {1e3 * e['t0']:.2f} ms + k {1e6 * e['k']:.1f} us x batch (fit on 1..64); "
        f"prefill p {1e6 * e['p']:.1f} us/token"
    )
    print(
        f"  learner {cal['train_fixed_s']:.3f} s + {1e6 * cal['train_per_token_s']:.1f} us/token ({S} steps); "
        f"weight sync + driver {cal['overhead_s']:.3f} s/step"
    )
    lens = cal["cfg"].lengths
    ln = cal["lognormal"]
    print(
        f"  lengths: {len(lens)} from the {S} run (p50 {np.percentile(lens, 50):.0f}, p99 {np.percentile(lens, 99):.0f}, "
        f"max {max(lens)}); grouped log-normal fit: median {ln['median_tokens']:.1f}, sigma prompt "
        f"{ln['sigma_prompt']:.2f}, sample {ln['sigma_sample']:.2f}"
    )
    print(
        f"  sim(empirical): the {S} run's lengths, i.i.d.; sim(grouped): log-normal with the groups' spread; "
        f"sim(+overhead): sim(empirical) + {cal['rollout_overhead_s']:.3f} s/step of rollout time the engine "
        f"model leaves out (fitted on {S}); sim(calibrated): engine step times x{cal['engine_scale']:.2f} (the "
        f"{S} run's busy seconds) + {cal['outside_engine_s']:.3f} s/step of its rollout time outside engine steps"
    )
    print(
        f"  {'':32s}{'empirical':>11s}{'grouped':>11s}{'+overhead':>11s}{'calibrated':>11s}{'measured':>10s}"
        f"{'error (calibrated)':>20s}"
    )

    E, G, O, C = cal["empirical"], cal["grouped"], cal["overhead"], cal["calibrated"]

    def cmp(label: str, key: str, m: float, unit: str = "x", k: str | None = None, term: str | None = None) -> None:
        vals = [V[key] if k is None else V["per_step"][k][term] for V in (E, G, O, C)]
        print(
            f"  {label:32s}" + "".join(f"{v:>10.2f}{unit}" for v in vals) + f"{m:>9.2f}{unit}"
            f"{100 * (vals[3] - m) / m:>19.1f}%"
        )

    cmp("april2/sync tok/s, wall-clock", "pred_wall", cal["meas_wall"])
    cmp("april2/sync tok/s, rollout time", "pred_rollout", cal["meas_rollout"])
    for k, measured in (("sync", S), ("april2", A)):
        for term, key in (("step", "step_s_mean"), ("rollout", "rollout_s_mean"), ("learner", "learner_s_mean")):
            cmp(f"{k} {term} s / step", "", sums[measured][key], " ", k, term)
    a = C["sim"]["april2"]
    print(
        f"  april2 off-policy share (sim / measured): {100 * a.off_policy_share:.1f}% / {100 * sums[A]['off_policy']:.1f}%;"
        f" max span {a.max_span} / {sums[A]['max_span']}"
    )
    pc = cal["pad_coef"]
    print(
        f"  learner as rows x widest row ({1e6 * pc:.2f} us per padded token, {S} fit): predicts {A} "
        f"{pc * sums[A]['padded_per_step']:.3f} s/step vs measured {sums[A]['learner_s_mean']:.3f}"
    )
    total_s = time.time() - bench_started
    print(
        f"\nbenchmark wall {total_s:.0f} s (model dir {model_s:.1f} s, calibration {calib_s:.1f} s, eval {eval_s:.1f} s); "
        f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )

    def ratio(c: str, key: str) -> float:
        return round(sums[c][key] / base[key], 3)

    result: dict = {
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup_steps,
        "sync_rollout_tokens_per_s": round(base["rollout_tok_s"], 1),
        "sync_wall_tokens_per_s": round(base["wall_tok_s"], 1),
        "sync_step_time_s": round(base["step_s_mean"], 3),
    }
    for c in cols[1:]:
        if not math.isnan(sums[c]["rollout_tok_s"]):
            result[f"{c}_over_sync_rollout_tokens_per_s_ratio"] = ratio(c, "rollout_tok_s")
        result[f"{c}_over_sync_wall_tokens_per_s_ratio"] = ratio(c, "wall_tok_s")
        result[f"{c}_over_sync_trained_tokens_per_s_ratio"] = ratio(c, "trained_tok_s")
        result[f"{c}_over_sync_step_time_ratio"] = ratio(c, "step_s_mean")
    for c in cols:
        s = sums[c]
        result[f"{c}_engine_busy_fraction"] = round(s["engine_busy"], 3)
        if not math.isnan(s["engine_busy_in_rollout"]):
            result[f"{c}_engine_busy_fraction_during_rollout"] = round(s["engine_busy_in_rollout"], 3)
            result[f"{c}_worker_buffer_io_fraction_during_rollout"] = round(s["buffer_io_in_rollout"], 3)
        result[f"{c}_mean_decode_batch"] = round(s["mean_decode_batch"], 1)
        result[f"{c}_learner_busy_fraction"] = round(s["learner_busy"], 3)
        if c.startswith("april") or c == "ppo_streaming":
            result[f"{c}_off_policy_token_share"] = round(s["off_policy"], 3)
            result[f"{c}_max_version_span"] = int(s["max_span"])
            result[f"{c}_max_version_lag"] = int(s["max_lag"])
            result[f"{c}_resumed_samples_per_step"] = round(s["resumed_per_step"], 2)
            result[f"{c}_wasted_tokens"] = int(s["wasted_tokens"])
        result[f"{c}_train_reward_first5"] = round(first_last(s["rewards"])[0], 3)
        result[f"{c}_train_reward_last5"] = round(first_last(s["rewards"])[1], 3)
        result[f"{c}_heldout_reward"] = round(evals[c], 3)
    if all(c in sums for c in STREAMING_PAIR):
        sb, st = (sums[c] for c in STREAMING_PAIR)
        result["ppo_streaming_over_ppo_sync_wall_tokens_per_s_ratio"] = round(st["wall_tok_s"] / sb["wall_tok_s"], 3)
        result["ppo_streaming_over_ppo_sync_trained_tokens_per_s_ratio"] = round(
            st["trained_tok_s"] / sb["trained_tok_s"], 3
        )
    if pooled:
        for key, name in (("rollout_tok_s", "rollout_tokens_per_s"), ("wall_tok_s", "wall_tokens_per_s")):
            result[f"pooled2_april2_over_sync_{name}_ratio"] = round(pooled["april2"][key] / pooled["sync"][key], 3)
    if all(c in sums for c in FROZEN_PAIR):
        fb, fa = (sums[c] for c in FROZEN_PAIR)
        for key, name in (
            ("rollout_tok_s", "rollout_tokens_per_s"),
            ("wall_tok_s", "wall_tokens_per_s"),
            ("trained_tok_s", "trained_tokens_per_s"),
        ):
            result[f"april2_frozen_over_sync_frozen_{name}_ratio"] = round(fa[key] / fb[key], 3)
    result.update(
        initial_heldout_reward=round(evals["initial"], 3),
        sim_compared_with="/".join(reversed(cal["pair"])),
        sim_predicted_april2_ratio=round(E["pred_wall"], 3),
        measured_april2_ratio=round(cal["meas_wall"], 3),
        sim_error_pct=round(E["err_wall_pct"], 1),
        sim_predicted_april2_rollout_ratio=round(E["pred_rollout"], 3),
        measured_april2_rollout_ratio=round(cal["meas_rollout"], 3),
        sim_rollout_error_pct=round(E["err_rollout_pct"], 1),
        sim_grouped_predicted_april2_ratio=round(G["pred_wall"], 3),
        sim_grouped_error_pct=round(G["err_wall_pct"], 1),
        sim_with_rollout_overhead_predicted_april2_ratio=round(O["pred_wall"], 3),
        sim_with_rollout_overhead_error_pct=round(O["err_wall_pct"], 1),
        sim_with_rollout_overhead_predicted_april2_rollout_ratio=round(O["pred_rollout"], 3),
        sim_with_rollout_overhead_rollout_error_pct=round(O["err_rollout_pct"], 1),
        sim_calibrated_predicted_april2_ratio=round(C["pred_wall"], 3),
        sim_calibrated_error_pct=round(C["err_wall_pct"], 1),
        sim_calibrated_predicted_april2_rollout_ratio=round(C["pred_rollout"], 3),
        sim_calibrated_rollout_error_pct=round(C["err_rollout_pct"], 1),
        calib_engine_scale=round(cal["engine_scale"], 3),
        calib_outside_engine_s_per_step=round(cal["outside_engine_s"], 4),
        calib_t0_s=round(e["t0"], 5),
        calib_k_s_per_request=round(e["k"], 7),
        calib_prefill_s_per_token=round(e["p"], 8),
        calib_train_fixed_s=round(cal["train_fixed_s"], 4),
        calib_train_s_per_token=round(cal["train_per_token_s"], 7),
        calib_overhead_s_per_step=round(cal["overhead_s"], 4),
        benchmark_wall_s=round(total_s, 1),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
