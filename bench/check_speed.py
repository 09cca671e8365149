"""Seconds per GiB the switch check's element hash takes on this machine (`dynatrain.check.hashing`).

    python bench/check_speed.py --gib 1 --threads 1     # add --dtype bfloat16, --threads 2

Hashes a 2-d tensor of ``--gib`` GiB as `state_sums.local_sums` and the switch's check do (`indexed_checksum`: int8
matrix products of the bytes on a CPU, the elementwise way where `torch._int_mm` is missing or inexact), after a
warm-up on a few rows, ``--repeats`` times, and prints the best s/GiB, every repetition and the load average.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from dynatrain.check.hashing import indexed_checksum


def measure(gib: float, threads: int, dtype: str, repeats: int) -> list[float]:
    """Seconds per GiB that `indexed_checksum` takes on a 2-d tensor of ``gib`` GiB, per repetition."""
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    cols = 4096
    rows = max(1, int(gib * (1 << 30)) // (elem * cols))
    t = torch.randn(rows, cols).to(dt)
    idx = [range(rows), range(cols)]
    indexed_checksum(t[:8], [range(8), idx[1]], (rows, cols))  # warm up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        indexed_checksum(t, idx, (rows, cols))
        out.append((time.perf_counter() - start) / (t.numel() * elem / (1 << 30)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description="seconds per GiB the placed checksum takes on this machine")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = measure(args.gib, args.threads, args.dtype, args.repeats)
    print(f"{min(runs):.2f} s/GiB best of {len(runs)} ({', '.join(f'{r:.2f}' for r in runs)}; {args.dtype}, "
          f"{args.threads} thread(s), {math.ceil(args.gib * 1024)} MiB, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
