"""The rules that check themselves (docs/architecture.md): the import contracts in pyproject.toml,
ruff's lint and format, and the size of product files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("slime", "april", "rewards", "envs")
MAX_LINES = 650  # "about 600": a file past this is split along a real seam, or named below with its reason
LONGER_BY_REASON = {
    # One class over one HTTP protocol; its launched processes, the protocol server and its
    # engine thread are already files of their own.
    "slime/engines/sglang/adapter.py": 700,
}


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


def test_product_files_stay_readable_in_size():
    too_long = {
        str(p.relative_to(ROOT)): n
        for folder in PRODUCT_DIRS
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > LONGER_BY_REASON.get(str(p.relative_to(ROOT)), MAX_LINES)
    }
    assert not too_long, f"files over {MAX_LINES} lines (split them along a real seam): {too_long}"
