"""The simulator's results (`SimResult`, one per policy run) and their report: each policy against
sync (`headline`), the table `slime simulate` prints, and its plot. april/sim/run.py runs the
policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class SimResult:
    policy: str  # label, e.g. "april_x2"
    oversample: float | None
    max_staleness: int | None
    steps: int
    wall_s: float
    step_s: float  # mean wall-clock seconds per training step
    generated_tokens: int
    trained_tokens: int  # response tokens trained on
    held_tokens: int  # generated, not trained yet at the end (partials, queued groups): not waste
    wasted_tokens: int  # generated and thrown away by the policy (aborted and dropped)
    filtered_tokens: int  # generated in groups the dynamic-sampling filter dropped
    rollout_s: float | None  # wave policies: mean seconds of a step's rollout phase (start to abort done)
    trained_rollout_throughput: float | None  # trained response tokens per rollout-phase second
    throughput: float  # generated tokens / wall-clock second
    trained_throughput: float  # trained response tokens / wall-clock second
    engine_busy: float  # slot occupancy: mean share of slots decoding, over engines and wall-clock
    engine_stepping: float  # share of wall-clock an engine is executing steps (any batch size)
    bubble_ratio: float  # 1 - engine_busy
    learner_busy: float  # share of wall-clock the learner trains
    off_policy_share: float  # trained tokens produced by a version older than the trainer's
    span_histogram: dict[int, int]  # trainer version - oldest token version, per trained sample
    max_span: int
    partials: int  # requests aborted with tokens kept for resumption
    preemptions: int
    prefill_tokens: int  # prefix tokens prefilled (new prompts, resumed partials, preempted requests)
    mean_engines: float  # engines (GPUs they hold) averaged over wall-clock; elastic varies it
    step_times: list[float] = field(default_factory=list)
    engines_per_step: list[int] = field(default_factory=list)  # engines (running or starting) at each step end


def headline(results: list[SimResult]) -> dict[str, float]:
    """Each policy relative to sync (the first result named 'sync'): generated tokens per second, and
    for the wave policies trained tokens per rollout-phase second (`<policy>_trained_per_rollout_s`)."""
    sync = next(r for r in results if r.policy == "sync")
    out: dict[str, float] = {}
    for r in results:
        if r.policy == "sync":
            continue
        out[r.policy] = round(r.throughput / sync.throughput, 3)
        if r.trained_rollout_throughput and sync.trained_rollout_throughput:
            out[f"{r.policy}_trained_per_rollout_s"] = round(
                r.trained_rollout_throughput / sync.trained_rollout_throughput, 3
            )
    return out


def format_table(results: list[SimResult]) -> str:
    sync = next((r for r in results if r.policy == "sync"), results[0])
    head = (
        f"{'policy':<24} {'tok/s':>9} {'vs sync':>8} {'trained/s':>9} {'step s':>8} {'engines':>7} {'engine busy':>11} "
        f"{'off-policy':>10} {'max span':>8} {'wasted tok':>10} {'filtered tok':>12} {'trained/rollout s':>17}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        per_rollout = "n/a"
        if r.trained_rollout_throughput and sync.trained_rollout_throughput:
            per_rollout = (
                f"{r.trained_rollout_throughput:.0f} "
                f"({r.trained_rollout_throughput / sync.trained_rollout_throughput:.2f}x)"
            )
        rows.append(
            f"{r.policy:<24} {r.throughput:>9.0f} {r.throughput / sync.throughput:>7.2f}x {r.trained_throughput:>9.0f} "
            f"{r.step_s:>8.2f} {r.mean_engines:>7.1f} {100 * r.engine_busy:>10.1f}% {100 * r.off_policy_share:>9.1f}% "
            f"{r.max_span:>8d} "
            f"{r.wasted_tokens:>10d} {r.filtered_tokens:>12d} {per_rollout:>17}"
        )
    return "\n".join(rows)


def plot(results: list[SimResult], path: str | Path) -> Path:
    """Bars: throughput relative to sync, and off-policy token share, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r.throughput for r in results if r.policy == "sync"), results[0].throughput)
    names = [r.policy for r in results]
    x = np.arange(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    bars = ax1.bar(x, [r.throughput / base for r in results], color="tab:blue")
    ax1.bar_label(bars, fmt="%.2f", fontsize=8)
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_title("rollout throughput vs sync")
    ax1.set_ylabel("ratio")
    bars = ax2.bar(x, [100 * r.off_policy_share for r in results], color="tab:orange")
    ax2.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax2.set_title("off-policy token share")
    ax2.set_ylabel("% of trained tokens")
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
