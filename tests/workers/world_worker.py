"""One process of tests/test_elastic_world.py: an initial member, a joiner, or a member waiting for a ghost.

Scenario (ids p0..p3 start, j4 and j5 join later):
  gen 0 {p0,p1,p2,p3} -> gen 1 {p2,p3} (p0, p1 exit 0) -> union gen 2 {p2,p3,j4,j5} -> gen 3 {p3,j4,j5} (p2 exits 0).
Each process writes the events it saw (generation, rank, world size, all_reduce result) as JSON to --out.
"""

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

# The package's __init__ imports Lightning, which the elastic module does not use; skipping it keeps each of
# these processes at torch's start-up cost, and checks that the elastic module stands without Lightning.
_pkg = types.ModuleType("dynatrain")
_pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "dynatrain")]
sys.modules.setdefault("dynatrain", _pkg)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dynatrain.elastic import (  # noqa: E402
    WorldGeneration, await_admission, connect, pending_joiners, register, run_world_change, union_then_target,
)

INITIAL = ["p0", "p1", "p2", "p3"]
TIMEOUT = 30.0


def number(member_id: str) -> int:
    return int(member_id[1:])


def reduce_ids(world: WorldGeneration) -> dict:
    t = torch.tensor([float(number(world.member_id)), 1.0])
    dist.all_reduce(t)
    return {"gen": world.generation, "rank": world.rank, "world": world.world_size,
            "backend_world": dist.get_world_size(), "backend_rank": dist.get_rank(),
            "sum": t[0].item(), "count": t[1].item()}


def run(args, store, events: list) -> None:
    if args.role == "ghost":
        t0 = time.monotonic()
        try:
            WorldGeneration.join(store, args.generation, args.id, [*args.members, "ghost"], timeout=args.timeout)
        except TimeoutError as e:
            events.append({"error": "TimeoutError", "message": str(e), "elapsed": time.monotonic() - t0})
        return

    transfer = lambda w: events.append({"transfer": True, **reduce_ids(w)})  # noqa: E731
    if args.role == "joiner":
        t = await_admission(store, args.id, TIMEOUT)
        world = run_world_change(t, store=store, member_id=args.id, transfer=transfer, timeout=TIMEOUT)
    else:
        world = WorldGeneration.join(store, 0, args.id, INITIAL, timeout=TIMEOUT)
        events.append(reduce_ids(world))
        world = world.next_generation(["p2", "p3"])
        if world is None:
            return
        events.append(reduce_ids(world))
        deadline = time.monotonic() + TIMEOUT
        while len(pending_joiners(store, world.members)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the two joiners did not register")
            time.sleep(0.1)
        # Rank 0 decides the target and every member adopts it in one collective, so all pass the same list.
        target = [sorted(set(world.members) - {"p2"} | set(pending_joiners(store, world.members)))]
        dist.broadcast_object_list(target, src=0)
        events.append({"pending_seen": sorted(pending_joiners(store, world.members))})
        world = union_then_target(world, target[0], transfer=transfer)
    if world is None:
        return
    events.append(reduce_ids(world))
    world.leave()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--role", choices=["initial", "joiner", "ghost"], default="initial")
    p.add_argument("--config-hash", default="cfg-a")
    p.add_argument("--members", nargs="*", default=[])
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--timeout", type=float, default=TIMEOUT)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    store = connect(args.endpoint, os.environ["DYNATRAIN_STORE_TOKEN"], timeout=TIMEOUT)
    if args.role != "ghost":
        register(store, args.id, {"model_config_hash": args.config_hash, "code_version": "test",
                                  "pid": os.getpid()})
    events: list = []
    run(args, store, events)
    args.out.write_text(json.dumps(events))


if __name__ == "__main__":
    main()
