"""One long agent episode end to end: a software-engineering task (envs/swe.py) solved over ~31
tool-calling turns to ~35k tokens by a scripted policy on the tiny MoE at 40k positions, through the
real rollout worker, engine, Redis buffer and learner; aborted in the middle, its worker stopped,
resumed by a new worker from the stored tokens and env snapshot, finished, then one PPO step.

The scripted policy (tests/scripted_policy.py) is the real engine (every forward pass, the KV
cache, abort and resume) whose choice of token follows the script; logprobs are the model's own.

    python benchmarks/long_episode.py                    # the default tiny MoE (4 layers), ~6 min
    python benchmarks/long_episode.py --layers 1         # what tests/test_swe_agent.py runs
    python benchmarks/long_episode.py --smoke

Prints a table, then LAST one JSON line (names carry units).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from envs.swe_tasks import generate_tasks, long_reference_actions, prompt, tool_call  # noqa: E402
from slime.buffer import TrajectoryStore  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.config import ModelConfig, TinyModelConfig, WarmstartConfig, load_config  # noqa: E402
from slime.model import ensure_model_dir, load_tokenizer  # noqa: E402
from tests.scripted_policy import TurnScript, scripted_engine_class  # noqa: E402


def wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.2)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="the tiny MoE's layers (its default: 4)")
    ap.add_argument("--turns", type=int, default=32, help="turns of the scripted episode's plan")
    ap.add_argument("--lines-per-read", type=int, default=40)
    ap.add_argument("--positions", type=int, default=40960)
    ap.add_argument(
        "--kept-kv-tokens",
        type=int,
        default=None,
        help="rollout.kept_kv_tokens (the job's default when not given; 0: every turn prefilled again)",
    )
    ap.add_argument("--smoke", action="store_true", help="a 1-layer model and a 7-turn episode")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.turns, args.lines_per_read, args.positions = 1, 8, 10, 4096
    import slime.engines.builtin as builtin
    from slime.learner import Learner
    from slime.rollout import RolloutWorker

    model_dir = ensure_model_dir(
        ModelConfig(
            tiny=TinyModelConfig(max_position_embeddings=args.positions, num_layers=args.layers),
            warmstart=WarmstartConfig(enabled=False),
        )
    )
    task = generate_tasks()[0]
    reads = long_reference_actions(task, args.turns, lines_per_read=args.lines_per_read)[1:-4]
    script = [tool_call("list_dir", path="."), tool_call("apply_patch", patch=task.fix), *reads]
    script += [tool_call("run_tests"), tool_call("finish")]
    tokenizer = load_tokenizer(model_dir)
    builtin.BuiltinEngine = scripted_engine_class(TurnScript(tokenizer, {prompt(task): script}))

    with tempfile.TemporaryDirectory(prefix="bench-long-episode-") as tmp:
        server = LocalRedisServer(Path(tmp) / "redis", aof=False)
        try:
            cfg = load_config(
                None,
                [
                    "job_name=long-episode",
                    f"output_dir={tmp}",
                    "algorithm.name=ppo",
                    f"rollout.max_new_tokens={args.positions - 1024}",
                    "rollout.max_running_requests=2",
                    "rollout.chunk_tokens=64",
                    *([] if args.kept_kv_tokens is None else [f"rollout.kept_kv_tokens={args.kept_kv_tokens}"]),
                    "learner.max_tokens_per_micro_batch=65536",
                    "env.plugin=envs.swe:SweEnv",
                    "env.kwargs={max_read_lines: 80, max_observation_chars: 8000}",
                    "env.max_turns=64",
                    "env.max_turn_tokens=1024",
                    "env.max_observation_tokens=8192",
                    f"env.max_episode_tokens={args.positions}",
                ],
            )
            buffer = TrajectoryStore.open(server.url, cfg.job_name)
            prompt_ids = tokenizer(prompt(task), add_special_tokens=False)["input_ids"]
            gid = buffer.add_group(prompt_ids, 1, cfg.rollout.max_new_tokens, {"label": task.label(), "task": "swe"})

            t0 = time.perf_counter()
            worker = RolloutWorker(cfg, str(model_dir), server.url, "w1")
            try:
                middle = args.positions * 2 // 5  # about the middle of a ~35k-token episode at 40k positions
                wait(lambda: worker.error or buffer.get_group(gid)[0].response_length > middle, 900, "mid-episode")
                worker.abort_all()
            finally:
                worker.stop()
            first_part_s = time.perf_counter() - t0
            (at_abort,) = buffer.get_group(gid)

            t1 = time.perf_counter()
            worker = RolloutWorker(cfg, str(model_dir), server.url, "w2")
            try:
                wait(lambda: buffer.get_group(gid)[0].response_length > at_abort.response_length, 300, "resumed tokens")
                resumed_s = time.perf_counter() - t1
                wait(lambda: worker.error or buffer.counts()["groups_ready"] == 1, 900, "the episode to finish")
                if worker.error:
                    raise RuntimeError(worker.error)
                engine_health = worker.engine.health()
            finally:
                worker.stop()
            second_part_s = time.perf_counter() - t1
            (done,) = buffer.get_group(gid)
            mask = done.loss_mask.astype(int)
            model_turns = int(mask[0] == 1) + int(np.sum(np.diff(mask) == 1))
            stats = buffer.stats()

            rss_before_learner = peak_rss_gib()
            learner = Learner(cfg, str(model_dir), server.url)
            t2 = time.perf_counter()
            metrics = learner.train_step(0, num_groups=1)
            learner_s = time.perf_counter() - t2
            learner.close()
        finally:
            server.stop()

    total = len(done.prompt_ids) + done.response_length
    out = {
        "bench": "long_episode",
        "smoke": args.smoke,
        "layers": args.layers,
        "positions": args.positions,
        "kept_kv_tokens": cfg.rollout.kept_kv_tokens,
        "episode_tokens": total,
        "model_turns": model_turns,
        "model_tokens": int(mask.sum()),
        "observation_tokens": int((mask == 0).sum()),
        "status": done.status.value,
        "reward": done.reward,
        "env_end": done.metadata.get("env_end"),
        "aborted_at_tokens": len(done.prompt_ids) + at_abort.response_length,
        "env_snapshot_restores": stats.get("env_snapshot_restores", 0),
        "env_replays": stats.get("env_replays", 0),
        "rollout_before_abort_s": round(first_part_s, 1),
        "resume_to_first_new_token_s": round(resumed_s, 2),
        "rollout_after_resume_s": round(second_part_s, 1),
        "rollout_s": round(first_part_s + second_part_s, 1),
        "rollout_tokens_per_s": round(done.response_length / (first_part_s + second_part_s), 1),
        "engine_forward": engine_health.get("forward"),
        "learner_step_s": round(learner_s, 1),
        "learner_loss": metrics["loss"],
        "peak_rss_rollout_gib": round(rss_before_learner, 2),
        "peak_rss_gib": round(peak_rss_gib(), 2),
    }
    print(f"{'figure':<32} value")
    for key, value in out.items():
        if key != "bench":
            print(f"{key:<32} {value}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
