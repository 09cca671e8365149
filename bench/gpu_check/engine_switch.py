"""Part (b): the engine's CUDA path with two processes sharing one GPU, switching the states (fp32 + Adam) of 125m and
1b ``dp_shard=2 -> tp=2 -> dp_shard=2``, bit for bit, its memory bound held against the caching allocator's
``max_memory_allocated`` and ``max_memory_reserved``. NCCL refuses two ranks on one device, so the CUDA tensors travel
through gloo by a test shim (`gloo_staging`): the wire is not NCCL's, everything else is the engine's CUDA path. The
CPU fallback runs the same ranks on CPU tensors and the debug model.

    python bench/gpu_check/engine_switch.py --device cuda --out /tmp/b.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import common
import torch


def add_args(ap) -> None:
    ap.add_argument("--models", default=None, help="default: 125m,1b on CUDA, debug on the CPU")
    ap.add_argument("--timeout", type=float, default=300.0)


def run(args, device: torch.device) -> dict:
    from dynatrain.launch.local import launch_local

    models = args.models or ("125m,1b" if device.type == "cuda" else "debug")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_local([str(Path(__file__).with_name("engine_rank.py")), "--device", str(device), "--models",
                              models], 2, Path(tmp), timeout=args.timeout, name="engine")
    rows = [row for r in ranks for row in r["switches"]]
    checks = {}
    for row in rows:
        for name, ok in row["checks"].items():
            checks[name] = checks.get(name, True) and ok
    return {"models": models, "wire": "gloo, CUDA tensors staged through host memory" if device.type == "cuda"
            else "gloo", "switches": rows, "checks": checks}


if __name__ == "__main__":
    common.run_part("engine_switch", __doc__, run, add_args)
