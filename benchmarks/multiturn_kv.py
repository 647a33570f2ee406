"""Multi-turn rollout on the built-in engine: each turn fed onto the kept cache of the turn before
(the job's default, `rollout.kept_kv_tokens`) against every turn prefilled from its token ids
(`kept_kv_tokens=0`).

Episodes as an agent env drives them: each model turn is the same request over prompt + every
token so far, the previous turns' tokens and an observation after each. The tiny MoE (4 layers,
float32, CPU), greedy, a fixed turn length and random observation tokens, so both arms generate the
same tokens (reported: `same_tokens`; a float near-tie could flip one). Arms alternate (ABAB), 3 rounds each after a warm-up of each; mean and
spread of the rollout's wall-clock seconds.

    python benchmarks/multiturn_kv.py [--episodes 8] [--turns 16] [--turn-tokens 32] [--obs-tokens 200]
    python benchmarks/multiturn_kv.py --smoke

Prints a table, then LAST one JSON line (names carry units).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.spread import mean_sd  # noqa: E402
from slime.config import TinyModelConfig  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationChunk, GenerationRequest, SamplingParams  # noqa: E402
from slime.model import build_tiny_moe  # noqa: E402

VOCAB = 64


def run_turns(
    engine: BuiltinEngine,
    prompts: list[list[int]],
    temperatures: list[float],
    observations: list[list[list[int]]],
    budgets: list[int],
) -> list[tuple[dict[str, GenerationChunk], dict[str, list[int]]]]:
    """Episodes ``e0, e1, ...`` turn by turn: turn t generates ``budgets[t]`` tokens per episode
    (no stop token), then ``observations[t][i]`` follows episode i's. Per turn: the chunks, and each
    episode's context before the turn (also what tests/test_fast_decoder.py and
    tests/test_generic_decoder.py drive)."""
    responses: dict[str, list[int]] = {f"e{i}": [] for i in range(len(prompts))}
    out = []
    for turn, budget in enumerate(budgets):
        contexts = {rid: prompts[int(rid[1:])] + r for rid, r in responses.items()}
        requests = [
            GenerationRequest(
                rid,
                prompts[int(rid[1:])],
                SamplingParams(temperatures[int(rid[1:])], max_new_tokens=len(r) + budget, stop_token_ids=[]),
                list(r),
                keep_kv_after_finish=True,
            )
            for rid, r in responses.items()
        ]
        got = engine.generate(requests)
        out.append((got, contexts))
        for rid in responses:
            responses[rid] += got[rid].token_ids + (
                observations[turn][int(rid[1:])] if turn < len(observations) else []
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--obs-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a check that it runs (not figures to quote)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.episodes, args.turns, args.turn_tokens, args.obs_tokens, args.rounds = 2, 3, 4, 8, 1
    torch.set_num_threads(args.threads)
    model = build_tiny_moe(TinyModelConfig(), VOCAB, 0).float().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(40, 60))] for _ in range(args.episodes)]
    observations = [
        [[rng.randrange(2, VOCAB) for _ in range(args.obs_tokens)] for _ in range(args.episodes)]
        for _ in range(args.turns - 1)
    ]
    max_len = 64 + args.turns * (args.turn_tokens + args.obs_tokens)
    arms = {"kept": 1 << 30, "prefill": 0}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    outputs: dict[str, list[dict[str, list[int]]]] = {}  # per arm, per turn: each episode's tokens
    health: dict[str, dict] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms each arm up, untimed
        for arm, kept in arms.items():
            engine = BuiltinEngine(model, max_running_requests=args.episodes, max_seq_len=max_len, kept_kv_tokens=kept)
            t0 = time.perf_counter()
            turns = run_turns(engine, prompts, [0.0] * args.episodes, observations, [args.turn_tokens] * args.turns)
            outputs[arm] = [{rid: chunk.token_ids for rid, chunk in got.items()} for got, _ in turns]
            if rnd:
                seconds[arm].append(time.perf_counter() - t0)
            health[arm] = engine.health()
    same = outputs["kept"] == outputs["prefill"]
    model_tokens = args.episodes * args.turns * args.turn_tokens
    context_tokens = sum(map(len, prompts)) + model_tokens + sum(len(o) for turn in observations for o in turn)
    (kept_s, kept_sd), (prefill_s, prefill_sd) = mean_sd(seconds["kept"]), mean_sd(seconds["prefill"])
    print(f"{args.episodes} episodes x {args.turns} turns: {args.turn_tokens} model tokens and {args.obs_tokens} ")
    print(f"observation tokens a turn, {context_tokens} context tokens at the end; greedy, same tokens: {same}")
    print(f"{'arm':<10}{'rollout s':>14}{'model tok/s':>14}{'tokens not prefilled':>24}")
    for arm, (s, sd) in (("kept", (kept_s, kept_sd)), ("prefill", (prefill_s, prefill_sd))):
        print(f"{arm:<10}{s:>9.2f} ± {sd:<4.2f}{model_tokens / s:>12.0f}{health[arm]['kv_resumed_tokens']:>24}")
    print(f"kept / prefill rollout speed: {prefill_s / kept_s:.2f}x")
    figures = {
        "bench": "multiturn_kv",
        "smoke": args.smoke,
        "episodes": args.episodes,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "obs_tokens": args.obs_tokens,
        "rounds": args.rounds,
        "context_tokens_at_end": context_tokens,
        "same_tokens": same,
        "kept_rollout_s": round(kept_s, 3),
        "kept_rollout_s_sd": round(kept_sd, 3),
        "prefill_rollout_s": round(prefill_s, 3),
        "prefill_rollout_s_sd": round(prefill_sd, 3),
        "kept_model_tokens_per_s": round(model_tokens / kept_s, 1),
        "prefill_model_tokens_per_s": round(model_tokens / prefill_s, 1),
        "kept_vs_prefill_speed_x": round(prefill_s / kept_s, 3),
        "kept_tokens_not_prefilled": health["kept"]["kv_resumed_tokens"],
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
