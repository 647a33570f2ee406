"""Sandbox throughput for a trivial program (`print(1)`): sequential vs pooled, and the overhead
over running the same program without a sandbox (plain `subprocess.run([python, "-c", ...])`).

    python benchmarks/sandbox.py [--n 40] [--pool 2 4]

Prints a small table, then LAST one JSON line. Takes well under 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.sandbox import Sandbox, SandboxConfig, SandboxPool

CODE = "print(1)"


def bench_plain(python: str, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        r = subprocess.run([python, "-c", CODE], capture_output=True, check=True)
        assert r.stdout == b"1\n"
    return n / (time.perf_counter() - t0)


def bench_sequential(sb: Sandbox, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        r = sb.run_python(CODE)
        assert r.status == "ok" and r.stdout == "1\n", r
    return n / (time.perf_counter() - t0)


def bench_pool(cfg: SandboxConfig, size: int, n: int) -> float:
    with SandboxPool(cfg, max_concurrency=size) as pool:
        pool.map([CODE] * size)  # warm the threads
        t0 = time.perf_counter()
        results = pool.map([CODE] * n)
        rate = n / (time.perf_counter() - t0)
    assert all(r.status == "ok" for r in results)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--pool", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--smoke", action="store_true", help="smallest settings, a check that it runs (not figures to quote)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.n, args.pool = 2, [2]
    cfg = SandboxConfig(timeout_s=10)
    sb = Sandbox(cfg)
    sb.check()
    sb.run_python(CODE)  # warm-up (probe, page cache)
    bench_plain(cfg.python, 3)

    plain = bench_plain(cfg.python, args.n)
    seq = bench_sequential(sb, args.n)
    pooled = {size: bench_pool(cfg, size, args.n) for size in args.pool}

    print(f"{'mode':<22}{'exec/s':>10}{'ms/exec':>10}")
    print(f"{'plain subprocess':<22}{plain:>10.1f}{1000 / plain:>10.1f}")
    print(f"{'sandbox sequential':<22}{seq:>10.1f}{1000 / seq:>10.1f}")
    for size, rate in pooled.items():
        print(f"{f'sandbox pool={size}':<22}{rate:>10.1f}{1000 / rate:>10.1f}")
    print(f"sandbox overhead over plain subprocess: {plain / seq:.2f}x time per execution (sequential)")

    out = {
        "bench": "sandbox",
        **({"smoke": True} if args.smoke else {}),
        "n_execs": args.n,
        "plain_subprocess_execs_per_s": round(plain, 2),
        "sandbox_sequential_execs_per_s": round(seq, 2),
        **{f"sandbox_pool{size}_execs_per_s": round(rate, 2) for size, rate in pooled.items()},
        "sandbox_overhead_ratio_x": round(plain / seq, 3),
        "sandbox_ms_per_exec": round(1000 / seq, 2),
        "plain_ms_per_exec": round(1000 / plain, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
