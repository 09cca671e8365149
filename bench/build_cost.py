"""The target build's cost per tensor, for the stall model (`dynatrain.policy.stall_model`): one process, one core.

    python bench/build_cost.py --json bench/results/stall_prediction/build_cost.json

A switch builds its target from a meta copy of the module, parallelised by the model kind's own `parallelize_fn`
(the zoo's dense FSDP2 + TP, or the MoE's with experts) on a probe mesh of the target's shape, and then reads every
state's placements: `bench/meta_build.py`'s three parts (copy, parallelise, placements), here for any zoo model
through the registry and for the layouts the stall model is asked about. Each row divides the parts' wall seconds by
the parameters and buffers the rank wraps, the unit the model prices; CPU seconds beside wall seconds, and the load
average, since other jobs share the cores. Median of ``--repeats``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meta_build import PARTS, timed  # noqa: E402

from dynatrain.models.registry import get_zoo_config, spec_for  # noqa: E402
from dynatrain.switch.capture import merged_shardings  # noqa: E402
from dynatrain.switch.probe import probe_mesh  # noqa: E402
from dynatrain.switch.target import meta_copy  # noqa: E402
from dynatrain.vps.parallel_config import ParallelConfig  # noqa: E402

# The stall model's two paper cases (their targets), and the dense model without TP, which sets its second constant.
PAIRS = "llama3-70b:dp_shard=8,tp=8;llama3-70b:dp_shard=64;qwen3-235b-a22b:dp_shard=16,tp=4,ep=16"


def build_once(model: torch.nn.Module, cfg, pcfg: ParallelConfig) -> dict:
    row = {}
    copy, row["copy_s"], row["copy_cpu_s"] = timed(lambda: meta_copy(model))
    with probe_mesh(pcfg, "cpu") as mesh:
        _, row["parallelize_s"], row["parallelize_cpu_s"] = timed(
            lambda: spec_for(cfg).parallelize_fn(copy, mesh, pcfg, None))
        table, row["placements_s"], row["placements_cpu_s"] = timed(lambda: merged_shardings([(copy, mesh)]))
    row["parameters_and_buffers"] = len(table)
    row["total_s"] = sum(row[f"{p}_s"] for p in PARTS)
    row["total_cpu_s"] = sum(row[f"{p}_cpu_s"] for p in PARTS)
    return row


def measure(name: str, layout: str, repeats: int) -> dict:
    cfg = get_zoo_config(name)
    pcfg = ParallelConfig.parse(layout).validate(cfg)
    with torch.device("meta"):
        model = spec_for(cfg).build(cfg)
    load = os.getloadavg()[0]
    rows = [build_once(model, cfg, pcfg) for _ in range(repeats)]
    out = {"model": name, "layout": pcfg.short(), "load_average_1min": load,
           **{k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")},
           "total_s_each": [r["total_s"] for r in rows], "parameters_and_buffers": rows[0]["parameters_and_buffers"]}
    n = out["parameters_and_buffers"]
    out["per_tensor_s"] = {p: out[f"{p}_s"] / n for p in (*PARTS, "total")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default=PAIRS, help="';'-separated MODEL:LAYOUT pairs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            for pair in args.pairs.split(";"):
                name, layout = pair.split(":", 1)
                row = measure(name, layout, args.repeats)
                results.append(row)
                per = row["per_tensor_s"]
                print(f"{name:16s} {row['layout']:22s} {row['parameters_and_buffers']:5d} tensors  total "
                      f"{row['total_s']:.3f} s (cpu {row['total_cpu_s']:.3f}): {per['total'] * 1e3:.3f} ms/tensor "
                      f"(copy {per['copy'] * 1e3:.3f}, parallelise {per['parallelize'] * 1e3:.3f}, placements "
                      f"{per['placements'] * 1e3:.3f}); load {row['load_average_1min']:.2f}", flush=True)
        finally:
            dist.destroy_process_group()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "torch": torch.__version__, "cpu_count": os.cpu_count(),
                                               "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
