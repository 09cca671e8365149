"""Online layout switch: time per phase, bytes moved, peak memory, against the raw p2p bandwidth of the same ranks
and a naive all-gather-and-slice baseline, all in one run.

    python bench/switch.py --model 125m --devices 4 --budget-mb 64 [--sweep 16,256] --json bench/results/switch.json

Trains ``--model`` on ``--devices`` CPU ranks under ``--source`` (default dp_shard=4), switches to ``--target``
(default dp_shard=2,tp=2) and back, ``--steps-between`` optimizer steps apart. Per switch, in the same run:
* the switch's phases (plan, build, release, transfer, adopt) and the engine's own split of the transfer
  (pack, wire, local copies, unpack), max over ranks;
* bytes moved with the chosen rank map and with the identity map;
* the engine's peak live bytes (sources + destinations + staging) per rank against max(src, dst) + budget, and
  the process's RSS growth over the transfer (kernel VmHWM, reset just before);
* the raw limits: the same bytes between the same ordered pairs from preallocated buffers, all posted at once in one
  batch_isend_irecv of <= 64 MiB messages, and in rounds that pass at most the budget through each process (the
  goal's baseline); and a replay of the engine's own rounds without pack/unpack;
* the copy-speed bound: the raw time under the budget plus this rank's copies that no transfer avoids (its
  strided sends packed, its strided receives unpacked, its local copies but those kept in place), timed alone on
  touched tensors of the states' shapes; a transfer that overlaps nothing reaches it (`copy_bound`);
* before the first switch of each direction (budget --budget-mb), the naive baseline: `full_tensor()` of every
  parameter and moment, slice the target shard; its time, peak, and whether its result equals the engine's.
``--sweep`` adds one switch pair per extra budget (MiB) in the same run. ``--engine-ways streamed,batched`` runs each
pair once per way the engine posts a round (``run_transition(streamed=...)``), taking turns; ``direct=N`` ways set the
smallest piece that goes on the wire in place.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dynatrain.launch.local import launch_local

HERE = Path(__file__).resolve().parent
MiB = 2**20


def summarise(ranks: list[dict]) -> list[dict]:
    rows = []
    for i in range(len(ranks[0]["switches"])):
        per = [r["switches"][i] for r in ranks]
        rep0 = per[0]["report"]
        phases = {k: max(p["report"]["phases"][k] for p in per) for k in rep0["phases"]}
        eng = {k: max(p["engine"][k] for p in per) for k in
               ("seconds_total", "seconds_pack", "seconds_wire", "seconds_local", "seconds_unpack")}
        moved = per[0]["bytes_moved_plan"]
        budget = per[0]["budget_mb"] * MiB
        # A repeat takes as long as its slowest rank; the best repeat is the baseline.
        best = lambda key: min(max(p[key][j] for p in per) for j in range(len(per[0][key])))
        raw_s, replay_s, budget_raw_s = best("raw_seconds"), best("replay_seconds"), best("budget_raw_seconds")
        # The copy-speed bound: per rank, its best wire time under the budget plus its best time for the copies
        # it cannot do without (`copy_bound`); a transfer takes as long as its slowest rank.
        copy_s = max(min(p["copy_seconds"]) for p in per)
        bound_s = max(min(p["budget_raw_seconds"]) + min(p["copy_seconds"]) for p in per)
        peaks = []
        for p in per:
            e = p["engine"]
            bound = max(e["src_bytes"], e["dst_bytes"]) + budget
            peaks.append({"peak": e["peak_bytes"], "bound_budget": bound, "ratio": e["peak_bytes"] / bound,
                          "staging": e["staging_bytes"], "rss_growth": p["rss_peak"] - p["rss_before"]})
        worst = max(peaks, key=lambda x: x["ratio"])
        row = {
            "switch": f"{rep0['old_layout']} -> {rep0['new_layout']}", "step": per[0]["step"],
            "budget_mb": per[0]["budget_mb"], "rounds": rep0["rounds"], "rank_map": rep0["rank_map"],
            "phases_s": phases, "stall_s": max(p["report"]["stall_s"] for p in per),
            "transfer_barrier_wait_s": max(p["barrier_wait_s"] for p in per),
            "engine_s": eng, "bytes_total": rep0["bytes_total"], "bytes_moved": moved,
            "bytes_moved_identity": rep0["bytes_moved_identity"],
            "raw_s": raw_s, "replay_s": replay_s, "budget_raw_s": budget_raw_s,
            "raw_gib_s": moved / raw_s / 2**30, "replay_gib_s": moved / replay_s / 2**30,
            "transfer_gib_s": moved / eng["seconds_total"] / 2**30,
            "ratio_vs_raw": raw_s / eng["seconds_total"], "ratio_replay_vs_raw": raw_s / replay_s,
            "ratio_vs_budget_raw": budget_raw_s / eng["seconds_total"],
            "engine_way": per[0].get("engine_way", "default"), "copy_s": copy_s, "copy_bound_s": bound_s,
            "ratio_vs_copy_bound": bound_s / eng["seconds_total"],
            "peak_worst_rank": worst, "peak_ratio_max": worst["ratio"],
            "per_rank_peak": peaks,
        }
        if "naive" in per[0]:
            nv = [p["naive"] for p in per]
            row["naive"] = {
                "seconds": max(n["seconds"] for n in nv), "seconds_gather": max(n["seconds_gather"] for n in nv),
                "peak_bytes": max(n["peak_bytes"] for n in nv),
                "peak_ratio_max": max(n["peak_bytes"] / (max(n["src_bytes"], n["dst_bytes"]) + budget) for n in nv),
                "rss_growth": max(n["rss_peak"] - n["rss_before"] for n in nv),
                "matches_engine": all(n.get("matches_engine") for n in nv),
            }
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    f = lambda b: f"{b / MiB:.0f}"
    out = ["| switch | budget MiB | rounds | plan s | build s | release s | transfer s (pack/wire/local/unpack) "
           "| adopt s | stall s | moved MiB (identity) | raw p2p GiB/s | transfer GiB/s | ratio to raw "
           "| ratio to raw under budget (goal >= 0.9) "
           "| peak MiB / (max(src,dst)+budget) (goal <= 1.05) | RSS growth MiB | naive s | naive peak MiB (ratio) |",
           "|" + "---|" * 17]
    for r in rows:
        p, e, w = r["phases_s"], r["engine_s"], r["peak_worst_rank"]
        nv = r.get("naive")
        out.append(
            f"| {r['switch']} | {r['budget_mb']:.0f} | {r['rounds']} | {p['plan']:.2f} | {p['build']:.2f} "
            f"| {p['release']:.2f} | {p['transfer']:.2f} ({e['seconds_pack']:.2f}/{e['seconds_wire']:.2f}/"
            f"{e['seconds_local']:.2f}/{e['seconds_unpack']:.2f}) | {p['adopt']:.2f} | {r['stall_s']:.2f} "
            f"| {f(r['bytes_moved'])} ({f(r['bytes_moved_identity'] or 0)}) | {r['raw_gib_s']:.2f} "
            f"| {r['transfer_gib_s']:.2f} | {r['ratio_vs_raw']:.2f} | {r['ratio_vs_budget_raw']:.2f} "
            f"| {f(w['peak'])} / {f(w['bound_budget'])} = {r['peak_ratio_max']:.3f} | {f(w['rss_growth'])} "
            + (f"| {nv['seconds']:.2f} | {f(nv['peak_bytes'])} ({nv['peak_ratio_max']:.2f}) |" if nv else "| - | - |")
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--source", default="dp_shard=4")
    ap.add_argument("--target", default="dp_shard=2,tp=2")
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--sweep", default="", help="extra budgets in MiB, comma separated (e.g. 16,256)")
    ap.add_argument("--steps-between", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--raw-repeats", type=int, default=2)
    ap.add_argument("--engine-ways", default="default",
                    help="streamed,batched: every switch pair once per way the engine posts a round, taking turns; "
                         "direct=N: pieces of N bytes or more go on the wire in place")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    budgets = [args.budget_mb] + [float(b) for b in args.sweep.split(",") if b.strip()]
    argv = [str(HERE / "_switch_worker.py"), "--model", args.model, "--source", args.source, "--target", args.target,
            "--budgets", ",".join(str(b) for b in budgets), "--naive-budget", str(args.budget_mb),
            "--steps-between", str(args.steps_between), "--seq-len", str(args.seq_len),
            "--micro-batch", str(args.micro_batch), "--raw-repeats", str(args.raw_repeats),
            "--engine-ways", args.engine_ways]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_local(argv, args.devices, Path(tmp), timeout=args.timeout, name="switch-bench")
    wall = time.perf_counter() - t0
    rows = summarise(ranks)
    print(f"model {args.model}, {args.devices} CPU ranks (gloo), {args.source} <-> {args.target}, "
          f"seq {args.seq_len}, micro-batch {args.micro_batch}, wall {wall:.0f}s")
    print(table(rows))
    for r in rows:
        if "naive" in r:
            print(f"naive baseline before {r['switch']}: {r['naive']['seconds']:.2f}s "
                  f"(gather {r['naive']['seconds_gather']:.2f}s), result equals the engine's: "
                  f"{r['naive']['matches_engine']}")
    for r in rows:
        print(f"{r['switch']} ({r['engine_way']}): engine {r['engine_s']['seconds_total']:.3f}s, raw under budget "
              f"{r['budget_raw_s']:.3f}s, copies alone {r['copy_s']:.3f}s, copy-speed bound {r['copy_bound_s']:.3f}s: "
              f"ratio to raw under budget {r['ratio_vs_budget_raw']:.2f}, to the copy-speed bound "
              f"{r['ratio_vs_copy_bound']:.2f} (goal >= 0.9)")
    steps = sorted(t for rk in ranks for t in rk["step_times"])
    if steps:
        print(f"median optimizer step (all ranks, between switches): {steps[len(steps) // 2]:.2f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python", "bench/switch.py", *sys.argv[1:]]), "model": args.model,
            "devices": args.devices, "source": args.source, "target": args.target, "wall_s": wall,
            "switches": rows, "losses": ranks[0]["losses"], "ranks": ranks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
