"""Small Python packages with unittest suites, the raw material of the SWE tasks (envs/swe_tasks.py).

Each template is a correct package (2-3 modules) with its tests; each of its mutations plants one
bug: a snippet of one module replaced by a wrong one (off-by-one, wrong operator or comparison,
wrong default, missing case, ...). A mutation names the tests it makes fail and says, as a bug
report would, what the function should do; tests/test_swe_env.py runs every mutation in the
sandbox and checks that exactly those tests fail and that the correct package passes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    key: str  # short name, part of the task id
    path: str  # the module the bug is planted in
    correct: str  # a snippet of the correct module (it occurs exactly once)
    buggy: str  # what replaces it
    report: str  # the bug report: what the function should do
    failing_tests: tuple[str, ...]  # unittest ids of the tests the bug makes fail


@dataclass(frozen=True)
class Template:
    name: str
    package: str
    files: dict[str, str]  # relative path -> correct source, package modules and tests/test_*.py
    mutations: tuple[Mutation, ...]

    @property
    def test_files(self) -> list[str]:
        return sorted(p for p in self.files if p.startswith("tests/"))

    def buggy_files(self, mutation: Mutation) -> dict[str, str]:
        source = self.files[mutation.path]
        if source.count(mutation.correct) != 1:
            raise ValueError(f"{self.name}/{mutation.key}: the snippet must occur once in {mutation.path}")
        return {**self.files, mutation.path: source.replace(mutation.correct, mutation.buggy)}


def source(text: str) -> str:
    """A module's text as written in a template (the leading newline dropped)."""
    return text.lstrip("\n")
