"""The whole stall `dynatrain plan` predicts for the paper's two 128 -> 64 GPU cases, each with the check's measured
(CPU) hash rate and with the rate a GPU's copy bandwidth suggests (an estimate; `policy.stall_model`).

    python bench/stall_prediction.py --out bench/results/stall_prediction

One JSON per case and rate, ``<case>.<rate>.json``: the `dynatrain plan` command, its ``--json`` object (the phases
under ``stall``), and the load average while it planned (planning is timed here; every other phase is a model).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from dynatrain.cli import plan
from dynatrain.policy.stall_model import CPU_HASH, GPU_HASH_S_PER_GIB_ESTIMATE

NET = "--gpus-per-node 8"
CASES = {
    # docs/planner.md's 70B 128 -> 64 example: a tp=8 layout loses half its data-parallel ranks.
    "llama3_70b": f"--model llama3-70b --from dp_shard=16,tp=8 --to dp_shard=8,tp=8 {NET}",
    "llama3_70b_fsdp": f"--model llama3-70b --from dp_shard=128 --to dp_shard=64 {NET}",
    # Every state sharded over all ranks (the layouts whose states fit 80 GB at 128; docs/benchmarks.md).
    "qwen3_235b": f"--model qwen3-235b-a22b --from dp_shard=128,ep=16 --to dp_shard=64,ep=16 {NET}",
    "qwen3_235b_tp": f"--model qwen3-235b-a22b --from dp_shard=64,tp=2,ep=16 --to dp_shard=64,ep=16 {NET}",
}
RATES = {"cpu_hash": CPU_HASH.s_per_gib, "gpu_hash_estimate": GPU_HASH_S_PER_GIB_ESTIMATE}


def run_case(flags: str) -> dict:
    parser = plan.configure(argparse.ArgumentParser(prog="dynatrain plan"))
    load = os.getloadavg()[0]
    result = plan.compute(parser.parse_args(shlex.split(flags)))
    return {"command": f"dynatrain plan {flags} --json", "load_average_1min": load, "plan": result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/stall_prediction")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        for rate_name, rate in RATES.items():
            row = run_case(f"{CASES[case]} --hash-s-per-gib {rate:g}")
            row["bench_command"] = "python " + " ".join(sys.argv)
            (out / f"{case}.{rate_name}.json").write_text(json.dumps(row, indent=1) + "\n")
            s = row["plan"]["stall"]
            print(f"{case:16s} {rate_name:18s} in stall {s['in_stall']:7.3f} s  ahead {s['ahead']:6.3f} s  (formation "
                  f"{s['formation']:.3f}, build {s['build']:.3f}, plan {s['plan']:.3f}, transfer {s['transfer']:.3f}, "
                  f"check {s['check']:.3f}); load {row['load_average_1min']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
