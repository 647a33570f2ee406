"""Sandbox throughput of the software-engineering env (envs/swe.py, issue 36 item 5), against the
engine's time for a model turn.

Scripted episodes (`envs.swe_tasks.reference_actions`: list_dir, read_file, apply_patch,
run_tests, finish; one tool call per turn) over the 24 shipped tasks, with 1, 8 and 32 episodes
in flight at once on a thread pool, as the rollout worker's env pool runs them. run_tests is one
sandbox run; finish is one or two (the failing-at-start set comes from running the original
repository once per episode, when the workspace has changed before the first test run, as here).
Per tool: latency p50/p99 (ms) of `env.step` (`sandbox_call_*`: run_tests and finish together);
per arm: episodes per minute and tool calls per second. For comparison, the built-in engine's time
for one 64-token model turn of the default tiny MoE (CPU, 2 torch threads) at batch 1, 8 and 32,
over a 256-token context.

Arms alternate (1, 8, 32, then the engine, then the next round) over `--rounds` rounds; latencies
pool every round, rates are total episodes (calls) over total wall time, engine times the best of
the rounds. Prints a table, then LAST one JSON line.

    python benchmarks/swe_sandbox.py [--rounds 3] [--in-flight 1 8 32] [--episodes 16 48 128]   # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.sandbox import Sandbox  # noqa: E402
from envs.swe import SweEnv  # noqa: E402
from envs.swe_tasks import SweTask, generate_tasks, reference_actions  # noqa: E402
from slime.sample import Sample  # noqa: E402

TOOLS = ("list_dir", "read_file", "apply_patch", "run_tests", "finish")


def run_episode(task: SweTask) -> list[tuple[str, float]]:
    """(tool, seconds) per step of one scripted episode; the episode must earn 1.0."""
    env = SweEnv()
    env.reset(Sample(group_id="bench", index=0, prompt_ids=[1], max_new_tokens=1, metadata={"label": task.label()}))
    timings = []
    reward = 0.0
    for tool, action in zip(TOOLS, reference_actions(task)):
        t0 = time.perf_counter()
        _, reward, _, _ = env.step(action)
        timings.append((tool, time.perf_counter() - t0))
    assert reward == 1.0, f"{task.task_id}: the scripted episode earned {reward}"
    return timings


def run_arm(tasks: list[SweTask], in_flight: int, episodes: int, offset: int) -> tuple[float, list[list]]:
    chosen = [tasks[(offset + i) % len(tasks)] for i in range(episodes)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight, thread_name_prefix="env") as pool:
        results = list(pool.map(run_episode, chosen))
    return time.perf_counter() - t0, results


def engine_turn_seconds(batches: list[int], new_tokens: int, context: int) -> dict[int, float]:
    """Wall time of one model turn (`new_tokens` greedy tokens) for `b` requests at once."""
    import torch

    from slime.config import load_config
    from slime.engines.builtin import BuiltinEngine
    from slime.engines.contract import GenerationRequest, SamplingParams
    from slime.model import ensure_model_dir, load_model

    torch.set_num_threads(2)
    model = load_model(ensure_model_dir(load_config(None, []).model))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)  # no stop tokens: full turns
    out = {}
    for b in batches:
        engine = BuiltinEngine(model, max_running_requests=b)
        for attempt in ("warm-up", "timed"):
            prompts = [rng.integers(10, 90, size=context).tolist() for _ in range(b)]  # distinct contexts
            requests = [GenerationRequest(f"{attempt}{i}", p, params) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            chunks = engine.generate(requests)
            out[b] = time.perf_counter() - t0
        assert all(len(c.token_ids) == new_tokens for c in chunks.values())
    return out


def percentile_ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--episodes", type=int, nargs="+", default=[16, 48, 128], help="per arm and round")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.in_flight, args.episodes, args.new_tokens, args.context = 1, [1, 2], [2, 2], 4, 16
    if len(args.episodes) != len(args.in_flight):
        ap.error("--episodes needs one count per --in-flight value")
    Sandbox().check()
    tasks = generate_tasks()
    run_episode(tasks[0])  # warm-up: the sandbox probe, the page cache

    latencies: dict[int, dict[str, list[float]]] = {k: defaultdict(list) for k in args.in_flight}
    walls: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    engine: dict[int, float] = {}
    started = time.perf_counter()
    for r in range(args.rounds):
        for k, n in zip(args.in_flight, args.episodes):
            wall, results = run_arm(tasks, k, n, offset=r * 7 + k)
            walls[k] += wall
            counts[k] += n
            for episode in results:
                for tool, seconds in episode:
                    latencies[k][tool].append(seconds)
        for b, seconds in engine_turn_seconds(args.in_flight, args.new_tokens, args.context).items():
            engine[b] = min(engine.get(b, float("inf")), seconds)
    total_s = time.perf_counter() - started

    print(
        f"SWE env, scripted 5-turn episodes over {len(tasks)} tasks, {args.rounds} rounds; "
        f"{os.cpu_count()} cores, {platform.machine()}, load avg {os.getloadavg()[0]:.1f}"
    )
    head = f"{'in flight':>9}{'episodes':>9}{'ep/min':>8}{'calls/s':>8}" + "".join(
        f"{t + ' p50/p99 ms':>24}" for t in TOOLS
    )
    print(head)
    figures: dict[str, object] = {"bench": "swe_sandbox", **({"smoke": True} if args.smoke else {})}
    for k in args.in_flight:
        per_minute = counts[k] / walls[k] * 60
        calls_per_s = counts[k] * len(TOOLS) / walls[k]
        every = [s for tool in TOOLS for s in latencies[k][tool]]
        sandboxed = latencies[k]["run_tests"] + latencies[k]["finish"]
        row = f"{k:>9}{counts[k]:>9}{per_minute:>8.1f}{calls_per_s:>8.1f}"
        for tool in TOOLS:
            p50, p99 = percentile_ms(latencies[k][tool], 50), percentile_ms(latencies[k][tool], 99)
            row += f"{f'{p50:.2f} / {p99:.2f}':>24}"
            figures[f"{tool}_p50_ms@{k}"], figures[f"{tool}_p99_ms@{k}"] = p50, p99
        print(row)
        figures[f"episodes_per_min@{k}"] = round(per_minute, 1)
        figures[f"tool_calls_per_s@{k}"] = round(calls_per_s, 1)
        figures[f"tool_p50_ms@{k}"], figures[f"tool_p99_ms@{k}"] = percentile_ms(every, 50), percentile_ms(every, 99)
        figures[f"sandbox_call_p50_ms@{k}"] = percentile_ms(sandboxed, 50)
        figures[f"sandbox_call_p99_ms@{k}"] = percentile_ms(sandboxed, 99)
    print(
        f"engine (default tiny MoE, CPU, 2 threads): one {args.new_tokens}-token turn over {args.context} context tokens"
    )
    for b, seconds in sorted(engine.items()):
        print(f"  batch {b:>3}: {seconds * 1000:8.1f} ms per turn ({b * args.new_tokens / seconds:8.1f} tokens/s)")
        figures[f"engine_turn_ms@{b}"] = round(seconds * 1000, 1)
    figures.update(
        {
            "engine_turn_tokens": args.new_tokens,
            "cores": os.cpu_count(),
            "rounds": args.rounds,
            "bench_wall_s": round(total_s, 1),
        }
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
