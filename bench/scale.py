"""Switches at scale, by simulation: `dynatrain plan` for Llama-3-70B and 8B at 64 to 1,024 ranks.

    python bench/scale.py --json bench/results/scale.json

For each model and rank count N, two switches are planned the way `dynatrain plan` does (one rank's planning
timed on this machine, the transfer predicted on the paper's cluster model: 8 GPUs per node, 8 x 200 Gbit/s NICs
per node, 3200 Gbit/s per GPU inside a node, fp32 weights + Adam moments, budget 2048 MiB, TP groups kept inside a
node):
* **node lost**: the last node (8 ranks) leaves, dp_shard=N/8,tp=8 -> dp_shard=N/8-1,tp=8;
* **re-layout**: the same N ranks go from dp_shard=N/8,tp=8 to dp_shard=N/4,tp=4.

Beside each, a checkpoint-and-restart estimate: the whole training state written once and read once at an
aggregate storage bandwidth (``--storage-gbs``, GB/s, for the whole job), nothing else counted (no process
launch, no communicator set-up, no model initialisation), so it is a lower bound of a restart.
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

MODELS = {"llama3-70b": "Llama-3-70B", "llama3-8b": "Llama-3-8B"}
RANKS = (64, 128, 256, 512, 1024)
GPUS_PER_NODE = 8
# Figures the paper reports on its cluster (the comparison column of the table).
PAPER = {"llama3-70b": "under 2 s", "235B MoE": "4.36 s", "against checkpoint-based systems": "up to 1000x faster"}


def switches(n: int) -> dict[str, list[str]]:
    """`dynatrain plan` arguments of the two switches planned at ``n`` ranks."""
    dp = n // GPUS_PER_NODE
    return {
        "node lost": ["--from", f"dp_shard={dp},tp=8", "--to", f"dp_shard={dp - 1},tp=8",
                      "--leave", f"{n - GPUS_PER_NODE}-{n - 1}"],
        "re-layout": ["--from", f"dp_shard={dp},tp=8", "--to", f"dp_shard={2 * dp},tp=4"],
    }


def plan_one(model: str, extra: list[str]) -> dict:
    """`dynatrain plan --json`'s figures, plus the CPU seconds of the whole computation: on a shared machine the
    wall-clock `plan_seconds` counts the time other processes held the core too."""
    args = configure(argparse.ArgumentParser()).parse_args(
        ["--model", model, "--gpus-per-node", str(GPUS_PER_NODE), *extra])
    cpu = time.process_time()
    out = compute(args)
    out["cpu_seconds"] = time.process_time() - cpu
    return out


def restart_estimate(bytes_total: int, storage_gbs: float) -> float:
    """Seconds to write the whole state once and read it once at ``storage_gbs`` GB/s (the job's aggregate)."""
    return 2 * bytes_total / (storage_gbs * 1e9)


def run(storage: list[float]) -> list[dict]:
    rows = []
    for model in MODELS:
        for n in RANKS:
            for kind, extra in switches(n).items():
                r = plan_one(model, extra)
                switch_s = r["plan_seconds"] + r["predicted_seconds"]
                restart = {f"{g:g}": restart_estimate(r["bytes_total"], g) for g in storage}
                rows.append({"model": model, "ranks": n, "kind": kind, "from": r["from"], "to": r["to"],
                             "plan_s": r["plan_seconds"], "plan_cpu_s": r["cpu_seconds"],
                             "predicted_transfer_s": r["predicted_seconds"],
                             "switch_s": switch_s, "bytes_total": r["bytes_total"], "bytes_moved": r["bytes_moved"],
                             "fraction_moved": r["fraction_moved"], "rounds": r["rounds"],
                             "max_rank_bytes": r["max_rank_bytes"], "restart_s": restart,
                             "restart_over_switch": {g: t / switch_s for g, t in restart.items()}})
                print(f"  {model} {n:>5} {kind:<9} plan {r['plan_seconds']:.2f}s "
                      f"transfer {r['predicted_seconds']:.3f}s", flush=True)
    return rows


def table(rows: list[dict], storage: list[float]) -> str:
    heads = "".join(f" | restart at {g:g} GB/s s (x switch)" for g in storage)
    out = [f"| model | ranks | switch | moved | planning s, wall (CPU) | predicted transfer s "
           f"| switch s (plan + transfer){heads} |", "|" + "---|" * (7 + len(storage))]
    for r in rows:
        cells = "".join(f" | {r['restart_s'][f'{g:g}']:.0f} ({r['restart_over_switch'][f'{g:g}']:.0f}x)"
                        for g in storage)
        out.append(f"| {MODELS[r['model']]} | {r['ranks']} | {r['kind']}: {r['from']} -> {r['to']} "
                   f"| {100 * r['fraction_moved']:.1f}% | {r['plan_s']:.2f} ({r['plan_cpu_s']:.2f}) "
                   f"| {r['predicted_transfer_s']:.3f} "
                   f"| {r['switch_s']:.2f}{cells} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage-gbs", default="10,100",
                    help="aggregate checkpoint storage bandwidth of the job in GB/s, comma separated (default 10,100)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    storage = [float(g) for g in args.storage_gbs.split(",")]
    t0 = time.perf_counter()
    rows = run(storage)
    wall = time.perf_counter() - t0
    print(f"paper cluster model: {GPUS_PER_NODE} GPUs per node, 8 x 200 Gbit/s NICs per node, 3200 Gbit/s per GPU "
          f"inside a node; fp32 + Adam; planning timed on one core of this machine; wall {wall:.0f}s")
    print(table(rows, storage))
    print("paper: " + "; ".join(f"{k}: {v}" for k, v in PAPER.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python", "bench/scale.py", *sys.argv[1:]]), "wall_s": wall,
            "storage_gbs": storage, "paper": PAPER, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
