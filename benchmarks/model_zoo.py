"""The built-in engine on every decoder family transformers can build, against `model.generate`.

For each family of benchmarks/families.py a random-init model of a few M parameters
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
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.families import FAMILIES, TINY_SHAPE, discover_families, tiny_model, tiny_settings  # noqa: E402
from benchmarks.spread import mean_sd  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402

VOCAB = 2048
PROMPT_TOKENS = 16
SIZE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def bench_model(family: str, overrides: dict) -> torch.nn.Module:
    """A few-M-parameter model of ``family``: its tiny config (``overrides`` on the family's
    settings) at the benchmark's size."""
    settings = {**(FAMILIES[family] if family in FAMILIES else tiny_settings(family)), **overrides}
    extra = dict(SIZE)
    extra["num_hidden_layers"] = max(SIZE["num_hidden_layers"], settings.get("num_hidden_layers", 0))
    if "head_dim" in settings:
        extra["head_dim"] = 32
    if "moe_intermediate_size" in settings:
        extra["moe_intermediate_size"] = 128
    if "shared_expert_intermediate_size" in settings:
        extra["shared_expert_intermediate_size"] = 256
    if settings.get("num_key_value_heads") == TINY_SHAPE["num_attention_heads"]:  # as many as query heads
        extra["num_key_value_heads"] = SIZE["num_attention_heads"]
    return tiny_model(family, VOCAB, **{**overrides, **extra})


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


def measure(row: dict, model, arms: dict, batches: dict, n: int, repeats: int) -> None:
    """Into ``row``: per batch, tok/s per arm, the engine/generate ratio and greedy agreement."""
    for b, ps in batches.items():
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        tokens: dict[str, list[list[int]]] = {}
        try:
            for arm, fn in arms.items():  # warm-up
                tokens[arm] = fn(ps)[1]
        except Exception as exc:  # model.generate (or the engine's Hugging Face path) fails here
            row[f"ratio_b{b}"] = row[f"agree_b{b}"] = None
            row.setdefault("errors", []).append(f"b{b} {arm}: {type(exc).__name__}: {str(exc)[:150]}")
            continue
        for _ in range(repeats):
            for arm, fn in arms.items():
                seconds, tokens[arm] = fn(ps)
                times[arm].append(len(ps) * n / seconds)
        for arm in arms:
            row[f"{arm}_b{b}_tok_s"] = mean_sd(times[arm])
        row[f"ratio_b{b}"] = row[f"engine_b{b}_tok_s"][0] / row[f"generate_b{b}_tok_s"][0]
        row[f"agree_b{b}"] = agreement(tokens["engine"], tokens["generate"])
        if "generic" in arms:
            row[f"hand_over_generic_b{b}"] = row[f"engine_b{b}_tok_s"][0] / row[f"generic_b{b}_tok_s"][0]


def bench_family(family: str, overrides: dict, batches: dict, n: int, repeats: int, why: Why) -> dict:
    """One family's row: its forward path (and why), then `measure` on ``batches``."""
    model = bench_model(family, overrides)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    row: dict = {"family": family, "params_m": round(params_m, 2), "curated": family in FAMILIES}
    try:
        forward = BuiltinEngine(model, max_running_requests=32).health()["forward"]
    except Exception as exc:
        row.update(forward="failed", why=f"{type(exc).__name__}: {str(exc)[:150]}")
        row.update({f"ratio_b{b}": None for b in batches} | {f"agree_b{b}": None for b in batches})
        return row
    row.update(forward=forward, why=why.last)
    arms = {
        "engine": lambda ps: run_engine(model, ps, n, None),
        "generate": lambda ps: run_generate(model, ps, n),
    }
    if forward == "fast" and family in FAMILIES:  # the hand-written path: against the generic one
        arms["generic"] = lambda ps: run_engine(model, ps, n, "generic")
    measure(row, model, arms, batches, n, repeats)
    return row


def line(row: dict) -> str:
    cells = " ".join(f"{b[6:]} {fmt(row[b])}" for b in ("ratio_b1", "ratio_b32", "ratio_b32v") if b in row)
    agree = fmt(row.get("agree_b32"), "")
    text = f"{row['family']:<20} {row['params_m']:5.2f}M {row['forward']:<8} {cells}  agree b32 {agree}"
    if "hand_over_generic_b32" in row:
        text += f"  hand-written/generic b1 {row['hand_over_generic_b1']:.2f}x b32 {row['hand_over_generic_b32']:.2f}x"
    return text


def ratio_stats(rows: list[dict], key: str) -> dict[str, float | None]:
    ratios = sorted(r[key] for r in rows if r.get(key) is not None)
    if not ratios:
        return {"min": None, "median": None}
    return {"min": round(ratios[0], 3), "median": round(ratios[len(ratios) // 2], 3)}


def summary(rows: list[dict], refused: dict[str, str], args, started: float) -> dict:
    figures: dict = {}
    for r in rows:
        figures[f"{r['family']}_forward"] = r["forward"]
        for b, name in (("1", "b1"), ("32", "b32"), ("32v", "b32_unequal_prompts")):
            if f"ratio_b{b}" in r:
                ratio = r[f"ratio_b{b}"]
                figures[f"{r['family']}_engine_over_generate_{name}_ratio"] = None if ratio is None else round(ratio, 3)
        agree = r.get("agree_b32")
        figures[f"{r['family']}_greedy_agreement_b32_share"] = None if agree is None else round(agree, 3)
        if "hand_over_generic_b32" in r:
            figures[f"{r['family']}_hand_written_over_generic_b1_ratio"] = round(r["hand_over_generic_b1"], 3)
            figures[f"{r['family']}_hand_written_over_generic_b32_ratio"] = round(r["hand_over_generic_b32"], 3)
    curated = [r for r in rows if r["curated"]]
    for b, name in (("1", "b1"), ("32", "b32"), ("32v", "b32_unequal_prompts")):
        figures[f"min_engine_over_generate_{name}_ratio"] = ratio_stats(curated, f"ratio_b{b}")["min"]
    for path in ("fast", "generic", "hf", "failed"):
        on_path = [r for r in rows if r["forward"] == path]
        figures[f"families_{path}_count"] = len(on_path)
        if path in ("fast", "generic"):
            stats = ratio_stats(on_path, "ratio_b32")
            figures[f"{path}_min_engine_over_generate_b32_ratio"] = stats["min"]
            figures[f"{path}_median_engine_over_generate_b32_ratio"] = stats["median"]
            agreements = [r["agree_b32"] for r in on_path if r.get("agree_b32") is not None]
            figures[f"{path}_min_greedy_agreement_b32_share"] = round(min(agreements), 3) if agreements else None
    figures["generate_failures"] = sum(len(r.get("errors", [])) for r in rows)
    figures["families"] = len(rows)
    figures["families_on_a_fast_path"] = sum(r["forward"] in ("fast", "generic") for r in rows)
    figures["refused_count"] = len(refused)
    figures["refused"] = refused
    figures["repeats_per_arm"] = args.repeats
    figures["new_tokens"] = args.new_tokens
    figures["extra_families_new_tokens"] = args.extra_new_tokens
    figures["wall_s"] = round(time.time() - started, 1)
    return figures


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'family':<20} {'forward':<8} {'params':>7} {'b1 tok/s engine / generate':>30} {'b32':>30} {'b32 unequal':>30}"
    )
    for r in rows:
        cells = []
        for b in ("1", "32", "32v"):
            e, g = r.get(f"engine_b{b}_tok_s"), r.get(f"generate_b{b}_tok_s")
            if f"ratio_b{b}" not in r:
                cells.append("-")
            elif r[f"ratio_b{b}"] is None:
                cells.append("failed")
            else:
                cells.append(f"{e[0]:.0f}±{e[1]:.0f} / {g[0]:.0f}±{g[1]:.0f} {r[f'ratio_b{b}']:.2f}x")
        print(
            f"{r['family']:<20} {r['forward']:<8} {r['params_m']:>6.2f}M {cells[0]:>30} {cells[1]:>30} {cells[2]:>30}"
        )
    for r in rows:
        if r["forward"] in ("hf", "failed"):
            print(f"{r['family']}: {r['forward']}: {r['why']}")
        for error in r.get("errors", []):
            print(f"{r['family']}: {error}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--families",
        default="all",
        help="all (the curated 15, then every other buildable family), curated, or a comma-separated list",
    )
    ap.add_argument("--extra-new-tokens", type=int, default=32, help="tokens per prompt on the non-curated families")
    ap.add_argument("--extra-repeats", type=int, default=1, help="timed runs per arm on the non-curated families")
    ap.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = ap.parse_args()
    if args.smoke:  # two curated families (a MoE, a dense one), a few tokens, one timed run per arm
        args.families, args.repeats, args.new_tokens = "qwen3_moe,llama", 1, 4
    torch.set_num_threads(args.threads)
    why = Why()
    logging.getLogger("slime.engines.builtin.generic_decoder").addHandler(why)
    logging.getLogger("slime.engines.builtin.generic_decoder").setLevel(logging.INFO)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started = time.time()
    named = [] if args.families in ("curated", "all") else args.families.split(",")
    # discovery builds every family transformers has (~10 s): only when a non-curated one may run
    built, refused = discover_families() if args.families == "all" or set(named) - set(FAMILIES) else ({}, {})
    if args.families == "curated":
        chosen = list(FAMILIES)
    elif args.families == "all":
        chosen = list(FAMILIES) + [f for f in built if f not in FAMILIES]
    else:
        chosen = named
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(b)] for b in (1, 32)}
    prompts["32v"] = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 28))] for _ in range(32)]
    rows = []
    for family in chosen:
        if family in FAMILIES:
            row = bench_family(family, {}, prompts, args.new_tokens, args.repeats, why)
        else:  # one batch of 32 equal prompts, fewer tokens: the 10-minute budget of the whole run
            extra = {32: prompts[32]}
            row = bench_family(family, built.get(family, {}), extra, args.extra_new_tokens, args.extra_repeats, why)
        rows.append(row)
        print(line(row), flush=True)
    print_table(rows)
    if args.families != "curated":
        for family, reason in refused.items():
            print(f"{family}: refused: {reason}")
    figures = summary(rows, refused if args.families != "curated" else {}, args, started)
    print(json.dumps({"smoke": True, **figures} if args.smoke else figures))


if __name__ == "__main__":
    main()
