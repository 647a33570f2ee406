"""GPU check: learner and built-in engine on one GPU, weights pushed by CUDA IPC (no internet, < 5 min).

    python deploy/gpu_check.py                    # CUDA, random-init Qwen3 ~0.75B (bf16), CUDA IPC
    python deploy/gpu_check.py --device cpu --tiny   # the same code path on CPU (shared memory), seconds

Two processes, as in a job: the learner (this process) builds a random-init Qwen3 model in code
(no download) and takes one AdamW step; the engine process builds the same architecture with other
random weights inside a `slime.engines.builtin.BuiltinEngine`. Then:

1. weight sync: the learner publishes with `slime.weights.CudaIpcTransport` (shared memory on CPU),
   the engine applies it with `update_weights`; best of 3 syncs, seconds and GB/s;
2. probe check: the engine's logprobs of a fixed sequence must match the learner's;
3. decode: tokens/s of the engine at batch 32 and batch 1;
4. a real job (`--job-steps`, 3) with the local launcher (no Ray: the learner and the rollout
   worker on threads of this process, weights pushed in-process): the built-in defaults with the
   learner as an FSDP2 group of one in bf16 mixed precision, its shards gathered into the push, the
   probe check and the per-tensor checksums after every push, and the colocated engines freeing their
   KV memory while the learner trains.

Prints a short table and one JSON line last; exits 1 if a probe check fails or the job does.
With ``--engine-bench`` it then runs `benchmarks/gpu_engine.py` (its own table and JSON line last).
With ``--job`` it then runs `benchmarks/april_vs_sync.py --launcher local` on this device: sync,
APRIL x2 and async (staleness 2) on the long-tailed example task, alternating, 3 rounds (its own
table and JSON line last; ``--device cpu`` runs the same code on CPU).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# Qwen3-0.6B's shape with untied embeddings (~0.75B parameters), and a tiny one; benchmarks/gpu_learner.py
# builds the same two.
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def build_model(tiny: bool, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = TINY_QWEN3 if tiny else QWEN3_06B
    cfg = Qwen3Config(**shape, max_position_embeddings=1024 if tiny else 4096, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):  # initialise directly on the device: seconds, not minutes, for 0.75B
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype)


def probe_ids(vocab: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (48,), generator=g).tolist()
    return ids[:32], ids[32:]


def engine_process(args: argparse.Namespace, jobs: mp.Queue, results: mp.Queue) -> None:
    from slime.engines.builtin import BuiltinEngine
    from slime.engines.contract import GenerationRequest, SamplingParams
    from slime.weights import CudaIpcTransport, SharedMemoryTransport

    try:
        dtype = getattr(torch, args.dtype)
        model = build_model(args.tiny, args.device, dtype, seed=1)
        engine = BuiltinEngine(model, device=args.device, max_running_requests=64, seed=0)
        transport = (
            CudaIpcTransport() if args.device.startswith("cuda") else SharedMemoryTransport("slime_gpu_check_engine")
        )
        vocab = model.config.vocab_size
        results.put(("ready", sum(p.numel() for p in model.parameters())))
        while (job := jobs.get()) is not None:
            kind, payload = job
            if kind == "update":
                t0 = time.perf_counter()
                engine.update_weights(payload.version, transport.receive(payload))
                results.put(("updated", time.perf_counter() - t0))
            elif kind == "probe":
                prompt, response = probe_ids(vocab)
                results.put(("probe", engine.score_logprobs(prompt, response)))
            elif kind == "decode":
                batch, new_tokens = payload
                g = torch.Generator().manual_seed(7)
                reqs = [
                    GenerationRequest(
                        f"r{i}",
                        torch.randint(0, vocab, (64,), generator=g).tolist(),
                        SamplingParams(temperature=1.0, max_new_tokens=new_tokens),
                    )
                    for i in range(batch)
                ]
                # Warm-up at the timed batch: kernels, the allocator, and this batch size's graphs captured
                engine.generate([GenerationRequest("w" + r.request_id, r.prompt_ids, r.params) for r in reqs])
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = engine.generate(reqs)
                dt = time.perf_counter() - t0
                results.put(("decode", sum(len(c.token_ids) for c in out.values()) / dt))
        transport.close()
    except BaseException as e:
        import traceback

        results.put(("error", traceback.format_exc()))
        raise SystemExit(1) from e


def expect(results: mp.Queue, kind: str, timeout: float = 600):
    got, value = results.get(timeout=timeout)
    if got == "error":
        raise RuntimeError(f"engine process failed:\n{value}")
    assert got == kind, (got, kind)
    return value


def run_job(device: str, steps: int, model_path: str | None = None) -> dict:
    """A real job on the built-in defaults (tiny MoE, GRPO, APRIL) with the learner as an FSDP2 group
    of one in bf16 mixed precision: the weight push gathers its shards (CUDA IPC on a GPU, shared
    memory on CPU), the probe check runs after every push, and the colocated engines free their KV
    memory while the learner trains."""
    import tempfile

    from slime.config import load_config
    from slime.train import train

    overrides = [
        "cluster.launcher=local",  # no Ray on the GPU box: threads of this process
        f"output_dir={tempfile.mkdtemp(prefix='gpu_check_job_')}",
        f"steps={steps}",
        *([f"model.path={model_path}"] if model_path else []),
        f"learner.device={device}",
        f"rollout.device={device}",
        "learner.mixed_precision=true",
        "rollout.release_memory=true",
        "weights.check_every=1",
        "weights.checksum_every=1",  # every tensor, gathered from the shards, against the engine's
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]
    cfg = load_config(None, overrides)
    out: dict = {"steps": steps, "transport": cfg.weight_transport, "launcher": cfg.cluster.launcher}
    try:
        history = train(cfg)
    except Exception as e:  # reported in the table: the check's other rows still count
        return {**out, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {
        **out,
        "ok": len(history) == steps,
        "reward_first": float(history[0]["reward_mean"]),
        "reward_last": float(history[-1]["reward_mean"]),
        "learner_seconds": sum(h["learner_seconds"] for h in history) / len(history),
        "push_seconds": sum(h["weight_sync_seconds"] for h in history) / len(history),
        "learner_tokens_per_s": sum(h["batch_tokens"] for h in history) / sum(h["learner_seconds"] for h in history),
        "released_mb": sum(h.get("engine_memory_released_bytes", 0) for h in history) / len(history) / 2**20,
        "learner_model_tflops": sum(h["learner_model_tflops"] for h in history) / len(history),
        # None on CPU or a GPU slime.learner.flops does not know
        "learner_mfu": sum(h["learner_mfu"] for h in history) / len(history) if "learner_mfu" in history[0] else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--job-steps", type=int, default=3, help="then a real job of this many steps (0: none)")
    ap.add_argument("--job-model", default=None, help="the job's model directory (default: the tiny MoE, built)")
    ap.add_argument(
        "--engine-bench",
        action="store_true",
        help="last, benchmarks/gpu_engine.py (--quick with --tiny): decode against kernel time and roofline",
    )
    ap.add_argument(
        "--job",
        action="store_true",
        help="last, benchmarks/april_vs_sync.py --launcher local on --device: sync, APRIL x2, async2, 3 rounds",
    )
    ap.add_argument("--job-rounds", type=int, default=3)
    ap.add_argument("--job-bench-steps", type=int, default=12)
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device visible; for the CPU path run: python deploy/gpu_check.py --device cpu --tiny")
        return 2
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    dtype = getattr(torch, a.dtype)
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    started = time.perf_counter()

    from slime.weights import CudaIpcTransport, SharedMemoryTransport

    ctx = mp.get_context("spawn")  # CUDA cannot be shared with a forked child
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_process, args=(a, jobs, results), daemon=True)
    proc.start()
    learner = build_model(a.tiny, a.device, dtype, seed=0)
    n_params = expect(results, "ready")

    # One real training step, so the pushed weights are not the initial ones.
    opt = torch.optim.AdamW(learner.parameters(), lr=1e-4)
    ids = torch.randint(0, learner.config.vocab_size, (2, 64), device=a.device)
    learner.train()
    learner(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    learner.eval()
    del opt

    prompt, response = probe_ids(learner.config.vocab_size)
    with torch.no_grad():
        logits = learner(input_ids=torch.tensor([prompt + response], device=a.device)).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    expected = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]
    jobs.put(("probe", None))  # before the sync the engine holds other weights: the check must see it
    diff_before = max(abs(x - y) for x, y in zip(expect(results, "probe"), expected))

    transport = CudaIpcTransport() if cuda else SharedMemoryTransport("slime_gpu_check")
    nbytes = sum(p.numel() * p.element_size() for p in learner.parameters())
    best, engine_best = float("inf"), float("inf")
    for version in range(1, a.syncs + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = transport.publish(version, learner.named_parameters())
        jobs.put(("update", handle))
        engine_seconds = expect(results, "updated")
        best, engine_best = min(best, time.perf_counter() - t0), min(engine_best, engine_seconds)

    jobs.put(("probe", None))
    got = expect(results, "probe")
    probe_diff = max(abs(x - y) for x, y in zip(got, expected))

    jobs.put(("decode", (32, a.new_tokens)))
    tps32 = expect(results, "decode")
    jobs.put(("decode", (1, a.new_tokens)))
    tps1 = expect(results, "decode")
    jobs.put(None)
    proc.join(timeout=60)
    transport.close()

    job = run_job(a.device, a.job_steps, a.job_model) if a.job_steps else None
    total = time.perf_counter() - started
    probe_ok = probe_diff <= tolerance < diff_before
    ok = probe_ok and (job is None or job["ok"])
    rows = [
        ("device", f"{a.device} ({torch.cuda.get_device_name() if cuda else 'cpu'})"),
        ("model", f"Qwen3 random init, {n_params / 1e6:,.1f} M params, {a.dtype}"),
        ("transport", transport.name),
        ("weight sync (publish -> applied)", f"{best:.3f} s, {nbytes / best / 1e9:.2f} GB/s"),
        ("  engine apply only", f"{engine_best:.3f} s, {nbytes / engine_best / 1e9:.2f} GB/s"),
        (
            "probe |logp diff| max",
            f"{probe_diff:.2e} (tolerance {tolerance:.0e}; {diff_before:.2e} before the sync) "
            f"{'OK' if probe_ok else 'MISMATCH'}",
        ),
        ("decode batch 32", f"{tps32:.0f} tokens/s"),
        ("decode batch 1", f"{tps1:.0f} tokens/s"),
    ]
    if job is not None:
        rows += [
            (
                "job",
                f"{job['steps']} steps, {job['launcher']} launcher, FSDP2 learner (1 rank, bf16 mixed precision), "
                f"{job['transport']} push",
            ),
            ("  probe and checksum checks after each push", "OK" if job["ok"] else "FAILED: " + job.get("error", "")),
            (
                "  reward first -> last step",
                f"{job.get('reward_first', float('nan')):.3f} -> {job.get('reward_last', float('nan')):.3f}",
            ),
            ("  learner seconds per step", f"{job.get('learner_seconds', float('nan')):.2f}"),
            ("  push seconds per step", f"{job.get('push_seconds', float('nan')):.3f}"),
            (
                "  learner tokens/s (batch tokens / learner seconds)",
                f"{job.get('learner_tokens_per_s', float('nan')):.0f}",
            ),
            (
                "  learner model TFLOPS, MFU (6 x active params x tokens)",
                f"{job.get('learner_model_tflops', float('nan')):.3f}, "
                + ("n/a" if job.get("learner_mfu") is None else f"{job['learner_mfu']:.1%}"),
            ),
            ("  engine memory released per step", f"{job.get('released_mb', float('nan')):.1f} MB"),
        ]
    rows.append(("total wall", f"{total:.1f} s"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(
        json.dumps(
            {
                "check": "gpu_check",
                "device": a.device,
                "params": n_params,
                "dtype": a.dtype,
                "transport": transport.name,
                "weight_bytes": nbytes,
                "weight_sync_seconds": round(best, 4),
                "weight_sync_gb_per_s": round(nbytes / best / 1e9, 3),
                "engine_apply_seconds": round(engine_best, 4),
                "probe_max_abs_diff": probe_diff,
                "probe_diff_before_sync": diff_before,
                "probe_ok": probe_ok,
                "ok": ok,
                "decode_b32_tokens_per_s": round(tps32, 1),
                "decode_b1_tokens_per_s": round(tps1, 1),
                "job": job,
                "total_seconds": round(total, 1),
            }
        )
    )
    if a.engine_bench:
        ok = run_engine_bench(a.device, a.tiny) and ok
    if a.job:
        ok = run_job_bench(a.device, a.job_rounds, a.job_bench_steps) and ok
    return 0 if ok else 1


def run_job_bench(device: str, rounds: int, steps: int) -> bool:
    """APRIL where it pays: the whole job on this device under the local launcher, sync vs APRIL x2
    vs async (max_staleness 2), alternating; every push probe-checked (a mismatch fails the run)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        str(root / "benchmarks" / "april_vs_sync.py"),
        "--launcher=local",
        "--arms=sync,april2,async2",
        f"--runs={rounds}",
        f"--steps={steps}",
        "--eval-prompts=64",
        f"--set=rollout.device={device}",
        f"--set=learner.device={device}",
        "--set=weights.check_every=1",
        # Every arm keeps its engine memory (async cannot release it): a release drops the CUDA graphs
        # and APRIL's kept caches each step, which would penalise sync and APRIL alone.
        "--set=rollout.release_memory=false",
    ]
    print("\n$ " + " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, cwd=root).returncode == 0


def run_engine_bench(device: str, tiny: bool) -> bool:
    """benchmarks/gpu_engine.py in its own process (its models need the GPU's memory to themselves)."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_engine.py"
    cmd = [sys.executable, str(script), "--device", device] + (["--quick"] if tiny else [])
    print(f"\n$ {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
