"""Planning Llama-3.1-405B dense layout changes at 16,384 simulated ranks: `dynatrain plan --json` plus the CPU
seconds of the computation (wall time on a shared machine counts other processes too).

    python bench/plan405.py --out bench/results/plan405
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning is timed as one rank computes it: one core

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from dynatrain.cli.plan import compute, configure  # noqa: E402

SWITCHES = {
    "hsdp": ["--from", "dp_shard=2048,tp=8", "--to", "dp_replicate=2,dp_shard=1024,tp=8"],
    "node_lost": ["--from", "dp_shard=2048,tp=8", "--to", "dp_shard=2047,tp=8", "--leave", "16376-16383"],
}
GOAL_CPU_S = 2.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for <switch>.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, extra in SWITCHES.items():
        argv_plan = ["--model", "llama3-405b", *extra]
        cpu = time.process_time()
        out = compute(configure(argparse.ArgumentParser()).parse_args(argv_plan))
        out["cpu_seconds"] = time.process_time() - cpu  # includes the network model's prediction
        out["goal_cpu_s"] = GOAL_CPU_S
        out["command"] = "dynatrain plan " + " ".join(argv_plan) + " --json (via python bench/plan405.py)"
        (args.out / f"{name}.json").write_text(json.dumps(out) + "\n")
        print(f"{name}: cpu {out['cpu_seconds']:.2f} s, plan (wall) {out['plan_seconds']:.2f} s, "
              f"moved {out['fraction_moved']:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
