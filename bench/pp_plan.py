"""Pipeline-parallel switches by simulation: `dynatrain plan` for Llama-3-70B on 128 GPUs (16 nodes x 8) for layouts
that change pp, beside two dense dp/tp switches on the same cluster; planning of 70B pp changes at 1,024 ranks; and,
with ``--405b``, Llama-3.1-405B pp changes at 16,384 ranks.

    python bench/pp_plan.py --json bench/results/pp/llama3_70b_128.json
    python bench/pp_plan.py --405b --json bench/results/pp/plan405.json

The switch time is defined as for the dense and MoE figures (`bench/scale.py`, `bench/moe_plan.py`): one rank's
planning, timed on this machine, plus the transfer the network model predicts on the paper's cluster (8 GPUs per node,
8 x 200 Gbit/s NICs per node, 3200 Gbit/s per GPU inside a node, 20 us per round), fp32 weights + Adam moments, budget
2048 MiB, TP groups kept inside a node. A pp layout's boxes come from the analytic specs (`models.specs`): each state
keeps its placements without pp and is held by its stage only, by the stage split the runtime uses.

Every 128-rank row's bytes on the wire are checked against an independent count with torch's distributed-checkpoint
arithmetic, as in `bench/moe_plan.py`: per new position, its wanted chunk less the chunk its process saved in the old
layout, each from `_compute_local_shape_and_global_offset` on the stage's own mesh (a position of another stage holds
nothing), their overlap from DCP's `create_read_items_for_chunk_list`. The planner's routes are not used.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning is timed as one rank computes it: one core

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from dynatrain.cli.plan import compute, configure  # noqa: E402
from moe_plan import _torch_placements, finish, verify_plan  # noqa: E402  (this folder)
from dynatrain.models.specs import get_zoo_config  # noqa: E402
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS, Layout  # noqa: E402
from dynatrain.vps.placement import Sharding  # noqa: E402

GPUS_PER_NODE = 8
BUDGET_MB = 2048
GOAL_S = 2.0  # the paper's "under 2 s" for a 70B switch
CLUSTER = {"gpus_per_node": GPUS_PER_NODE, "nics_per_node": 8, "link_gbps": 200, "intra_node_gbps": 3200,
           "round_latency_s": 20e-6}
# Llama-3-70B on 16 nodes x 8 GPUs; tp stays 8 (one node) unless the row says otherwise. 120 ranks after a node is
# lost factor as pp x dp_shard x 8 with pp in {3, 5, 15}.
SWITCHES_128 = {
    "dense re-layout (reference)": ["--from", "dp_shard=16,tp=8", "--to", "dp_shard=32,tp=4"],
    "dense node lost (reference)": ["--from", "dp_shard=16,tp=8", "--to", "dp_shard=15,tp=8", "--leave", "120-127"],
    "pp on": ["--from", "dp_shard=16,tp=8", "--to", "pp=2,dp_shard=8,tp=8"],
    "pp 2 -> 4": ["--from", "pp=2,dp_shard=8,tp=8", "--to", "pp=4,dp_shard=4,tp=8"],
    "pp 4 -> 8": ["--from", "pp=4,dp_shard=4,tp=8", "--to", "pp=8,dp_shard=2,tp=8"],
    "pp 8 -> 2": ["--from", "pp=8,dp_shard=2,tp=8", "--to", "pp=2,dp_shard=8,tp=8"],
    "pp off": ["--from", "pp=4,dp_shard=4,tp=8", "--to", "dp_shard=16,tp=8"],
    "pp 2 -> 4, tp 8 -> 4": ["--from", "pp=2,dp_shard=8,tp=8", "--to", "pp=4,dp_shard=8,tp=4"],
    "node lost, pp 4 -> 5": ["--from", "pp=4,dp_shard=4,tp=8", "--to", "pp=5,dp_shard=3,tp=8", "--leave", "120-127"],
    "node lost, pp 2 -> 3": ["--from", "pp=2,dp_shard=8,tp=8", "--to", "pp=3,dp_shard=5,tp=8", "--leave", "120-127"],
    "node lost, pp off": ["--from", "pp=2,dp_shard=8,tp=8", "--to", "dp_shard=15,tp=8", "--leave", "120-127"],
}
PLANNING_1024 = {
    "pp on": ["--from", "dp_shard=128,tp=8", "--to", "pp=2,dp_shard=64,tp=8"],
    "pp 2 -> 4": ["--from", "pp=2,dp_shard=64,tp=8", "--to", "pp=4,dp_shard=32,tp=8"],
    "pp 8 -> 16": ["--from", "pp=8,dp_shard=16,tp=8", "--to", "pp=16,dp_shard=8,tp=8"],
    "pp off": ["--from", "pp=4,dp_shard=32,tp=8", "--to", "dp_shard=128,tp=8"],
}
# Llama-3.1-405B (126 layers) at 16,384 ranks. A lost node leaves 16,376 = 8 x 23 x 89 ranks: with tp=8 the only pp
# that keeps whole stages is 23 (or 89).
PLANNING_16384 = {
    "pp 16 -> 8": ["--from", "pp=16,dp_shard=128,tp=8", "--to", "pp=8,dp_shard=256,tp=8"],
    "pp 8 -> 16": ["--from", "pp=8,dp_shard=256,tp=8", "--to", "pp=16,dp_shard=128,tp=8"],
    "pp on (1 -> 16)": ["--from", "dp_shard=2048,tp=8", "--to", "pp=16,dp_shard=128,tp=8"],
    "node lost, pp 16 -> 23": ["--from", "pp=16,dp_shard=128,tp=8", "--to", "pp=23,dp_shard=89,tp=8",
                               "--leave", "16376-16383"],
}


def _args(model: str, extra: list[str]) -> argparse.Namespace:
    return configure(argparse.ArgumentParser()).parse_args(
        ["--model", model, "--gpus-per-node", str(GPUS_PER_NODE), "--budget-mb", str(BUDGET_MB), *extra])


def plan_one(model: str, extra: list[str]) -> dict:
    """`dynatrain plan --json`'s figures plus the CPU seconds of the computation (wall time on a shared machine
    counts other processes too)."""
    args = _args(model, extra)
    cpu = time.process_time()
    out = compute(args)
    out["cpu_seconds"] = time.process_time() - cpu
    out["switch_seconds"] = out["plan_seconds"] + out["predicted_seconds"]
    return out


# ---------------------------------------------------------------------------------------------- DCP cross-check
def _chunk(shape: tuple[int, ...], sh: Sharding, position: int, placements):
    """DTensor's (local shape, global offset) at ``position`` on the mesh of its placements; nothing on a position of
    another pipeline stage."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if not sh.holds(position):
        return None
    if not placements:
        return ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))
    size, offset = _compute_local_shape_and_global_offset(shape, sh.sizes(), list(sh.coordinates(position)),
                                                          placements)
    return ChunkStorageMetadata(torch.Size(offset), torch.Size(size))


def _sharding(layout: Layout, i: int) -> Sharding:
    """A state's placements: read from the layout when it has them (pp, MoE), else those of its rule."""
    from dynatrain.vps.rules import rule_sharding

    return layout.shardings[i] if layout.shardings is not None else rule_sharding(layout.states[i].rule,
                                                                                  layout.config)


def dcp_bytes_on_the_wire(old: Layout, new: Layout, kind: str) -> int:
    """Bytes every process must receive: per new position, its wanted chunk less what its process saved in the old
    layout, times the bytes per element of all states of the parameter (they share its placements). Parameters with
    the same shape and the same old and new placements are counted once and multiplied."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    per_element = sum(DTYPE_ITEMSIZE[dtype] for _, dtype in STATE_KINDS[kind])
    per_param = len(STATE_KINDS[kind])
    groups: dict[tuple, int] = {}
    for i in range(0, len(old.states), per_param):
        key = (old.states[i].shape, _sharding(old, i), _sharding(new, i))
        groups[key] = groups.get(key, 0) + 1
    total = 0
    for (shape, sh_old, sh_new), count in groups.items():
        pl_old, pl_new = _torch_placements(sh_old), _torch_placements(sh_new)
        saved: dict[int, object] = {}
        elements = 0
        for q, proc in enumerate(new.rank_map):
            want = _chunk(shape, sh_new, q, pl_new)
            if want is None or not math.prod(want.sizes):
                continue
            kept = 0
            q_old = old.position_of(proc)
            if q_old is not None:
                if q_old not in saved:
                    saved[q_old] = _chunk(shape, sh_old, q_old, pl_old)
                if saved[q_old] is not None:
                    md = TensorStorageMetadata(TensorProperties(), torch.Size(shape), [saved[q_old]])
                    items = create_read_items_for_chunk_list("state", md, [want])
                    kept = sum(math.prod(item.lengths) for item in items)
            elements += math.prod(want.sizes) - kept
        total += elements * per_element * count
    return total


def cross_check(model: str, extra: list[str], planned: dict) -> dict:
    """The plan again (same inputs: deterministic), and its bytes against the DCP count."""
    return verify_plan(_args(model, extra), planned, dcp_bytes_on_the_wire)


# ---------------------------------------------------------------------------------------------- run
def _row(model: str, label: str, extra: list[str], check: bool) -> dict:
    r = plan_one(model, extra)
    row = {
        "switch": label, "ranks": r["processes_old"], "from": r["from"], "to": r["to"], "leaving": len(r["leaving"]),
        "bytes_total": r["bytes_total"], "bytes_moved": r["bytes_moved"], "fraction_moved": r["fraction_moved"],
        "bytes_moved_identity": r["bytes_moved_identity"], "max_rank_recv_bytes": r["max_rank_recv_bytes"],
        "rounds": r["rounds"], "phases": r["phases"], "pairs": r["pairs"], "plan_s": r["plan_seconds"],
        "plan_cpu_s": r["cpu_seconds"],
        "predicted_transfer_s": r["predicted_seconds"], "switch_s": r["switch_seconds"],
        "goal_met": r["switch_seconds"] <= GOAL_S,
        "command": "dynatrain plan --model " + model + " " + " ".join(extra)
                   + f" --gpus-per-node {GPUS_PER_NODE} --budget-mb {BUDGET_MB}",
    }
    if check:
        row["dcp_check"] = cross_check(model, extra, r)
    print(f"  {row['ranks']:>5} {label:<30} moved {100 * row['fraction_moved']:5.1f}% plan {row['plan_s']:.2f}s "
          f"(cpu {row['plan_cpu_s']:.2f}) transfer {row['predicted_transfer_s']:.3f}s switch {row['switch_s']:.2f}s"
          + (f" dcp {'==' if row['dcp_check']['equal'] else '!='}" if check else ""), flush=True)
    return row


def _header(model: str) -> dict:
    cfg = get_zoo_config(model)
    return {
        "model": model, "state": "fp32-adam", "params": cfg.num_params(), "n_layers": cfg.n_layers,
        "cluster": CLUSTER, "budget_mb": BUDGET_MB, "stages_per_rank": 1,
        "switch_seconds_definition": "plan_seconds (one rank's planning, wall clock on this machine) + "
                                     "predicted_seconds (network model), as bench/scale.py",
        "goal_s": GOAL_S, "python": sys.version.split()[0],
    }


def run_70b(check: bool) -> dict:
    out = _header("llama3-70b")
    out["cluster"] = dict(CLUSTER, nodes=16)
    out["dcp_check_method"] = ("per distinct (shape, old placements, new placements), every new position: "
                               "_compute_local_shape_and_global_offset on the stage's mesh for the wanted chunk and "
                               "the process's saved chunk, DCP create_read_items_for_chunk_list for their overlap; "
                               "bytes = wanted - kept") if check else None
    out["switches_128"] = [_row("llama3-70b", label, extra, check) for label, extra in SWITCHES_128.items()]
    out["planning_1024"] = [_row("llama3-70b", label, extra, False) for label, extra in PLANNING_1024.items()]
    return out


def run_405b() -> dict:
    out = _header("llama3-405b")
    out["planning_16384"] = [_row("llama3-405b", label, extra, False) for label, extra in PLANNING_16384.items()]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--405b", dest="big", action="store_true",
                    help="plan Llama-3.1-405B pp changes at 16,384 ranks instead of the 70B rows")
    ap.add_argument("--no-check", action="store_true", help="skip the DCP cross-check of the 128-rank rows")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out = run_405b() if args.big else run_70b(not args.no_check)
    out["wall_s"] = time.perf_counter() - start
    out["command"] = "python bench/pp_plan.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return finish(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
