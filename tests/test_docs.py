"""The docs stand alone: nothing in the repository points outside it, and every repository path the
README and docs/*.md name exists.

(a) No file of the repository (docs, README, code, configs) mentions the team-internal design file
    or the folder beside the clone it lived in: a user's clone has neither.
(b) Every path written in README.md or docs/*.md — in backticks, as a link target, or bare in the
    prose when it starts with one of the repository's top-level folders — exists. URLs, glob
    patterns, placeholders (`NAME`, `<dir>`, `step_N`), paths under a run's output folder and
    absolute paths are not repository paths and are skipped; so is a file a dated note names as it
    was then, written "`old/path.py` (today `new/path.py`)" (the new path is checked).
(c) Every bare file name in backticks (`grpo.py`, named beside its folder) is the name of some file
    of the repository.
(d) Every module of ours named in backticks (`slime.tools.simulate`, `rewards.rule:exact_match`)
    exists, at least its package and module.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Spelled in pieces so that this file does not match itself.
OUTSIDE_POINTERS = ("../" + "shared", "DESIGN" + ".md")

# Top-level folders (and root files) of the repository: a path that starts with one is checked
# wherever it is written; other relative paths only when they are in backticks or a link.
TOP = ("slime", "april", "rewards", "envs", "benchmarks", "tests", "deploy", "examples", "docs", ".ci")
ROOT_FILES = ("README.md", "pyproject.toml")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".lua", ".json", ".jsonl", ".js", ".css", ".html")

# Names a doc uses for the user's own files or a run's files, not the repository's.
NOT_REPO_FILES = {
    "cfg.yaml",
    "config.yaml",
    "job.yaml",
    "my_rewards.py",
    "my_rm.py",
    "learner.json",
    "driver_state.json",
    "metrics.jsonl",
    "openapi.json",
}
# Paths relative to a run directory, the user's data or another project's tree.
NOT_REPO_PREFIXES = ("outputs/", "runs/", "data/", "path/", "sglang/", "managers/", "checkpoints/", "redis/")
PLACEHOLDER = re.compile(r"[*?{}<>$\[\]]|\.\.\.|\b[A-Z][A-Z_]+[A-Z]\b|_N\b|\bN_|/N\b")

# A dated note may name a file as it was then, followed by where it is today:
# "`slime/learner.py` (today `slime/learner/actor.py`)". The old name is not checked; the new one is.
RENAMED = re.compile(r"`([^`\s]+)` \((?:today|now) `")
SPAN = re.compile(r"`([^`\n]+)`|\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w./`@-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")


def repository_files() -> list[Path]:
    """The repository's files: git's tracked and not-ignored files, or a walk of the tree without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [
                d for d in dirs if not (d.startswith((".venv", ".git")) or d in {"outputs", "runs", "__pycache__"})
            ]
            names += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def candidates(line: str) -> set[str]:
    """Path-like words of one line: in backticks or link targets, and bare ones under a top folder."""
    found: set[str] = set()
    for m in SPAN.finditer(line):
        for word in re.split(r"[\s,;()=|]+", m.group(1) or m.group(2)):
            found.add(word)
    found.update(m.group(1) for m in BARE.finditer(line))
    return found


def as_repository_path(word: str) -> str | None:
    """The repository path a word names, or None when it is no repository path."""
    word = word.strip(".,:;'\"")
    if not word or "://" in word or word.startswith(("/", "~", "-", ".venv")) or PLACEHOLDER.search(word):
        return None
    word = word.split("#")[0].split(":")[0].rstrip(".,")  # anchors; `file.py:function`
    if not word or word.startswith(NOT_REPO_PREFIXES):
        return None
    if word.startswith(tuple(t + "/" for t in TOP)) or word in ROOT_FILES:
        return word
    if "/" in word and word.endswith(FILE_SUFFIXES) and word.split("/")[0] in TOP:
        return word
    return None


def bare_name(word: str) -> str | None:
    """A bare file name in backticks (`grpo.py`): named relative to a folder the text gives."""
    word = word.strip(".,:;'\"").split(":")[0]
    if "/" in word or not word.endswith(FILE_SUFFIXES) or word.endswith((".json", ".jsonl")):  # .json(l): data
        return None
    if PLACEHOLDER.search(word) or word in NOT_REPO_FILES:
        return None
    return word


def test_nothing_points_outside_the_repository() -> None:
    hits = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for pointer in OUTSIDE_POINTERS:
                if pointer in line:
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {pointer}")
    assert not hits, "files that point outside the repository:\n" + "\n".join(hits)


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in doc_files():
        in_code_block = False
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code_block = not in_code_block
                continue
            words = candidates(line) if not in_code_block else {m.group(1) for m in BARE.finditer(line)}
            words -= set(RENAMED.findall(line))
            for word in words:
                path = as_repository_path(word)
                if path is not None and not (ROOT / path).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_bare_file_name_the_docs_give_exists_somewhere() -> None:
    """`grpo.py` beside `slime/algorithms/`: a file of that name is in the repository."""
    names = {p.name for p in repository_files()}
    missing = []
    for doc in doc_files():
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in SPAN.finditer(line):
                for word in re.split(r"[\s,;()=|]+", m.group(1) or ""):
                    name = bare_name(word)
                    if name is not None and name not in names:
                        missing.append(f"{doc.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "file names in the docs that no file of the repository has:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("slime/engines/contract.py", "slime/engines/contract.py"),
        ("slime/buffer/lua/*.lua", None),
        ("https://github.com/THUDM/slime", None),
        ("outputs/repeat-grpo/training.png", None),
        ("path/to/file.py", None),
        ("OUTPUT_DIR/job.secret", None),
        ("checkpoints/step_N/", None),
        ("rewards/judge.py:judge", "rewards/judge.py"),
        ("docs/engines.md#fast-path", "docs/engines.md"),
        ("examples/repeat_grpo.yaml,", "examples/repeat_grpo.yaml"),
    ],
)
def test_what_counts_as_a_repository_path(word: str, expected: str | None) -> None:
    assert as_repository_path(word) == expected


MODULE = re.compile(r"`((?:slime|rewards|envs)(?:\.\w+)+)")


def test_every_module_the_docs_name_exists() -> None:
    """`slime.tools.simulate.sim_config_from_job`, `rewards.rule:exact_match`: the package and its
    module exist (what follows the module is an attribute, not checked). `april.*` is also a config
    section, so it is not checked here."""
    missing = []
    for doc in doc_files():
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for dotted in MODULE.findall(line):
                parts = dotted.split(".")
                resolved = 1
                while resolved < len(parts):
                    path = ROOT.joinpath(*parts[: resolved + 1])
                    if not (path.is_dir() or path.with_suffix(".py").is_file()):
                        break
                    resolved += 1
                if resolved < 2:
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {dotted}")
    assert not missing, "modules named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))
