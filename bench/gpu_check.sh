#!/usr/bin/env bash
# The CUDA/NCCL check of bench/gpu_check.py, under 5 minutes on one node: writes bench/results/gpu.json.
# Uses .venv when it exists, else the python3 on PATH (a CUDA build of torch 2.13 with Lightning installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && PY=.venv/bin/python
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')"
exec timeout 300 "$PY" bench/gpu_check.py --device cuda "$@"
