"""Tasks for the software-engineering env (envs/swe.py), generated from the templates of
envs/swe_templates: a small package with one planted bug and the unittest suite that catches it.

    python -m envs.swe_tasks --out examples/data/swe_tasks.jsonl [--n 24] [--seed 0]

writes one dataset line per task, in the project's data format:

    {"prompt": <the bug report, the tools and the call format>,
     "label": {"task_id": ..., "files": {path: text}, "test_files": [...]},
     "task": "swe"}

Deterministic in (n, seed): the seed shuffles each template's mutations and the order of the
templates, which are then taken in turn, so every template is used about equally. Each task also
carries its fix (a unified diff from the buggy module to the correct one), which
`reference_actions` turns into a scripted policy that solves the task, and
`long_reference_actions` into a longer one (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from envs.swe_templates import Mutation, Template, dates, intervals, inventory, matrix, stats, text

TEMPLATES: tuple[Template, ...] = (
    stats.TEMPLATE,
    text.TEMPLATE,
    intervals.TEMPLATE,
    inventory.TEMPLATE,
    matrix.TEMPLATE,
    dates.TEMPLATE,
)
MAX_LISTED_FAILURES = 4


@dataclass(frozen=True)
class SweTask:
    task_id: str
    template: str
    package: str
    files: dict[str, str]  # the buggy repository
    test_files: list[str]
    buggy_path: str
    fix: str  # unified diff (a/ b/ prefixes) that turns the buggy module back into the correct one
    description: str  # the bug report
    failing_tests: tuple[str, ...]

    def label(self) -> dict:
        return {"task_id": self.task_id, "files": self.files, "test_files": self.test_files}

    def record(self) -> dict:
        return {"prompt": prompt(self), "label": self.label(), "task": "swe"}


def make_task(template: Template, mutation: Mutation) -> SweTask:
    files = template.buggy_files(mutation)
    fix = "".join(
        difflib.unified_diff(
            files[mutation.path].splitlines(keepends=True),
            template.files[mutation.path].splitlines(keepends=True),
            f"a/{mutation.path}",
            f"b/{mutation.path}",
        )
    )
    return SweTask(
        task_id=f"{template.name}-{mutation.key}",
        template=template.name,
        package=template.package,
        files=files,
        test_files=template.test_files,
        buggy_path=mutation.path,
        fix=fix,
        description=mutation.report,
        failing_tests=mutation.failing_tests,
    )


def generate_tasks(n: int = 24, seed: int = 0) -> list[SweTask]:
    available = sum(len(t.mutations) for t in TEMPLATES)
    if not 1 <= n <= available:
        raise ValueError(f"n must be within 1..{available} (the templates' mutations), got {n}")
    rng = random.Random(seed)
    queues = {t.name: rng.sample(list(t.mutations), len(t.mutations)) for t in TEMPLATES}
    order = rng.sample(list(TEMPLATES), len(TEMPLATES))
    tasks: list[SweTask] = []
    while len(tasks) < n:
        for template in order:
            if queues[template.name] and len(tasks) < n:
                tasks.append(make_task(template, queues[template.name].pop()))
    return tasks


def prompt(task: SweTask) -> str:
    failing = list(task.failing_tests[:MAX_LISTED_FAILURES])
    more = len(task.failing_tests) - len(failing)
    listed = ", ".join(failing) + (f" (and {more} more)" if more else "")
    example = json.dumps({"name": "read_file", "arguments": {"path": f"{task.package}/__init__.py"}})
    return (
        f"Fix the bug in the Python package `{task.package}`; its repository is your workspace.\n"
        f"Bug report: {task.description}\n"
        f"Failing tests: {listed}\n"
        "The tests in tests/ use unittest and are read-only.\n"
        "Tools:\n"
        '  list_dir(path=".")\n'
        "  read_file(path, start_line=1, end_line=null)\n"
        "  write_file(path, content)\n"
        "  apply_patch(patch): a unified diff: --- a/PATH, +++ b/PATH, @@ -START,COUNT +START,COUNT @@ hunks\n"
        "  run_tests(): runs the whole suite\n"
        "  finish(): ends the episode; the reward is the share of the failing tests you fixed, 1 when all pass\n"
        f"Call a tool as <tool_call>{example}</tool_call>; several calls per turn are allowed.\n"
        "Call finish when done.\n"
    )


def tool_call(name: str, **arguments: object) -> str:
    """One model turn that makes one call, in the Qwen format SweEnv parses."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def reference_actions(task: SweTask) -> list[str]:
    """A scripted policy that solves the task in five turns."""
    return [
        tool_call("list_dir", path="."),
        tool_call("read_file", path=task.buggy_path),
        tool_call("apply_patch", patch=task.fix),
        tool_call("run_tests"),
        tool_call("finish"),
    ]


def long_reference_actions(task: SweTask, turns: int, lines_per_read: int = 10) -> list[str]:
    """Exactly `turns` turns: list the repository, read its files `lines_per_read` lines at a time
    (over and over when `turns` asks for more reads than there are), then fix, test and finish."""
    if turns < 5:
        raise ValueError(f"a scripted episode needs at least 5 turns, got {turns}")
    reads = []
    for path in sorted(task.files):
        line_count = len(task.files[path].splitlines())
        for start in range(1, line_count + 1, lines_per_read):
            reads.append(tool_call("read_file", path=path, start_line=start, end_line=start + lines_per_read - 1))
    body = [reads[i % len(reads)] for i in range(turns - 4)]
    return [tool_call("list_dir", path="."), *body, *reference_actions(task)[2:]]


def dataset_text(tasks: list[SweTask]) -> str:
    return "".join(json.dumps(task.record()) + "\n" for task in tasks)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tasks = generate_tasks(args.n, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dataset_text(tasks))
    print(f"wrote {len(tasks)} tasks to {out}")


if __name__ == "__main__":
    main()
