"""What the first touch of fresh memory costs a switch on CPU, and what allocating destinations ahead saves.

    python bench/first_touch.py --model 125m --repeats 4 --json bench/results/first_touch.json

The engine alone (no training) on synthetic states of ``--model`` (fp32 weights and both Adam moments), gloo:
* same world, 2 processes: dp_shard=2 -> tp=2 and back. *during*: each destination is allocated when its first
  bytes arrive, as a member's are (the memory bound); *ahead*: every destination comes from
  `allocate_destinations` before the transfer (what a process with memory to spare can do);
* scale-out, 4 processes (2 cores: oversubscribed): dp_shard=2 -> dp_shard=4 with two joiners; *ahead*: the joiners
  allocate ahead, as `dynatrain join` does (they hold no sources, so it is within their bound).
Per trial: the engine's seconds (barrier to return, the slowest process), the allocation ahead (outside the stall),
and the raw p2p time of the same bytes per ordered pair from and into touched buffers (`_raw_p2p.py`), both all at
once and in rounds that pass at most the budget through each process (the limit for any transfer under it).
The ways take turns going first; median and range over ``--repeats``.

``--ways during,every-state`` compares the phases that leave states kept in place out of what a phase doubles with
phases that count every state (the earlier rule), side by side:

    python bench/first_touch.py --ways during,every-state --runs same-world --repeats 8 --json bench/results/phases.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dynatrain.launch.local import launch_local

WORKER = str(Path(__file__).resolve().parent / "_first_touch_worker.py")
RUNS = {"same-world": ("same-world,same-world-back", 2), "scale-out": ("scale-out", 4)}  # name -> (cases, processes)


def summarise(ranks: list[dict], ways: list[str]) -> list[dict]:
    rows = []
    trials = list(zip(*[r["trials"] for r in ranks]))  # per trial, every process's record
    for case in dict.fromkeys(t[0]["case"] for t in trials):
        per_way = {}
        for way in ways:
            mine = [t for t in trials if t[0]["case"] == case and t[0]["way"] == way]
            engine = [max(p["engine_s"] for p in t) for t in mine]
            raw = [max(p["raw_s"] for p in t) for t in mine]
            budget_raw = [max(p["budget_raw_s"] for p in t) for t in mine]
            per_way[way] = {"rounds": max(p["rounds"] for p in mine[0]),
                            "engine_s": spread(engine), "raw_s": spread(raw),
                            "ratio_raw_to_engine": spread([r / e for r, e in zip(raw, engine)]),
                            "budget_raw_s": spread(budget_raw),
                            "ratio_budget_raw_to_engine": spread([r / e for r, e in zip(budget_raw, engine)]),
                            "alloc_ahead_s": spread([max(p["alloc_ahead_s"] for p in t) for t in mine]),
                            # the engine's own split, slowest process per trial: where the rest of the time goes
                            **{k: spread([max(p[k] for p in t) for t in mine])
                               for k in ("seconds_pack", "seconds_wire", "seconds_local", "seconds_unpack")},
                            "peak_bytes_max": max(p["peak_bytes"] for t in mine for p in t),
                            "peak_over_bound_max": max(p["peak_bytes"] / p["peak_bound"] for t in mine for p in t)}
        first = next(t for t in trials if t[0]["case"] == case)
        row = {"case": case, "bytes_received_max": max(p["bytes_received"] for p in first),
               "process_threads": first[0]["process_threads"], "copy_threads": first[0]["copy_threads"], **per_way}
        base = per_way[ways[0]]["engine_s"]["median"]
        for way in ways[1:]:
            row[f"engine_{way}_over_{ways[0]}"] = per_way[way]["engine_s"]["median"] / base
        rows.append(row)
    return rows


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(rows: list[dict], ways: list[str]) -> str:
    f = lambda s: f"{s['median']:.3f} ({s['min']:.3f} to {s['max']:.3f})"
    g = lambda s: f"{s['median']:.2f} ({s['min']:.2f} to {s['max']:.2f})"
    head = ["case", "received MiB (max)"]
    for way in ways:
        head += [f"rounds, {way}", f"engine s, {way}", f"raw / engine, {way}", f"raw under budget / engine, {way}"]
    head += [f"{way} / {ways[0]}" for way in ways[1:]]
    if "ahead" in ways:
        head.append("allocation ahead s")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], f"{r['bytes_received_max'] / 2**20:.0f}"]
        for way in ways:
            cells += [str(r[way]["rounds"]), f(r[way]["engine_s"]), g(r[way]["ratio_raw_to_engine"]),
                      g(r[way]["ratio_budget_raw_to_engine"])]
        cells += [f"{r[f'engine_{way}_over_{ways[0]}']:.2f}" for way in ways[1:]]
        if "ahead" in ways:
            cells.append(f(r["ahead"]["alloc_ahead_s"]))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ways", default="during,ahead", help="comma-separated: during, ahead, every-state")
    ap.add_argument("--runs", default="same-world,scale-out", help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of each process (OMP_NUM_THREADS)")
    ap.add_argument("--copy-threads", type=int, default=None,
                    help="the engine's copy threads (run_transition's copy_threads; default: its own choice)")
    args = ap.parse_args()
    ways = args.ways.split(",")
    bad = [w for w in ways if w not in ("during", "ahead", "every-state")] + \
        [r for r in args.runs.split(",") if r not in RUNS]
    if bad:
        ap.error(f"unknown way or run {bad}: ways are during, ahead, every-state; runs are {', '.join(RUNS)}")
    t0 = time.perf_counter()
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs.split(","):
            cases, procs = RUNS[run]
            copy = ["--copy-threads", str(args.copy_threads)] if args.copy_threads else []
            ranks = launch_local([WORKER, "--model", args.model, "--cases", cases, "--repeats", str(args.repeats),
                                  "--budget-mb", str(args.budget_mb), "--ways", args.ways, *copy], procs, Path(tmp),
                                 timeout=args.timeout, env={"OMP_NUM_THREADS": str(args.threads)}, name="first-touch")
            rows += summarise(ranks, ways)
            raw.append({"processes": procs, "ranks": ranks})
    print(table(rows, ways))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "wall_s": time.perf_counter() - t0, "rows": rows, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
