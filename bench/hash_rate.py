"""The switch check's hash rate on this host's CPU, for the stall model (`dynatrain.policy.stall_model`).

    python bench/hash_rate.py --json bench/results/stall_prediction/hash_cpu.json

Seconds per GiB of `placed_sums.indexed_checksum` on one thread (the rate the engine's own `__main__` prints),
float32 and bfloat16, best and every repetition, wall and CPU seconds, with the load average: other jobs share the
cores, and on a loaded host the wall seconds count the time the thread waited for a core. A GPU's rate comes from
`bench/gpu_check/hash_cost.py` on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import time

import torch

from dynatrain.engine.placed_sums import indexed_checksum


def measure(gib: float, threads: int, dtype: str, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds per GiB of one 2-d tensor of ``gib`` GiB, hashed as `local_sums` hashes it."""
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    cols = 4096
    rows = max(1, int(gib * (1 << 30)) // (dt.itemsize * cols))
    t = torch.randn(rows, cols).to(dt)
    idx = [range(rows), range(cols)]
    indexed_checksum(t[:8], [range(8), idx[1]], (rows, cols))  # the one-off checks and tables
    size = t.numel() * dt.itemsize / (1 << 30)
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        indexed_checksum(t, idx, (rows, cols))
        wall.append((time.perf_counter() - w) / size)
        cpu.append((time.process_time() - c) / size)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for dtype in ("float32", "bfloat16"):
        load = os.getloadavg()[0]
        runs, cpu = measure(args.gib, args.threads, dtype, args.repeats)
        rows.append({"dtype": dtype, "s_per_gib": min(runs), "s_per_gib_each": runs, "cpu_s_per_gib": min(cpu),
                     "cpu_s_per_gib_each": cpu, "load_average_1min": load})
        print(f"{dtype:9s} {min(runs):.3f} s/GiB best of {len(runs)} ({', '.join(f'{r:.3f}' for r in runs)}), CPU "
              f"{min(cpu):.3f}; {args.threads} thread(s), load {load:.2f} on {os.cpu_count()} CPUs", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "device": "cpu", "cpu_count": os.cpu_count(),
                                               "torch": torch.__version__, "hashes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
