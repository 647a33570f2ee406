"""APRIL vs sync on the long-tail example task: several runs of each arm, and the simulator's prediction.

Every run is one real job (driver, a fresh redis-server of its own, learner + 1 rollout worker as
Ray actors, or with `--launcher local` on threads of the driver's process,
the tiny MoE with the default warm start, the repeat task); only `april.*` (and the learner) differ
between arms:

    sync            the synchronous baseline (APRIL off)
    april2          APRIL, oversample 2.0, no staleness budget
    april2_budget2  APRIL, oversample 2.0, april.max_version_span=2 (beyond_budget=restart)
    async2          async, max_staleness=2: the learner trains while the engines generate (its
                    rollout window is the whole step: read its wall figures)
    sync_frozen, april2_frozen   sync and APRIL x2 with the policy frozen (learner.lr=1e-12): the same
                    workload for both, what the mechanism alone buys; the simulator is compared here
  with --extra also:
    ppo_sync        PPO + critic (GAE), APRIL off: the baseline of the streaming variant
    ppo_streaming   GLM-5's streaming variant: PPO trains every trajectory each 16 new tokens while
                    the engine keeps generating; the critic bootstraps unfinished returns
    april1.5, april3   APRIL at oversample 1.5 and 3.0
  and by name (--arms):
    sync_local, april2_local   sync and APRIL x2 with cluster.launcher=local (learner and worker on
                    threads of this process), each divided by the same arm under --launcher

Runs go in rounds, the arms in the same order in every round (sync, april2, ..., sync, april2, ...),
`--runs` rounds; round r runs every arm with seed `--seed + r`. Each run starts its own redis-server
(slime/buffer/redis_server.py) on an emptied data directory and stops it afterwards. A ratio is
taken per round (run r of an arm over run r of its baseline); every figure is reported as the mean
over the runs, with the sample standard deviation and the min..max. Nothing is pooled or picked.

The clock (slime/job.py, RunningJob): a step's rollout seconds run while its engines may generate
for it, from the moment they have work (sync: the step schedules its groups; APRIL: the previous
step resumed the partials) until every engine has stopped: sync when the batch is complete, APRIL
when the abort has COMPLETED (the decode step in flight finished, every partial's last tokens
stored) although the abort overlaps the learner. Every generated token is counted in the window it
was generated in. Step seconds are contiguous (one step starts where the last ended), so the wall
figures cover the whole loop; the table also shows tokens over the whole loop's wall-clock.

Then the simulator (`april/sim/run.py`, preset `cpu_tiny`) is calibrated from this machine: the engine's
decode step time at several batch sizes (-> t0, k), prefill time per token (-> p), training time per
step/token and the weight-sync/driver overhead from round 0's sync_frozen run, and that run's real
response lengths as the empirical length distribution. It predicts sync and APRIL x2 and is
compared with the frozen pair's mean measured ratios.

Prints a human table, then LAST one JSON line (names carry units; `<name>` is the mean over the
runs, `<name>_mean` the same, `<name>_std` the sample standard deviation, and for ratios and
throughputs `<name>_min` / `<name>_max`).

    python benchmarks/april_vs_sync.py [--runs 3] [--steps 20] [--extra] [--arms sync,april2,...]
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
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
    "buffer.keep_trained_steps=null",  # the figures below read every trained group back
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
    # The rollout mechanism alone, on the same workload: a learning rate far below float32's
    # resolution of the weights (Adam moves each by ~lr), so the policy, and with it the length
    # distribution, stays the warm start's in both; the learner still does all its work. With real
    # training the two policies drift apart (APRIL's often to longer answers), and so do the
    # workloads the rows above compare. The simulator is compared with this pair.
    # Async (staleness 2): the engines never stop; the learner trains on finished groups while they
    # generate. Its rollout window is the whole step, so it has no "per rollout second" figure:
    # read its wall-clock and trained-token ratios.
    "async2": ["april.enabled=false", "mode=async", "max_staleness=2"],
    "sync_frozen": ["april.enabled=false", "learner.lr=1e-12"],
    "april2_frozen": ["april.enabled=true", "april.oversample=2.0", "learner.lr=1e-12"],
}
EXTRA_SETTINGS: dict[str, list[str]] = {
    "ppo_sync": ["april.enabled=false", "algorithm.name=ppo", "algorithm.gamma=1.0", "algorithm.lam=0.95"],
    "ppo_streaming": [
        "april.enabled=false",
        "algorithm.name=ppo",
        "algorithm.gamma=1.0",
        "algorithm.lam=0.95",
        "april.streaming_chunk_tokens=16",
        "rollout.chunk_tokens=8",
    ],
    "april1.5": ["april.enabled=true", "april.oversample=1.5"],
    "april3": ["april.enabled=true", "april.oversample=3.0"],
}
# The launcher itself (--arms sync,sync_local,april2,april2_local): the same jobs with the learner and
# the worker on threads of the driver's process instead of Ray actors, against the --launcher runs.
LAUNCHER_SETTINGS: dict[str, list[str]] = {
    "sync_local": ["april.enabled=false", "cluster.launcher=local"],
    "april2_local": ["april.enabled=true", "april.oversample=2.0", "cluster.launcher=local"],
}
FROZEN_PAIR = ("sync_frozen", "april2_frozen")
STREAMING_PAIR = ("ppo_sync", "ppo_streaming")
CLOCK = (
    "rollout clock: from the moment a step's engines have work (sync: its groups are scheduled; APRIL: "
    "the previous step resumed the partials) until every engine has stopped (sync: the batch is complete; "
    "APRIL: the abort has completed, in-flight decode step and partials' last tokens stored, though it "
    "overlaps the learner); every generated token counted in the window it was made in; step windows contiguous"
)


def baseline_of(arm: str) -> str:
    """The arm a ratio divides by: the frozen APRIL arm by the frozen sync arm, PPO streaming by
    PPO sync, an arm under the local launcher by the same arm under --launcher, everything else by sync."""
    if arm in LAUNCHER_SETTINGS:
        return arm.removesuffix("_local")
    if arm == FROZEN_PAIR[1]:
        return FROZEN_PAIR[0]
    if arm == STREAMING_PAIR[1]:
        return STREAMING_PAIR[0]
    return "sync"


# --------------------------------------------------------------------------- one real job


def fresh_dir(path: Path) -> Path:
    """An empty directory the benchmark owns (a leftover AOF would be replayed into the new server)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def run_setting(name: str, overrides: list[str], args, round_index: int) -> dict:
    from slime.buffer.redis_server import LocalRedisServer
    from slime.sample import Status
    from slime.train import LOOPS, RunningJob

    out = Path(args.out)
    seed = args.seed + round_index
    run_dir = fresh_dir(out / name / f"run{round_index}")
    started = time.time()
    # A fresh redis-server per run, on an empty data directory: no run sees another's keys, AOF or memory.
    server = LocalRedisServer(fresh_dir(out / "redis" / f"{name}-run{round_index}"), aof=True)
    try:
        cfg = load_config(
            None,
            [
                f"job_name=bench-april-{name}-r{round_index}",
                f"cluster.launcher={args.launcher}",
                f"output_dir={run_dir}",
                f"steps={args.steps}",
                f"seed={seed}",
                "model.seed=0",  # one model for every round: the seed varies sampling and data only
                f"data.seed={seed}",
                f"buffer.url={server.url}",
                *SHAPE,
                *args.set,
                *overrides,
            ],
        )
        with RunningJob(cfg) as job:
            setup_s = time.time() - started
            before = job.launcher.get([w.health.remote() for w in job.workers])
            gen_before = job.buffer.stats().get("generated_tokens", 0.0)
            t0 = time.time()
            LOOPS[cfg.loop_mode](job)
            loop_wall = time.time() - t0
            after = job.launcher.get([w.health.remote() for w in job.workers])
            grown = lambda key: sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before))  # over the loop
            gen_after = job.buffer.stats().get("generated_tokens", 0.0)
            # Every token made up to the last step's rollout end, against what the step windows counted:
            # 1 when no token falls between two windows or in two (the engines idle outside them).
            made = job.clock.tokens_at_rollout_end - gen_before
            counted = sum(m["generated_tokens"] for m in job.logger.history)
            # The real response-length distribution: every finished response in the buffer.
            finished = [s for s in job.buffer.iter_samples() if s.status in (Status.COMPLETED, Status.TRUNCATED)]
            lengths = [int(s.response_length) for s in finished]
            prompt_tokens = float(np.mean([len(s.prompt_ids) for s in finished])) if finished else 6.0
            history = list(job.logger.history)
            # Each step's batch, group by group: (prompt, response) lengths. The learner's forward costs
            # the rows' own tokens when it packs them (learner_packed), else rows x widest row (right
            # padding); the groups give the real within-group correlation.
            steps_groups: dict[int, list[list[tuple[int, int]]]] = {}
            for gid, step in job.buffer.redis.zrange(job.buffer._key("trained"), 0, -1, withscores=True):
                group = job.buffer.get_group(gid.decode())
                steps_groups.setdefault(int(step), []).append([(len(s.prompt_ids), s.response_length) for s in group])
            packed_steps = {int(m["step"]) for m in job.logger.history if m.get("learner_packed", 0.0) >= 0.5}
            padded = {
                st: sum(p + r for g in gs for p, r in g)
                if st in packed_steps
                else sum(len(g) for g in gs) * max(p + r for g in gs for p, r in g)
                for st, gs in steps_groups.items()
            }
            group_lengths = [[r for _, r in g] for gs in steps_groups.values() for g in gs]
            latest = job.run_dir / "checkpoints" / "latest"
            policy_dir = (
                job.run_dir / "checkpoints" / latest.read_text().strip() / "policy" if latest.exists() else None
            )
    finally:
        server.stop()
    return {
        "name": name,
        "round": round_index,
        "seed": seed,
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
        "clock_coverage": counted / made if made else math.nan,
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
    abort_s = sum(m.get("abort_seconds", 0.0) for m in h)
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
    # per-rollout-second figures are undefined. Nor has async: its window is the whole step.
    streaming = run["cfg"].april.streaming_chunk_tokens is not None
    overlapped = streaming or run["cfg"].mode == "async"
    all_rollout_s = sum(m["rollout_seconds"] for m in all_h)
    return {
        "steps": len(h),
        "generated_tokens": gen,
        "rollout_tok_s": math.nan if overlapped else gen / max(rollout_s, 1e-9),
        "wall_tok_s": gen / max(step_s, 1e-9),
        "trained_tok_s": sum(m.get("trained_tokens", 0.0) for m in h) / max(step_s, 1e-9),
        # Independent of any per-step clock: every token the loop generated over its wall-clock.
        "loop_tok_s": run["generated_total"] / max(run["loop_wall_s"], 1e-9),
        "clock_coverage": math.nan if streaming else run["clock_coverage"],
        "step_s_mean": step_s / len(h),
        "rollout_s_mean": rollout_s / len(h),
        "abort_s_mean": abort_s / len(h),
        "learner_s_mean": learner_s / len(h),
        "learner_model_tflops": statistics.mean(m.get("learner_model_tflops", math.nan) for m in h),
        "learner_mfu": statistics.mean(m.get("learner_mfu", math.nan) for m in h),  # nan: CPU or an unknown GPU
        # The abort is inside the rollout window and overlaps the learner: counted once here.
        # Async: the window overlaps the learner and the rest of the step.
        "other_s_mean": (step_s - (0.0 if overlapped else rollout_s - abort_s) - learner_s) / len(h),
        "sync_s_mean": statistics.mean(m.get("weight_sync_seconds", 0.0) for m in h),
        "engine_busy": run["engine_busy_s"] / run["loop_wall_s"],
        "mean_decode_batch": run["decode_rows"] / max(1, run["decode_steps"]),
        "decode_steps_per_step": run["decode_steps"] / max(1, len(all_h)),
        "engine_busy_in_rollout": math.nan if streaming else run["engine_busy_s"] / all_rollout_s,
        # The rollout thread's buffer I/O between engine steps (leases and finishes; chunk writes).
        "buffer_io_in_rollout": math.nan
        if streaming
        else (run["worker_admit_s"] + run["worker_absorb_s"]) / all_rollout_s,
        "learner_busy": sum(m["learner_seconds"] for m in all_h) / run["loop_wall_s"],
        "off_policy": off,
        "max_span": max(spans, default=0),
        "max_lag": max(lags, default=0),
        "resumed_per_step": statistics.mean(m.get("resumed_samples", 0.0) for m in all_h),
        "aborted_per_step": statistics.mean(m.get("aborted_samples", 0.0) for m in all_h),
        "wasted_tokens": all_h[-1].get("wasted_tokens_total", 0.0),
        "rewards": [m.get("reward_mean", float("nan")) for m in all_h],
        "reward_first5": first_last([m.get("reward_mean", float("nan")) for m in all_h])[0],
        "reward_last5": first_last([m.get("reward_mean", float("nan")) for m in all_h])[1],
        "reward_std": float(np.nanstd([m.get("reward_mean", float("nan")) for m in all_h])),
        "len_mean": statistics.mean(m.get("response_len_mean", 0.0) for m in all_h),
        "padded_per_step": statistics.mean(run["padded_tokens"].get(int(m["step"]), 0) for m in h),
        "trained_tokens_per_step": statistics.mean(m.get("trained_tokens", 0.0) for m in h),
        "padded": [run["padded_tokens"].get(int(m["step"]), 0) for m in h],
        "learner_s": [m["learner_seconds"] for m in h],
    }


# --------------------------------------------------------------------------- calibration


def measure_engine(model_dir: str, threads: int, prompt_len: int, repeats: int = 3, device: str = "cpu") -> dict:
    """Decode step time at batch 1..256 (best of `repeats` interleaved runs of 15 steps, fair under
    background load), least squares t(b) = t0 + k*b over batch 1/8/32/64; prefill time per token
    from admitting 128 requests of 30 context tokens (the size of a resumed partial). On the runs'
    rollout.device: a GPU run's simulator is calibrated on the GPU. Each step hands its tokens to the
    host, so a step's time is the device's."""
    import torch

    from slime.engines.builtin import BuiltinEngine
    from slime.engines.contract import GenerationRequest, SamplingParams
    from slime.model import load_model

    torch.set_num_threads(threads)
    model = load_model(model_dir, device=device)
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
            engine = BuiltinEngine(model, device=device, max_running_requests=b, seed=r)
            for i in range(b):
                engine.add_request(GenerationRequest(f"{r}-{i}", context(prompt_len), params))
            for _ in range(4):  # prefill + warm-up
                engine.step()
            t = time.perf_counter()
            for _ in range(15):
                engine.step()
            step_s[b] = min(step_s[b], (time.perf_counter() - t) / 15)
        engine = BuiltinEngine(model, device=device, max_running_requests=128, seed=r)
        for i in range(128):
            engine.add_request(GenerationRequest(f"p{r}-{i}", context(prompt_len), params, context(30 - prompt_len)))
        t = time.perf_counter()
        engine.step()  # prefill of 128 x 30 tokens, then one decode step of 128
        prefill = min(prefill, time.perf_counter() - t)
    fit = [1, 8, 32, 64]
    k, t0 = np.polyfit(fit, [step_s[b] for b in fit], 1)
    p = max(0.0, (prefill - step_s[128]) / (128 * 30))
    return {"step_s": step_s, "t0": float(max(t0, 0.0)), "k": float(max(k, 0.0)), "p": p}


def evaluate(
    model_dir: str,
    policy_dir: Path | None,
    prompts: list[dict],
    threads: int,
    temperature: float = 0.0,
    samples_per_prompt: int = 1,
) -> float:
    """Mean reward of a policy on held-out prompts of the repeat task (no selection bias), as
    `slime eval` scores it (slime/evaluation.py): greedy by default; with a temperature,
    `samples_per_prompt` samples of each prompt from a fixed seed."""
    import tempfile

    import torch

    from slime.config import load_config
    from slime.data import load_prompts, write_jsonl
    from slime.evaluation import evaluate_model_dir
    from slime.model import load_tokenizer

    torch.set_num_threads(threads)
    sampled = temperature > 0
    job = load_config(
        None,
        [
            f"model.path={policy_dir or model_dir}",
            "rollout.max_new_tokens=96",
            f"rollout.max_running_requests={len(prompts) * max(samples_per_prompt, 1)}",
            f"eval.samples={samples_per_prompt if sampled else 0}",
            f"eval.temperature={temperature if sampled else 1.0}",
        ],
    )
    tokenizer = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        records = load_prompts(job.data, tokenizer, str(write_jsonl(prompts, Path(tmp) / "held_out.jsonl")))
    result = evaluate_model_dir(job, Path(policy_dir or model_dir), records, tokenizer)
    return result["sampled_reward_mean" if sampled else "greedy_reward_mean"]


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


def calibrate_and_simulate(
    runs: dict[str, dict], sums: dict[str, dict], engine: dict, args, measured: dict[str, float]
) -> dict:
    """`runs`: one run per arm (round 0's); `sums`: each arm's figures as means over its runs;
    `measured`: the pair's mean per-round ratios ("wall", "rollout")."""
    from april.sim import simulate
    from slime.tools.simulate import sim_config_from_job

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
    # What the real learner costs: the tokens its forward runs (packed rows, or rows x widest row
    # when it pads), fitted on the same sync steps.
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
    out["meas_wall"], out["meas_rollout"] = measured["wall"], measured["rollout"]
    for label, _ in variants:
        out[label]["err_wall_pct"] = 100 * (out[label]["pred_wall"] - out["meas_wall"]) / out["meas_wall"]
        out[label]["err_rollout_pct"] = 100 * (out[label]["pred_rollout"] - out["meas_rollout"]) / out["meas_rollout"]
    return out


# --------------------------------------------------------------------------- spread over runs


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one run), min and max of one figure over the runs."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {
        "mean": statistics.mean(v),
        "std": statistics.stdev(v) if len(v) > 1 else 0.0,
        "min": min(v),
        "max": max(v),
        "n": len(v),
    }


def fmt_spread(s: dict[str, float], digits: int, unit: str = "") -> str:
    if s["n"] == 0:
        return "n/a"
    d = digits
    return f"{s['mean']:.{d}f}{unit} ±{s['std']:.{d}f} [{s['min']:.{d}f}..{s['max']:.{d}f}]"


def per_round_ratios(sums: dict[str, list[dict]], arm: str, base: str, key: str) -> list[float]:
    """Run r of `arm` over run r of `base` (the same round, the same seed, adjacent in time)."""
    return [a[key] / b[key] for a, b in zip(sums[arm], sums[base])]


def mean_summary(runs_sums: list[dict]) -> dict:
    """One arm's figures as means over its runs (lists: round 0's)."""
    out = {}
    for key, value in runs_sums[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = spread([s[key] for s in runs_sums])["mean"]
        else:
            out[key] = value
    return out


def first_last(values: list[float], n: int = 5) -> tuple[float, float]:
    v = [x for x in values if math.isfinite(x)]
    return (float(np.mean(v[:n])), float(np.mean(v[-n:]))) if v else (math.nan, math.nan)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per arm, in rounds (every arm once per round)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the time figures")
    ap.add_argument("--seed", type=int, default=0, help="round r runs every arm with seed + r")
    ap.add_argument(
        "--arms", default=",".join(SETTINGS), help=f"comma-separated arms (default: all of {', '.join(SETTINGS)})"
    )
    ap.add_argument("--extra", action="store_true", help=f"also run {', '.join(EXTRA_SETTINGS)}")
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
        "--launcher",
        choices=("ray", "local"),
        default="ray",
        help="cluster.launcher of every run: Ray actors, or threads of this process (no Ray imported)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of calibration/eval (= cluster.torch_threads)"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="sync and april2 once, 4 steps of 2x2 samples, 16 tokens, output in a temporary directory: "
        "checks it runs (not figures to quote)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.steps, args.warmup_steps, args.arms, args.extra, args.eval_prompts = (
            1,
            4,
            1,
            "sync,april2",
            False,
            4,
        )
        args.set = [*args.set, "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16"]
        args.out = tempfile.mkdtemp(prefix="bench-april-vs-sync-smoke-")
        atexit.register(shutil.rmtree, args.out, True)  # a smoke's runs are not kept
    if args.steps <= args.warmup_steps + 2:
        ap.error("--steps must exceed --warmup-steps by at least 3")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    known = {**SETTINGS, **EXTRA_SETTINGS, **LAUNCHER_SETTINGS}
    arms = [a for a in args.arms.split(",") if a] + (list(EXTRA_SETTINGS) if args.extra else [])
    arms = list(dict.fromkeys(arms))
    unknown = [a for a in arms if a not in known]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {', '.join(known)}")
    for arm in list(arms):
        if baseline_of(arm) not in arms:
            ap.error(f"arm {arm} needs its baseline {baseline_of(arm)} in --arms")
    bench_started = time.time()

    from envs import repeat
    from slime.model import ensure_model_dir

    t = time.time()
    model_dir = str(ensure_model_dir(load_config(None, []).model))
    model_s = time.time() - t
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    load_before = os.getloadavg()

    # One Ray for every run (each job has its own actors, killed when it ends); a Redis per run.
    if args.launcher == "ray":
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    try:
        for r in range(args.runs):
            for arm in arms:
                run = run_setting(arm, known[arm], args, r)
                runs[arm].append(run)
                print(
                    f"[{time.time() - bench_started:6.1f}s] round {r} {arm}: {args.steps} steps in "
                    f"{run['loop_wall_s']:.1f}s (job {run['job_s']:.1f}s, load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        if args.launcher == "ray":
            ray.shutdown()
    runs_s = time.time() - bench_started
    S0, A0 = FROZEN_PAIR if all(a in arms for a in FROZEN_PAIR) else ("sync", "april2")
    calibrate = S0 in arms and A0 in arms
    t = time.time()
    engine = (
        measure_engine(
            model_dir,
            args.threads,
            round(runs[S0][0]["prompt_tokens"]),
            1 if args.smoke else 3,
            next((o.split("=", 1)[1] for o in reversed(args.set) if o.startswith("rollout.device=")), "cpu"),
        )
        if calibrate
        else None
    )
    calib_s = time.time() - t
    t = time.time()
    held_out = repeat.make_dataset(args.eval_prompts, seed=10_000 + args.seed)
    initial_eval = evaluate(model_dir, None, held_out, args.threads)
    evals = {
        arm: [evaluate(model_dir, run["policy_dir"], held_out, args.threads) for run in rs] for arm, rs in runs.items()
    }
    eval_s = time.time() - t
    sums = {arm: [summarize(run, args.warmup_steps) for run in rs] for arm, rs in runs.items()}
    for arm in arms:
        for s, e in zip(sums[arm], evals[arm]):
            s["heldout"] = e

    def ratio_spread(arm: str, key: str) -> dict[str, float]:
        return spread(per_round_ratios(sums, arm, baseline_of(arm), key))

    def fig(arm: str, key: str) -> dict[str, float]:
        return spread([s[key] for s in sums[arm]])

    cal = None
    if calibrate:
        measured = {
            "wall": ratio_spread(A0, "wall_tok_s")["mean"],
            "rollout": ratio_spread(A0, "rollout_tok_s")["mean"],
        }
        cal = calibrate_and_simulate(
            {a: runs[a][0] for a in (S0, A0)},
            {a: mean_summary(sums[a]) for a in (S0, A0)},
            engine,
            args,
            measured,
        )
    total_s = time.time() - bench_started

    # ---- the report ---------------------------------------------------------------------------
    print()
    print(
        f"APRIL vs sync: repeat task, tiny MoE (default warm start), 1 rollout worker, batch 16 x 8, 96-token cap, "
        f"T=1, 256 slots, lr 5e-4, {args.steps} steps (time figures: steps {args.warmup_steps}..{args.steps - 1}); "
        f"{args.runs} runs per arm in rounds ({' '.join(arms)}) x {args.runs}, round r with seed {args.seed}+r, "
        f"each run on a fresh redis-server" + (f"; overrides {' '.join(args.set)}" if args.set else "")
    )
    print(CLOCK)
    print("every figure: mean over the runs ±sample std [min..max]; a ratio is taken per round, then averaged")
    print()
    print("headline:")
    lead = [
        ("generated tok / wall s", "wall_tok_s"),
        ("trained tok / wall s", "trained_tok_s"),
        ("generated tok / rollout s", "rollout_tok_s"),
    ]
    headline_arms = [a for a in ("april2", "april2_frozen", "april2_budget2") if a in arms]
    for arm in headline_arms:
        for label, key in lead:
            print(f"  {arm + ' / ' + baseline_of(arm):30s} {label:28s} {fmt_spread(ratio_spread(arm, key), 2, 'x')}")
    print()

    w = 30
    print(f"{'':38s}" + "".join(f"{c:>{w}s}" for c in arms))

    def row(label: str, fn, digits: int = 0, unit: str = "") -> None:
        cells = [fmt_spread(spread([fn(s, c) for s in sums[c]]), digits, unit) for c in arms]
        print(f"{label:38s}" + "".join(f"{cell:>{w}s}" for cell in cells))

    def ratio_row(label: str, key: str) -> None:
        cells = [fmt_spread(ratio_spread(c, key), 2, "x") if c != baseline_of(c) else "1" for c in arms]
        print(f"{label:38s}" + "".join(f"{cell:>{w}s}" for cell in cells))

    row("generated tok / wall s", lambda s, c: s["wall_tok_s"])
    ratio_row("  ratio vs baseline (per round)", "wall_tok_s")
    row("trained tok / wall s", lambda s, c: s["trained_tok_s"])
    ratio_row("  ratio vs baseline (per round)", "trained_tok_s")
    row("generated tok / rollout s", lambda s, c: s["rollout_tok_s"])
    ratio_row("  ratio vs baseline (per round)", "rollout_tok_s")
    row("generated tok / loop wall s (all steps*)", lambda s, c: s["loop_tok_s"])
    ratio_row("  ratio vs baseline (per round)", "loop_tok_s")
    row("tokens counted in step windows / made", lambda s, c: s["clock_coverage"], 4)
    row("step time, mean s", lambda s, c: s["step_s_mean"], 3)
    row("  rollout s / step (window)", lambda s, c: s["rollout_s_mean"], 3)
    row("    of which abort (overlaps learner)", lambda s, c: s["abort_s_mean"], 3)
    row("  learner s / step", lambda s, c: s["learner_s_mean"], 3)
    row("    learner model TFLOPS (6N x tokens)", lambda s, c: s["learner_model_tflops"], 3)
    row("    learner MFU, % (nan: no known peak)", lambda s, c: 100 * s["learner_mfu"], 1)
    row("  weight push s / step", lambda s, c: s["sync_s_mean"], 3)
    row("  other s / step (sync, driver)", lambda s, c: s["other_s_mean"], 3)
    row("generated tok / step", lambda s, c: s["generated_tokens"] / s["steps"])
    row("trained tok / step", lambda s, c: s["trained_tokens_per_step"])
    row("learner forward tok / step", lambda s, c: s["padded_per_step"])
    row("engine busy (busy s / wall), %", lambda s, c: 100 * s["engine_busy"], 1)
    row("engine busy during rollout, %", lambda s, c: 100 * s["engine_busy_in_rollout"], 1)
    row("worker buffer I/O in rollout, %", lambda s, c: 100 * s["buffer_io_in_rollout"], 1)
    row("engine decode steps / step", lambda s, c: s["decode_steps_per_step"], 1)
    row("  mean decode batch (rows)", lambda s, c: s["mean_decode_batch"], 1)
    row("learner busy (learn s / wall), %", lambda s, c: 100 * s["learner_busy"], 1)
    row("off-policy token share, %", lambda s, c: 100 * s["off_policy"], 1)
    row("max version span (in a sample)", lambda s, c: s["max_span"])
    row("max version lag (trainer - oldest)", lambda s, c: s["max_lag"])
    row("resumed samples / step", lambda s, c: s["resumed_per_step"], 1)
    row("aborted samples / step", lambda s, c: s["aborted_per_step"], 1)
    row("wasted tokens (total)", lambda s, c: s["wasted_tokens"])
    row("trained response len, mean", lambda s, c: s["len_mean"], 1)
    row("train reward, first 5 steps", lambda s, c: s["reward_first5"], 3)
    row("train reward, last 5 steps", lambda s, c: s["reward_last5"], 3)
    row("train reward, std of step means", lambda s, c: s["reward_std"], 3)
    row(f"held-out reward ({args.eval_prompts}, greedy)", lambda s, c: s["heldout"], 3)
    print(f"  (held-out reward of the initial warm-started model: {initial_eval:.3f})")
    print(
        "  * every token the loop generated over the loop's wall-clock, step 0 included (APRIL's first step fills "
        "2x the groups) and the partials still held at the end (never trained): a cross-check independent of "
        "the per-step clocks, not a fair throughput figure"
    )
    print()
    print("train reward curve, mean over runs (5-step moving average, every 5th step):")
    for c in arms:
        r = np.nanmean(np.array([s["rewards"] for s in sums[c]]), axis=0)
        ma = [float(np.nanmean(r[max(0, i - 4) : i + 1])) for i in range(len(r))]
        print(f"  {c:16s}" + " ".join(f"{ma[i]:.3f}" for i in range(4, len(ma), 5)))

    if all(c in arms for c in STREAMING_PAIR):
        print()
        print("streaming variant (PPO, trains each 16 new tokens; engine never pauses for the learner) vs sync PPO:")
        for label, key in (("generated tok / wall s", "wall_tok_s"), ("trained tok / wall s", "trained_tok_s")):
            print(f"  {label:26s} {fmt_spread(ratio_spread(STREAMING_PAIR[1], key), 2, 'x')}")

    if cal is not None:
        e = engine
        S, A = cal["pair"]
        msum = {a: mean_summary(sums[a]) for a in (S, A)}
        print()
        print(
            f"simulator (april/sim/run.py, preset cpu_tiny) calibrated on this machine and round 0's {S} run, "
            f"compared with the mean of {A} / {S} over the rounds:"
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
            f"  lengths: {len(lens)} from the {S} run (p50 {np.percentile(lens, 50):.0f}, p99 "
            f"{np.percentile(lens, 99):.0f}, max {max(lens)}); grouped log-normal fit: median {ln['median_tokens']:.1f}, "
            f"sigma prompt {ln['sigma_prompt']:.2f}, sample {ln['sigma_sample']:.2f}"
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

        def cmp(label: str, key: str, m: float, unit: str = "x", k: str | None = None, term: str | None = None):
            vals = [V[key] if k is None else V["per_step"][k][term] for V in (E, G, O, C)]
            print(
                f"  {label:32s}" + "".join(f"{v:>10.2f}{unit}" for v in vals) + f"{m:>9.2f}{unit}"
                f"{100 * (vals[3] - m) / m:>19.1f}%"
            )

        cmp("april2/sync tok/s, wall-clock", "pred_wall", cal["meas_wall"])
        cmp("april2/sync tok/s, rollout time", "pred_rollout", cal["meas_rollout"])
        for k, measured_arm in (("sync", S), ("april2", A)):
            for term, key in (("step", "step_s_mean"), ("rollout", "rollout_s_mean"), ("learner", "learner_s_mean")):
                cmp(f"{k} {term} s / step", "", msum[measured_arm][key], " ", k, term)
        a = C["sim"]["april2"]
        print(
            f"  april2 off-policy share (sim / measured): {100 * a.off_policy_share:.1f}% / "
            f"{100 * msum[A]['off_policy']:.1f}%; max span {a.max_span} / {msum[A]['max_span']:.1f}"
        )
        pc = cal["pad_coef"]
        print(
            f"  learner by the tokens its forward runs ({1e6 * pc:.2f} us per token, {S} fit): predicts {A} "
            f"{pc * msum[A]['padded_per_step']:.3f} s/step vs measured {msum[A]['learner_s_mean']:.3f}"
        )
    print(
        f"\nbenchmark wall {total_s:.0f} s (runs {runs_s:.0f} s, model dir {model_s:.1f} s, calibration {calib_s:.1f} s, "
        f"eval {eval_s:.1f} s); load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )

    # ---- the JSON line ------------------------------------------------------------------------
    result: dict = {"smoke": True} if args.smoke else {}

    def put(name: str, s: dict[str, float], digits: int, with_range: bool = False) -> None:
        r = lambda x: None if not math.isfinite(x) else round(x, digits)
        result[name] = r(s["mean"])
        result[f"{name}_mean"] = r(s["mean"])
        result[f"{name}_std"] = r(s["std"])
        if with_range:
            result[f"{name}_min"] = r(s["min"])
            result[f"{name}_max"] = r(s["max"])

    units = {"wall_tok_s": "wall", "trained_tok_s": "trained", "rollout_tok_s": "rollout", "loop_tok_s": "loop_wall"}
    # The lead: wall-clock ratios, then the frozen pair's, then the rollout-time ratios.
    for arm in headline_arms:
        for key in ("wall_tok_s", "trained_tok_s", "rollout_tok_s"):
            put(f"{arm}_over_{baseline_of(arm)}_{units[key]}_tokens_per_s_ratio", ratio_spread(arm, key), 3, True)
    result.update(
        runs_per_arm=args.runs,
        launcher=args.launcher,
        steps=args.steps,
        warmup_steps_excluded=args.warmup_steps,
        arms=arms,
        order="rounds: " + " ".join(arms),
        rollout_clock="stops when the abort completes (APRIL) / the batch is complete (sync)",
    )
    for arm in arms:
        if arm == baseline_of(arm):
            continue
        for key in ("wall_tok_s", "trained_tok_s", "rollout_tok_s", "loop_tok_s"):
            if any(math.isnan(s[key]) for s in sums[arm]):
                continue
            put(f"{arm}_over_{baseline_of(arm)}_{units[key]}_tokens_per_s_ratio", ratio_spread(arm, key), 3, True)
        put(f"{arm}_over_{baseline_of(arm)}_step_time_ratio", ratio_spread(arm, "step_s_mean"), 3, True)
    for arm in arms:
        for key, name in (
            ("wall_tok_s", "wall_tokens_per_s"),
            ("trained_tok_s", "trained_tokens_per_s"),
            ("rollout_tok_s", "rollout_tokens_per_s"),
            ("loop_tok_s", "loop_wall_tokens_per_s"),
        ):
            if not any(math.isnan(s[key]) for s in sums[arm]):
                put(f"{arm}_{name}", fig(arm, key), 1, True)
        if not any(math.isnan(s["clock_coverage"]) for s in sums[arm]):
            put(f"{arm}_clock_token_coverage", fig(arm, "clock_coverage"), 4)
        put(f"{arm}_step_time_s", fig(arm, "step_s_mean"), 4)
        put(f"{arm}_rollout_s_per_step", fig(arm, "rollout_s_mean"), 4)
        put(f"{arm}_abort_s_per_step", fig(arm, "abort_s_mean"), 4)
        put(f"{arm}_learner_s_per_step", fig(arm, "learner_s_mean"), 4)
        put(f"{arm}_weight_push_s_per_step", fig(arm, "sync_s_mean"), 4)
        put(f"{arm}_learner_model_tflops", fig(arm, "learner_model_tflops"), 4)
        if not any(math.isnan(s["learner_mfu"]) for s in sums[arm]):
            put(f"{arm}_learner_mfu", fig(arm, "learner_mfu"), 4)
        put(f"{arm}_engine_busy_fraction", fig(arm, "engine_busy"), 3)
        if not any(math.isnan(s["engine_busy_in_rollout"]) for s in sums[arm]):
            put(f"{arm}_engine_busy_fraction_during_rollout", fig(arm, "engine_busy_in_rollout"), 3)
            put(f"{arm}_worker_buffer_io_fraction_during_rollout", fig(arm, "buffer_io_in_rollout"), 3)
        put(f"{arm}_mean_decode_batch", fig(arm, "mean_decode_batch"), 1)
        put(f"{arm}_learner_busy_fraction", fig(arm, "learner_busy"), 3)
        if arm.startswith("april") or arm == "ppo_streaming":
            put(f"{arm}_off_policy_token_share", fig(arm, "off_policy"), 3)
            put(f"{arm}_max_version_span", fig(arm, "max_span"), 2)
            put(f"{arm}_max_version_lag", fig(arm, "max_lag"), 2)
            put(f"{arm}_resumed_samples_per_step", fig(arm, "resumed_per_step"), 2)
            put(f"{arm}_wasted_tokens", fig(arm, "wasted_tokens"), 1)
        put(f"{arm}_train_reward_first5", fig(arm, "reward_first5"), 3)
        put(f"{arm}_train_reward_last5", fig(arm, "reward_last5"), 3)
        put(f"{arm}_heldout_reward", fig(arm, "heldout"), 3)
    result["initial_heldout_reward"] = round(initial_eval, 3)
    if cal is not None:
        E, G, O, C = cal["empirical"], cal["grouped"], cal["overhead"], cal["calibrated"]
        e = engine
        result.update(
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
        )
    result["benchmark_wall_s"] = round(total_s, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
