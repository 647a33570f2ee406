"""Weight-sync throughput: shared memory, broadcast (gloo) and safetensors files, learner -> engine
process, against a plain in-process memory copy of the same bytes (the physical limit here).

One sync = the learner publishes a version and a separate engine process copies every tensor into
its own parameters (what `BuiltinEngine.update_weights` does); the clock runs from publish to the
engine's acknowledgement. Each transport runs a warm-up sync (segment creation, group setup), then
`--repeats` timed syncs; the best is reported. Prints one JSON line last.

    python benchmarks/weight_sync.py [--total-mb 256] [--bucket-mb 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slime.weights import BroadcastTransport, FileTransport, SharedMemoryTransport  # noqa: E402


def make_tensors(total_mb: float, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A model-shaped set of fp32 tensors: a few large matrices and many small ones."""
    g = torch.Generator().manual_seed(seed)
    total = int(total_mb * 2**20 / 4)
    named, used, i = [], 0, 0
    while used < total:
        n = min(total - used, 1 << 21 if i % 4 else 1 << 12)  # 8 MB matrices, 16 KB norms/biases
        named.append((f"layer{i}.weight", torch.randn(n, generator=g)))
        used, i = used + n, i + 1
    return named


def engine_process(total_mb: float, bucket_mb: float, jobs: mp.Queue, acks: mp.Queue) -> None:
    torch.set_num_threads(1)
    params = {n: torch.zeros_like(t) for n, t in make_tensors(total_mb, seed=1)}
    transports = {
        "shm": SharedMemoryTransport("slime_bench_unused"),
        "file": FileTransport(tempfile.gettempdir()),
        "broadcast": BroadcastTransport(bucket_mb),
    }
    try:
        while (job := jobs.get()) is not None:
            kind, handle = job
            try:
                with torch.no_grad():
                    for name, t in transports[kind].receive(handle):
                        params[name].copy_(t)
            except Exception as exc:  # the parent raises it instead of waiting for an ack
                acks.put(("error", f"{kind}: {type(exc).__name__}: {exc}"))
                return
            probe = next(iter(params.values()))
            acks.put((kind, float(probe[:4].sum())))
    finally:
        for t in transports.values():
            t.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mb", type=float, default=256)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    a = ap.parse_args()
    if a.smoke:
        a.total_mb, a.bucket_mb, a.repeats = 4.0, 1.0, 1
    torch.set_num_threads(1)

    named = make_tensors(a.total_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    gb = nbytes / 1e9

    # The physical limit: one plain copy of the same bytes, in one process (measured before and
    # after the transports, best of all: a busy machine slows it as much as the others).
    dst = [torch.empty_like(t) for _, t in named]

    def memcpy_seconds() -> float:
        best = float("inf")
        for _ in range(a.repeats + 1):
            t0 = time.perf_counter()
            for d, (_, s) in zip(dst, named):
                d.copy_(s)
            best = min(best, time.perf_counter() - t0)
        return best

    best_copy = memcpy_seconds()

    ctx = mp.get_context("spawn")
    jobs, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_process, args=(a.total_mb, a.bucket_mb, jobs, acks), daemon=True)
    proc.start()
    tmp = tempfile.mkdtemp(prefix="weight_sync_")
    senders = {
        "shm": SharedMemoryTransport(f"slime_bench_{os.getpid()}", a.bucket_mb),  # the receiver checks the prefix
        "broadcast": BroadcastTransport(a.bucket_mb, num_receivers=1, master_addr="127.0.0.1"),
        "file": FileTransport(tmp),
    }
    seconds: dict[str, float] = {}
    try:
        version = 0
        for kind, sender in senders.items():
            best = float("inf")
            for rep in range(a.repeats + 1):  # the first sync is the warm-up
                version += 1
                t0 = time.perf_counter()
                handle = sender.publish(version, named)
                jobs.put((kind, handle))
                got_kind, check = acks.get(timeout=600)
                dt = time.perf_counter() - t0
                if got_kind == "error":
                    raise RuntimeError(f"the engine process failed: {check}")
                assert got_kind == kind and abs(check - float(named[0][1][:4].sum())) < 1e-4, "engine got wrong weights"
                if rep:
                    best = min(best, dt)
            seconds[kind] = best
    finally:
        jobs.put(None)
        proc.join(timeout=60)
        for s in senders.values():
            s.close()
        for f in Path(tmp).glob("*"):
            f.unlink()
        os.rmdir(tmp)

    best_copy = min(best_copy, memcpy_seconds())
    copy_gb_s = gb / best_copy
    result = {
        "benchmark": "weight_sync",
        **({"smoke": True} if a.smoke else {}),
        "machine": f"{os.cpu_count()} cpu, {platform.processor() or platform.machine()}, no GPU",
        "bytes": nbytes,
        "bucket_mb": a.bucket_mb,
        "memcpy_gb_per_s": round(copy_gb_s, 3),
    }
    for kind, s in seconds.items():
        result[f"{kind}_seconds"] = round(s, 4)
        result[f"{kind}_gb_per_s"] = round(gb / s, 3)
        result[f"{kind}_vs_memcpy_ratio"] = round((gb / s) / copy_gb_s, 3)
    for kind in seconds:
        print(
            f"{kind:>10}: {seconds[kind]:.3f} s  {gb / seconds[kind]:.2f} GB/s  ({(gb / seconds[kind]) / copy_gb_s:.2f} x memcpy)"
        )
    print(f"{'memcpy':>10}: {best_copy:.3f} s  {copy_gb_s:.2f} GB/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
