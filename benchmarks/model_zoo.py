"""The built-in engine on every decoder family transformers can build, against `model.generate`.

For each family of slime/engines/families.py a random-init model of a few M parameters
(hidden 256, 4 layers, 8 query / 4 key-value heads; experts, MLA, windows and sinks as the family
has them), float32, CPU. Per family: which forward the engine takes (hand-written fast path,
generic fast path over the model's own modules, or Hugging Face's, and why), decode throughput
against `model.generate` at batch 1 and 32 (16-token prompts, `--new-tokens` greedy tokens each,
EOS off for both, prefill included on both sides), and the share of greedy tokens the two
agree on. Equal prompt lengths are the case most favourable to `generate` (no padding, every
row ends together); a third batch of 32 prompts of 4 to 28 tokens (left padded for `generate`)
is the usual case. On the hand-written families also the generic path against the
hand-written one.

Fair by construction: the same prompts, threads and token counts; the arms alternate
(engine, generate, engine, generate, ...) after one warm-up each, `--repeats` timed runs per arm;
the mean and spread per arm, ratios of the means.

Prints a table, then LAST one JSON line.   python benchmarks/model_zoo.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.spread import mean_sd  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402
from slime.engines.families import FAMILIES, tiny_model  # noqa: E402

VOCAB = 2048
PROMPT_TOKENS = 16
SIZE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def bench_model(family: str) -> torch.nn.Module:
    """A few-M-parameter model of ``family``: the tiny family config at the benchmark's size."""
    extra = dict(SIZE)
    if "head_dim" in FAMILIES[family]:
        extra["head_dim"] = 32
    if "moe_intermediate_size" in FAMILIES[family]:
        extra["moe_intermediate_size"] = 128
    if "shared_expert_intermediate_size" in FAMILIES[family]:
        extra["shared_expert_intermediate_size"] = 256
    return tiny_model(family, VOCAB, **extra)


class Why(logging.Handler):
    """Keeps the engine's log line that says which forward it took and why."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()


def run_engine(model, prompts: list[list[int]], n: int, fast_path) -> tuple[float, list[list[int]]]:
    engine = BuiltinEngine(model, max_running_requests=len(prompts), fast_path=fast_path)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[])
    t0 = time.perf_counter()
    out = engine.generate([GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - t0
    return seconds, [out[f"r{i}"].token_ids for i in range(len(prompts))]


def run_generate(model, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    # EOS off as in the engine: no end-of-sequence id at all. (min_new_tokens would instead mask
    # the EOS logit, and greedy would pick another token where the engine picks EOS.)
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padded (pad id 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config.eos_token_id = eos
    seconds = time.perf_counter() - t0
    return seconds, out[:, width:].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions whose greedy token is the same (after a first difference the two
    continue from different contexts, so later positions count as different too)."""
    same = total = 0
    for x, y in zip(a, b):
        first_diff = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same += first_diff
        total += max(len(x), len(y))
    return same / max(1, total)


def fmt(x: float | None, unit: str = "x") -> str:
    return "failed" if x is None else f"{x:.2f}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    why = Why()
    logging.getLogger("slime.engines.generic_decoder").addHandler(why)
    logging.getLogger("slime.engines.generic_decoder").setLevel(logging.INFO)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    n = args.new_tokens
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(b)] for b in (1, 32)}
    prompts["32v"] = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 28))] for _ in range(32)]
    rows, figures = [], {}
    started = time.time()
    for family in args.families.split(","):
        model = bench_model(family)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        engine = BuiltinEngine(model, max_running_requests=32)
        forward = engine.health()["forward"]
        reason = why.last
        row = {"family": family, "params_m": round(params_m, 2), "forward": forward, "why": reason}
        arms = {
            "engine": lambda ps, m=model: run_engine(m, ps, n, None),
            "generate": lambda ps, m=model: run_generate(m, ps, n),
        }
        if forward == "fast":  # the hand-written path: against the generic one on the same model
            arms["generic"] = lambda ps, m=model: run_engine(m, ps, n, "generic")
        for b, ps in prompts.items():
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            tokens: dict[str, list[list[int]]] = {}
            try:
                for arm, fn in arms.items():  # warm-up
                    tokens[arm] = fn(ps)[1]
            except Exception as exc:  # model.generate itself fails on this family and batch
                row[f"ratio_b{b}"] = row[f"agree_b{b}"] = None
                row.setdefault("errors", []).append(f"b{b} {arm}: {type(exc).__name__}: {str(exc)[:150]}")
                continue
            for _ in range(args.repeats):
                for arm, fn in arms.items():
                    seconds, tokens[arm] = fn(ps)
                    times[arm].append(len(ps) * n / seconds)
            for arm in arms:
                row[f"{arm}_b{b}_tok_s"] = mean_sd(times[arm])
            row[f"ratio_b{b}"] = row[f"engine_b{b}_tok_s"][0] / row[f"generate_b{b}_tok_s"][0]
            row[f"agree_b{b}"] = agreement(tokens["engine"], tokens["generate"])
            if "generic" in arms:
                row[f"hand_over_generic_b{b}"] = row[f"engine_b{b}_tok_s"][0] / row[f"generic_b{b}_tok_s"][0]
        rows.append(row)
        print(
            f"{family:<12} {params_m:5.2f}M {forward:<8} b1 {fmt(row['ratio_b1'])}  b32 {fmt(row['ratio_b32'])}  "
            f"b32 unequal prompts {fmt(row['ratio_b32v'])}  agree {fmt(row['agree_b1'], '')}/{fmt(row['agree_b32'], '')}"
            + (
                f"  hand-written/generic b1 {row['hand_over_generic_b1']:.2f}x b32 {row['hand_over_generic_b32']:.2f}x"
                if "hand_over_generic_b1" in row
                else ""
            ),
            flush=True,
        )
    print()
    print(
        f"{'family':<12} {'forward':<8} {'params':>7} {'b1 tok/s engine / generate':>30} {'b32':>30} {'b32 unequal':>30}"
    )
    for r in rows:
        cells = []
        for b in ("1", "32", "32v"):
            e, g = r.get(f"engine_b{b}_tok_s"), r.get(f"generate_b{b}_tok_s")
            cells.append(
                "generate failed"
                if r[f"ratio_b{b}"] is None
                else f"{e[0]:.0f}±{e[1]:.0f} / {g[0]:.0f}±{g[1]:.0f} {r[f'ratio_b{b}']:.2f}x"
            )
        print(
            f"{r['family']:<12} {r['forward']:<8} {r['params_m']:>6.2f}M {cells[0]:>30} {cells[1]:>30} {cells[2]:>30}"
        )
        figures[f"{r['family']}_forward"] = r["forward"]
        for b, name in (("1", "b1"), ("32", "b32"), ("32v", "b32_unequal_prompts")):
            ratio = r[f"ratio_b{b}"]
            figures[f"{r['family']}_engine_over_generate_{name}_ratio"] = None if ratio is None else round(ratio, 3)
        agree = r["agree_b32"]
        figures[f"{r['family']}_greedy_agreement_b32_share"] = None if agree is None else round(agree, 3)
        if "hand_over_generic_b32" in r:
            figures[f"{r['family']}_hand_written_over_generic_b1_ratio"] = round(r["hand_over_generic_b1"], 3)
            figures[f"{r['family']}_hand_written_over_generic_b32_ratio"] = round(r["hand_over_generic_b32"], 3)
    for r in rows:
        if r["forward"] == "hf":
            print(f"{r['family']}: Hugging Face path: {r['why']}")
        for error in r.get("errors", []):
            print(f"{r['family']}: {error}")
    for b, name in (("1", "b1"), ("32", "b32"), ("32v", "b32_unequal_prompts")):
        ratios = [r[f"ratio_b{b}"] for r in rows if r[f"ratio_b{b}"] is not None]
        figures[f"min_engine_over_generate_{name}_ratio"] = round(min(ratios), 3) if ratios else None
    figures["generate_failures"] = sum(len(r.get("errors", [])) for r in rows)
    figures["families"] = len(rows)
    figures["families_on_a_fast_path"] = sum(r["forward"] != "hf" for r in rows)
    figures["repeats_per_arm"] = args.repeats
    figures["new_tokens"] = n
    figures["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
