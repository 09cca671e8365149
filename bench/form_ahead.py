"""What forming the next world costs at the boundary: in the stall, against formed ahead while the old world trains.

    python bench/form_ahead.py --processes 4 --repeats 5 --json bench/results/form_ahead/gloo4.json

Each of ``--processes`` gloo processes (one job store) runs ``--repeats`` world changes of each way, alternating:
* **in the stall**: at the boundary, `WorldGeneration.next_generation` (the old generation's barrier and destroy,
  the store rendezvous, the group's connect and first collective), as every world change did before the target
  was formed ahead;
* **ahead**: `WorldGeneration.form_ahead` starts at the previous boundary and the old world trains on meanwhile
  (a stand-in step: ``--allreduces`` all-reduces of 4 MiB on it); at the boundary only `WorldGeneration.enter`.

Per change: the boundary's seconds (the latest process's), and for the ahead way whether the formation was done
within the step and how much longer the stand-in step took than the step before it, with nothing forming beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynatrain.elastic.store import connect, start_store
from dynatrain.elastic.world import WorldGeneration
from dynatrain.runtime.memory import freeze_import_time_objects


def _step(count: int) -> float:
    """A stand-in training step on the current world: ``count`` all-reduces of 4 MiB; its wall time."""
    start, x = time.perf_counter(), torch.ones(1 << 20)
    for _ in range(count):
        dist.all_reduce(x)
    return time.perf_counter() - start


def _latest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank(rank: int, n: int, endpoint: str, token: str, args, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    freeze_import_time_objects()  # as dynatrain's entry points do: the leave's collection scans what came after
    store = connect(endpoint, token, timeout=60)
    members = [f"p{i:03d}" for i in range(n)]
    world = WorldGeneration.join(store, 0, members[rank], members, timeout=60, backend="gloo")
    rows = []
    for i in range(2 * args.repeats):
        plain = _latest(_step(args.allreduces))
        if i % 2 == 0:
            start = time.perf_counter()
            world = world.next_generation(members, ordered=True)
            boundary = time.perf_counter() - start
            rows.append({"way": "in the stall", "boundary_s": _latest(boundary), "step_s": plain})
        else:
            ahead = world.form_ahead(lambda: connect(endpoint, token, timeout=60), members)
            step = _step(args.allreduces)
            formed_within_step = ahead.formation.done()
            start = time.perf_counter()
            world = world.enter(ahead)
            boundary = time.perf_counter() - start
            rows.append({"way": "ahead", "boundary_s": _latest(boundary), "step_s": _latest(step),
                         "plain_step_s": plain, "formed_within_step": bool(_latest(float(formed_within_step)))})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    world.leave()


def summary(rows: list[dict]) -> dict:
    out = {}
    for way in ("in the stall", "ahead"):
        mine = [r for r in rows if r["way"] == way]
        b = [r["boundary_s"] for r in mine]
        out[way] = {"boundary_s_median": statistics.median(b), "boundary_s_range": [min(b), max(b)]}
        if way == "ahead":
            slow = [r["step_s"] / r["plain_step_s"] for r in mine]
            out[way]["step_with_formation_over_plain_median"] = statistics.median(slow)
    out["ratio_ahead_over_stall"] = out["ahead"]["boundary_s_median"] / out["in the stall"]["boundary_s_median"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--allreduces", type=int, default=30, help="all-reduces of 4 MiB in a stand-in training step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import tempfile

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        token = os.urandom(8).hex()
        handle = start_store(token, Path(tmp), timeout=60)
        try:
            out = str(Path(tmp) / "rows.json")
            mp.start_processes(_rank, args=(args.processes, handle.endpoint, token, args, out),
                               nprocs=args.processes, start_method="spawn")
            rows = json.loads(Path(out).read_text())
        finally:
            handle.stop()
    result = {"command": "python bench/form_ahead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "processes": args.processes, "repeats": args.repeats, "backend": "gloo", "allreduces": args.allreduces,
              "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
              "load_average_before_after": [load_before, os.getloadavg()], "rows": rows,
              "summary": summary(rows)}
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
