"""Part (d): 20 generations of a world, as elastic world changes make them: each a fresh default group (a new
`PrefixStore` on one long-lived store) bound to the device, the groups of a layout's mesh, one collective on each
(where NCCL creates its communicator), then destroyed. Per generation, the seconds to form it and to the first
collective's end, and the memory left behind: the driver's view of the device (NCCL's buffers live there, outside
the caching allocator), the allocator's reserved bytes and the resident set. Drift is the last generation against
the second (the first pays for start-up). One process: NCCL takes one rank per GPU.

    python bench/gpu_check/group_generations.py --device cuda --out /tmp/d.json
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import common
import torch
import torch.distributed as dist


DRIFT_BYTES = 32 << 20


def add_args(ap) -> None:
    ap.add_argument("--generations", type=int, default=20)
    ap.add_argument("--groups", type=int, default=3, help="groups made per generation besides the default one")


def run(args, device: torch.device) -> dict:
    from dynatrain.runtime.memory import resident_bytes

    cuda = device.type == "cuda"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=60))
    rows = []
    for gen in range(args.generations):
        common.sync(device)
        t0 = time.perf_counter()
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=0,
                                world_size=1, device_id=device if cuda else None)
        groups = [dist.new_group([0]) for _ in range(args.groups)]
        t1 = time.perf_counter()
        x = torch.ones(1024, device=device)
        for g in [None, *groups]:
            dist.all_reduce(x, group=g)
        common.sync(device)
        t2 = time.perf_counter()
        del groups
        dist.destroy_process_group()
        t3 = time.perf_counter()
        row = {"generation": gen, "form_s": t1 - t0, "first_collectives_s": t2 - t1, "destroy_s": t3 - t2,
               "rss_bytes": resident_bytes()}
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            row.update(device_used_bytes=total - free, reserved_bytes=torch.cuda.memory_reserved(device))
        rows.append(row)
    first, last = rows[min(1, len(rows) - 1)], rows[-1]
    drift = {k: last[k] - first[k] for k in ("rss_bytes", "device_used_bytes", "reserved_bytes") if k in last}
    return {"backend": "nccl" if cuda else "gloo", "generations": rows, "drift_bytes": drift,
            "checks": {"formed_every_generation": len(rows) == args.generations,
                       # NCCL's buffers and the groups of a layout no longer in use must go with their generation:
                       # what may stay is less than one communicator's buffers (tens of MiB) over all of them.
                       "device_memory_flat": drift.get("device_used_bytes", 0) <= DRIFT_BYTES}}


if __name__ == "__main__":
    common.run_part("group_generations", __doc__, run, add_args)
