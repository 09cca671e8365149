"""Steady-state step time: strategy="dynatrain" against a baseline, same model and layout.

Baselines: Lightning's ModelParallelStrategy (``--baseline lightning``), or the loop a torchtitan user writes by hand
on torch alone (``--baseline fsdp-loop``: `fully_shard`, `torch.compile` per block, checkpointing every n-th block,
no Lightning; bench/_fsdp_loop.py), where ``--compile`` and ``--every`` apply to both sides alike.

Runs alternate (A, B, A, B, ...) in one invocation so machine noise hits both alike; the figure is the ratio of
medians of per-step times, warm-up steps dropped.

    python bench/step_time.py [--model debug] [--devices 2] [--tp 1] [--steps 20] [--repeats 3] [--json out.json]
    python bench/step_time.py --baseline fsdp-loop --model 125m --compile inductor --every 2 --seq-len 256 \
        --micro-batch 2 --steps 12 --repeats 3 --json bench/results/step_vs_fsdp_loop.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from dynatrain.launch.local import launch_local

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
    ap.add_argument("--baseline", choices=("lightning", "fsdp-loop"), default="lightning")
    ap.add_argument("--compile", default=None, help="torch.compile backend per block, both sides (fsdp-loop only)")
    ap.add_argument("--every", type=int, default=0,
                    help="checkpoint every n-th block, both sides (fsdp-loop only; 1 = full)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.baseline == "lightning" and (args.compile or args.every):
        ap.error("--compile and --every need --baseline fsdp-loop")
    times: dict[str, list[float]] = {"dynatrain": [], args.baseline: []}
    extra = (["--compile", args.compile] if args.compile else []) + ["--every", str(args.every)]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in times:
                argv = [str(HERE / "_step_worker.py"), "--strategy", name, "--model", args.model, "--tp", str(args.tp),
                        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                        "--micro-batch", str(args.micro_batch), *extra]
                results = launch_local(argv, args.devices, Path(tmp), timeout=1200, name=f"{name}-{rep}")
                times[name].extend(results[0]["step_times"][args.warmup:])
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["dynatrain"] / med[args.baseline]
    layout = f"dp_shard={args.devices // args.tp},tp={args.tp}"
    print(f"model {args.model}, {args.devices} CPU processes, layout {layout}, seq_len {args.seq_len}, micro-batch "
          f"{args.micro_batch}, compile {args.compile or 'off'}, checkpointing every {args.every or '-'} block(s), "
          f"{args.repeats} alternating runs x {args.steps - args.warmup - 1} timed steps each")
    print("| strategy | median step (s) | steps timed |")
    print("|---|---|---|")
    for k in times:
        print(f"| {k} | {med[k]:.4f} | {len(times[k])} |")
    goal = 1.02 if args.baseline == "lightning" else 1.03
    print(f"ratio dynatrain / {args.baseline}: {ratio:.3f} (goal <= {goal})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "model": args.model, "devices": args.devices, "layout": layout,
            "baseline": args.baseline, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "compile": args.compile, "checkpoint_every": args.every, "median_s": med, "ratio": ratio, "goal": goal,
            "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
