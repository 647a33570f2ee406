"""Routing replay: the engine-vs-learner logprob gap of the same tokens, with and without replay.

The tiny MoE samples responses in the built-in engine (temperature 1) with its experts recorded;
the learner (float32, Hugging Face forward) then scores the same tokens twice, routing them itself
and replaying the engine's experts. Two engine precisions:
- float32: the engine computes what the learner computes (its fast path, other kernels);
- bfloat16: the usual rollout setting (vLLM and SGLang serve bf16 while the learner keeps fp32
  masters), where routers near a tie choose other experts in the engine than in the learner.
Per setting: mean |log π_learner − log μ_engine| over the response tokens, the mean of k3 (an
estimate of KL(μ‖π)), the largest gap, and the share of tokens whose recorded experts differ
from the learner's own choice in at least one layer. Deterministic (seeded); prints one JSON line.

    python benchmarks/routing_replay.py [--prompts 64] [--samples 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs import repeat  # noqa: E402
from slime.algorithms.batch import collate  # noqa: E402
from slime.config import ModelConfig  # noqa: E402
from slime.engines.builtin import BuiltinEngine  # noqa: E402
from slime.engines.contract import GenerationRequest, SamplingParams  # noqa: E402
from slime.engines.routing import NO_ROUTE, routers_of  # noqa: E402
from slime.learner import response_logprobs  # noqa: E402
from slime.model import ensure_model_dir, load_model, load_tokenizer  # noqa: E402
from slime.sample import Sample, Status  # noqa: E402


def sample_with_engine(model_dir: str, dtype: str, prompts: list[list[int]], n: int, tokens: int) -> list[Sample]:
    engine = BuiltinEngine(load_model(model_dir, dtype, "cpu"), record_routing=True, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    requests = [GenerationRequest(f"p{i}s{j}", p, params) for i, p in enumerate(prompts) for j in range(n)]
    out = engine.generate(requests)
    samples = []
    for r in requests:
        c = out[r.request_id]
        s = Sample(group_id=r.request_id, index=0, prompt_ids=r.prompt_ids, max_new_tokens=tokens)
        s.append(c.token_ids, c.logprobs, 0)
        s.routing = np.frombuffer(b"".join(c.routing), dtype=np.uint8).reshape(len(c.token_ids), -1).copy()
        s.status, s.reward = Status.COMPLETED, 0.0
        samples.append(s)
    return samples


@torch.no_grad()
def gaps(learner: torch.nn.Module, samples: list[Sample], micro: int = 32) -> dict[str, float]:
    diffs = {"own": [], "replay": []}
    k3 = {"own": [], "replay": []}
    differ, total = 0, 0
    for start in range(0, len(samples), micro):
        batch = collate(samples[start : start + micro], list(range(len(samples[start : start + micro]))), pad_id=0)
        mask = batch.mask > 0
        chosen: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda m, i, o, out=chosen: out.append(o[-1])) for r in routers_of(learner)]
        own = response_logprobs(learner, batch, 1.0)[0]
        for h in hooks:
            h.remove()
        replayed = response_logprobs(learner, batch, 1.0, replay=True)[0]
        for name, logp in (("own", own), ("replay", replayed)):
            log_ratio = (logp - batch.behaviour_logp)[mask]
            diffs[name].append(log_ratio.abs())
            k3[name].append(torch.expm1(log_ratio) - log_ratio)
        # Where the learner's own routing left the recorded experts (any layer), at the sampled positions.
        n, width = batch.input_ids.shape
        k = batch.routing.shape[-1] // len(chosen)
        own_choice = torch.cat([c.reshape(n, width, k) for c in chosen], dim=-1)
        at_pos = own_choice.gather(1, batch.response_pos[..., None].expand(-1, -1, own_choice.shape[-1]))
        recorded = batch.routing.long()
        per_layer_differs = [
            (
                at_pos[..., i * k : (i + 1) * k].sort(-1).values != recorded[..., i * k : (i + 1) * k].sort(-1).values
            ).any(-1)
            for i in range(len(chosen))
        ]
        any_differs = torch.stack(per_layer_differs, -1).any(-1) & mask & (recorded[..., 0] != NO_ROUTE)
        differ += int(any_differs.sum())
        total += int(mask.sum())
    out = {"tokens": total, "routing_differs_share": differ / max(total, 1)}
    for name in ("own", "replay"):
        d, kl = torch.cat(diffs[name]), torch.cat(k3[name])
        out[f"{name}_logp_abs_diff"] = float(d.mean())
        out[f"{name}_logp_abs_diff_max"] = float(d.max())
        out[f"{name}_kl"] = float(kl.mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.samples, args.tokens = 2, 1, 4
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model_dir = str(ensure_model_dir(ModelConfig(cache_dir=str(Path(tempfile.gettempdir()) / "slime_replay_models"))))
    tokenizer = load_tokenizer(model_dir)
    records = repeat.make_dataset(args.prompts, seed=123)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for r in records
    ]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    learner = load_model(model_dir, "float32", "cpu").eval()
    figures: dict[str, float] = {"smoke": True} if args.smoke else {}
    print(
        f"{'engine':>8} {'tokens':>7} {'experts differ':>15} {'|Δlogp| own':>12} {'replay':>9} {'KL own':>9} {'replay':>9}"
    )
    for dtype in ("float32", "bfloat16"):
        g = gaps(learner, sample_with_engine(model_dir, dtype, prompts, args.samples, args.tokens))
        print(
            f"{dtype:>8} {g['tokens']:>7} {g['routing_differs_share']:>15.4f} {g['own_logp_abs_diff']:>12.2e} "
            f"{g['replay_logp_abs_diff']:>9.2e} {g['own_kl']:>9.2e} {g['replay_kl']:>9.2e}"
        )
        for key, value in g.items():
            figures[f"{dtype}_engine_{key}"] = round(value, 8) if isinstance(value, float) else value
        figures[f"{dtype}_engine_replay_over_own_logp_gap_ratio"] = round(
            g["replay_logp_abs_diff"] / max(g["own_logp_abs_diff"], 1e-12), 4
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
