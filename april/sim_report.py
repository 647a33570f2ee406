"""The simulator's report: each policy against sync (`headline`), the table `slime simulate` prints,
and its plot. april/sim.py runs the policies."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # april/sim.py imports this module
    from april.sim import SimResult


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
