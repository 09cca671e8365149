"""One rank of the engine test: many random switches in one process group; writes per-case results as JSON.

Every rank builds the same cases from the same seed (pure planner), fills its old local tensors from a
seeded global tensor, runs the engine, and checks its new local tensors against the same global tensor.
"""

import argparse
import gc
import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__" and "dynatrain" not in sys.modules:
    # This worker needs only the pure planner and the engine. dynatrain/__init__ imports Lightning to
    # register the strategy (about 4 s of CPU per process here); skip it by registering the bare package.
    import types

    _pkg = types.ModuleType("dynatrain")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "dynatrain")]
    sys.modules["dynatrain"] = _pkg

from dynatrain.engine import allocate_destinations, run_transition, torch_dtype, wire
from dynatrain.planner.schedule import plan_switch
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig

DTYPES = ("float32", "bfloat16", "float64", "float16", "int32", "int8")


def configs(n: int) -> list[ParallelConfig]:
    return [ParallelConfig(r, s, n // (r * s)) for r in range(1, n + 1) for s in range(1, n + 1)
            if n % (r * s) == 0]


def random_states(rng: random.Random) -> list[StateSpec]:
    out = []
    for i in range(rng.randint(2, 4)):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.choice((1, 2, 2, 3))))
        tp_dim = rng.choice([None] + list(range(len(shape))))
        fused = None
        if tp_dim is not None and shape[tp_dim] >= 3 and rng.random() < 0.3:
            a = rng.randint(1, shape[tp_dim] - 2)
            b = rng.randint(1, shape[tp_dim] - a - 1)
            fused = (a, b, shape[tp_dim] - a - b)
        dtype = rng.choice(DTYPES)
        out.append(StateSpec(f"s{i}", shape, dtype, tp_dim, fused))
        if rng.random() < 0.5:  # an optimizer-like sibling with the same split, another dtype
            out.append(StateSpec(f"s{i}.m", shape, rng.choice(DTYPES), tp_dim, fused))
    return out


def build_case(rng: random.Random, world: int) -> dict:
    """A random switch on ``world`` processes: same world, scale-in (one leaves) or scale-out (one joins).
    Plan process ids are a random permutation of arbitrary ids, mapped to group ranks by the engine."""
    states = random_states(rng)
    pid_of_rank = rng.sample(range(3, 3 + 3 * world), world)
    kind = rng.choice(("same", "same", "in", "out")) if world > 1 else "same"
    kw = {}
    if kind == "same":
        old_procs, new_n = pid_of_rank, world
        kw["rank_map"] = rng.choice(("optimal", "identity"))
    elif kind == "in":
        old_procs, new_n = pid_of_rank, world - 1
        kw["leave"] = [rng.choice(pid_of_rank)]
    else:
        joiner = rng.choice(pid_of_rank)
        old_procs, new_n = [p for p in pid_of_rank if p != joiner], world
        kw["joiners"] = [joiner]
    old_cfg, new_cfg = rng.choice(configs(len(old_procs))), rng.choice(configs(new_n))
    old = Layout.from_config(states, old_cfg, rng.sample(old_procs, len(old_procs)))
    # Size the budget from the busiest rank's traffic so the wire part takes several rounds.
    sent, recv = plan_switch(old, new_cfg, budget_bytes=1 << 40, **kw).rank_bytes()
    busiest = max([sent.get(p, 0) + recv.get(p, 0) for p in set(sent) | set(recv)], default=0)
    budget = max(16, busiest // rng.randint(3, 8))
    plan = plan_switch(old, new_cfg, budget_bytes=budget, **kw)
    return {"plan": plan, "pid_of_rank": pid_of_rank, "names": [s.name for s in states],
            "seed": rng.randrange(1 << 30), "desc": f"{kind} {old_cfg.short()} -> {new_cfg.short()} {kw}"}


def global_tensor(layout: Layout, name: str, seed: int) -> torch.Tensor:
    spec = layout.state(name)
    g = torch.Generator().manual_seed(seed * 131 + layout.state_index(name))
    dtype = torch_dtype(spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, spec.shape, generator=g).to(dtype)


def fill_local(layout: Layout, name: str, pid: int, seed: int) -> torch.Tensor:
    """The local tensor ``pid`` holds of ``name`` in ``layout``: its boxes of the global tensor."""
    full = global_tensor(layout, name, seed)
    held = layout.shards(name, pid)
    out = torch.zeros(held.local_shape, dtype=full.dtype)
    covered = 0
    for box, off in zip(held.boxes, held.offsets):
        out[tuple(slice(o, o + n) for o, n in zip(off, box.shape))] = full[box.slices()]
        covered += box.numel
    assert covered == out.numel(), f"boxes of {name!r} do not tile the local tensor of {pid}"
    return out


expected_local = fill_local


def on_one_storage(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same tensors as views of one buffer (a module's flat parameters, FSDP2's padded shards), each at a 16-byte
    offset; returns (the buffer, the views)."""
    offsets, size = {}, 0
    for name, t in tensors.items():
        offsets[name] = size
        size += -(-t.numel() * t.element_size() // 16) * 16
    flat = torch.empty(size, dtype=torch.uint8)
    views = {}
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        views[name] = flat[offsets[name]:offsets[name] + nbytes].view(t.dtype).view(t.shape)
        views[name].copy_(t)
    return flat, views


def freed_as_expected(held: dict[str, torch.Tensor], flat: torch.Tensor | None, dst: dict) -> list[str]:
    """What the engine left allocated that it should have emptied, or emptied that a destination still uses. A source
    adopted as its destination keeps its storage; any other is emptied, though ``held`` still references it; on one
    shared storage, the storage is emptied only when no state on it was adopted."""
    kept = {name for name, t in held.items() if dst.get(name) is t}
    if flat is not None:
        emptied = flat.untyped_storage().nbytes() == 0
        return [] if emptied != bool(kept) else [f"shared storage {'emptied' if emptied else 'kept'}, kept {kept}"]
    return [f"{name} storage {'kept' if t.untyped_storage().nbytes() else 'emptied'}" for name, t in held.items()
            if t.numel() and (t.untyped_storage().nbytes() == 0) == (name in kept)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct-min", type=int, default=None, help="smallest piece sent or received in place")
    ap.add_argument("--streamed", action="store_true", help="each send posted as soon as it is packed")
    ap.add_argument("--joiners-ahead", action="store_true",
                    help="a process without sources allocates its destinations before the transfer")
    ap.add_argument("--one-storage", action="store_true", help="a process's sources are views of one buffer")
    args = ap.parse_args()
    if args.direct_min is not None:
        wire.DIRECT_MIN_BYTES = args.direct_min
    dist.init_process_group("gloo")
    dist.barrier()  # a group's first operation is one every rank joins: the engine's sends expect a formed group
    world, me = dist.get_world_size(), dist.get_rank()
    results = []
    for i in range(args.cases):
        case = build_case(random.Random(args.seed * 1000 + world * 100 + i), world)
        plan, pid_of_rank = case["plan"], case["pid_of_rank"]
        pid = pid_of_rank[me]
        rank_of_pid = {p: r for r, p in enumerate(pid_of_rank)}
        res = {"case": i, "desc": case["desc"], "rounds": plan.num_rounds, "ok": True, "errors": []}
        if pid in plan.processes:
            src = {name: fill_local(plan.old, name, pid, case["seed"]) for name in case["names"]
                   if plan.old.position_of(pid) is not None}
            flat = None
            if args.one_storage and any(t.numel() for t in src.values()):
                flat, src = on_one_storage(src)
            held = dict(src)  # what a live module's reference cycles would still hold
            ready = allocate_destinations(plan, pid) if args.joiners_ahead and not src else {}
            ptrs = {name: t.data_ptr() for name, t in ready.items()}
            dst, stats = run_transition(plan, pid, src, group_ranks=rank_of_pid, preallocated=ready,
                                        streamed=args.streamed)
            assert not src, "the engine must consume every source"
            res["ahead"] = len(ptrs)
            res["received_in_place_ahead"] = all(dst[name].data_ptr() == ptr for name, ptr in ptrs.items())
            freed = freed_as_expected(held, flat, dst)  # first: reading an emptied destination would crash
            res["ok"] = not freed
            res["errors"] += freed
            if flat is not None:
                res["one_storage"] = "kept" if flat.untyped_storage().nbytes() else "emptied"
            if plan.new.position_of(pid) is not None:
                for name in case["names"] if not freed else []:
                    want = expected_local(plan.new, name, pid, case["seed"])
                    got = dst.get(name)
                    if got is None or got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
                        res["ok"] = False
                        res["errors"].append(name)
            elif dst:
                res["ok"] = False
                res["errors"].append("destinations for a process without a new position")
            res["stats"] = stats.as_dict()
            res["budget"] = plan.budget_bytes
            rp = plan.rank_plan(pid)
            res["max_ops"] = max([len([op for m in rp.sends[k] for op in wire.split_message(m, plan.old, plan.new, m.dst)])
                                  + len([op for m in rp.recvs[k]
                                         for op in wire.split_message(m, plan.old, plan.new, m.src)])
                                  for k in range(rp.num_rounds)], default=0)
            res["max_state_bytes"] = max(
                [t.numel() * t.element_size() for t in dst.values()]
                + [plan.old.shards(n, pid).numel * plan.old.state(n).itemsize
                   for n in case["names"] if plan.old.position_of(pid) is not None], default=0)
            del dst, src, held, flat
        results.append(res)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps({"rank": me, "results": results}))


if __name__ == "__main__":
    main()
