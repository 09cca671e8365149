#!/usr/bin/env bash
# The one-GPU check (bench/gpu_check/run.py), one command, under 8 minutes: results as JSON under $OUT (else the
# first argument, else bench/results/gpu_check). Runs with the machine's own CUDA Python ($PYTHON, else python3),
# which has torch with CUDA but not our venv and no internet: dynatrain is installed into it without its dependencies
# (torch is never reinstalled), and a dependency it lacks is installed from its pinned range only if pip can reach
# one; otherwise the check stops here and names it. Without CUDA every part runs its CPU fallback (tiny sizes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-${1:-bench/results/gpu_check}}"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] \
        && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python  # no CUDA on PATH's Python: the project's venv runs the CPU fallback
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch; set PYTHON to the Python that has torch with CUDA" >&2
    exit 2
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
# Each dependency of pyproject.toml the parts import (torch aside; wandb only if a logger is made, and none is):
# import name and pinned requirement.
missing=()
for dep in "lightning:lightning>=2.6.0,<2.7" "torchmetrics:torchmetrics>=1.0" \
           "jsonargparse:jsonargparse[signatures]>=4.27" "yaml:pyyaml>=6" "numpy:numpy>=1.24" "scipy:scipy>=1.10" \
           "matplotlib:matplotlib>=3.7"; do
    "$PY" -c "import ${dep%%:*}" 2>/dev/null || missing+=("${dep#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check: installing what $PY lacks: ${missing[*]}"
    if ! "$PY" -m pip install -q "${missing[@]}"; then
        echo "gpu_check: cannot install ${missing[*]} (no network?): install them into $PY, then run again" >&2
        exit 2
    fi
fi
if ! (cd /tmp && "$PY" -c "import dynatrain" 2>/dev/null); then
    # --no-deps keeps the machine's torch; --no-build-isolation needs no network for setuptools.
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || echo "gpu_check: pip install -e . failed; the parts put the repository on their path themselves" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline
exec timeout 480 "$PY" bench/gpu_check/run.py --out "$OUT_DIR"
