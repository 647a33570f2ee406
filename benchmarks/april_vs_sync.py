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
        "engine_busy_s": sum(a["busy_seconds"] - b["busy_seconds"] for a, b in zip(after, before)),
        "generated_total": gen_after - gen_before,
        "lengths": lengths,
        "prompt_tokens": prompt_tokens,
        "padded_tokens": padded,
        "group_lengths": group_lengths,
        "policy_dir": policy_dir,
        "job_s": time.time() - started,
    }


