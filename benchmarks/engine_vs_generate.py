"""Decode throughput of the built-in engine (BuiltinEngine) vs Hugging Face `model.generate`.

Tiny random Qwen3-MoE, float32, CPU, 2 torch threads. 32 prompts of ~10 tokens, 128 greedy new
tokens each with EOS disabled for both, so both decode exactly 32 * 128 tokens. Warm-up run,
then best of 3. Prints a small table, a greedy-equality sanity line, and LAST one JSON line.

    python benchmarks/engine_vs_generate.py [--batch 32] [--new-tokens 128] [--repeats 3]
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
from slime.config import TinyModelConfig  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402
from slime.model import build_tiny_moe  # noqa: E402


def tiny_moe(seed: int = 0) -> torch.nn.Module:
    """The default tiny MoE architecture (slime.model), random init."""
    return build_tiny_moe(TinyModelConfig(), 64, seed).float().eval()


def best_of(fns: dict, repeats: int) -> dict[str, tuple[float, object]]:
    """Warm up each fn, then time them interleaved (fair under background load); keep the best."""
    results = {name: (float("inf"), fn()) for name, fn in fns.items()}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            results[name] = (min(results[name][0], time.perf_counter() - t0), out)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.new_tokens, args.repeats = 2, 4, 1
    torch.set_num_threads(args.threads)
    B, N = args.batch, args.new_tokens

    model = tiny_moe(0)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(8, 12))] for _ in range(B)]

    # The same left-padded batch for generate (pad id 0; the mask hides it).
    width = max(map(len, prompts))
    input_ids = torch.zeros(B, width, dtype=torch.long)
    attention_mask = torch.zeros(B, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1

    def hf_generate():
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=N,
                min_new_tokens=N,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    engine = BuiltinEngine(model, max_running_requests=B)
    params = SamplingParams(temperature=0.0, max_new_tokens=N)  # no stop tokens: EOS disabled

    def engine_generate():
        reqs = [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        return [out[str(i)].token_ids for i in range(B)]

    timed = best_of({"hf": hf_generate, "engine": engine_generate}, args.repeats)
    (t_hf, hf_tokens), (t_engine, engine_tokens) = timed["hf"], timed["engine"]
    assert all(len(t) == N for t in hf_tokens) and all(len(t) == N for t in engine_tokens)

    total = B * N
    engine_tps, hf_tps = total / t_engine, total / t_hf
    same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
    print(
        f"tiny Qwen3-MoE, float32, CPU, {args.threads} threads, batch {B}, {N} new tokens, greedy, best of {args.repeats}"
    )
    print(f"{'':22s}{'seconds':>10s}{'decode tok/s':>15s}")
    print(f"{'BuiltinEngine':22s}{t_engine:10.3f}{engine_tps:15.1f}")
    print(f"{'model.generate':22s}{t_hf:10.3f}{hf_tps:15.1f}")
    print(f"ratio engine/generate: {engine_tps / hf_tps:.3f}")
    print(f"sanity: greedy token ids identical for {same}/{B} sequences")
    print(
        json.dumps(
            {
                **({"smoke": True} if args.smoke else {}),
                "engine_decode_tokens_per_s": round(engine_tps, 1),
                "hf_generate_tokens_per_s": round(hf_tps, 1),
                "engine_over_generate_ratio": round(engine_tps / hf_tps, 3),
                "batch": B,
                "new_tokens": N,
                "greedy_identical_sequences": same,
            }
        )
    )


if __name__ == "__main__":
    main()
