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
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import needs

REPO = Path(__file__).resolve().parents[1]
HELPERS = {"__init__", "families", "gain", "models", "spread"}  # imported by the benchmarks, not run
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem not in HELPERS)
TIMEOUT_S = 400  # the slowest smoke takes about a minute alone on 2 busy cores
SMOKES_AT_ONCE = 3

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


def _run_smoke(name: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc, time.monotonic() - started


@pytest.fixture(scope="session")
def smoke_runs(request) -> Iterator[dict[str, Future]]:
    """Every selected smoke, SMOKES_AT_ONCE at a time from the first one's start: a smoke spends much
    of its time starting Python, Ray or a redis-server, so three overlap well on two cores."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_benchmark_smoke"
        and not any(m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers())
    ]
    with ThreadPoolExecutor(SMOKES_AT_ONCE) as pool:
        yield {name: pool.submit(_run_smoke, name) for name in selected}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(b, marks=MARKS.get(b, [])) for b in BENCHMARKS])
def test_benchmark_smoke(name: str, smoke_runs: dict[str, Future]) -> None:
    proc, wall = smoke_runs[name].result() if name in smoke_runs else _run_smoke(name)
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
