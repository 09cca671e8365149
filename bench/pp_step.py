"""Steady-state step time with pipeline parallelism: strategy="dynatrain" with pp against the same split driven by
hand with torch.distributed.pipelining (1F1B, FSDP2 on each stage, AdamW), same model, micro-batches and layout.

Runs alternate (A, B, A, B, ...) in one invocation, in random order per pair, so machine noise hits both alike;
the figure is the ratio of medians of per-step times, warm-up steps dropped.

    python bench/pp_step.py [--model debug] [--devices 2] [--steps 20] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from dynatrain.launch.local import launch_local

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"dynatrain": [], "by-hand": []}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in rng.sample(list(times), len(times)):
                argv = [str(HERE / "_pp_step_worker.py"), "--mode", mode, "--model", args.model,
                        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                        "--micro-batch", str(args.micro_batch), "--microbatches", str(args.microbatches)]
                results = launch_local(argv, args.devices, Path(tmp), timeout=1200, name=f"{mode}-{rep}")
                times[mode].extend(results[0]["step_times"][args.warmup:])
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["dynatrain"] / med["by-hand"]
    print(f"model {args.model}, pp={args.devices} on {args.devices} CPU processes, {args.microbatches} micro-batches "
          f"of {args.micro_batch} x {args.seq_len} tokens, {args.repeats} alternating runs")
    print("| run | median step (s) | steps timed |")
    print("|---|---|---|")
    for k in times:
        print(f"| {k} | {med[k]:.4f} | {len(times[k])} |")
    print(f"ratio dynatrain / torch pipelining by hand: {ratio:.3f} (goal <= 1.02)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "devices": args.devices,
                                               "layout": f"pp={args.devices}", "microbatches": args.microbatches,
                                               "median_s": med, "ratio": ratio, "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
