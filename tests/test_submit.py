"""`slime submit/status/logs/stop` refuse what cannot work in one line with exit code 2, before
anything is uploaded: an address nothing answers on, a config the job could not read. (A real
cluster: tests/test_cluster.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "repeat_grpo.yaml")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slime(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return subprocess.run(
        [sys.executable, "-m", "slime.cli", *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_unreachable_address_or_a_config_outside_the_project_is_one_line(tmp_path):
    port, other = _closed_port(), _closed_port()
    # --address wins over RAY_ADDRESS (Ray's SDK would take the variable)
    error = _one_line_error(
        _slime("submit", EXAMPLE, "steps=2", "--address", f"http://127.0.0.1:{port}", RAY_ADDRESS=f"127.0.0.1:{other}")
    )
    assert error.startswith(f"slime submit: cannot reach the Ray Jobs API at http://127.0.0.1:{port}:"), error
    # RAY_ADDRESS without --address; HOST:PORT is the dashboard's
    error = _one_line_error(_slime("status", RAY_ADDRESS=f"127.0.0.1:{other}"))
    assert error.startswith(f"slime status: cannot reach the Ray Jobs API at http://127.0.0.1:{other}:"), error
    outside = tmp_path / "job.yaml"
    outside.write_text(Path(EXAMPLE).read_text())
    error = _one_line_error(_slime("submit", str(outside), "--address", "http://127.0.0.1:1"))
    assert f"{outside}: outside the project directory {ROOT}" in error, error
