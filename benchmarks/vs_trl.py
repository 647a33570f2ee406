"""Wall-clock time to a reward threshold: our GRPO job vs TRL's `GRPOTrainer`, side by side, CPU.

Both sides start from the same weakly warm-started tiny Qwen3-MoE (`ensure_model_dir` with
`model.warmstart.steps=100`), train on the same prompts (`envs.repeat.make_dataset(2000, seed=0)`,
plain text, no chat template) with the same reward (`envs.repeat.reward`) and batch shape:

    16 prompts x 8 samples = 128 completions per optimizer step, max 96 new tokens,
    temperature 1.0, top_p 1, AdamW lr 1e-3 (constant), grad clip 1.0, no KL (beta=0),
    clip 0.2 low / 0.28 high, token-mean loss over completion tokens of the whole batch,
    group-std-normalised advantages, MoE router aux loss 0.001 (MoE models), no gradient checkpointing,
    float32, no checkpoints, no external loggers.

Our side: `RunningJob` + `sync_loop` from `slime.train` (exactly what `train(cfg)` runs for
mode=sync) with default cluster settings (1 rollout worker + 1 learner Ray actor, 1 torch thread
each), so the loop can be stopped at the threshold or the budget.
TRL side: in-process, `torch.set_num_threads(--trl-threads)`, default transformers `generate` path (no vLLM),
per_device_train_batch_size=32 x gradient_accumulation_steps=4 (TRL counts completions, not
prompts; the generation batch defaults to 32 x 4 = 128 = 16 prompts x num_generations 8, generated
once per optimizer step).

Threads: our two actors use 1 torch thread each and, in sync mode, mostly take turns, so about one
core computes at a time; TRL gets 1 thread by default for the same reason. `--trl-threads 2` is
allowed, but on a 2-core box that also runs anything else, 2 intra-op threads for this tiny model
are many times slower than 1 (HF generate of 128 x 48 tokens: ~0.5 s with 1 thread, 1-10 s with 2),
so that setting measures CPU contention rather than TRL.

Clock: both sides start at their first training step. Excluded: building/warm-starting the model,
imports, and framework start-up (ours: Redis, Ray, actors loading the model, first weight publish;
TRL: dataset, config, trainer construction, and Trainer.train's set-up before `on_train_begin`).
Each side stops when the 5-step moving average of the batch-mean reward reaches the threshold,
or at the wall-clock budget.

    python benchmarks/vs_trl.py [--threshold 0.45] [--budget-s 240] [--sides slime,trl] [--trl-threads 1]
                                [--model qwen3_moe|qwen2_moe|llama] [--slime-mode sync|async] [--seeds 1]

Models (`--model`): `qwen3_moe`, the project's default tiny MoE; `qwen2_moe`, a Qwen2-MoE with 8
experts plus a shared expert (2.2M parameters); `llama`, a dense Llama (3.2M). Each is built from
its transformers config with the char tokenizer and given the same 100-step warm start, then both
sides load it from one directory. `--slime-mode async` runs our side in async mode (staleness 1);
the default is the project's default, sync. `--seeds N` runs N seeds per side, alternating
(slime, trl, slime, trl, ...), and reports mean and sd. `--set KEY=VALUE` (repeatable) overrides
our side's config only, e.g. `--set algorithm.correction.name=behaviour_clip`.

    python benchmarks/vs_trl.py --model qwen2_moe --slime-mode async --seeds 3

`--prompts`, `--samples`, `--max-new-tokens` change the batch shape of both sides (a small batch,
e.g. 4 x 8 x 64, shows each side's fixed cost per step); `--launcher local` runs our side's learner
and worker on threads of this process instead of Ray actors.

Prints a small table, then LAST one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS, SAMPLES, MAX_NEW, LR, WARMSTART_STEPS = 16, 8, 96, 1e-3, 100
NUM_PROMPTS, DATA_SEED = 2000, 0


def moving_average_crossing(times: list[float], rewards: list[float], window: int, threshold: float, budget: float):
    """(seconds when the trailing `window`-step mean first reaches `threshold` within budget, last full-window mean)."""
    crossed, last_ma = None, None
    for i in range(window - 1, len(rewards)):
        ma = sum(rewards[i - window + 1 : i + 1]) / window
        last_ma = ma
        if crossed is None and ma >= threshold and times[i] <= budget:
            crossed = times[i]
    return crossed, last_ma


class _Stop(Exception):
    pass


def should_stop(times: list[float], rewards: list[float], args) -> bool:
    if times and times[-1] >= args.budget_s:
        return True
    if args.full_budget:
        return False
    return moving_average_crossing(times, rewards, args.window, args.threshold, args.budget_s)[0] is not None


def run_slime(args, out_dir: str, model_path: str | None, seed: int) -> dict:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from slime.config import load_config
    from slime.train import LOOPS, RunningJob

    cfg = load_config(
        None,
        [
            f"model.warmstart.steps={WARMSTART_STEPS}",
            *([f"model.path={model_path}"] if model_path else []),
            f"mode={args.slime_mode}",
            f"seed={seed}",
            "model.seed=0",  # the model TRL trains too: seed varies sampling only
            f"rollout.batch_size={PROMPTS}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_new_tokens={MAX_NEW}",
            f"learner.lr={LR}",
            f"steps={args.max_steps}",
            f"data.num_generated={NUM_PROMPTS}",
            f"data.seed={DATA_SEED}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            f"output_dir={out_dir}",
            *args.set,
        ],
    )
    t_start = time.time()
    times: list[float] = []
    rewards: list[float] = []
    with RunningJob(cfg) as job:
        startup = time.time() - t_start
        original_end_step = job.end_step

        def end_step(step: int, metrics: dict) -> None:
            original_end_step(step, metrics)
            last = job.logger.history[-1]
            times.append(last["wall_seconds"])
            rewards.append(last["reward_mean"])
            if args.verbose:
                print(f"  slime step {step:3d} t={times[-1]:6.1f}s reward={rewards[-1]:.3f}", flush=True)
            if should_stop(times, rewards, args):
                raise _Stop

        job.end_step = end_step
        try:
            LOOPS[cfg.loop_mode](job)
        except _Stop:
            pass
        history = job.logger.history
    completions = sum(h.get("samples", PROMPTS * SAMPLES) for h in history)
    return {
        "startup_s": startup,
        "times": times,
        "rewards": rewards,
        "completions": completions,
        "threads": cfg.cluster.torch_threads,
    }


def run_trl(args, model_dir: str, out_dir: str, seed: int) -> dict:
    import torch

    torch.set_num_threads(args.trl_threads)
    t_start = time.time()
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs import repeat

    def repeat_reward(prompts, completions, label, **kwargs) -> list[float]:
        return [repeat.reward(p, c, lab) for p, c, lab in zip(prompts, completions, label)]

    times: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        started = None

        def on_train_begin(self, a, state, control, **kw):
            self.started = time.time()

        def on_log(self, a, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return control
            times.append(time.time() - self.started)
            rewards.append(float(logs["reward"]))
            if args.verbose:
                print(f"  trl   step {state.global_step:3d} t={times[-1]:6.1f}s reward={rewards[-1]:.3f}", flush=True)
            if should_stop(times, rewards, args):
                control.should_training_stop = True
            return control

    dataset = Dataset.from_list(repeat.make_dataset(NUM_PROMPTS, DATA_SEED))
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=seed,
        max_steps=args.max_steps,
        # 128 completions per optimizer step: 32 per micro-batch x 4 accumulation steps, generated at once.
        per_device_train_batch_size=PROMPTS * SAMPLES // 4,
        gradient_accumulation_steps=4,
        num_generations=SAMPLES,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        num_iterations=1,
        loss_type="dapo",  # token mean over the whole accumulated batch (= our token_mean)
        scale_rewards="group",
        # our algorithm.router_aux_coef; TRL refuses it for a dense model
        **({"router_aux_loss_coef": 0.001} if args.model != "llama" else {}),
        gradient_checkpointing=False,
        use_vllm=False,
        dataloader_num_workers=0,
    )
    assert config.generation_batch_size == PROMPTS * SAMPLES and config.steps_per_generation == 4
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    timer = Timer()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; --verbose prints a short line instead
    trainer.train()
    startup = timer.started - t_start
    return {"startup_s": startup, "times": times, "rewards": rewards, "completions": PROMPTS * SAMPLES * len(times)}


def build_model(name: str, root: str) -> str | None:
    """The model directory both sides load: None for the project's default (our side builds and
    caches it; TRL gets the cached path), else `name` from its config, warm-started the same way."""
    if name == "qwen3_moe":
        return None
    from benchmarks import models as zoo

    return str(zoo.build_warmstarted(name, Path(root) / name, [f"model.warmstart.steps={WARMSTART_STEPS}"]))


def summarize(name: str, res: dict, args) -> dict:
    times, rewards = res["times"], res["rewards"]
    crossed, last_ma = moving_average_crossing(times, rewards, args.window, args.threshold, args.budget_s)
    elapsed = times[-1] if times else float("nan")
    return {
        f"{name}_seconds_to_threshold": None if crossed is None else round(crossed, 1),
        f"{name}_steps": len(times),
        f"{name}_train_seconds": round(elapsed, 1),
        f"{name}_startup_seconds": round(res["startup_s"], 1),
        f"{name}_seconds_per_step": round(elapsed / len(times), 2) if times else None,
        f"{name}_completions_per_s": round(res["completions"] / elapsed, 2) if times else None,
        f"{name}_first_reward": round(rewards[0], 3) if rewards else None,
        f"{name}_final_reward_ma5": None if last_ma is None else round(last_ma, 3),
    }


def combine(runs: list[dict]) -> dict:
    """One seed: its figures. Several: each figure's mean and sd over the seeds (a side that missed
    the threshold in a seed counts the budget there, and `*_misses` says how often)."""
    if len(runs) == 1:
        return runs[0]
    from benchmarks.spread import mean_sd

    out: dict = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        if key.endswith("_seconds_to_threshold"):
            out[key.replace("_seconds_to_threshold", "_misses")] = sum(v is None for v in values)
        numbers = [v for v in values if isinstance(v, (int, float))]
        if len(numbers) == len(values):
            mean, sd = mean_sd([float(v) for v in numbers])
            out[key], out[f"{key}_sd"] = round(mean, 3), round(sd, 3)
        else:
            out[key] = values
    return out


def main() -> None:
    global PROMPTS, SAMPLES, MAX_NEW
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold", type=float, default=0.45, help="5-step moving-average reward to reach.")
    ap.add_argument("--budget-s", type=float, default=240.0, help="Training wall-clock cap per side.")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=10000, help="Step cap (the budget normally ends a side first).")
    ap.add_argument("--sides", default="slime,trl")
    ap.add_argument("--trl-threads", type=int, default=1, help="torch threads of the in-process TRL trainer.")
    ap.add_argument("--full-budget", action="store_true", help="Keep training after the threshold until the budget.")
    ap.add_argument("--model", choices=["qwen3_moe", "qwen2_moe", "llama"], default="qwen3_moe")
    ap.add_argument("--slime-mode", choices=["sync", "async"], default="sync", help="Our side's training mode.")
    ap.add_argument("--seeds", type=int, default=1, help="Seeds per side, run alternating.")
    ap.add_argument("--verbose", action="store_true", help="Print every step.")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for our side only (repeatable), e.g. algorithm.correction.name=behaviour_clip.",
    )
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="Prompts per step (both sides).")
    ap.add_argument("--samples", type=int, default=SAMPLES, help="Completions per prompt (both sides).")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="Completion cap (both sides).")
    ap.add_argument(
        "--launcher",
        choices=("ray", "local"),
        default="ray",
        help="Our side's cluster.launcher: Ray actors, or threads of this process.",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="2 steps per side of 2 prompts x 2 samples, 8 tokens: checks it runs (not figures to quote)",
    )
    args = ap.parse_args()
    PROMPTS, SAMPLES, MAX_NEW = args.prompts, args.samples, args.max_new_tokens
    if PROMPTS * SAMPLES % 4:
        ap.error("--prompts x --samples must be a multiple of 4 (TRL's side: 4 micro-batches per step)")
    args.set = [f"cluster.launcher={args.launcher}", *args.set]
    if args.smoke:
        PROMPTS, SAMPLES, MAX_NEW = 2, 2, 8
        args.max_steps, args.window = 2, 1
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(sides) - {"slime", "trl"}:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}")

    from slime.config import load_config
    from slime.model import ensure_model_dir

    summary: dict = {
        **({"smoke": True} if args.smoke else {}),
        "model": args.model,
        "slime_mode": args.slime_mode,
        "slime_overrides": args.set,
        "seeds": args.seeds,
        "threshold_reward": args.threshold,
        "ma_window_steps": args.window,
        "budget_seconds": args.budget_s,
        "completions_per_step": PROMPTS * SAMPLES,
        "prompts_per_step": PROMPTS,
        "max_new_tokens": MAX_NEW,
        "slime_launcher": args.launcher,
        "trl_torch_threads": args.trl_threads,
    }
    tmp = tempfile.mkdtemp(prefix="vs_trl-")
    rewards: dict[str, list[list[float]]] = {side: [] for side in sides}
    try:
        t0 = time.time()
        built = build_model(args.model, tmp)
        model_dir = built or str(
            ensure_model_dir(load_config(None, [f"model.warmstart.steps={WARMSTART_STEPS}"]).model)
        )
        print(f"model {args.model}: {model_dir} (ready in {time.time() - t0:.1f}s, excluded)", flush=True)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for seed in range(args.seeds):
            for side in sides:
                print(f"running {side} (seed {seed}) ...", flush=True)
                out_dir = os.path.join(tmp, f"{side}-{seed}")
                if side == "slime":
                    res = run_slime(args, out_dir, built, seed)
                    summary["slime_torch_threads_per_actor"] = res["threads"]
                else:
                    res = run_trl(args, model_dir, out_dir, seed)
                runs[side].append(summarize(side, res, args))
                rewards[side].append([round(r, 3) for r in res["rewards"]])
        for side in sides:
            summary.update(combine(runs[side]))
            summary[f"{side}_reward_per_step"] = rewards[side] if args.seeds > 1 else rewards[side][0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    a, b = summary.get("slime_seconds_to_threshold"), summary.get("trl_seconds_to_threshold")
    if args.seeds > 1:  # the ratio of the means, over seeds where both sides crossed
        pairs = [
            (r_s["slime_seconds_to_threshold"], r_t["trl_seconds_to_threshold"])
            for r_s, r_t in zip(runs.get("slime", []), runs.get("trl", []))
            if r_s["slime_seconds_to_threshold"] and r_t["trl_seconds_to_threshold"]
        ]
        summary["seeds_both_crossed"] = len(pairs)
        a = sum(p[0] for p in pairs) / len(pairs) if pairs else None
        b = sum(p[1] for p in pairs) / len(pairs) if pairs else None
    summary["trl_over_slime_time_ratio"] = (
        round(b / a, 2) if isinstance(a, float | int) and isinstance(b, float | int) and a else None
    )
    if args.seeds == 1 and a and b is None and "trl_steps" in summary:  # TRL missed the bar: a lower bound
        summary["trl_over_slime_time_ratio_at_least"] = round(args.budget_s / a, 2)
    sp_s, sp_t = summary.get("slime_seconds_per_step"), summary.get("trl_seconds_per_step")
    if isinstance(sp_s, float | int) and isinstance(sp_t, float | int) and sp_s:
        summary["trl_over_slime_step_time_ratio"] = round(sp_t / sp_s, 2)

    print(
        f"\n{args.model}, slime {args.slime_mode}, {args.seeds} seed(s): threshold 5-step MA >= {args.threshold}, "
        f"budget {args.budget_s:.0f}s per side"
    )
    cols = [
        "seconds_to_threshold",
        "steps",
        "seconds_per_step",
        "completions_per_s",
        "first_reward",
        "final_reward_ma5",
        "startup_seconds",
    ]
    print(f"{'':22s}" + "".join(f"{s:>12s}" for s in sides))
    for c in cols:
        print(f"{c:22s}" + "".join(f"{summary.get(f'{s}_{c}')!s:>12s}" for s in sides))
    ratio = summary["trl_over_slime_time_ratio"]
    if ratio is None and "trl_over_slime_time_ratio_at_least" in summary:
        ratio = f">= {summary['trl_over_slime_time_ratio_at_least']}"
    print(f"{'trl/slime time ratio':22s}{ratio!s:>12s}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
