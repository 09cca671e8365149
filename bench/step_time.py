"""Steady-state step time: strategy="dynatrain" against Lightning's ModelParallelStrategy, same model and layout.

Runs alternate (A, B, A, B, ...) in one invocation so machine noise hits both alike; the figure is the ratio of
medians of per-step times, warm-up steps dropped.

    python bench/step_time.py [--model debug] [--devices 2] [--tp 1] [--steps 20] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from dynatrain.launcher import launch_local

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"dynatrain": [], "lightning": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in times:
                argv = [str(HERE / "_step_worker.py"), "--strategy", name, "--model", args.model, "--tp", str(args.tp),
                        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                        "--micro-batch", str(args.micro_batch)]
                results = launch_local(argv, args.devices, Path(tmp), timeout=1200, name=f"{name}-{rep}")
                times[name].extend(results[0]["step_times"][args.warmup:])
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["dynatrain"] / med["lightning"]
    layout = f"dp_shard={args.devices // args.tp},tp={args.tp}"
    print(f"model {args.model}, {args.devices} CPU processes, layout {layout}, "
          f"{args.repeats} alternating runs x {args.steps - args.warmup - 1} timed steps each")
    print("| strategy | median step (s) | steps timed |")
    print("|---|---|---|")
    for k in times:
        print(f"| {k} | {med[k]:.4f} | {len(times[k])} |")
    print(f"ratio dynatrain / ModelParallelStrategy: {ratio:.3f} (goal <= 1.02)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "devices": args.devices, "layout": layout,
                                               "median_s": med, "ratio": ratio, "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
