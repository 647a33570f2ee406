#!/usr/bin/env bash
# GPU machine (CUDA 12.x driver): CUDA torch from PyPI's default index, then the project.
#   bash deploy/install_gpu.sh            (add EXTRAS=vllm or EXTRAS=sglang for those engines)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch>=2.4"
python -m pip install -q -e ".[gpu,$EXTRAS]"
python -c "import torch; print('cuda available:', torch.cuda.is_available(), torch.cuda.device_count(), 'GPUs')"
