"""Seconds per GiB the switch check's element hash takes on this host's CPU (`dynatrain.check.hashing`), the rate the
stall model prices the check at (`dynatrain.policy.stall_model`).

    python bench/check_speed.py --gib 1 --threads 1 --json bench/results/stall_prediction/hash_cpu.json

Hashes a 2-d tensor of ``--gib`` GiB as `state_sums.local_sums` and the switch's check do (`indexed_checksum`: int8
matrix products of the bytes on a CPU, the elementwise way where `torch._int_mm` is missing or inexact), after a
warm-up on a few rows, ``--repeats`` times per dtype: the best and every repetition, wall and CPU seconds, with the
load average (on a loaded host the wall seconds count the time the thread waited for a core). A GPU's rate comes from
`bench/gpu_check/hash_cost.py` on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from dynatrain.check.hashing import indexed_checksum


def measure(gib: float, threads: int, dtype: str, repeats: int) -> tuple[list[float], list[float], list[float]]:
    """Wall and CPU seconds per GiB of hashing one 2-d tensor of ``gib`` GiB, and wall seconds per GiB of reading it
    once (a sum of its bytes as int64, memory-bound: what a hash fused into another pass over them could save at
    most), per repetition."""
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    cols = 4096
    rows = max(1, int(gib * (1 << 30)) // (dt.itemsize * cols))
    t = torch.randn(rows, cols).to(dt)
    idx = [range(rows), range(cols)]
    indexed_checksum(t[:8], [range(8), idx[1]], (rows, cols))  # the one-off checks and tables
    size = t.numel() * dt.itemsize / (1 << 30)
    wall, cpu, read = [], [], []
    words = t.view(-1).view(torch.int64)
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        indexed_checksum(t, idx, (rows, cols))
        wall.append((time.perf_counter() - w) / size)
        cpu.append((time.process_time() - c) / size)
        w = time.perf_counter()
        words.sum()
        read.append((time.perf_counter() - w) / size)
    return wall, cpu, read


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for dtype in args.dtypes.split(","):
        load = os.getloadavg()[0]
        runs, cpu, read = measure(args.gib, args.threads, dtype, args.repeats)
        rows.append({"dtype": dtype, "s_per_gib": min(runs), "s_per_gib_each": runs, "cpu_s_per_gib": min(cpu),
                     "cpu_s_per_gib_each": cpu, "read_s_per_gib": min(read), "read_s_per_gib_each": read,
                     "load_average_1min": load})
        print(f"{dtype:9s} {min(runs):.3f} s/GiB best of {len(runs)} ({', '.join(f'{r:.3f}' for r in runs)}), CPU "
              f"{min(cpu):.3f}; a plain read {min(read):.3f}; {args.threads} thread(s), load {load:.2f} on "
              f"{os.cpu_count()} CPUs", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "device": "cpu", "cpu_count": os.cpu_count(),
                                               "torch": torch.__version__, "hashes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
