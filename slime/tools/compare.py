"""`slime compare RUN_DIR... [--metric M] [--out PNG]`: several runs side by side.

Each run directory (a job's output_dir) holds `metrics.jsonl` (a JSON object per step) and
`config.yaml`. Runs whose configs are equal except for the seed, the run's own names and paths
(`SEED_LIKE`) and how it is watched (`WATCHING`) are the seeds of one setting: a group, drawn as its mean with a min-max band and
labelled by the settings that differ between groups. The command writes one PNG (per metric: the
curve against the step and against wall-clock seconds) and prints a table of the final values
(each run's mean over its last `LAST_STEPS` steps; for a group the mean and sample std over its
runs), then one JSON line with the same figures."""

from __future__ import annotations

import difflib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from slime.config import RENAMED
from slime.errors import UserError

# Keys that name or seed one run rather than set what the runs compare (dotted paths of config.yaml):
# `seed` derives model.seed and data.seed; buffer.url is the job's own redis-server's port.
SEED_LIKE = frozenset(
    {
        "seed",
        "model.seed",
        "data.seed",
        "eval.seed",
        "job_name",
        "output_dir",
        "resume",
        "buffer.url",
        "model.cache_dir",
    }
)
# Sections that say how a run is watched (tracking names, the dashboard's port), not what it trains.
WATCHING = ("logging.", "dashboard.")
LAST_STEPS = 5
MAX_LABEL_KEYS = 5


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


class CompareError(UserError, ValueError):
    """A run directory, a metrics file or a metric that `slime compare` cannot use."""

    hint = "slime compare RUN_DIR... [--metric NAME]: each RUN_DIR is a job's output_dir (config.yaml, metrics.jsonl)"


@dataclass
class Run:
    name: str
    path: Path
    config: dict[str, Any] | None
    rows: list[dict[str, Any]]

    def values(self, metric: str) -> dict[int, float]:
        """step -> value of the steps that have the metric as a number."""
        return {r["step"]: float(r[metric]) for r in self.rows if isinstance(r.get(metric), (int, float))}

    def final(self, metric: str) -> float | None:
        """The metric's mean over the run's last LAST_STEPS steps that have it."""
        values = list(self.values(metric).values())[-LAST_STEPS:]
        return statistics.fmean(values) if values else None

    @property
    def wall_seconds(self) -> float:
        return float(self.rows[-1].get("wall_seconds", 0.0))


@dataclass
class Group:
    label: str
    runs: list[Run]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The steps of a metrics.jsonl, in step order; torn or foreign lines are skipped, and a step
    written twice keeps its last line."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def load_run(path: Path, name: str) -> Run:
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise CompareError(f"{path} is not a run directory: it has no metrics.jsonl")
    rows = read_metrics(metrics)
    if not rows:
        raise CompareError(f"{metrics} holds no complete step (empty, or only torn lines)")
    config_file = path / "config.yaml"
    config = yaml.safe_load(config_file.read_text(encoding="utf-8")) if config_file.is_file() else None
    return Run(name, path, config if isinstance(config, dict) else None, rows)


def run_names(paths: list[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two runs share a name (april2/run0)."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def setting(run: Run) -> dict[str, Any]:
    """What a run sets, seed-like keys left out; a run without config.yaml is a setting of its own."""
    if run.config is None:
        return {"run": str(run.path.resolve())}
    flat = {RENAMED.get(k, k): v for k, v in flatten(run.config).items()}  # an older run's moved keys
    return {k: v for k, v in flat.items() if k not in SEED_LIKE and not k.startswith(WATCHING)}


def show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def label_keys(differing: list[str], settings: list[dict[str, Any]]) -> list[str]:
    """At most MAX_LABEL_KEYS of the differing keys, chosen so the labels tell the groups apart:
    each next key is the one that separates the most groups still sharing a label (config order
    breaks ties), until every label differs; then in config order."""
    chosen: list[str] = []

    def distinct(keys: list[str]) -> int:
        return len({tuple(show(flat.get(k)) for k in keys) for flat in settings})

    while len(chosen) < min(MAX_LABEL_KEYS, len(differing)) and distinct(chosen) < len(settings):
        chosen.append(max((k for k in differing if k not in chosen), key=lambda k: distinct([*chosen, k])))
    chosen += [k for k in differing if k not in chosen][: MAX_LABEL_KEYS - len(chosen)]
    return sorted(chosen, key=differing.index)


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs of equal settings in one group each, in the order of their first run."""
    members: dict[str, list[Run]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for run in runs:
        flat = setting(run)
        key = json.dumps(flat, sort_keys=True, default=str)
        members.setdefault(key, []).append(run)
        settings.setdefault(key, flat)
    keys = list(dict.fromkeys(k for flat in settings.values() for k in flat))  # config.yaml's order
    differing = [k for k in keys if len({show(flat.get(k)) for flat in settings.values()}) > 1]
    shown = label_keys(differing, list(settings.values()))
    groups = []
    for key, members_ in members.items():
        parts = [f"{k}={show(settings[key].get(k))}" for k in shown]
        if len(differing) > MAX_LABEL_KEYS:
            parts.append(f"+{len(differing) - MAX_LABEL_KEYS} more")
        groups.append(Group(", ".join(parts) if parts else members_[0].name, members_))
    return groups


def check_metrics(runs: list[Run], metrics: list[str]) -> None:
    have = {k for run in runs for row in run.rows for k, v in row.items() if isinstance(v, (int, float))}
    have -= {"step"}
    for metric in metrics:
        if metric not in have:
            close = difflib.get_close_matches(metric, sorted(have), n=3)
            some = list(dict.fromkeys([*close, *sorted(have)]))[:6]
            raise CompareError(
                f"no run has the metric {metric!r}; they have {', '.join(some)}, ... ({len(have)} in all)",
                hint="--metric NAME, a key of the runs' metrics.jsonl lines",
            )


def curve(group: Group, metric: str) -> tuple[list[int], list[float], list[list[float]]]:
    """(steps, mean wall seconds, values per run) over the steps every run of the group has the metric at."""
    per_run = [run.values(metric) for run in group.runs]
    steps = sorted(set.intersection(*(set(v) for v in per_run)))
    walls = [{r["step"]: float(r.get("wall_seconds", 0.0)) for r in run.rows} for run in group.runs]
    wall = [statistics.fmean(w[s] for w in walls) for s in steps]
    return steps, wall, [[v[s] for v in per_run] for s in steps]


def legend(group: Group) -> str:
    names = [run.name for run in group.runs]
    if len(names) == 1:
        return names[0] if group.label == names[0] else f"{names[0]} ({group.label})"
    return f"{group.label}: mean of {len(names)} ({', '.join(names)}), min-max"


def plot(groups: list[Group], metrics: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legend_inches = 0.3 + 0.22 * len(groups)  # one legend above the panels, a line per group
    height = 3.6 * len(metrics) + legend_inches
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, height), squeeze=False)
    for row, metric in zip(axes, metrics):
        for index, group in enumerate(groups):  # a group's colour is the same in every panel
            steps, wall, values = curve(group, metric)
            color = f"C{index % 10}"
            for ax, x in zip(row, (steps, wall)):
                ax.plot(x, [statistics.fmean(v) for v in values], label=legend(group), color=color)
                if len(group.runs) > 1:
                    ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=color)
        for ax, xlabel in zip(row, ("step", "wall-clock seconds")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_inches / height))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def spread(values: list[float]) -> dict[str, float | None]:
    """mean, and the sample std over runs (None for one run)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def summary(group: Group, metrics: list[str]) -> dict[str, Any]:
    """The group's figures: mean (and std over its runs) of steps, wall seconds and each final metric."""
    figures: dict[str, Any] = {"label": group.label, "runs": [run.name for run in group.runs], "n": len(group.runs)}
    columns = {"steps": [float(len(run.rows)) for run in group.runs]}
    columns["wall_seconds"] = [run.wall_seconds for run in group.runs]
    for metric in metrics:
        columns[f"final_{metric}"] = [v for v in (run.final(metric) for run in group.runs) if v is not None]
    for name, values in columns.items():
        stats = spread(values) if values else {"mean": None, "std": None}
        figures[name] = stats["mean"]
        if len(group.runs) > 1:
            figures[f"{name}_std"] = stats["std"]
    return figures


def cell(figures: dict[str, Any], name: str) -> str:
    mean, std = figures.get(name), figures.get(f"{name}_std")
    if mean is None:
        return "-"
    return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def table(summaries: list[dict[str, Any]], metrics: list[str]) -> str:
    header = ["group", "n", "steps", "wall_seconds"]
    columns = ["steps", "wall_seconds", *(f"final_{m}" for m in metrics)]
    rows = [header + [f"final {m}" for m in metrics]]
    rows += [[s["label"], str(s["n"]), *(cell(s, c) for c in columns)] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    note = f"final = a run's mean over its last {LAST_STEPS} steps; a group: mean ± sample std over its n runs"
    return "\n".join([note, *lines])


def compare(paths: list[Path], metrics: list[str], out: Path) -> list[dict[str, Any]]:
    """Load, group, plot and summarise; returns the groups' figures."""
    if not paths:
        raise CompareError("slime compare needs at least one run directory")
    seen: dict[Path, Path] = {}
    for path in paths:  # one run named twice would count as two seeds of its group
        if (twice := seen.setdefault(path.resolve(), path)) is not path:
            raise CompareError(f"{path} is named twice (also as {twice}): each run counts once")
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise CompareError(f"--out {out}: the plot is an image; name a file ending in {', '.join(PLOT_SUFFIXES)}")
    runs = [load_run(path, name) for path, name in zip(paths, run_names(paths))]
    check_metrics(runs, metrics)
    groups = group_runs(runs)
    plot(groups, metrics, out)
    return [summary(group, metrics) for group in groups]


def main_compare(run_dirs: list[str], metrics: list[str], out: str) -> int:
    """`slime compare`: the table, which runs each group holds, the plot's path, then the JSON line."""
    metrics = list(dict.fromkeys(metrics))
    summaries = compare([Path(d) for d in run_dirs], metrics, Path(out))
    print(table(summaries, metrics))
    for s in summaries:
        if s["runs"] != [s["label"]]:
            print(f"{s['label']}: {', '.join(s['runs'])}")
    print(f"plot: {out}")
    print(json.dumps({"final_window_steps": LAST_STEPS, "groups": summaries}))
    return 0
