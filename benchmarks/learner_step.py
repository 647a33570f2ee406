"""The learner's step, before and after its forward became padding-free (issue 21, item 3).

One in-process `Learner` (a real redis-server for its buffer, no Ray) runs GRPO updates on a fixed
batch of 4 prompts x 8 samples; the time of `Learner.update` is the step's learner time. Arms:
- before: the forward as it was until 2026-12-03 (`legacy_response_logprobs` below): logits at
  every position of padded rows, an [N, T, V] log-softmax, the entropy inside the autograd graph,
  and torch's default AdamW;
- padded: today's forward on padded rows (`learner.packing=false`): logits only where a response
  token is predicted, log π = logit - logsumexp, the entropy outside the graph when its
  coefficient is 0;
- packed: today's default (`learner.packing=true`): the same on the rows laid end to end;
- packed_unfused: packed with torch's default AdamW (one op per tensor on CPU) in place of the
  fused kernel the learner takes since 2026-12-06 (`make_adamw`).

Workloads (each model random-init from its transformers config; the learner's speed does not
depend on the weights):
- qwen2_moe: the issue's model, Qwen2-MoE with 8 experts plus a shared expert, 2.2M parameters,
  the char tokenizer (102 tokens); responses long-tailed (most stop early) and full (all 64);
- qwen3_moe: the project's default tiny MoE (TinyModelConfig), long-tailed;
- llama: a dense Llama, 3.2M parameters, long-tailed;
- qwen3_moe_32k: the default MoE with a 32,000-token vocabulary (real tokenizers have 32k-150k),
  full-length responses.

Arms alternate within each round (before, padded, packed, then the next round), `--rounds` rounds;
each arm builds its learner, runs one warm-up update, then `--steps` timed updates. One torch
thread (the learner actor's default). Prints a table, then one JSON line.

    python benchmarks/learner_step.py [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks import models as zoo  # noqa: E402
from benchmarks.spread import mean_sd  # noqa: E402
from slime.algorithms.batch import Batch  # noqa: E402
from slime.algorithms.core import entropy_from_logits  # noqa: E402
from slime.buffer.redis_server import LocalRedisServer  # noqa: E402
from slime.config import TinyModelConfig, load_config  # noqa: E402
from slime.learner import Learner  # noqa: E402
from slime.learner import actor as learner_actor  # noqa: E402
from slime.model import build_char_tokenizer, build_tiny_moe  # noqa: E402
from slime.sample import Sample, Status  # noqa: E402

PROMPTS, SAMPLES, MAX_NEW = 4, 8, 64
ARMS = ["before", "padded", "packed", "packed_unfused"]


def legacy_response_logprobs(model, batch: Batch, temperature: float, with_entropy=False, with_aux=False, **_):
    """The learner's forward until 2026-12-03 (routing replay aside): logits at every position."""
    kwargs = {"output_router_logits": True} if with_aux else {}
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs)
    vocab = out.logits.shape[-1]
    logits = out.logits.gather(1, batch.response_pos[..., None].expand(-1, -1, vocab)) / temperature
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = entropy_from_logits(logits.float()) if with_entropy else None
    return logp, entropy, getattr(out, "aux_loss", None) if with_aux else None


def build_models(root: Path, names: set[str]) -> dict[str, Path]:
    tokenizer = build_char_tokenizer()
    vocab = len(tokenizer)
    builders = {
        "qwen2_moe": lambda: zoo.build("qwen2_moe", vocab),
        "qwen3_moe": lambda: build_tiny_moe(TinyModelConfig(), vocab),
        "llama": lambda: zoo.build("llama", vocab),
        "qwen3_moe_32k": lambda: build_tiny_moe(TinyModelConfig(), 32000),
    }
    models = {name: build() for name, build in builders.items() if name in names}
    dirs = {}
    for name, model in models.items():
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def fixed_batch(vocab: int, lengths: str, seed: int = 0) -> tuple[list[Sample], list[int]]:
    """4 prompts x 8 samples; `long_tail`: response lengths 4 + Exp(mean 14), capped at 64; `full`: all 64."""
    rng = np.random.default_rng(seed)
    samples, group_ids = [], []
    for g in range(PROMPTS):
        prompt = rng.integers(6, min(vocab, 100), size=int(rng.integers(20, 40))).tolist()
        for i in range(SAMPLES):
            n = MAX_NEW if lengths == "full" else int(min(MAX_NEW, 4 + rng.exponential(14)))
            s = Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, max_new_tokens=MAX_NEW)
            s.append(rng.integers(6, min(vocab, 100), size=n), -rng.random(n).astype(np.float32) - 0.5, 0)
            s.status, s.reward = Status.COMPLETED, float(rng.random() < 0.5)
            samples.append(s)
            group_ids.append(g)
    return samples, group_ids


def run_arm(arm: str, model_dir: Path, redis_url: str, batch, steps: int, out_dir: Path) -> dict:
    cfg = load_config(
        None,
        [
            f"job_name=learner-step-{arm}",
            f"output_dir={out_dir}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            f"learner.packing={arm.startswith('packed')}",
            "cluster.torch_threads=1",
        ],
    )
    patch = (
        contextlib.nullcontext()
        if arm != "before"
        else _patched(learner_actor, "response_logprobs", legacy_response_logprobs)
    )
    with patch:
        learner = Learner(cfg, str(model_dir), redis_url)
        if arm == "packed_unfused" or arm == "before":  # the optimizer as it was before make_adamw
            settings = {k: learner.optim.defaults[k] for k in ("lr", "betas", "weight_decay")}
            learner.optim = torch.optim.AdamW(learner.trainable, **settings)
        samples, group_ids = batch
        learner.update(samples, group_ids, 0)  # warm-up
        times = []
        for step in range(steps):
            start = time.perf_counter()
            learner.update(samples, group_ids, step + 1)
            times.append(time.perf_counter() - start)
        packed = learner.packed
        learner.buffer.delete_job()
        learner.close()
    return {"step_s": float(np.mean(times)), "packed": packed}


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    torch.set_num_threads(1)
    wall = time.time()
    workloads = [
        ("qwen2_moe", "long_tail"),
        ("qwen2_moe", "full"),
        ("qwen3_moe", "long_tail"),
        ("llama", "long_tail"),
        ("qwen3_moe_32k", "full"),
    ]
    if args.smoke:  # one workload, the project's default model
        workloads = [("qwen3_moe", "long_tail")]
    results: dict[str, dict[str, list[float]]] = {f"{m}_{lengths}": {a: [] for a in ARMS} for m, lengths in workloads}
    tokens: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, LocalRedisServer(Path(tmp) / "redis", aof=False) as redis:
        dirs = build_models(Path(tmp) / "models", {m for m, _ in workloads})
        batches = {}
        for model, lengths in workloads:
            vocab = 32000 if model.endswith("32k") else 102
            samples, group_ids = fixed_batch(vocab, lengths)
            batches[(model, lengths)] = (samples, group_ids)
            real = sum(len(s.prompt_ids) + s.response_length for s in samples)
            width = max(len(s.prompt_ids) + s.response_length for s in samples)
            tokens[f"{model}_{lengths}"] = {
                "response_tokens": float(sum(s.response_length for s in samples)),
                "padding_share": round(1 - real / (width * len(samples)), 3),
            }
        for r in range(args.rounds):
            for model, lengths in workloads:
                for arm in ARMS:
                    res = run_arm(
                        arm, dirs[model], redis.url, batches[(model, lengths)], args.steps, Path(tmp) / "runs"
                    )
                    assert res["packed"] == arm.startswith("packed"), (model, arm, res)
                    results[f"{model}_{lengths}"][arm].append(res["step_s"])
                    print(
                        f"round {r} {model:14s} {lengths:9s} {arm:7s} {res['step_s'] * 1000:8.1f} ms/step", flush=True
                    )
    line: dict = {
        **({"smoke": True} if args.smoke else {}),
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "batch": f"{PROMPTS}x{SAMPLES}",
        "max_new_tokens": MAX_NEW,
    }
    header = " ".join(f"{a:>14s}" for a in ARMS)
    print(f"\n{'workload':26s} {'padding':>8s} {header} {'before/packed':>13s} {'unfused/fused':>13s}")
    for name, arms in results.items():
        stats = {a: mean_sd(arms[a]) for a in ARMS}
        for a in ARMS:
            line[f"{name}_{a}_step_ms"] = round(stats[a][0] * 1000, 1)
            line[f"{name}_{a}_step_ms_sd"] = round(stats[a][1] * 1000, 1)
        speedup = stats["before"][0] / stats["packed"][0]
        line[f"{name}_before_over_packed_step_time_ratio"] = round(speedup, 3)
        line[f"{name}_padded_over_packed_step_time_ratio"] = round(stats["padded"][0] / stats["packed"][0], 3)
        unfused = stats["packed_unfused"][0] / stats["packed"][0]
        line[f"{name}_unfused_over_fused_adamw_step_time_ratio"] = round(unfused, 3)
        line[f"{name}_padding_share"] = tokens[name]["padding_share"]
        cells = " ".join(f"{stats[a][0] * 1000:8.1f}±{stats[a][1] * 1000:4.1f}" for a in ARMS)
        print(f"{name:26s} {tokens[name]['padding_share']:8.2f} {cells} {speedup:12.2f}x {unfused:12.2f}x")
    line["min_before_over_packed_step_time_ratio"] = min(
        v for k, v in line.items() if k.endswith("_before_over_packed_step_time_ratio")
    )
    line["machine"] = f"{os.cpu_count()} cpu, {platform.machine()}, torch threads 1"
    line["wall_s"] = round(time.time() - wall, 1)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
