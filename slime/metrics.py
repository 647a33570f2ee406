"""Progress bar, JSONL and TensorBoard metrics, and the end-of-run plot."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from slime.config import LoggingConfig


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int = 0):
        self.run_dir = run_dir
        self.cfg = cfg
        self.started = time.time()
        self.history: list[dict[str, float]] = []
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if cfg.jsonl else None
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = (
            tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True) if cfg.progress else None
        )

    def waiting(self, counts: dict[str, int], ready_needed: int) -> None:
        """Live buffer state while the step's groups are generated."""
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"ready {counts['groups_ready']}/{ready_needed} running {counts['running']} "
                f"resume {counts['queue_resume']} new {counts['queue_new']}",
                refresh=True,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        flat = flatten(metrics)
        flat["step"] = step
        flat["wall_seconds"] = time.time() - self.started
        self.history.append(flat)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(flat) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for key, value in flat.items():
                if math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"reward {flat.get('reward_mean', float('nan')):.3f} "
                f"len p50/p99 {flat.get('response_len_p50', 0):.0f}/{flat.get('response_len_p99', 0):.0f} "
                f"{flat.get('rollout_tokens_per_s', 0):.0f} tok/s "
                f"learn {flat.get('learner_seconds', 0):.1f}s "
                f"buf r{flat.get('buffer/groups_ready', 0):.0f}/p{flat.get('buffer/queue_resume', 0):.0f}",
                refresh=True,
            )

    def plot(self) -> Path | None:
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [h["wall_seconds"] for h in self.history]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        rewards = [h.get("reward_mean", math.nan) for h in self.history]
        ax1.plot(t, rewards, marker="o", ms=3, alpha=0.5, label="per step")
        window = 10
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        ax1.plot(t, smooth, color="tab:blue", lw=2, label=f"mean of last {window}")
        ax1.legend(loc="lower right")
        ax1.set_ylabel("mean reward")
        ax1.grid(alpha=0.3)
        ax2.plot(
            t, [h.get("rollout_tokens_per_s", math.nan) for h in self.history], marker="o", ms=3, color="tab:orange"
        )
        ax2.set_ylabel("rollout tokens/s")
        ax2.set_xlabel("wall-clock seconds")
        ax2.grid(alpha=0.3)
        fig.suptitle(self.run_dir.name)
        fig.tight_layout()
        path = self.run_dir / "training.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.cfg.plot:
            self.plot()
