"""Pipeline stages with experts at 1,024 ranks: `dynatrain plan` for Qwen3-235B-A22B from the cluster recipe's layout
(`recipes/qwen3-235b-a22b.yaml`, pp=8,dp_shard=128,ep=8 on 128 nodes x 8) to half the job (pp=8,dp_shard=64,ep=8
on 512) and, with a node of 8 lost, to the layout policy's best on the 1,016 left.

    python bench/moe_pp_plan.py --json bench/results/moe/qwen3_235b_pp.json

Figures as `bench/moe_plan.py` defines them: one rank's planning (wall and CPU seconds on one core of this machine)
plus the transfer the network model predicts on the paper's cluster, fp32 weights + Adam moments, budget 2048 MiB.
Goal: planning <= 2 s and predicted transfer <= 2 s each (the paper: 4.36 s on 128 GPUs).

1,016 = 8 x 127 processes: every layout of them has 127 in its data-parallel size (pp cannot be 127: the model has 94
layers), so the recipe's global batch of 2048 sequences is kept by none of them. The policy is asked for the best
layout with the nearest global batch that 127 divides, 2032 sequences (16 x 127), the recipe's other settings kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning is timed as one rank computes it: one core

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from moe_plan import GOAL_S, MODEL, REFERENCE_S, plan_one  # noqa: E402  (this folder)
from dynatrain.policy import Devices, Workload, choose_layout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "qwen3-235b-a22b.yaml"
LOST_NODE_BATCH = 2032  # 16 x 127: the global batch a 1,016-process layout can keep


def recipe_workload(global_batch: int | None = None) -> tuple[str, Workload, int]:
    """(the recipe's layout, its workload, its devices per node)."""
    cfg = yaml.safe_load(RECIPE.read_text())
    trainer, data, init = cfg["trainer"], cfg["data"], cfg["trainer"]["strategy"]["init_args"]
    work = Workload(cfg["model"]["model"], seq_len=data["seq_len"],
                    global_batch=global_batch or data["global_batch_size"], micro_batch=data["micro_batch_size"],
                    activation_checkpointing=init["parallelism"]["activation_checkpointing"])
    return init["parallel"], work, trainer["devices"]


def run() -> dict:
    layout, _, per_node = recipe_workload()
    _, lost_work, _ = recipe_workload(LOST_NODE_BATCH)
    best = choose_layout(Devices(1016, 80 * 10**9, per_node=per_node, flops=989e12), lost_work)
    targets = {
        "half the job (512)": ["--to", "pp=8,dp_shard=64,ep=8", "--leave", "512-1023"],
        "a node lost: the policy's best on 1,016": ["--to", best.config.short(), "--leave", "1016-1023"],
    }
    rows = []
    for label, extra in targets.items():
        r = plan_one(["--from", layout, *extra])
        row = {"switch": label, "from": r["from"], "to": r["to"], "ranks_from": r["processes_old"],
               "ranks_to": r["processes_new"], "bytes_total": r["bytes_total"], "bytes_moved": r["bytes_moved"],
               "fraction_moved": r["fraction_moved"], "rounds": r["rounds"], "plan_s": r["plan_seconds"],
               "plan_cpu_s": r["cpu_seconds"], "predicted_transfer_s": r["predicted_seconds"],
               "goal_met": r["plan_seconds"] <= GOAL_S and r["predicted_seconds"] <= GOAL_S}
        rows.append(row)
        print(f"  {label:<42} {row['from']} -> {row['to']}: moved {100 * row['fraction_moved']:.1f}%, plan "
              f"{row['plan_s']:.2f} s (cpu {row['plan_cpu_s']:.2f}), transfer {row['predicted_transfer_s']:.3f} s, "
              f"goal {'met' if row['goal_met'] else 'MISSED'}", flush=True)
    return {
        "model": MODEL, "state": "fp32-adam", "recipe": str(RECIPE.relative_to(REPO)), "recipe_layout": layout,
        "policy_best_1016": {"layout": best.config.short(), "global_batch": LOST_NODE_BATCH,
                             "step_s": best.step_seconds, "memory_gib": best.memory_bytes / 2**30,
                             "checkpointing": best.checkpointing},
        "cluster": {"gpus_per_node": per_node, "nics_per_node": 8, "link_gbps": 200, "intra_node_gbps": 3200,
                    "round_latency_s": 20e-6},
        "goal_s": {"plan": GOAL_S, "predicted_transfer": GOAL_S}, "reference_s": REFERENCE_S,
        "switches": rows, "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    out = run()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["goal_met"] for r in out["switches"]) else 1


if __name__ == "__main__":
    sys.exit(main())
