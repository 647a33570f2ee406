"""A step's clocks; progress bar, JSONL metrics, the end-of-run plot, and the tracking sinks (TensorBoard,
W&B, MLflow: slime/tracking.py) every step's metrics fan out to."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from slime.config import LoggingConfig
from slime.security import redact
from slime.tracking import build_sinks

HISTORY_ROWS = 1000  # full rows MetricsLogger keeps in memory (train() returns them)


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


class TooManyFailures(RuntimeError):
    """More samples failed over the last steps than reward.max_failed_share allows."""


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each point's mean over the last ``window`` finite values: a step without one (every sample
    failed: NaN) neither blanks the next ``window`` points nor breaks the line."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


class FailureWatch:
    """Makes failed samples loud. Each new kind of failure is printed once, with an example; when
    the failed share of the samples of the last `window` steps passes `max_share`, `check`
    raises TooManyFailures naming the most common reasons (the job then stops, exit 1)."""

    def __init__(self, max_share: float, window: int, say=tqdm.write):
        self.max_share, self.window, self.say = max_share, window, say
        # (failed, samples, their reasons: count and an example) of the last steps
        self.recent: list[tuple[int, int, dict[str, dict]]] = []
        self.seen: set[str] = set()  # every reason printed once

    def observe(self, metrics: dict[str, Any]) -> None:
        reasons = metrics.get("failures_by_reason", {})
        for key, entry in reasons.items():
            if key not in self.seen:
                self.seen.add(key)
                self.say(f"failed sample ({key}): {entry['example']} [sample {entry['example_id']}]")
        step = (int(metrics.get("failed_samples", 0)), int(metrics.get("samples", 0)), reasons)
        self.recent = [*self.recent, step][-self.window :]

    def check(self, last_step: bool = False) -> None:
        """Judged once the window is full (or at the run's last step, for a run shorter than it)."""
        if len(self.recent) < self.window and not last_step:
            return
        failed, total = sum(s[0] for s in self.recent), sum(s[1] for s in self.recent)
        if total == 0 or failed / total <= self.max_share:
            return
        window: dict[str, dict] = {}  # the reasons of the same steps as the count above
        for _, _, reasons in self.recent:
            for key, entry in reasons.items():
                window.setdefault(key, {**entry, "count": 0})["count"] += entry["count"]
        top = sorted(window.items(), key=lambda kv: -kv[1]["count"])[:3]
        lines = [f"  {e['count']}x {key}\n      e.g. sample {e['example_id']}: {e['example']}" for key, e in top]
        raise TooManyFailures(
            f"{failed} of {total} samples failed over the last {len(self.recent)} steps "
            f"({failed / total:.0%} > reward.max_failed_share={self.max_share:g}); the job stops without "
            "checkpointing this step (a checkpoint written earlier in the window holds the steps before it). "
            "Most common reasons:\n" + "\n".join(lines)
        )


class StepClock:
    """The clocks of one step. Steps are contiguous: one starts where the last ended, so the step
    seconds add up to the loop's wall-clock. Its rollout clock runs while its engines may generate:
    from the resume when the last step aborted (APRIL: the partials go on while the driver ends the
    last step), from where the last window ended when the engines never stop (async), else from
    the step's start (its groups are scheduled next); until stop_rollout. Every generated token is
    counted in the rollout window it was made in."""

    def __init__(self, generated_tokens: Callable[[], float]) -> None:
        self._generated_tokens = generated_tokens  # every token generated so far (the buffer's count)
        self._boundary: float | None = None  # where this step ends and the next begins
        self._engines_released: tuple[float, float] | None = None  # (time, tokens): the next window's start
        self.started = self.rollout_started_at = self.rollout_ended_at = time.time()
        self.tokens_at_rollout_start = self.tokens_at_rollout_end = 0.0
        self.abort_sent_at: float | None = None  # APRIL's abort of this step, overlapping the learner
        self.abort_seconds = 0.0
        self.weight_sync_seconds = 0.0

    def next_step(self) -> None:
        now = time.time()
        self.started = now if self._boundary is None else self._boundary
        if self._engines_released is not None:
            self.rollout_started_at, self.tokens_at_rollout_start = self._engines_released
        else:
            self.rollout_started_at, self.tokens_at_rollout_start = now, self._generated_tokens()
        self.abort_sent_at, self.abort_seconds = None, 0.0
        self._boundary = self._engines_released = None

    def stop_rollout(self, abort_sent_at: float | None = None) -> None:
        """The engines stopped generating for this step (``abort_sent_at``: by APRIL's abort, now complete)."""
        self.rollout_ended_at = time.time()
        self.tokens_at_rollout_end = self._generated_tokens()
        if abort_sent_at is not None:
            self.abort_sent_at = abort_sent_at
            self.abort_seconds = self.rollout_ended_at - abort_sent_at

    def rollout_goes_on(self) -> None:
        """Async: the engines never stop; the next step's window starts where this one ended."""
        self._engines_released = (self.rollout_ended_at, self.tokens_at_rollout_end)

    def resumed(self) -> None:
        """The engines go on: the next step starts here, and after an abort its rollout clock too."""
        self._boundary = time.time()
        if self.abort_sent_at is not None:
            self._engines_released = (self._boundary, self._generated_tokens())

    def end(self) -> float:
        """The step ends (at the resume, if there was one); its seconds."""
        if self._boundary is None:
            self._boundary = time.time()
        return self._boundary - self.started

    def rollout_metrics(self) -> dict[str, float]:
        generated = self.tokens_at_rollout_end - self.tokens_at_rollout_start
        rollout_seconds = self.rollout_ended_at - self.rollout_started_at
        return {
            "rollout_seconds": rollout_seconds,
            "rollout_tokens_per_s": generated / max(rollout_seconds, 1e-9),
            "generated_tokens": generated,
            "abort_seconds": self.abort_seconds,  # inside rollout_seconds, overlapping the learner
        }

    def rollout_elapsed(self) -> float:
        return time.time() - self.rollout_started_at

    def tokens_since_rollout_start(self) -> float:
        return self._generated_tokens() - self.tokens_at_rollout_start


class MetricsLogger:
    """metrics.jsonl, the progress bar and the plot; every step also goes to the configured sinks
    (slime/tracking.py), which get `config` (the run's, secrets redacted) once. A sink that fails
    says so once and is off; a backend configured without its package raises ConfigError here."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        total_steps: int,
        start_step: int = 0,
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = run_dir
        self.cfg = cfg
        job_name = (config or {}).get("job_name")
        self.title = f"{job_name} ({run_dir.name})" if job_name and job_name != run_dir.name else run_dir.name
        self.sinks = build_sinks(run_dir, cfg, start_step, self.say)
        if config is not None:
            shown = redact(config)  # the caller redacted it (config_for_display); once more costs nothing
            for sink in self.sinks:
                sink.log_config(shown)
        # Memory stays bounded over a long job: the last HISTORY_ROWS steps' rows, and the plot's three
        # series of every step (24 bytes a step); metrics.jsonl holds every row.
        self.history: deque[dict[str, float]] = deque(maxlen=HISTORY_ROWS)
        self.curve = (array("d"), array("d"), array("d"))  # wall seconds, reward_mean, rollout_tokens_per_s
        # A resumed run continues the series: the steps it will redo are dropped from metrics.jsonl
        # (and from TensorBoard by purge_step), and its wall clock goes on from the last kept step.
        for row in _kept_rows(run_dir / "metrics.jsonl", start_step, rewrite=cfg.jsonl):
            self._remember(row)
        self.started = time.time() - (self.history[-1]["wall_seconds"] if self.history else 0.0)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if cfg.jsonl else None
        self.bar = (
            tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True) if cfg.progress else None
        )

    def say(self, message: str) -> None:
        """A line above the progress bar."""
        tqdm.write(message)

    def waiting(self, counts: dict[str, int], ready_needed: int) -> None:
        """Live buffer state while the step's groups are generated."""
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"ready {counts['groups_ready']}/{ready_needed} running {counts['running']} "
                f"resume {counts['queue_resume']} new {counts['queue_new']}",
                refresh=True,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # One copy of each metric's name, not one per kept step (names come fresh from Ray's unpickling
        # and from flatten's f-strings; 9.1 -> 3.6 KB a step)
        flat = {sys.intern(key): value for key, value in flatten(metrics).items()}
        flat["step"] = step
        flat["wall_seconds"] = time.time() - self.started
        self._remember(flat)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(flat) + "\n")
            self.jsonl.flush()
        finite = {key: value for key, value in flat.items() if math.isfinite(value)}
        for sink in self.sinks:
            sink.log_metrics(step, finite)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"reward {flat.get('reward_mean', float('nan')):.3f} "
                f"len p50/p99 {flat.get('response_len_p50', 0):.0f}/{flat.get('response_len_p99', 0):.0f} "
                f"{flat.get('rollout_tokens_per_s', 0):.0f} tok/s "
                f"learn {flat.get('learner_seconds', 0):.1f}s "
                f"buf r{flat.get('buffer/groups_ready', 0):.0f}/p{flat.get('buffer/queue_resume', 0):.0f}"
                + (f" failed {flat['failed_samples']:.0f}/{flat['samples']:.0f}" if flat.get("failed_samples") else ""),
                refresh=True,
            )

    def _remember(self, row: dict[str, float]) -> None:
        self.history.append(row)
        for series, key in zip(self.curve, ("wall_seconds", "reward_mean", "rollout_tokens_per_s")):
            series.append(float(row.get(key, math.nan)))

    def plot(self) -> Path | None:
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t, rewards, tokens_per_s = (list(series) for series in self.curve)
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        ax1.plot(t, rewards, marker="o", ms=3, alpha=0.5, label="per step")
        window = 10
        ax1.plot(t, trailing_mean(rewards, window), color="tab:blue", lw=2, label=f"mean of last {window}")
        ax1.legend(loc="lower right")
        ax1.set_ylabel("mean reward")
        ax1.grid(alpha=0.3)
        ax2.plot(t, tokens_per_s, marker="o", ms=3, color="tab:orange")
        ax2.set_ylabel("rollout tokens/s")
        ax2.set_xlabel("wall-clock seconds")
        ax2.grid(alpha=0.3)
        fig.suptitle(self.title)
        fig.tight_layout()
        path = self.run_dir / "training.png"
        tmp = path.with_name(".training.png.tmp")  # a full disk or a kill leaves the last plot whole
        try:
            fig.savefig(tmp, dpi=110, format="png")
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            tmp.unlink(missing_ok=True)
        return path

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        for sink in self.sinks:
            sink.close()
        if self.cfg.plot:
            self.plot()


def _kept_rows(path: Path, start_step: int, rewrite: bool) -> Iterator[dict[str, float]]:
    """The rows of the steps before start_step from an earlier run of this run dir (a resume), in
    order; nothing for a fresh run. With `rewrite`, metrics.jsonl is replaced by those rows, line by
    line (a long run's file is never held whole). A torn last line (the process died while writing
    it) is skipped."""
    if start_step == 0 or not path.exists():
        if rewrite:
            write_atomic(path, "")
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(path) as lines, open(tmp, "w") if rewrite else open(os.devnull, "w") as kept:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("step", start_step) < start_step:
                kept.write(json.dumps(row) + "\n")
                yield {sys.intern(key): value for key, value in row.items()}
    if rewrite:
        os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` at once: a reader (or a crash) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
