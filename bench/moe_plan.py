"""Mixture-of-experts switches by simulation: `dynatrain plan` for Qwen3-235B-A22B on 128 GPUs (16 nodes x 8) for
layout pairs that change ep, and planning at 1,024 ranks.

    python bench/moe_plan.py --json bench/results/moe/qwen3_235b.json

The switch time is defined as for the dense figures (`bench/scale.py`): one rank's planning, timed on this machine,
plus the transfer the network model predicts on the paper's cluster (8 GPUs per node, 8 x 200 Gbit/s NICs per node,
3200 Gbit/s per GPU inside a node, 20 us per round), fp32 weights + Adam moments, budget 2048 MiB, TP groups kept
inside a node. The reference is the paper's 4.36 s for its 235B MoE switch; the goal is 2 s.

Every pair's bytes on the wire are checked against an independent count made with torch's distributed-checkpoint
arithmetic: each position's wanted chunk in the new layout and the chunk its process saved in the old one come
from `_compute_local_shape_and_global_offset` (DTensor's own local shape and offset for a mesh coordinate), and
DCP's resharding (`create_read_items_for_chunk_list`) gives the part of the wanted chunk the process already holds.
Bytes on the wire are the wanted bytes less those, summed over positions: what stays on a process is excluded on
both sides. The planner's routes are not used.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning is timed as one rank computes it: one core

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from dynatrain.cli.plan import compute, configure  # noqa: E402
from dynatrain.models.specs import get_zoo_config, layout_for_model  # noqa: E402
from dynatrain.planner.schedule import plan_switch  # noqa: E402
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS, Layout  # noqa: E402
from dynatrain.vps.placement import Shard, Sharding, StridedShard  # noqa: E402

MODEL = "qwen3-235b-a22b"
GPUS_PER_NODE = 8
BUDGET_MB = 2048
REFERENCE_S = 4.36  # the paper's 235B MoE switch
GOAL_S = 2.0
# qwen3-235b-a22b has 4 KV heads, so tp is at most 4 (`ParallelConfig.validate`); ep divides its 128 experts.
PAIRS_128 = {
    "ep halved": ["--from", "dp_shard=32,tp=4,ep=16", "--to", "dp_shard=32,tp=4,ep=8"],
    "ep doubled, tp halved": ["--from", "dp_shard=32,tp=4,ep=16", "--to", "dp_shard=64,tp=2,ep=32"],
    "ep on, from plain FSDP": ["--from", "dp_shard=128", "--to", "dp_shard=128,ep=16"],
    "experts over every rank, tp off": ["--from", "dp_shard=64,tp=2,ep=8", "--to", "dp_shard=128,ep=128"],
    "node lost, ep shrinks": ["--from", "dp_shard=32,tp=4,ep=16", "--to", "dp_shard=30,tp=4,ep=2",
                              "--leave", "120-127"],
    # The same loss with tp given up instead: 120 = 15 x 8 keeps an ep that divides the 128 experts.
    "node lost, tp off, ep 8": ["--from", "dp_shard=32,tp=4,ep=16", "--to", "dp_shard=120,ep=8",
                                "--leave", "120-127"],
}
PAIRS_1024 = {
    "ep doubled, tp halved": ["--from", "dp_shard=256,tp=4,ep=32", "--to", "dp_shard=512,tp=2,ep=64"],
    "ep halved": ["--from", "dp_shard=256,tp=4,ep=32", "--to", "dp_shard=256,tp=4,ep=16"],
}


def _args(extra: list[str]) -> argparse.Namespace:
    return configure(argparse.ArgumentParser()).parse_args(
        ["--model", MODEL, "--gpus-per-node", str(GPUS_PER_NODE), "--budget-mb", str(BUDGET_MB), *extra])


def plan_one(extra: list[str]) -> dict:
    """`dynatrain plan --json`'s figures plus the CPU seconds of the computation (wall time on a shared machine
    counts other processes too)."""
    args = _args(extra)
    cpu = time.process_time()
    out = compute(args)
    out["cpu_seconds"] = time.process_time() - cpu
    out["switch_seconds"] = out["plan_seconds"] + out["predicted_seconds"]
    return out


# ---------------------------------------------------------------------------------------------- DCP cross-check
def _torch_placements(sh: Sharding):
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in sh.placements:
        if isinstance(p, StridedShard):
            out.append(_StridedShard(p.dim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(TShard(p.dim))
        else:
            raise ValueError(f"unexpected placement {p}")
    return out


def _chunk(shape: tuple[int, ...], sh: Sharding, position: int, placements):
    """DTensor's (local shape, global offset) at ``position``, each placement on its (flattened) mesh dimension."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    import torch

    if not placements:
        return ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))
    size, offset = _compute_local_shape_and_global_offset(shape, sh.sizes(), list(sh.coordinates(position)),
                                                          placements)
    return ChunkStorageMetadata(torch.Size(offset), torch.Size(size))


def dcp_bytes_on_the_wire(old: Layout, new: Layout, kind: str) -> int:
    """Bytes every process must receive: per new position, its wanted chunk less what its process saved in the
    old layout (DCP's read items against that one saved chunk), times the bytes per element of all states of the
    parameter (they share its placements)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    per_element = sum(DTYPE_ITEMSIZE[dtype] for _, dtype in STATE_KINDS[kind])
    params = [i for i, s in enumerate(old.states) if "." + s.name.rsplit(".", 1)[-1] not in
              {suffix for suffix, _ in STATE_KINDS[kind] if suffix}]
    total = 0
    for i in params:
        spec = old.states[i]
        sh_old, sh_new = old.shardings[i], new.shardings[i]
        pl_old, pl_new = _torch_placements(sh_old), _torch_placements(sh_new)
        saved = {}
        elements = 0
        for q, proc in enumerate(new.rank_map):
            if proc is None:
                continue
            want = _chunk(spec.shape, sh_new, q, pl_new)
            wanted = math.prod(want.sizes)
            if not wanted:
                continue
            kept = 0
            q_old = old.position_of(proc)
            if q_old is not None:
                if q_old not in saved:
                    saved[q_old] = _chunk(spec.shape, sh_old, q_old, pl_old)
                md = TensorStorageMetadata(TensorProperties(), torch.Size(spec.shape), [saved[q_old]])
                items = create_read_items_for_chunk_list(spec.name, md, [want])
                kept = sum(math.prod(item.lengths) for item in items)
            elements += wanted - kept
        total += elements * per_element
    return total


def cross_check(extra: list[str], planned: dict) -> dict:
    return verify_plan(_args(extra), planned, dcp_bytes_on_the_wire)


def verify_plan(args: argparse.Namespace, planned: dict, count) -> dict:
    """The plan of `dynatrain plan` ``args`` again (same inputs: deterministic), and its bytes against ``count``'s
    (old layout, new layout, state kind -> bytes on the wire)."""
    model = get_zoo_config(args.model)
    start = time.perf_counter()
    old = layout_for_model(model, args.old, args.state)
    plan = plan_switch(old, layout_for_model(model, args.new, args.state), leave=args.leave, lost=args.lost,
                       rank_map=args.rank_map, budget_bytes=planned["budget_bytes"], gpus_per_node=args.gpus_per_node)
    if plan.bytes_moved != planned["bytes_moved"]:
        raise AssertionError(f"the plan is not deterministic: {plan.bytes_moved} != {planned['bytes_moved']}")
    dcp = count(old, plan.new, args.state)
    return {"planner_bytes": plan.bytes_moved, "dcp_bytes": dcp, "equal": dcp == plan.bytes_moved,
            "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------- run
def _row(label: str, extra: list[str], check: bool) -> dict:
    r = plan_one(extra)
    row = {
        "switch": label, "ranks": r["processes_old"], "from": r["from"], "to": r["to"], "leaving": len(r["leaving"]),
        "bytes_total": r["bytes_total"], "bytes_moved": r["bytes_moved"], "fraction_moved": r["fraction_moved"],
        "bytes_moved_identity": r["bytes_moved_identity"], "rounds": r["rounds"],
        "plan_s": r["plan_seconds"], "plan_cpu_s": r["cpu_seconds"], "predicted_transfer_s": r["predicted_seconds"],
        "switch_s": r["switch_seconds"], "reference_s": REFERENCE_S, "goal_s": GOAL_S,
        "goal_met": r["switch_seconds"] <= GOAL_S,
    }
    if check:
        row["dcp_check"] = cross_check(extra, r)
    print(f"  {row['ranks']:>5} {label:<32} moved {100 * row['fraction_moved']:5.1f}% plan {row['plan_s']:.2f}s "
          f"(cpu {row['plan_cpu_s']:.2f}) transfer {row['predicted_transfer_s']:.3f}s switch {row['switch_s']:.2f}s"
          + (f" dcp {'==' if row['dcp_check']['equal'] else '!='}" if check else ""), flush=True)
    return row


def run(check: bool) -> dict:
    rows_128 = [_row(label, extra, check) for label, extra in PAIRS_128.items()]
    rows_1024 = [_row(label, extra, False) for label, extra in PAIRS_1024.items()]
    cfg = get_zoo_config(MODEL)
    return {
        "model": MODEL, "state": "fp32-adam", "params": cfg.num_params(), "active_params": cfg.active_params(),
        "cluster": {"nodes": 16, "gpus_per_node": GPUS_PER_NODE, "nics_per_node": 8, "link_gbps": 200,
                    "intra_node_gbps": 3200, "round_latency_s": 20e-6},
        "budget_mb": BUDGET_MB,
        "switch_seconds_definition": "plan_seconds (one rank's planning, wall clock on this machine) + "
                                     "predicted_seconds (network model), as bench/scale.py",
        "reference_s": REFERENCE_S, "goal_s": GOAL_S,
        "dcp_check_model": MODEL if check else None,
        "dcp_check_method": "per parameter (its optimizer states share its placements) and new position: "
                            "_compute_local_shape_and_global_offset for the wanted chunk and the process's saved "
                            "chunk, DCP create_read_items_for_chunk_list for their overlap; bytes = wanted - kept",
        "switches_128": rows_128,
        "planning_1024": rows_1024,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--no-check", action="store_true", help="skip the DCP cross-check")
    args = ap.parse_args(argv)
    return finish(run(not args.no_check), args.json)


def finish(out: dict, path: Path | None) -> int:
    """Write the figures (when asked) and fail when a row's bytes on the wire differ from the DCP count."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    bad = [r["switch"] for r in out.get("switches_128", []) if "dcp_check" in r and not r["dcp_check"]["equal"]]
    if bad:
        print(f"bytes on the wire differ from the DCP count for: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
