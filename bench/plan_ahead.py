"""What planning a switch ahead saves: the same switches requested at step boundaries with and without
``plan_ahead``, on a fixed world.

    python bench/plan_ahead.py --json bench/results/plan_ahead/same_world_125m.json

``--devices`` processes (2: one core each here, no oversubscription) train ``--model`` and switch along ``--chain``
every ``--every`` steps; each request is made at a step boundary, as `ElasticCallback` makes them. **now**: the
switch runs at that boundary, planned inside its stall. **ahead**: ``request_switch(..., plan_ahead=True)``, so it
is planned on a background thread while one more step trains and runs at that step's end. Per switch: its stall
(`SwitchReport.stall_s`, the slower rank) and its plan phase; for ``ahead``, the step its plan overlapped (first
micro-batch to end, the slower rank) against the median of that layout's other steps in the same run, since the
plan's thread takes CPU from that step. **Lost** = what the gaps between steps (a step's end to the next one's first
micro-batch) at the boundaries from the request's to the switch's took beyond the median gap at other boundaries
(the request, which checks the target and builds it on meta, any preparation there, the stall) + that step's extra
seconds (0 for ``now``); ``request_s`` is the request alone. Runs of the two ways alternate in a random order
(``--seed``), ``--repeats`` each. ``--rank-map`` is the strategy's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from dynatrain.launch.local import PRELOAD, launch_local

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_plan_ahead_worker.py")
WAYS = ("now", "ahead")


def run(args, way: str, tmp: Path) -> list[dict]:
    argv = [WORKER, "--chain", args.chain, "--every", str(args.every), "--model", args.model, "--seq-len",
            str(args.seq_len), "--global-batch", str(args.global_batch), "--budget-mb", str(args.budget_mb),
            "--rank-map", args.rank_map]
    return launch_local(argv + (["--ahead"] if way == "ahead" else []), args.devices, tmp, timeout=args.timeout,
                        name=f"plan-ahead-{way}", preload=PRELOAD, keep_zygote=True, env={"OMP_NUM_THREADS": "1"})


def figures(ranks: list[dict], way: str) -> list[dict]:
    """Per switch: stall, plan phase and, planned ahead, the overlapped step against its layout's median."""
    def span(step: int) -> float:
        return max(r["ends"][str(step)] - r["starts"][str(step)] for r in ranks)

    def gap(step: int) -> float:
        return max(r["starts"][str(step + 1)] - r["ends"][str(step)] for r in ranks)

    steps = sorted(int(s) for s in ranks[0]["ends"] if str(s) in ranks[0]["starts"])
    reports = list(zip(*(r["reports"] for r in ranks)))
    bounds = [rep[0]["step"] for rep in reports]
    busy = set(ranks[0]["requested"]) | set(bounds)
    normal_gap = statistics.median(gap(s) for s in steps if s not in busy and str(s + 1) in ranks[0]["starts"])
    out = []
    for i, (requested, per_rank) in enumerate(zip(ranks[0]["requested"], reports)):
        rep = per_rank[0]
        row = {"change": f"{rep['old_layout']} -> {rep['new_layout']}", "requested_at": requested,
               "switched_at": rep["step"], "prepared": all(r["prepared"] for r in per_rank),
               "stall_s": max(r["stall_s"] for r in per_rank),
               "request_s": max(r["request_s"][i] for r in ranks),
               "bytes_moved": rep["bytes_moved"], "bytes_moved_identity": rep["bytes_moved_identity"],
               "rank_map": rep["rank_map"],
               "plan_s": max(r["phases"].get("plan", 0.0) for r in per_rank), "overlap_extra_s": 0.0}
        if way == "ahead":
            overlapped = rep["step"]  # the step between the request and the switch
            start = bounds[i - 1] + 2 if i else 2  # the old layout's steps, the first after a switch left out
            same = [span(s) for s in steps if start <= s < overlapped]
            row["overlap_step_s"] = span(overlapped)
            row["layout_median_step_s"] = statistics.median(same) if same else None
            if same:
                row["overlap_extra_s"] = row["overlap_step_s"] - row["layout_median_step_s"]
        gaps = sum(gap(b) - normal_gap for b in range(requested, rep["step"] + 1))
        row["boundary_extra_s"] = gaps
        row["lost_s"] = gaps + row["overlap_extra_s"]
        out.append(row)
    return out


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def summary(trials: list[dict]) -> list[dict]:
    out = []
    changes = [row["change"] for row in trials[0]["switches"]]
    for i, change in enumerate(changes):
        entry: dict = {"change": change}
        for way in WAYS:
            rows = [t["switches"][i] for t in trials if t["way"] == way]
            entry[way] = {k: stats([r[k] for r in rows])
                          for k in ("request_s", "stall_s", "plan_s", "boundary_extra_s", "lost_s", "overlap_extra_s")}
            entry[way]["prepared"] = [r["prepared"] for r in rows]
        entry["lost_ahead_over_now"] = entry["ahead"]["lost_s"]["median"] / entry["now"]["lost_s"]["median"]
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--chain", default="dp_shard=2;tp=2;dp_shard=2")
    ap.add_argument("--every", type=int, default=4, help="steps between requests (>= 3: a median needs steps)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--rank-map", default="auto", help="the strategy's rank_map: auto, optimal or identity")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.every < 3:
        sys.exit("--every must be at least 3")
    order = [w for w in WAYS for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(order)
    trials = []
    with tempfile.TemporaryDirectory(prefix="plan-ahead-") as tmp:
        for n, way in enumerate(order):
            ranks = run(args, way, Path(tmp) / str(n))
            switches = figures(ranks, way)
            trials.append({"way": way, "switches": switches, "losses": ranks[0]["losses"]})
            print(f"{way}: " + "; ".join(f"{r['change']} at {r['switched_at']}: stall {r['stall_s']:.3f} s, plan "
                                         f"{r['plan_s']:.3f} s, lost {r['lost_s']:.3f} s" for r in switches),
                  flush=True)
    rows = summary(trials)
    for r in rows:
        now, ahead = r["now"], r["ahead"]
        print(f"{r['change']}: stall {now['stall_s']['median']:.3f} -> {ahead['stall_s']['median']:.3f} s, plan "
              f"{now['plan_s']['median']:.3f} -> {ahead['plan_s']['median']:.3f} s, lost "
              f"{now['lost_s']['median']:.3f} -> {ahead['lost_s']['median']:.3f} s (ratio "
              f"{r['lost_ahead_over_now']:.2f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(["python"] + sys.argv), "args": vars(args),
                                               "order": order, "summary": rows, "trials": trials}, indent=1))


if __name__ == "__main__":
    main()
