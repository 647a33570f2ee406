"""Learner scaling: 1 rank against 2 ranks (FSDP2 over gloo) on the same fixed batch, for the tiny
MoE and a larger built-in config (~58M parameters).

Per arm: the learner group is started (real Ray actors, real process group), runs one warm-up
update and then `--steps` timed updates of the batch, and reports
- trained tokens per second (the batch's trainable tokens x steps / wall seconds of the updates);
- per rank: bytes of parameters + gradients + AdamW state it holds (its shards), and its resident
  set (now, and its peak: the peak includes loading the whole model before it is sharded).
Arms alternate (1, 2, 1, 2, ...), `--rounds` of each, on one Ray with the same threads per rank.
On this 2-core box each rank has one core: the speed ratio is bounded by the cores, not the code.

    python benchmarks/learner_scaling.py [--rounds 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks.spread import mean_sd  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.config import ModelConfig, TinyModelConfig, WarmstartConfig, load_config  # noqa: E402
from slime.launch.ray_cluster import RayLauncher
from slime.learner import LearnerGroup  # noqa: E402
from slime.model import ensure_model_dir  # noqa: E402
from slime.sample import Sample, Status  # noqa: E402

MODELS = {
    "tiny_moe": TinyModelConfig(),
    "moe_58m": TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, expert_hidden_size=512),
}


def fixed_batch(vocab: int, groups: int, per_group: int, seed: int = 0) -> tuple[list[Sample], list[int]]:
    """Groups of responses with long-tailed lengths and varied rewards, all from policy version 0."""
    rng = np.random.default_rng(seed)
    samples, group_ids = [], []
    for g in range(groups):
        prompt = rng.integers(6, vocab, size=16).tolist()
        for i in range(per_group):
            length = int(min(160, 16 + rng.exponential(40)))
            s = Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, max_new_tokens=length)
            s.append(rng.integers(6, vocab, size=length), -rng.random(length).astype(np.float32) - 0.5, 0)
            s.status, s.reward = Status.COMPLETED, float(rng.random())
            samples.append(s)
            group_ids.append(g)
    return samples, group_ids


def run_arm(cfg_args: list[str], model_dir: str, redis_url: str, ranks: int, batch, steps: int) -> dict:
    import ray

    cfg = load_config(None, [*cfg_args, f"learner.num_ranks={ranks}", f"job_name=scaling-{ranks}"])
    group = LearnerGroup(cfg, model_dir, redis_url, None, RayLauncher())
    samples, group_ids = batch
    try:
        refs = [ray.put(samples), ray.put(group_ids)]
        group.result([r.update.remote(*refs, 0) for r in group.ranks])  # warm-up
        started = time.perf_counter()
        for step in range(steps):
            metrics = group.result([r.update.remote(*refs, step + 1) for r in group.ranks])
        seconds = time.perf_counter() - started
        memory = [ray.get(r.memory.remote()) for r in group.ranks]
    finally:
        group.result(group.close())
        group.kill()
    state = [m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] for m in memory]
    return {
        "tokens_per_s": metrics["trained_tokens"] * steps / seconds,
        "state_bytes_per_rank": float(np.mean(state)),
        "rss_bytes_per_rank": float(np.mean([m["rss_bytes"] for m in memory])),
        "peak_rss_bytes_per_rank": float(np.mean([m["peak_rss_bytes"] for m in memory])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.models = 1, 1, "tiny_moe"
    import ray

    work = Path(tempfile.mkdtemp(prefix="learner_scaling_"))
    server = LocalRedisServer(work / "redis", aof=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    figures: dict[str, float] = {"smoke": True} if args.smoke else {}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; 1 torch thread per rank")
    try:
        for name in args.models.split(","):
            tiny = MODELS[name]
            model_dir = str(
                ensure_model_dir(
                    ModelConfig(tiny=tiny, warmstart=WarmstartConfig(enabled=False), cache_dir=str(work / "models"))
                )
            )
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
            batch = fixed_batch(config.vocab_size, groups=2, per_group=4)
            cfg_args = [
                f"output_dir={work / name}",
                "algorithm.name=grpo",
                "learner.micro_batch_size=4",
                "cluster.torch_threads=1",
            ]
            runs: dict[int, list[dict]] = {1: [], 2: []}
            for r in range(args.rounds):
                for ranks in (1, 2):
                    runs[ranks].append(run_arm(cfg_args, model_dir, server.url, ranks, batch, args.steps))
                    print(f"{name} round {r} ranks {ranks}: {runs[ranks][-1]}", flush=True)
            params_m = (
                sum(t.numel() for t in load_file(str(next(Path(model_dir).glob("*.safetensors")))).values()) / 1e6
            )
            print(f"\n{name} ({params_m:.1f}M parameters), mean ± sd over {args.rounds} alternating runs per arm:")
            print(f"{'ranks':>5} {'tokens/s':>16} {'state MB/rank':>14} {'RSS MB/rank':>12} {'peak RSS MB/rank':>17}")
            for ranks in (1, 2):
                tps = mean_sd([x["tokens_per_s"] for x in runs[ranks]])
                state = np.mean([x["state_bytes_per_rank"] for x in runs[ranks]]) / 2**20
                rss = np.mean([x["rss_bytes_per_rank"] for x in runs[ranks]]) / 2**20
                peak = np.mean([x["peak_rss_bytes_per_rank"] for x in runs[ranks]]) / 2**20
                print(f"{ranks:>5} {tps[0]:>9.0f} ± {tps[1]:<5.0f} {state:>14.1f} {rss:>12.0f} {peak:>17.0f}")
            ratio = {
                k: np.mean([x[k] for x in runs[2]]) / np.mean([x[k] for x in runs[1]])
                for k in ("tokens_per_s", "state_bytes_per_rank", "rss_bytes_per_rank", "peak_rss_bytes_per_rank")
            }
            print(
                f"2 ranks / 1 rank: tokens/s {ratio['tokens_per_s']:.2f}x (2 cores: one per rank), "
                f"state per rank {ratio['state_bytes_per_rank']:.3f}x, RSS per rank {ratio['rss_bytes_per_rank']:.2f}x"
            )
            figures[f"{name}_params_millions"] = round(float(params_m), 1)
            figures[f"{name}_tokens_per_s_1_rank"] = round(float(np.mean([x["tokens_per_s"] for x in runs[1]])), 1)
            figures[f"{name}_tokens_per_s_2_ranks"] = round(float(np.mean([x["tokens_per_s"] for x in runs[2]])), 1)
            figures[f"{name}_tokens_per_s_2_over_1_ratio"] = round(float(ratio["tokens_per_s"]), 3)
            figures[f"{name}_memory_per_rank_2_over_1_ratio"] = round(float(ratio["state_bytes_per_rank"]), 3)
            figures[f"{name}_rss_per_rank_2_over_1_ratio"] = round(float(ratio["rss_bytes_per_rank"]), 3)
        last = args.models.split(",")[-1]
        figures["memory_per_rank_2_over_1_ratio"] = figures[f"{last}_memory_per_rank_2_over_1_ratio"]
    finally:
        ray.shutdown()
        server.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
