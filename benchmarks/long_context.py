"""The learner at long lengths: peak memory and step time of one forward and backward of
`response_logprobs` with the entropy, whole logits against chunked ones (issue 36, item 4).

The model: a Qwen3-style dense decoder built from its transformers config in code, random init, no
downloads: Qwen's 151,936-token vocabulary (untied head, as Qwen3-8B and up) over a small body
(hidden 256, 2 layers, 4 query and 2 key-value heads of 64), so that the vocabulary dominates.
One sequence of T tokens, a 64-token prompt and the rest response, packed (the learner's default).

Arms:
- whole: `learner.logit_chunk_tokens=0`, the forward before this change: logits [T_response, V] in
  float32, logsumexp, the entropy's softmax, all kept for backward;
- chunked: the default (2048 positions a chunk): log π and the entropy from the head's input, each
  chunk's logits recomputed in backward.

Each (T, arm) runs in a fresh subprocess, so peaks do not mix: it builds the model, resets its peak
resident set (/proc/self/clear_refs), runs the step, and reports the peak resident set above the
resident set before the step (`resource.getrusage`), i.e. the step's own memory (activations,
logits, gradients). The subprocess's address space is capped at what this machine has available
(less a margin): a step that needs more fails its allocation and is recorded as out of memory,
without pushing the machine's other processes out. Arms alternate within a round; rounds repeat
the cells that fit the time budget (`--budget-s`), so the short lengths get 3 runs (mean ± sd) and
the longest may get one. torch runs on `--threads` threads (default: every core).

    python benchmarks/long_context.py [--lengths 2048 4096 16384 32768] [--repeats 3] [--budget-s 480]
    python benchmarks/long_context.py --smoke      # a 4k vocabulary, T = 256, 512: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.spread import mean_sd  # noqa: E402

GIB = 2**30
PROMPT = 64
ARMS = ["whole", "chunked"]
FULL = {"vocab": 151936, "hidden": 256, "layers": 2, "lengths": [2048, 4096, 16384, 32768], "chunk": 2048}
SMOKE = {"vocab": 4096, "hidden": 64, "layers": 2, "lengths": [256, 512], "chunk": 128}
MARGIN_GIB = 2.5  # left to the machine's other processes when a step's address space is capped


# ---- one measurement, in its own process ----------------------------------------------------------
def _model(vocab: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen3ForCausalLM(config).train()


def _batch(vocab: int, length: int):
    import numpy as np

    from slime.algorithms.batch import collate
    from slime.sample import Sample, Status

    rng = np.random.default_rng(0)
    s = Sample(group_id="g", index=0, prompt_ids=rng.integers(3, vocab, PROMPT).tolist(), max_new_tokens=length)
    s.append(rng.integers(3, vocab, length - PROMPT).tolist(), np.zeros(length - PROMPT), 0)
    s.status, s.reward = Status.COMPLETED, 1.0
    return collate([s], [0], pad_id=0)


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _child(args: argparse.Namespace) -> None:
    import torch

    from slime.learner.forwards import response_logprobs
    from slime.learner.packing import use_packed_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args.vocab, args.hidden, args.layers)
    use_packed_attention(model)
    batch = _batch(args.vocab, args.length)
    chunk = args.chunk if args.arm == "chunked" else 0
    cap = _proc_kib("VmSize") * 1024 + int(args.mem_budget_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the step's
    before = _proc_kib("VmRSS") * 1024
    started = time.perf_counter()
    status = "ok"
    try:
        logp, entropy, _ = response_logprobs(
            model, batch, 1.0, with_entropy=True, packed=True, chunk_tokens=chunk, entropy_grad=True
        )
        (-(logp * batch.mask).sum() - 0.01 * (entropy * batch.mask).sum()).backward()
    except (RuntimeError, MemoryError) as e:
        if not isinstance(e, MemoryError) and "alloc" not in str(e):
            raise
        status = "oom"
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(json.dumps({"status": status, "peak_bytes": peak, "seconds": seconds}))


# ---- the driver -------------------------------------------------------------------------------
def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 8.0


def _measure(length: int, arm: str, shape: dict, args: argparse.Namespace) -> dict:
    budget = max(1.0, _available_gib() - MARGIN_GIB)
    cmd = [sys.executable, __file__, "--child", "--arm", arm, "--length", str(length), "--threads", str(args.threads)]
    cmd += ["--vocab", str(shape["vocab"]), "--hidden", str(shape["hidden"]), "--layers", str(shape["layers"])]
    cmd += ["--chunk", str(shape["chunk"]), "--mem-budget-gib", f"{budget:.2f}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s)
    if proc.returncode in (-9, 137):  # killed (the kernel's OOM killer): out of memory all the same
        return {"status": "oom", "peak_bytes": None, "seconds": None, "budget_gib": budget}
    if proc.returncode != 0:
        raise RuntimeError(f"T={length} {arm}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["budget_gib"], out["wall_s"] = budget, time.monotonic() - started
    return out


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares y = a + b x: (a, b, the largest residual relative to y)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    return a, b, max(abs(a + b * x - y) / y for x, y in zip(xs, ys))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny fast run (tests/test_benchmarks.py)")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths T (prompt 64, the rest response)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=480.0, help="no further repeats past this wall time")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cell-timeout-s", type=float, default=900.0)
    # one measurement (the driver runs itself with these)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mem-budget-gib", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    shape = dict(SMOKE if args.smoke else FULL)
    lengths = args.lengths or shape["lengths"]
    repeats = 1 if args.smoke else args.repeats
    started = time.monotonic()
    runs: dict[tuple[int, str], list[dict]] = {(t, a): [] for t in lengths for a in ARMS}
    oom: dict[tuple[int, str], float] = {}  # cell -> the memory it did not fit in (GiB)
    print(
        f"vocab {shape['vocab']}, hidden {shape['hidden']}, {shape['layers']} layers, chunk {shape['chunk']}, "
        f"{args.threads} threads; {os.cpu_count()} cores {_cpu()}, {_available_gib():.1f} GiB available",
        flush=True,
    )
    for rnd in range(repeats):
        for t in lengths:
            for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:  # arms alternate, the order too
                cell = (t, arm)
                if cell in oom or (rnd > 0 and not runs[cell]):
                    continue
                if rnd > 0:  # a repeat only where the time allows
                    est = max(r["wall_s"] for r in runs[cell])
                    if time.monotonic() - started + est > args.budget_s:
                        continue
                r = _measure(t, arm, shape, args)
                if r["status"] == "oom":
                    oom[cell] = r["budget_gib"]
                    print(f"  T={t:>6} {arm:>8}: out of memory (capped at {r['budget_gib']:.1f} GiB)", flush=True)
                    continue
                runs[cell].append(r)
                print(
                    f"  T={t:>6} {arm:>8}: peak {r['peak_bytes'] / GIB:6.2f} GiB, step {r['seconds']:6.1f} s",
                    flush=True,
                )
    figures: dict[str, object] = {"smoke": args.smoke, **{k: shape[k] for k in ("vocab", "hidden", "layers")}}
    figures.update(chunk_tokens=shape["chunk"], threads=args.threads, prompt_tokens=PROMPT)
    stats: dict[tuple[int, str], tuple[float, float, float, float]] = {}
    for (t, arm), rs in runs.items():
        key = f"T{t}_{arm}"
        if (t, arm) in oom:
            figures[f"oom_{key}"] = True
            figures[f"oom_cap_gib_{key}"] = round(oom[(t, arm)], 2)
            continue
        peak, peak_sd = mean_sd([r["peak_bytes"] / GIB for r in rs])
        step, step_sd = mean_sd([r["seconds"] for r in rs])
        stats[(t, arm)] = (peak, peak_sd, step, step_sd)
        figures.update(
            {
                f"peak_gib_{key}": round(peak, 3),
                f"peak_gib_sd_{key}": round(peak_sd, 3),
                f"peak_bytes_per_token_{key}": round(peak * GIB / t),
                f"step_s_{key}": round(step, 2),
                f"step_s_sd_{key}": round(step_sd, 2),
                f"runs_{key}": len(rs),
            }
        )
    longest = max(lengths)
    chunked = sorted(t for t in lengths if (t, "chunked") in stats)
    whole = sorted(t for t in lengths if (t, "whole") in stats)
    if len(chunked) >= 2:
        a, b, resid = _linear_fit(chunked, [stats[(t, "chunked")][0] for t in chunked])
        figures.update(
            chunked_peak_gib_intercept=round(a, 3),
            chunked_peak_gib_per_1k_tokens=round(b * 1024, 4),
            chunked_peak_linear_fit_max_residual_pct=round(100 * resid, 2),
        )
    if len(whole) >= 2:  # the whole path is linear in T: its logits are T x V floats a copy
        a, b, resid = _linear_fit(whole, [stats[(t, "whole")][0] for t in whole])
        figures.update(
            whole_peak_gib_intercept=round(a, 3),
            whole_peak_gib_per_1k_tokens=round(b * 1024, 4),
            whole_peak_linear_fit_max_residual_pct=round(100 * resid, 2),
        )
    if whole:  # the whole path's bytes per token where it fit, carried to the longest length
        per_token = stats[(whole[-1], "whole")][0] / whole[-1]
        if whole[-1] != longest:
            figures[f"whole_peak_gib_T{longest}_extrapolated"] = round(per_token * longest, 2)
        if (longest, "chunked") in stats and whole[-1] != longest:
            chunk_peak = stats[(longest, "chunked")][0]
            figures[f"chunked_over_whole_T{longest}_extrapolated"] = round(chunk_peak / (per_token * longest), 4)
            if (longest, "whole") in oom:  # whole did not fit in the cap: chunked / cap bounds the ratio
                figures[f"chunked_over_whole_T{longest}_at_most"] = round(chunk_peak / oom[(longest, "whole")], 4)
    for t in lengths:
        if (t, "whole") in stats and (t, "chunked") in stats:
            figures[f"chunked_over_whole_T{t}"] = round(stats[(t, "chunked")][0] / stats[(t, "whole")][0], 4)
    figures["wall_s"] = round(time.monotonic() - started, 1)

    def cell(t: int, arm: str, what: int) -> str:
        if (t, arm) in oom:
            return f"out of memory (> {oom[(t, arm)]:.1f} GiB)" if what == 0 else "-"
        if (t, arm) not in stats:
            return "-"
        mean, sd = stats[(t, arm)][2 * what : 2 * what + 2]
        runs_ = len(runs[(t, arm)])
        unit = "GiB" if what == 0 else "s"
        return f"{mean:.2f} ± {sd:.2f} {unit} ({runs_})" if runs_ > 1 else f"{mean:.2f} {unit} (1)"

    print()
    print("| T | whole: peak | chunked: peak | chunked / whole | chunked bytes / token | whole: step | chunked: step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in lengths:
        ratio = "-"
        if (t, "whole") in stats and (t, "chunked") in stats:
            ratio = f"{stats[(t, 'chunked')][0] / stats[(t, 'whole')][0]:.3f}"
        elif (t, "whole") in oom and (t, "chunked") in stats:
            ratio = f"< {stats[(t, 'chunked')][0] / oom[(t, 'whole')]:.3f}"
        per_token = f"{stats[(t, 'chunked')][0] * GIB / t / 1e3:.0f} kB" if (t, "chunked") in stats else "-"
        print(
            f"| {t:,} | {cell(t, 'whole', 0)} | {cell(t, 'chunked', 0)} | {ratio} | {per_token} "
            f"| {cell(t, 'whole', 1)} | {cell(t, 'chunked', 1)} |"
        )
    key = f"whole_peak_gib_T{longest}_extrapolated"
    if key in figures and (longest, "chunked") in stats:
        print(
            f"\nwhole at T={longest:,}, carried from its bytes per token at T={whole[-1]:,}: {figures[key]} GiB; "
            f"chunked / whole = {figures[f'chunked_over_whole_T{longest}_extrapolated']}"
        )
    figures["machine"] = f"{os.cpu_count()} cores {_cpu()}, torch threads {args.threads}"
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
