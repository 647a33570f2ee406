"""Full fine-tuning against LoRA (rank 8 and 64) in RL: the learner's memory and step, the weight
push, and the reward against wall-clock (issue 35).

Part 1, the learner (one in-process `Learner`, a real redis-server for its buffer, no Ray): GRPO
updates on a fixed batch of 4 prompts x 8 samples (responses 4 + Exp(14) tokens, capped at 64).
Per arm: parameters, gradients and AdamW state in bytes (`Learner.memory()`, after an update),
the peak RSS of the arm's own process (each arm runs in a fresh one), the update's seconds, and one weight push
(`publish_weights`: its bytes and seconds). Models, random-init from their transformers configs:
- qwen3_moe: the example's model, the project's default tiny MoE (1.8M parameters);
- llama: one more family, a dense Llama (3.2M);
- llama_58m: a dense Llama of 58M parameters with a 32,000-token vocabulary (the ratio on a model
  whose size comes from real layers); fewer timed updates.
LoRA targets the attention projections (q, k, v, o), alpha = 2 x rank; on the MoE the experts
are fused 3-D parameters that LoRA cannot target (docs/learner.md, "LoRA"). Arms alternate within
each round (full, lora8, lora64), `--rounds` rounds.

Part 2, the example task (the example job's shape: tiny MoE, GRPO, the repeat task, 16 prompts x 8
samples, 96 new tokens; `cluster.launcher=local` so no Ray start-up is timed): full fine-tuning at
the example's learning rate (5e-4) against LoRA rank 8 and 64 at LoRA's own (1e-3, alpha = 2 x
rank), `--seeds` seeds each, alternating (full, lora8, lora64, full, ...), `--steps` steps per run.
The figures: the final reward (mean of the last 5 steps), its spread over seeds, and the
wall-clock at which each arm's seed-mean curve (5-step moving average) first reaches full
fine-tuning's final reward minus its seed spread (sd), as a ratio of full fine-tuning's
wall-clock. LoRA's rate was fixed before these runs, by a one-seed pilot on a seed the runs do not
use (docs/benchmarks.md); nothing is picked from these runs.

    python benchmarks/lora.py [--rounds 3] [--seeds 3] [--steps 60] [--lora-lr 1e-3]

Prints tables, then LAST one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks import models as zoo  # noqa: E402
from benchmarks.families import tiny_model  # noqa: E402
from benchmarks.learner_step import fixed_batch  # noqa: E402
from benchmarks.spread import mean_sd  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.config import TinyModelConfig, load_config  # noqa: E402
from slime.learner import Learner  # noqa: E402
from slime.model import build_char_tokenizer, build_tiny_moe  # noqa: E402

PROMPTS, SAMPLES, MAX_NEW = 4, 8, 64
ARMS = {"full": None, "lora8": 8, "lora64": 64}
TARGETS = "[q_proj,k_proj,v_proj,o_proj]"


def lora_overrides(rank: int | None) -> list[str]:
    if rank is None:
        return []
    return [f"learner.lora.rank={rank}", f"learner.lora.alpha={2 * rank}", f"learner.lora.target_modules={TARGETS}"]


# ---- part 1: the learner ---------------------------------------------------------------------------
def build_models(root: Path, names: list[str]) -> dict[str, Path]:
    tokenizer = build_char_tokenizer()
    vocab = len(tokenizer)
    builders = {
        "qwen3_moe": lambda: build_tiny_moe(TinyModelConfig(), vocab),
        "llama": lambda: zoo.build("llama", vocab),
        "llama_58m": lambda: tiny_model(
            "llama",
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
        ),
    }
    dirs = {}
    for name in names:
        model = builders[name]()
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def learner_arm(arm: str, model_dir: Path, redis_url: str, steps: int, out_dir: Path) -> dict:
    """One arm in this process (a fresh one per arm: its peak RSS is the arm's own)."""
    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [
            f"job_name=lora-bench-{arm}",
            f"output_dir={out_dir}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            "cluster.torch_threads=1",
            *lora_overrides(ARMS[arm]),
        ],
    )
    learner = Learner(cfg, str(model_dir), redis_url)
    samples, group_ids = fixed_batch(102, "long_tail")  # learner_step.py's batch
    learner.update(samples, group_ids, 0)  # warm-up: AdamW's state exists from here
    times = []
    for step in range(steps):
        start = time.perf_counter()
        learner.update(samples, group_ids, step + 1)
        times.append(time.perf_counter() - start)
    memory = learner.memory()
    start = time.perf_counter()
    handle = learner.publish_weights()
    push_s = time.perf_counter() - start
    out = {
        "step_s": float(np.mean(times)),
        "param_bytes": memory["param_bytes"],
        "grad_bytes": memory["grad_bytes"],
        "optimizer_bytes": memory["optimizer_bytes"],
        "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        "push_bytes": float(handle.total_bytes),
        "push_s": push_s,
    }
    learner.buffer.delete_job()
    learner.close()
    return out


def learner_arm_in_subprocess(arm: str, model_dir: Path, redis_url: str, steps: int, out_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--learner-arm", arm, "--model-dir", str(model_dir), "--redis-url", redis_url]
    proc = subprocess.run(
        [*cmd, "--learner-steps", str(steps), "--out-dir", str(out_dir)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"learner arm {arm} on {model_dir.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def part_learner(args, tmp: Path, redis_url: str) -> dict[str, dict[str, list[dict]]]:
    names = ["qwen3_moe"] if args.smoke else ["qwen3_moe", "llama", "llama_58m"]
    dirs = build_models(tmp / "models", names)
    runs: dict[str, dict[str, list[dict]]] = {m: {a: [] for a in ARMS} for m in names}
    for r in range(args.rounds):
        for model in names:
            steps = 1 if model == "llama_58m" or args.smoke else args.learner_steps
            for arm in ARMS:
                # --smoke: in this process (its peak RSS is then not the arm's own; not a figure to quote)
                run_arm = learner_arm if args.smoke else learner_arm_in_subprocess
                res = run_arm(arm, dirs[model], redis_url, steps, tmp / "learner")
                runs[model][arm].append(res)
                print(
                    f"round {r} {model:10s} {arm:7s} step {res['step_s'] * 1000:8.1f} ms  optimizer "
                    f"{res['optimizer_bytes'] / 2**20:8.2f} MiB  push {res['push_bytes'] / 2**20:8.2f} MiB "
                    f"in {res['push_s'] * 1000:.1f} ms",
                    flush=True,
                )
    return runs


# ---- part 2: the example task ----------------------------------------------------------------------
def job_run(arm: str, seed: int, args, tmp: Path) -> dict:
    from slime.train import train

    lr = [f"learner.lr={args.full_lr if ARMS[arm] is None else args.lora_lr}"]
    cfg = load_config(
        None,
        [
            "cluster.launcher=local",
            f"job_name=lora-{arm}-s{seed}",
            f"output_dir={tmp / 'jobs' / f'{arm}-s{seed}'}",
            f"seed={seed}",
            "model.seed=0",  # one base model for every run: the seed moves the data and sampling
            f"steps={args.steps}",
            f"rollout.batch_size={args.batch_size}",
            "rollout.n_samples_per_prompt=8",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            *lora_overrides(ARMS[arm]),
            *lr,
        ],
    )
    history = train(cfg)
    return {
        "rewards": [h.get("reward_mean", float("nan")) for h in history],
        "wall": [h["wall_seconds"] for h in history],
        "learner_s": statistics.fmean(h["learner_seconds"] for h in history),
        "push_s": statistics.fmean(h.get("weight_sync_seconds", 0.0) for h in history),
        "push_bytes": statistics.fmean(h.get("weight_push_bytes", float("nan")) for h in history),
    }


def smoothed(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def part_job(args, tmp: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    for seed in range(args.seeds):
        for arm in ARMS:
            res = job_run(arm, seed, args, tmp)
            runs[arm].append(res)
            print(
                f"seed {seed} {arm:7s} final reward {statistics.fmean(res['rewards'][-5:]):.3f} "
                f"wall {res['wall'][-1]:6.1f} s  learner {res['learner_s']:.3f} s/step",
                flush=True,
            )
    return runs


def job_figures(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    finals = {a: [statistics.fmean(r["rewards"][-5:]) for r in rs] for a, rs in runs.items()}
    full_final, full_sd = mean_sd(finals["full"])
    full_wall = statistics.fmean(r["wall"][-1] for r in runs["full"])
    for arm, rs in runs.items():
        mean, sd = mean_sd(finals[arm])
        wall = statistics.fmean(r["wall"][-1] for r in rs)
        out[f"{arm}_final_reward"], out[f"{arm}_final_reward_sd"] = round(mean, 4), round(sd, 4)
        out[f"{arm}_wall_s"] = round(wall, 2)
        out[f"{arm}_learner_s_per_step"] = round(statistics.fmean(r["learner_s"] for r in rs), 4)
        out[f"{arm}_push_s_per_step"] = round(statistics.fmean(r["push_s"] for r in rs), 5)
        steps = min(len(r["rewards"]) for r in rs)
        curve = smoothed([statistics.fmean(r["rewards"][i] for r in rs) for i in range(steps)])
        walls = [statistics.fmean(r["wall"][i] for r in rs) for i in range(steps)]
        reached = next((walls[i] for i, v in enumerate(curve) if v >= full_final - full_sd), None)
        out[f"{arm}_wall_to_full_final_ratio"] = None if reached is None else round(reached / full_wall, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="part 1: rounds of the learner arms")
    ap.add_argument("--learner-steps", type=int, default=2, help="part 1: timed updates per arm")
    ap.add_argument("--seeds", type=int, default=3, help="part 2: seeds per arm")
    ap.add_argument("--steps", type=int, default=60, help="part 2: steps per run")
    ap.add_argument("--batch-size", type=int, default=16, help="part 2: prompts per step (8 samples each)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--full-lr", type=float, default=5e-4, help="part 2: full fine-tuning's (the example's)")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="part 2: LoRA's (a pilot's pick, docs/benchmarks.md)")
    ap.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    ap.add_argument("--learner-arm", choices=list(ARMS), help=argparse.SUPPRESS)  # part 1's child process
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.learner_arm:
        print(
            json.dumps(learner_arm(args.learner_arm, args.model_dir, args.redis_url, args.learner_steps, args.out_dir))
        )
        return
    if args.smoke:
        args.rounds, args.learner_steps, args.seeds, args.steps = 1, 1, 1, 2
        args.batch_size, args.max_new_tokens = 2, 16
    torch.set_num_threads(1)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp_dir, LocalRedisServer(Path(tmp_dir) / "redis", aof=False) as redis:
        tmp = Path(tmp_dir)
        learner_runs = part_learner(args, tmp, redis.url)
        job_runs = part_job(args, tmp)
    line: dict = {**({"smoke": True} if args.smoke else {}), "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    print(
        f"\n{'model':10s} {'arm':7s} {'step ms':>14s} {'grad+opt MiB':>13s} {'vs full':>8s} {'push MiB':>9s} {'vs full':>8s}"
    )
    for model, arms in learner_runs.items():
        full = arms["full"][0]
        for arm, rs in arms.items():
            step_mean, step_sd = mean_sd([r["step_s"] * 1000 for r in rs])
            state = rs[0]["grad_bytes"] + rs[0]["optimizer_bytes"]
            full_state = full["grad_bytes"] + full["optimizer_bytes"]
            share, push_share = state / full_state, rs[0]["push_bytes"] / full["push_bytes"]
            print(
                f"{model:10s} {arm:7s} {step_mean:8.1f} ± {step_sd:4.1f} {state / 2**20:13.3f} {share:8.3f} "
                f"{rs[0]['push_bytes'] / 2**20:9.3f} {push_share:8.3f}"
            )
            key = f"{model}_{arm}"
            line[f"{key}_learner_step_ms"], line[f"{key}_learner_step_ms_sd"] = round(step_mean, 2), round(step_sd, 2)
            line[f"{key}_param_bytes"] = rs[0]["param_bytes"]
            line[f"{key}_grad_plus_optimizer_bytes"] = state
            line[f"{key}_grad_plus_optimizer_share_of_full"] = round(share, 4)
            line[f"{key}_peak_rss_mib"] = round(statistics.fmean(r["peak_rss_bytes"] for r in rs) / 2**20, 1)
            line[f"{key}_push_bytes"] = rs[0]["push_bytes"]
            line[f"{key}_push_share_of_full"] = round(push_share, 4)
            line[f"{key}_push_ms"] = round(statistics.fmean(r["push_s"] for r in rs) * 1000, 2)
    figures = job_figures(job_runs)
    print(f"\nexample task, {args.seeds} seeds x {args.steps} steps (LoRA lr {args.lora_lr:g}):")
    for arm in ARMS:
        print(
            f"  {arm:7s} final reward {figures[f'{arm}_final_reward']:.3f} ± {figures[f'{arm}_final_reward_sd']:.3f}  "
            f"wall {figures[f'{arm}_wall_s']:.1f} s  to full's final-sd: {figures[f'{arm}_wall_to_full_final_ratio']}"
        )
    line.update({f"example_{k}": v for k, v in figures.items()})
    line["full_lr"], line["lora_lr"], line["steps"], line["seeds"] = args.full_lr, args.lora_lr, args.steps, args.seeds
    line["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
