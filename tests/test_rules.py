"""The rules that check themselves (docs/architecture.md): the import contracts in pyproject.toml,
no import circles, ruff's lint and format, and the size of product files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("slime", "april", "rewards", "envs")
SLIME_MAX_LINES = 500  # a file of slime/ past this says why in its docstring: "Longer than 500 lines: ..."
MAX_LINES = 650  # april/, rewards/, envs/: a file past this is split along a real seam
REASON = "Longer than 500 lines:"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_ruff_lint_and_format_are_clean():
    targets = [*PRODUCT_DIRS, "tests", "benchmarks", "deploy", "examples"]
    lint = _run("ruff", "check", *targets)
    assert lint.returncode == 0, lint.stdout[-4000:]
    fmt = _run("ruff", "format", "--check", *targets)
    assert fmt.returncode == 0, fmt.stdout[-4000:]


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def test_product_files_stay_readable_in_size():
    too_long = {}
    for folder in PRODUCT_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if folder == "slime":
                if lines > SLIME_MAX_LINES and REASON not in _docstring(path):
                    too_long[str(path.relative_to(ROOT))] = lines
            elif lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, (
        f"files over their size (slime/: {SLIME_MAX_LINES} lines unless the module docstring says "
        f"{REASON!r} and why; others: {MAX_LINES}): split them along a real seam or give the reason: {too_long}"
    )


def test_no_import_circles():
    """No two modules import each other, directly or through others (TYPE_CHECKING imports included)."""
    graph = grimp.build_graph(*PRODUCT_DIRS, include_external_packages=False)
    circles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != module and graph.chain_exists(importer=imported, imported=module):
                circles.append(
                    " -> ".join(graph.find_shortest_chain(importer=imported, imported=module)) + f" -> {imported}"
                )
    assert not circles, "import circles:\n" + "\n".join(circles)
