"""One of the two ranks of part (b) (`engine_switch.py`): the states of each model, filled from seeded global tensors
on the device, switched ``dp_shard=2 -> tp=2 -> dp_shard=2`` by `run_transition`, each result compared bit for bit
with the same global tensors, and the engine's bound against the caching allocator's own peaks."""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import common  # noqa: F401 - the repository on the path
import torch
import torch.distributed as dist

LAYOUTS = ("dp_shard=2", "tp=2", "dp_shard=2")


def global_tensor(layout, name: str, device: torch.device) -> torch.Tensor:
    from dynatrain.engine import torch_dtype

    spec = layout.state(name)
    g = torch.Generator(device=device).manual_seed(1000 + layout.state_index(name))
    return torch.randn(spec.shape, generator=g, device=device, dtype=torch.float32).to(torch_dtype(spec.dtype))


def fill_local(layout, name: str, pid: int, device: torch.device) -> torch.Tensor:
    """What ``pid`` holds of ``name`` in ``layout``: its boxes of the seeded global tensor."""
    full = global_tensor(layout, name, device)
    held = layout.shards(name, pid)
    out = torch.empty(held.local_shape, dtype=full.dtype, device=device)
    for box, off in zip(held.boxes, held.offsets):
        out[tuple(slice(o, o + n) for o, n in zip(off, box.shape))] = full[box.slices()]
    return out


def switches(model: str, rank: int, device: torch.device, budget: int) -> list[dict]:
    from dynatrain.engine import run_transition
    from dynatrain.models.specs import layout_for_model
    from dynatrain.planner.schedule import plan_switch
    from dynatrain.vps import ParallelConfig

    old = layout_for_model(model, ParallelConfig.parse(LAYOUTS[0]))
    names = [s.name for s in old.states]
    local = {name: fill_local(old, name, rank, device) for name in names}
    rows = []
    for target in LAYOUTS[1:]:
        plan = plan_switch(old, target, budget_bytes=budget, rank_map="identity")
        gc.collect()
        dist.barrier()
        t = time.perf_counter()
        dst, stats = run_transition(plan, rank, local, device=device)
        common.sync(device)
        seconds = time.perf_counter() - t
        s = stats.as_dict()
        differ = [n for n in names if not torch.equal(dst[n], fill_local(plan.new, n, rank, device))]
        row = {"model": model, "switch": f"{plan.old.config.short()} -> {target}", "seconds": seconds, **s,
               "states": len(names), "differ": differ[:10]}
        row["checks"] = {"bitwise": not differ, "live_bytes_within_bound": s["peak_bytes"] <= s["peak_bound"]}
        if device.type == "cuda":
            # Beyond what was allocated at the start, the allocator may hold at most what the bound adds to the
            # sources; its reserved bytes at most the bound the engine keeps them within.
            row["checks"]["allocated_within_bound"] = (
                s["device_peak_allocated"] - s["device_start_allocated"] <= s["peak_bound"] - s["src_bytes"])
            row["checks"]["reserved_within_bound"] = s["device_peak_reserved"] <= s["device_reserved_bound"]
        rows.append(row)
        local, old = dst, plan.new
        del dst
    del local
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next model starts from an empty cache, as a fresh job would
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--budget-mb", type=float, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import gloo_staging

    gloo_staging.install(every_tensor=device.type == "cpu")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for model in args.models.split(","):
        rows += switches(model, rank, device, int(args.budget_mb * 2**20))
    dist.barrier()
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps({"rank": rank, "switches": rows}))


if __name__ == "__main__":
    main()
