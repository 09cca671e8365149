"""One process of `bench/first_touch.py`: the engine alone on synthetic states, each of ``--ways`` in turn (the order
rotating from one repeat to the next), ``--repeats`` times each.

Ways: ``during`` (destinations allocated when their first bytes arrive), ``ahead`` (allocated before the transfer by
the processes the case names) and ``every-state`` (as ``during``, but with phases that count every state as
doubling while it moves, kept in place or not: how `planner.groups` cut a switch before it left such states out).
"""

import argparse
import gc
import time

import numpy as np
import torch
import torch.distributed as dist

import dynatrain.planner.groups as groups

from _raw_p2p import budget_exchange, pair_bytes, raw_exchange  # this folder
from dynatrain.engine import allocate_destinations, run_transition, torch_dtype
from dynatrain.launch.local import finish_rank
from dynatrain.models.specs import layout_for_model
from dynatrain.planner.schedule import plan_switch
from dynatrain.vps import ParallelConfig

MiB = 2**20
# case -> (old layout, its processes, new layout, the processes that allocate ahead in the "ahead" way)
CASES = {
    "same-world": ("dp_shard=2", 2, "tp=2", (0, 1)),
    "same-world-back": ("tp=2", 2, "dp_shard=2", (0, 1)),
    "scale-out": ("dp_shard=2", 2, "dp_shard=4", (2, 3)),  # the joiners, as `dynatrain join` does
}


def _nothing_kept(old, new, q_old, q_new):
    return np.zeros(len(q_old), dtype=bool)


def one_switch(case: str, args, rank: int, world: int, way: str) -> dict:
    old_cfg, old_procs, new_cfg, early = CASES[case]
    old = layout_for_model(args.model, ParallelConfig.parse(old_cfg))
    joiners = list(range(old_procs, world))
    kept_in_place = groups.kept_in_place
    if way == "every-state":
        groups.kept_in_place = _nothing_kept
    try:
        plan = plan_switch(old, new_cfg, budget_bytes=int(args.budget_mb * MiB), rank_map="identity",
                           joiners=joiners or None)
    finally:
        groups.kept_in_place = kept_in_place
    ahead = way == "ahead"
    src = {}
    if rank < old_procs:
        src = {s.name: torch.ones(old.shards(s.name, rank).local_shape, dtype=torch_dtype(s.dtype))
               for s in old.states}
    t0 = time.perf_counter()
    ready = allocate_destinations(plan, rank) if ahead and rank in early else {}
    alloc_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    dst, stats = run_transition(plan, rank, src, preallocated=ready, copy_threads=args.copy_threads)
    engine_s = time.perf_counter() - t0
    del dst, src, ready
    gc.collect()
    pairs = pair_bytes(plan)
    raw_s = min(raw_exchange(pairs, rank, 64 * MiB, 2))
    budget_raw_s = min(budget_exchange(pairs, rank, int(args.budget_mb * MiB), 2))
    return {"case": case, "way": way, "engine_s": engine_s, "alloc_ahead_s": alloc_s,
            "raw_s": raw_s, "budget_raw_s": budget_raw_s, "seconds_wire": stats.seconds_wire,
            "seconds_local": stats.seconds_local,
            "seconds_unpack": stats.seconds_unpack, "bytes_received": stats.bytes_received,
            "bytes_sent": stats.bytes_sent, "bytes_local": stats.bytes_local, "peak_bytes": stats.peak_bytes,
            "peak_bound": stats.peak_bound, "dst_bytes": stats.dst_bytes, "rounds": stats.rounds,
            "seconds_pack": stats.seconds_pack, "process_threads": torch.get_num_threads(),
            "copy_threads": stats.copy_threads}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--cases", default="same-world,same-world-back")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--ways", default="during,ahead")
    ap.add_argument("--copy-threads", type=int, default=None)
    args = ap.parse_args()
    ways = args.ways.split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trials = []
    for r in range(args.repeats):
        for case in args.cases.split(","):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:  # each way goes first in turn
                trials.append(one_switch(case, args, rank, world, way))
    finish_rank(args.out, {"rank": rank, "trials": trials})


if __name__ == "__main__":
    main()
