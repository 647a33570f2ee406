"""Reward service benchmark: where a reward runs, and whether a slow reward slows rollouts.

    python benchmarks/rewards.py [--samples 3000] [--window-s 15] [--rounds 4]

1. Throughput of a rule reward (envs.repeat:reward) scored through `make_reward_service` in each
   mode, side by side: in-process, HTTP (a real `slime reward-serve` subprocess), Ray actor.
   Cache off, every sample distinct; samples/s from first submit to last result.
2. A real rollout worker (built-in engine, tiny MoE, 48-token answers) generating with an instant
   reward vs a reward that sleeps 1 s per sample (reward.max_concurrency high enough for the
   load), in alternating windows: median generated tokens/s of each, and their ratio (1.0 = no
   slowdown).

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

HERE = Path(__file__).resolve()


def instant_reward(prompt: str, response: str, label: str = "") -> float:
    return float(response == label)


def slow_reward(prompt: str, response: str, label: str = "") -> float:
    time.sleep(1.0)
    return float(response == label)


def _throughput(service, n: int) -> float:
    items = [(f"ab*{i}=", f"ab{i}", f"ab{i % 7}") for i in range(n)]
    t0 = time.perf_counter()
    futures = [service.submit(p, r, label) for p, r, label in items]
    results = [f.result(timeout=120) for f in futures]
    elapsed = time.perf_counter() - t0
    failed = [r.failure for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} rewards failed, e.g. {failed[0]}")
    return n / elapsed


def reward_throughput(n: int) -> dict[str, float]:
    import httpx
    import ray

    from rewards.service import make_reward_service
    from slime.config import RewardConfig

    spec = "envs.repeat:reward"
    out: dict[str, float] = {}
    local = make_reward_service(RewardConfig(fn=spec, cache_size=0), "bench")
    _throughput(local, min(n, 200))  # warm up
    out["in_process_samples_per_s"] = _throughput(local, n)
    local.close()

    port = 18000 + os.getpid() % 1000
    token_dir = tempfile.mkdtemp(prefix="reward-bench-")
    atexit.register(shutil.rmtree, token_dir, True)  # the token is a secret: not left behind
    token_file = Path(token_dir) / "token"  # the server writes its token there
    server = subprocess.Popen(
        [sys.executable, "-m", "slime.cli", "reward-serve", spec, "--port", str(port), "--token-file", str(token_file)],
        cwd=HERE.parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError(f"reward server did not start: {server.stderr.read().decode()[-500:]}")
            time.sleep(0.2)
        token = token_file.read_text().strip()
        remote = make_reward_service(RewardConfig(mode="http", url=url, cache_size=0, token=token), "bench")
        _throughput(remote, min(n, 200))
        out["http_samples_per_s"] = _throughput(remote, n)
        remote.close()
    finally:
        server.terminate()
        server.wait(timeout=10)

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        actor = make_reward_service(RewardConfig(mode="ray_actor", fn=spec, cache_size=0), "bench")
        _throughput(actor, min(n, 200))
        out["ray_actor_samples_per_s"] = _throughput(actor, n)
        actor.close()
    finally:
        ray.shutdown()
    return out


def rollout_with_slow_reward(window_s: float, rounds: int, warmup_s: float = 3.0) -> dict[str, float]:
    """Generated tokens/s of one real rollout worker, instant vs 1 s reward, alternating windows."""
    from envs import repeat
    from slime.buffer import TrajectoryStore
    from slime.buffer.redis_server import LocalRedisServer
    from slime.config import ModelConfig, load_config
    from slime.data import _chat_ids
    from slime.model import ensure_model_dir, load_tokenizer
    from slime.rollout import RolloutWorker

    model_dir = ensure_model_dir(ModelConfig())
    tok = load_tokenizer(model_dir)
    problems = repeat.make_dataset(400, seed=0)
    prompts = [(_chat_ids("bench", [{"role": "user", "content": p["prompt"]}], tok), p) for p in problems]
    rates: dict[str, list[float]] = {"none": [], "slow": []}
    with tempfile.TemporaryDirectory() as tmp:
        redis = LocalRedisServer(Path(tmp) / "redis", aof=False)
        try:
            for round_ in range(rounds):
                # ABBA order, so a drift in the machine's load hits both kinds alike.
                for kind in ("none", "slow") if round_ % 2 == 0 else ("slow", "none"):
                    job = f"bench-rewards-{kind}-{round_}"
                    fn = f"{HERE}:{'slow_reward' if kind == 'slow' else 'instant_reward'}"
                    cfg = load_config(
                        None,
                        [
                            f"job_name={job}",
                            f"output_dir={tmp}",
                            "rollout.max_new_tokens=48",
                            "rollout.max_running_requests=16",
                            "rollout.temperature=1.0",
                            "rollout.ignore_eos=true",
                            "reward.max_concurrency=128",
                            "reward.timeout_s=30",
                            f"reward.fn={fn}",
                        ],
                    )
                    buffer = TrajectoryStore.open(redis.url, job)
                    buffer.delete_job()
                    for ids, p in prompts:
                        buffer.add_group(ids, 1, 48, {"label": p["label"], "prompt_text": p["prompt"]})
                    worker = RolloutWorker(cfg, str(model_dir), redis.url, f"w-{kind}")
                    try:
                        time.sleep(warmup_s)  # warm-up: first prefill, thread pools
                        tokens0, t0 = worker.generated_tokens, time.time()
                        time.sleep(window_s)
                        rates[kind].append((worker.generated_tokens - tokens0) / (time.time() - t0))
                    finally:
                        worker.stop()
                        buffer.delete_job()
                        buffer.close()
        finally:
            redis.stop()
    none, slow = statistics.median(rates["none"]), statistics.median(rates["slow"])
    return {
        "rollout_no_reward_tokens_per_s": none,
        "rollout_slow_reward_tokens_per_s": slow,
        "rollout_slow_vs_no_reward_ratio": slow / none,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    ns = parser.parse_args()
    warmup_s = 3.0
    if ns.smoke:
        ns.samples, ns.window_s, ns.rounds, warmup_s = 20, 1.0, 1, 1.0
    import torch

    torch.set_num_threads(1)
    figures: dict[str, float] = {}
    figures.update(reward_throughput(ns.samples))
    print(f"reward throughput: {figures}", flush=True)
    rollout = rollout_with_slow_reward(ns.window_s, ns.rounds, warmup_s)
    print(f"rollout: {rollout}", flush=True)
    figures.update(rollout)
    figures["http_vs_in_process_ratio"] = figures["http_samples_per_s"] / figures["in_process_samples_per_s"]
    figures["ray_actor_vs_in_process_ratio"] = figures["ray_actor_samples_per_s"] / figures["in_process_samples_per_s"]
    print(json.dumps({**({"smoke": True} if ns.smoke else {}), **{k: round(v, 3) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
