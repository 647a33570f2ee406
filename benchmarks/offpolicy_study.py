"""Which off-policy correction lets APRIL learn as well as sync: wall-clock to a held-out reward.

Every run is one real job (driver, Redis buffer, Ray learner + 1 rollout worker, tiny MoE with the
default warm start, the long-tail repeat task, batch 16 x 8, 96-token cap), the shape of
benchmarks/april_vs_sync.py. Arms:

    sync         APRIL off, the synchronous baseline
    april2       APRIL, oversample 2.0, no staleness budget, under a correction (algorithm.correction.name)
    async2       mode=async, max_staleness=2, under a correction
    april2_auto  april2 with the off-policy controller (algorithm.correction.auto): it sets APRIL's
                 max_version_span and the correction's tis_cap each step from the measured mismatch
    async2_auto  async2 with the controller: it sets max_staleness (admission) and tis_cap

--perturb KIND[:SCALE] makes every arm's engine sample from a perturbed policy
(rollout.behaviour_perturbation: bf16_logits, temperature_noise), a train-inference gap on purpose.

Each run saves a checkpoint every --eval-every steps; after all runs (off the training clock) every
checkpoint is scored on the same held-out prompts twice: greedy, and sampled (T = 1, --eval-samples
per prompt, a fixed seed), both unperturbed. Two measures of time to reward, side by side:

  time to 90% of sync's gain (the robust one, benchmarks/gain.py): threshold = initial held-out
      reward + 0.9 x (sync's final - initial); each run's curve smoothed by a trailing running mean
      over --smooth checkpoints (3; the point at 0 s included), sync's final read on its smoothed
      curves (mean over seeds); per run, the wall-clock of the first checkpoint whose smoothed value
      reaches the threshold; then mean ± sample std over the seeds that reached it (k/n)
  time to sync's final (the old one): the first checkpoint where the arm's mean curve over seeds
      (mean reward against mean wall-clock) reaches sync's final mean held-out reward

"sync then" is sync's mean curve read at the arm's own final wall-clock.

Order: seed by seed, learning rate by learning rate, the arms alternating (A B C A B C ...), one
Redis server and one Ray for all runs, each job under its own name.

    python benchmarks/offpolicy_study.py                     # the defaults' comparison, < 10 min here
    python benchmarks/offpolicy_study.py --corrections all   # every correction for april2 and async2
    python benchmarks/offpolicy_study.py --corrections tis,icepop --arms april2 --lrs 1e-3 --seeds 2
    python benchmarks/offpolicy_study.py --arm april2_restart=april.enabled=true,april.max_version_span=0
    python benchmarks/offpolicy_study.py --perturb temperature_noise:0.1   # the controller against a gap
    python benchmarks/offpolicy_study.py --model llama   # a dense Llama instead of the tiny MoE
    python benchmarks/offpolicy_study.py --quick    # = --smoke: sync and both auto arms, 1 seed, 2 steps

An --arm NAME=KEY=VALUE,KEY=VALUE adds an arm of your own (run under the default correction unless it
sets algorithm.correction.name itself). Each run's per-step metrics are kept in OUT/histories.json.

Prints a table per score (greedy, sampled), then LAST one JSON line (names carry units).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks.gain import gain_threshold, sync_final_smoothed, time_to_gain
from slime.algorithms.offpolicy_controller import Reason
from slime.config import CorrectionConfig, load_config

SHAPE = [
    "rollout.num_workers=1",
    "rollout.batch_size=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=96",
    "rollout.temperature=1.0",
    "rollout.max_running_requests=256",
    "logging.tensorboard=false",
    "logging.plot=false",
    "logging.progress=false",
]
ARMS: dict[str, list[str]] = {
    "sync": ["april.enabled=false"],
    "april2": ["april.enabled=true", "april.oversample=2.0"],
    "async2": ["mode=async", "max_staleness=2", "april.enabled=false"],
    "april2_auto": ["april.enabled=true", "april.oversample=2.0", "algorithm.correction.auto.enabled=true"],
    "async2_auto": ["mode=async", "max_staleness=2", "april.enabled=false", "algorithm.correction.auto.enabled=true"],
}
AUTO_KEYS = ("tis_cap", "max_staleness", "max_version_span")  # offpolicy_auto/* settings a run ends with
ALL_CORRECTIONS = list(typing.get_args(CorrectionConfig.model_fields["name"].annotation))
DEFAULT_CORRECTION = CorrectionConfig().name


def run_job(name: str, overrides: list[str], args, redis_url: str) -> dict:
    from slime.train import LOOPS, RunningJob

    cfg = load_config(
        None,
        [
            f"job_name=study-{name}",
            f"output_dir={args.out}/{name}",
            f"steps={args.steps}",
            f"checkpoint.every_steps={args.eval_every}",
            f"buffer.url={redis_url}",
            *SHAPE,
            *args.set,
            *overrides,
        ],
    )
    with RunningJob(cfg) as job:
        loop_start = time.time() - job.logger.started  # on the logger's clock
        LOOPS[cfg.loop_mode](job)
        history = list(job.logger.history)
        run_dir = job.run_dir
        buffer = job.buffer
    buffer.delete_job()
    wall = {int(h["step"]): h["wall_seconds"] - loop_start for h in history}
    checkpoints = {0: (None, 0.0)}
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        steps_done = int(path.name.split("_")[1])
        if (path / "driver_state.json").exists():
            checkpoints[steps_done] = (path / "policy", wall[steps_done - 1])
    return {
        "checkpoints": checkpoints,
        "train_reward_last5": statistics.mean(h.get("reward_mean", float("nan")) for h in history[-5:]),
        "offpolicy_masked_share": statistics.mean(h.get("offpolicy_masked_share", 0.0) for h in history),
        "stale_kl": statistics.mean(h.get("mismatch_stale_kl", 0.0) for h in history),
        "loop_s": wall[max(wall)],
        "auto_final": {
            k: history[-1][f"offpolicy_auto/{k}"] for k in AUTO_KEYS if f"offpolicy_auto/{k}" in history[-1]
        },
        "auto_reasons": [int(h["offpolicy_auto/reason"]) for h in history if "offpolicy_auto/reason" in h],
        # how much the staleness budget held the rollout back (async: learner wait; APRIL: tokens restarted)
        "held_share": [h["staleness_budget_held_share"] for h in history if "staleness_budget_held_share" in h],
        "history": history,
    }


def mean_curve(runs: list[dict], scores: dict[str, float]) -> list[tuple[int, float, float]]:
    """(steps done, mean wall s, mean held-out reward) at each checkpoint every seed has."""
    common = sorted(set.intersection(*(set(r["checkpoints"]) for r in runs)))
    curve = []
    for k in common:
        wall = statistics.mean(r["checkpoints"][k][1] for r in runs)
        reward = statistics.mean(scores[str(r["checkpoints"][k][0])] for r in runs)
        curve.append((k, wall, reward))
    return curve


def time_to(curve: list[tuple[int, float, float]], threshold: float) -> float | None:
    for _, wall, reward in curve:
        if reward >= threshold - 1e-9:
            return wall
    return None


def at_wall(curve: list[tuple[int, float, float]], wall: float) -> float:
    """The curve's reward at a wall-clock, linear between checkpoints (its last value past its end)."""
    for (_, w0, r0), (_, w1, r1) in zip(curve, curve[1:]):
        if w0 <= wall <= w1:
            return r0 + (r1 - r0) * (wall - w0) / (w1 - w0) if w1 > w0 else r1
    return curve[-1][2]


def run_curve(run: dict, scores: dict[str, float]) -> list[tuple[float, float]]:
    """One run's held-out curve: (wall s, reward) at each of its checkpoints, 0 s (the start) first."""
    return [(wall, scores[str(policy)]) for _, (policy, wall) in sorted(run["checkpoints"].items())]


def report(kind: str, scores: dict[str, float], runs: dict, variants: list, lrs: list[str], args, result: dict) -> None:
    """One table per kind of held-out score; its figures go into `result` (greedy's under the plain
    names, sampled's with `_sampled` after `heldout`)."""
    tag = "" if kind == "greedy" else "_sampled"
    print(
        f"\noff-policy study: {args.steps} steps, {args.seeds} seeds, held-out = {kind} on {args.eval_prompts} prompts"
        f"; t{args.gain_pct:g} = time to {args.gain_pct:g}% of sync's gain on a running mean over {args.smooth} checkpoints"
    )
    print(
        f"{'arm':<18} {'correction':<14} {'lr':>6} {'final held-out':>15} {'sync then':>9} {'train last5':>11} "
        f"{'loop s':>7} {f't{args.gain_pct:g} (seeds)':>22} {'vs sync':>7} {'time to sync final':>18} {'vs sync':>7} "
        f"{'masked':>7} {'stale KL':>8}"
    )
    initial = scores["None"]  # every run starts from the same warm start
    share = args.gain_pct / 100
    for lr in lrs:
        sync_runs = runs.get(("sync", "-", lr))
        sync_curve = mean_curve(sync_runs, scores) if sync_runs else None
        threshold = sync_curve[-1][2] if sync_curve else None
        sync_time = time_to(sync_curve, threshold) if sync_curve else None
        gain_at = None
        if sync_runs:
            sync_final = sync_final_smoothed([run_curve(r, scores) for r in sync_runs], args.smooth)
            gain_at = gain_threshold(initial, sync_final, share)
        sync_gain = time_to_gain([run_curve(r, scores) for r in sync_runs], gain_at, args.smooth) if sync_runs else None
        for arm, corr in variants:
            group = runs[(arm, corr, lr)]
            finals = [scores[str(r["checkpoints"][max(r["checkpoints"])][0])] for r in group]
            curve = mean_curve(group, scores)
            t = time_to(curve, threshold) if threshold is not None else None
            ratio = t / sync_time if t is not None and sync_time else None
            gain = time_to_gain([run_curve(r, scores) for r in group], gain_at, args.smooth)
            gain_ratio = None
            if gain.mean_s is not None and sync_gain is not None and sync_gain.mean_s:
                gain_ratio = gain.mean_s / sync_gain.mean_s
            sync_then = at_wall(sync_curve, curve[-1][1]) if sync_curve else None  # sync at this arm's end
            fin_mean, fin_std = statistics.mean(finals), statistics.pstdev(finals)
            print(
                f"{arm:<18} {corr:<14} {lr:>6} {fin_mean:>7.3f} ± {fin_std:<5.3f} "
                f"{f'{sync_then:.3f}' if sync_then is not None else '-':>9} "
                f"{statistics.mean(r['train_reward_last5'] for r in group):>11.3f} "
                f"{statistics.mean(r['loop_s'] for r in group):>7.1f} "
                f"{gain.text():>22} {f'{gain_ratio:.2f}x' if gain_ratio is not None else '-':>7} "
                f"{f'{t:.1f} s' if t is not None else 'not reached':>18} "
                f"{f'{ratio:.2f}x' if ratio is not None else '-':>7} "
                f"{100 * statistics.mean(r['offpolicy_masked_share'] for r in group):>6.1f}% "
                f"{statistics.mean(r['stale_kl'] for r in group):>8.4f}"
            )
            key = arm if corr == "-" else f"{arm}_{corr}"
            suffix = "" if lr == "1e-3" else f"_lr{lr}"
            result[f"{key}_final_heldout{tag}_reward{suffix}"] = round(fin_mean, 3)
            result[f"{key}_final_heldout{tag}_reward_std{suffix}"] = round(fin_std, 3)
            if arm != "sync" and sync_then is not None:
                result[f"sync_heldout{tag}_reward_at_{key}_final_wall{suffix}"] = round(sync_then, 3)
            result[f"{key}_time_to_sync_final{tag}_s{suffix}"] = round(t, 1) if t is not None else None
            pct = f"{args.gain_pct:g}pct"
            result[f"{key}_time_to_{pct}_gain{tag}_s{suffix}"] = (
                round(gain.mean_s, 1) if gain.mean_s is not None else None
            )
            result[f"{key}_time_to_{pct}_gain{tag}_s_std{suffix}"] = (
                round(gain.std_s, 1) if gain.std_s is not None else None
            )
            result[f"{key}_time_to_{pct}_gain{tag}_seeds_reached{suffix}"] = gain.reached
            if arm != "sync":
                result[f"{key}_over_sync_time_to{tag}_reward_ratio{suffix}"] = round(ratio, 3) if ratio else None
                result[f"{key}_over_sync_time_to_{pct}_gain{tag}_ratio{suffix}"] = (
                    round(gain_ratio, 3) if gain_ratio is not None else None
                )
                if corr == DEFAULT_CORRECTION:
                    result[f"{arm}_over_sync_time_to{tag}_reward_ratio{suffix}"] = round(ratio, 3) if ratio else None
            if kind == "greedy":  # the controller's end state, once (it does not depend on the score)
                for name in AUTO_KEYS:
                    values = [r["auto_final"][name] for r in group if name in r["auto_final"]]
                    if values:
                        result[f"{key}_auto_final_{name}{suffix}"] = round(statistics.mean(values), 3)
                held = [x for r in group for x in r["held_share"]]
                if held:
                    result[f"{key}_auto_mean_held_share{suffix}"] = round(statistics.mean(held), 3)
        if gain_at is not None:
            result[f"heldout{tag}_{args.gain_pct:g}pct_gain_threshold{'' if lr == '1e-3' else f'_lr{lr}'}"] = round(
                gain_at, 4
            )
        for arm, corr in variants:
            curve = mean_curve(runs[(arm, corr, lr)], scores)
            print(f"  curve {arm:<18} lr {lr}: " + "  ".join(f"{w:.0f}s:{r:.3f}" for _, w, r in curve))
            if kind == "greedy":
                for r in runs[(arm, corr, lr)]:
                    if r["auto_reasons"]:
                        reasons = [Reason(c).name.lower() for c in r["auto_reasons"]]
                        counts = ", ".join(f"{n} {reasons.count(n)}" for n in dict.fromkeys(reasons))
                        held = statistics.mean(r["held_share"]) if r["held_share"] else 0.0
                        print(
                            f"  auto  {arm:<18} lr {lr}: ends at {r['auto_final']}; decisions: {counts}; "
                            f"budget held the rollout back {100 * held:.1f}% (mean over steps)"
                        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lrs", default="5e-4,1e-3")
    ap.add_argument("--arms", default="sync,april2,async2,april2_auto,async2_auto")
    ap.add_argument(
        "--corrections",
        default=DEFAULT_CORRECTION,
        help=f"for april2 and async2: comma list or 'all' ({', '.join(ALL_CORRECTIONS)})",
    )
    ap.add_argument(
        "--arm", action="append", default=[], metavar="NAME=K=V,K=V", help="an extra arm: its config overrides"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every arm, e.g. --set rollout.device=cuda (repeatable)",
    )
    ap.add_argument(
        "--perturb",
        default=None,
        metavar="KIND[:SCALE]",
        help="every arm's engine samples from a perturbed policy: bf16_logits, or temperature_noise[:SCALE] "
        "(rollout.behaviour_perturbation; the held-out scores stay unperturbed)",
    )
    ap.add_argument("--smooth", type=int, default=3, help="checkpoints in the running mean of the gain measure")
    ap.add_argument("--gain-pct", type=float, default=90.0, help="the gain measure's share of sync's gain, in %%")
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per prompt of the sampled held-out score")
    ap.add_argument(
        "--model",
        choices=["qwen3_moe", "qwen2_moe", "llama"],
        default="qwen3_moe",
        help="the family every arm trains: the project's default tiny MoE, or benchmarks/models.py's Qwen2-MoE "
        "or dense Llama (built and warm-started once, off the clock)",
    )
    ap.add_argument("--out", default="outputs/bench-offpolicy-study")
    ap.add_argument(
        "--smoke",
        "--quick",
        dest="smoke",
        action="store_true",
        help="sync, april2_auto and async2_auto, one seed, 2 steps of 2x2 samples, 16 tokens, output in "
        "a temporary directory: checks it runs (not figures to quote)",
    )
    args = ap.parse_args()
    if args.perturb:
        perturb_kind, _, perturb_scale = args.perturb.partition(":")
        args.set = [*args.set, f"rollout.behaviour_perturbation.kind={perturb_kind}"]
        if perturb_scale:
            args.set.append(f"rollout.behaviour_perturbation.scale={perturb_scale}")
    if args.smoke:
        import tempfile

        args.steps, args.eval_every, args.seeds, args.lrs = 2, 1, 1, "1e-3"
        args.arms = "sync,april2_auto,async2_auto"  # plain APRIL's run is april_vs_sync's smoke
        args.eval_prompts, args.eval_samples = 4, 1
        args.set = [*args.set, "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16"]
        args.out = tempfile.mkdtemp(prefix="bench-offpolicy-study-smoke-")
        atexit.register(shutil.rmtree, args.out, True)  # a smoke's runs are not kept
    started = time.time()

    import ray
    from april_vs_sync import evaluate

    from envs import repeat
    from slime.buffer.redis_server import LocalRedisServer
    from slime.model import ensure_model_dir

    corrections = ALL_CORRECTIONS if args.corrections == "all" else args.corrections.split(",")
    lrs = args.lrs.split(",")
    arms = args.arms.split(",") if args.arms else []
    for spec in args.arm:
        arm_name, _, overrides = spec.partition("=")
        if not arm_name or "=" not in overrides:
            raise SystemExit(f"--arm {spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
        ARMS[arm_name] = overrides.split(",")
        arms.append(arm_name)

    def own_correction(arm: str) -> bool:
        return arm == "sync" or any(o.startswith("algorithm.correction.name=") for o in ARMS[arm])

    variants = [(arm, corr) for arm in arms for corr in (["-"] if own_correction(arm) else corrections)]
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    load_config(None, list(args.set))  # a bad --set or --perturb fails here, before any run
    if args.model == "qwen3_moe":
        model_dir = str(ensure_model_dir(load_config(None, []).model))
    else:
        from benchmarks import models as zoo

        model_dir = str(zoo.build_warmstarted(args.model, out / f"model-{args.model}"))
        args.set = [f"model.path={model_dir}", *args.set]

    server = LocalRedisServer(out / "redis", aof=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    runs: dict[tuple[str, str, str], list[dict]] = {}
    try:
        for seed in range(args.seeds):
            for lr in lrs:
                for arm, corr in variants:
                    name = f"{arm}-{corr}-lr{lr}-s{seed}"
                    overrides = [f"seed={seed}", "model.seed=0", f"data.seed={seed}", f"learner.lr={lr}", *ARMS[arm]]
                    if corr != "-":
                        overrides.append(f"algorithm.correction.name={corr}")
                    run = run_job(name, overrides, args, server.url)
                    runs.setdefault((arm, corr, lr), []).append(run)
                    print(
                        f"[{time.time() - started:6.1f}s] {name}: {run['loop_s']:.1f}s, "
                        f"train reward last 5 {run['train_reward_last5']:.3f}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
        server.stop()

    eval_started = time.time()
    held_out = repeat.make_dataset(args.eval_prompts, seed=10_000)
    # greedy: the usual score, but where the stop token's probability is near a tie with the next
    # character the argmax decides the whole answer; sampled: the policy as it is trained (T = 1,
    # --eval-samples per prompt, a fixed seed), the unbiased twin of the train reward
    kinds = {"greedy": {}, "sampled": {}}
    for group in runs.values():
        for run in group:
            for policy, _ in run["checkpoints"].values():
                if str(policy) not in kinds["greedy"]:
                    kinds["greedy"][str(policy)] = evaluate(model_dir, policy, held_out, 1)
                    kinds["sampled"][str(policy)] = evaluate(model_dir, policy, held_out, 1, 1.0, args.eval_samples)
    eval_s = time.time() - eval_started

    result: dict[str, float | int | str | None] = {
        **({"smoke": True} if args.smoke else {}),
        "steps": args.steps,
        "seeds": args.seeds,
        "eval_prompts": args.eval_prompts,
        "eval_samples_per_prompt": args.eval_samples,
        "model": args.model,
        "overrides": " ".join(args.set),
        "perturbation": args.perturb or "none",
        "gain_smoothing_checkpoints": args.smooth,
        "initial_heldout_reward": round(kinds["greedy"]["None"], 3),
        "initial_heldout_sampled_reward": round(kinds["sampled"]["None"], 3),
    }
    for kind, scores in kinds.items():
        report(kind, scores, runs, variants, lrs, args, result)
    result["eval_s"] = round(eval_s, 1)
    result["benchmark_wall_s"] = round(time.time() - started, 1)
    (out / "result.json").write_text(json.dumps(result))
    histories = {f"{arm}-{corr}-lr{lr}": [r["history"] for r in group] for (arm, corr, lr), group in runs.items()}
    (out / "histories.json").write_text(json.dumps(histories, default=str))
    print(f"\nbenchmark wall {time.time() - started:.0f} s (eval {eval_s:.0f} s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
