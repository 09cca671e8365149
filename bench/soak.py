"""Soak: many consecutive online layout switches in one run, and whether anything grows with them.

    python bench/soak.py --switches 200 --devices 4 --json bench/results/soak.json

Trains the ``debug`` Llama (``--layers`` 2) on ``--devices`` CPU ranks (gloo) and switches its layout every
``--every-n-steps`` optimizer steps, ``--switches`` times, cycling through same-world layouts (default, on 4:
dp_shard=4 -> dp_shard=2,tp=2 -> dp_replicate=2,dp_shard=2 -> tp=4 -> dp_replicate=4 -> dp_replicate=2,tp=2 ->
...). Every ``--verify-every``-th switch is verified bitwise. Each rank samples, after a full `gc.collect()`: RSS,
open file descriptors, threads (OS and Python), live process groups (torch's c10d registry) and how many were ever
created, live DeviceMesh / Transformer / ProcessGroup objects, gc-tracked objects and the strategy's caches.

The "start" sample is taken after ``--warmup`` switches (two cycles by default, so every layout's mesh and
groups exist and allocator pools have settled), the "end" after the last switch, and a series every
``--sample-every`` switches in between. Goals (the reliability issue): RSS growth end/start < 5% on every rank;
open fds, threads and live process groups not growing after the warm-up. Not part of `make bench` by default
(`python bench/all.py --only soak` runs it). Not in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from dynatrain.launch.local import launch_local  # noqa: E402

MiB = 2**20
# Every same-world layout of the 2-layer debug model on 4 processes, each step a different kind of change.
DEFAULT_CYCLE = "dp_shard=4;dp_shard=2,tp=2;dp_replicate=2,dp_shard=2;tp=4;dp_replicate=4;dp_replicate=2,tp=2"
RSS_GOAL = 0.05
# Process-wide counters that must not grow after the warm-up (no sample after it above the start, every rank).
FLAT = ("fds", "threads_os", "threads_py", "groups_live", "groups_created", "mesh_cache")
# Live objects whose count depends on the current layout: compared between samples at the same place in the cycle.
FLAT_PER_LAYOUT = ("meshes_alive", "transformers_alive")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def aligned_warmup(warmup: int, switches: int, cycle: int) -> int:
    """The first switch count >= warmup at the same place in the layout cycle as the last switch, so the start
    and end samples are taken under the same layout."""
    w = warmup
    while w < switches and (switches - w) % cycle:
        w += 1
    return min(w, switches)


def summarise(ranks: list[dict], warmup: int, cycle: int) -> dict:
    per_rank = []
    for rk in ranks:
        samples = rk["samples"]
        start = next(s for s in samples if s["switches"] >= warmup)
        end = samples[-1]
        after = [s for s in samples if s["switches"] >= start["switches"]]
        base: dict[int, dict] = {}
        for s in after:
            base.setdefault(s["switches"] % cycle, s)
        per_layout_growth = {k: max(s[k] - base[s["switches"] % cycle][k] for s in after) for k in FLAT_PER_LAYOUT}
        row = {
            "rank": rk["rank"], "first": samples[0], "start": start, "end": end,
            "rss_growth": end["rss_bytes"] / start["rss_bytes"] - 1,
            "rss_max_after_warmup": max(s["rss_bytes"] for s in after),
            "rss_slope_kib_per_switch": slope([s["switches"] for s in after],
                                              [s["rss_bytes"] / 1024 for s in after]),
            "max_after_warmup": {k: max(s[k] for s in after) for k in FLAT},
            "growth_same_layout": per_layout_growth,
            "changed": {k: end[k] - start[k] for k in FLAT + FLAT_PER_LAYOUT + ("switch_reports", "gc_objects")
                        if end[k] != start[k]},
        }
        if "malloc_in_use_bytes" in end:
            row["malloc_in_use_growth"] = end["malloc_in_use_bytes"] / start["malloc_in_use_bytes"] - 1
        row["pass_rss"] = row["rss_growth"] < RSS_GOAL
        row["pass_flat"] = (all(row["max_after_warmup"][k] <= start[k] for k in FLAT)
                            and all(v <= 0 for v in per_layout_growth.values()))
        per_rank.append(row)
    stalls = sorted(s for rk in ranks for s in rk["stalls_s"])
    return {
        "per_rank": per_rank,
        "pass_rss": all(r["pass_rss"] for r in per_rank),
        "pass_fds_threads_groups": all(r["pass_flat"] for r in per_rank),
        "pass": all(r["pass_rss"] and r["pass_flat"] for r in per_rank),
        "switches_done": min(rk["switches_done"] for rk in ranks),
        "verified_switches": ranks[0]["verified"],
        "stall_s_median": stalls[len(stalls) // 2] if stalls else None,
        "stall_s_max": stalls[-1] if stalls else None,
    }


def table(summary: dict) -> str:
    head = ("| rank | RSS MiB: before 1st switch, start, end, max after warm-up | RSS growth end/start (goal < 5%) "
            "| RSS slope KiB/switch | malloc in use MiB start -> end | fds start -> end | threads OS / Python "
            "start -> end | live groups start -> end (ever created) | meshes alive start -> end | mesh cache "
            "| switch reports |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in summary["per_rank"]:
        f, s, e = r["first"], r["start"], r["end"]
        malloc = (f"{s['malloc_in_use_bytes'] / MiB:.1f} -> {e['malloc_in_use_bytes'] / MiB:.1f}"
                  if "malloc_in_use_bytes" in e else "-")
        lines.append(
            f"| {r['rank']} | {f['rss_bytes'] / MiB:.1f}, {s['rss_bytes'] / MiB:.1f}, {e['rss_bytes'] / MiB:.1f}, "
            f"{r['rss_max_after_warmup'] / MiB:.1f} | {100 * r['rss_growth']:+.2f}% "
            f"{'pass' if r['pass_rss'] else 'FAIL'} | {r['rss_slope_kib_per_switch']:+.1f} | {malloc} "
            f"| {s['fds']} -> {e['fds']} | {s['threads_os']} / {s['threads_py']} -> {e['threads_os']} / "
            f"{e['threads_py']} | {s['groups_live']} -> {e['groups_live']} ({s['groups_created']} -> "
            f"{e['groups_created']}) | {s['meshes_alive']} -> {e['meshes_alive']} "
            f"| {s['mesh_cache']} -> {e['mesh_cache']} | {s['switch_reports']} -> {e['switch_reports']} |")
    return "\n".join(lines)


def series(ranks: list[dict]) -> str:
    """Per sample: RSS (MiB), fds, OS threads, live groups for each rank; allocator and objects on rank 0."""
    head = ("| switches | layout after | " + " | ".join(f"rank {rk['rank']} RSS MiB / fds / threads / groups"
                                                    for rk in ranks)
            + " | rank 0: malloc in use MiB, meshes / transformers alive, gc objects, "
              "DTensor sharding-cache misses, c10d work registry |")
    lines = [head, "|" + "---|" * (len(ranks) + 3)]
    cycle = ranks[0]["cycle"]
    for i in range(len(ranks[0]["samples"])):
        cells = []
        for rk in ranks:
            s = rk["samples"][i]
            cells.append(f"{s['rss_bytes'] / MiB:.1f} / {s['fds']} / {s['threads_os']} / {s['groups_live']}")
        s0 = ranks[0]["samples"][i]
        malloc = f"{s0['malloc_in_use_bytes'] / MiB:.1f}" if "malloc_in_use_bytes" in s0 else "-"
        cells.append(f"{malloc}, {s0['meshes_alive']} / {s0['transformers_alive']}, "
                     f"{s0['gc_objects']}, {s0['sharding_cache_misses']}, {s0.get('work_registry', '-')}")
        layout = cycle[s0["switches"] % len(cycle)]
        lines.append(f"| {s0['switches']} | {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switches", type=int, default=200)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--layouts", default=None, help="';'-separated cycle of same-world layouts (first = initial)")
    ap.add_argument("--every-n-steps", type=int, default=1, help="optimizer steps between switches")
    ap.add_argument("--warmup", type=int, default=12, help="switches before the start sample")
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--verify-every", type=int, default=10, help="verify every n-th switch bitwise (0: never)")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="switch_budget_mb of the strategy")
    ap.add_argument("--trim", action="store_true",
                    help="diagnosis: malloc_trim(0) before each sample (RSS without what glibc keeps free)")
    ap.add_argument("--trim-after-switch", action="store_true",
                    help="the proposed fix, emulated: malloc_trim(0) after every switch (glibc keeps freed memory)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="diagnosis: trace Python allocations from the warm-up to the end; prints what grew")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--txt", default=None, help="also write the tables here (default: next to --json)")
    args = ap.parse_args()
    if args.layouts is None:
        if args.devices != 4:
            ap.error("--layouts is needed for a device count other than 4")
        args.layouts = DEFAULT_CYCLE
    cycle_len = len([t for t in args.layouts.split(";") if t])
    warmup = aligned_warmup(args.warmup, args.switches, cycle_len)
    argv = [str(HERE / "_soak_worker.py"), "--model", args.model, "--layers", str(args.layers),
            "--layouts", args.layouts, "--switches", str(args.switches), "--every-n-steps", str(args.every_n_steps),
            "--warmup", str(warmup), "--sample-every", str(args.sample_every),
            "--verify-every", str(args.verify_every), "--budget-mb", str(args.budget_mb)] + (
        ["--trim"] if args.trim else []) + (["--tracemalloc"] if args.tracemalloc else []) + (
        ["--trim-after-switch"] if args.trim_after_switch else [])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch_local(argv, args.devices, Path(tmp), timeout=args.timeout, name="soak")
    wall = time.perf_counter() - t0
    ranks.sort(key=lambda r: r["rank"])
    summary = summarise(ranks, warmup, cycle_len)
    command = " ".join(["python", "bench/soak.py", *sys.argv[1:]])
    out = [
        f"soak: {summary['switches_done']} switches, model {args.model} ({args.layers} layers), {args.devices} CPU "
        f"ranks (gloo), one switch every {args.every_n_steps} optimizer step(s), cycle {ranks[0]['cycle']}; "
        f"wall {wall:.0f}s (switching {ranks[0]['switching_s']:.0f}s), stall median "
        f"{summary['stall_s_median']:.2f}s max {summary['stall_s_max']:.2f}s; "
        f"{summary['verified_switches']} switches verified bitwise",
        f"start = after {warmup} switches (warm-up, aligned with the end's place in the cycle), end = after "
        f"{summary['switches_done']}" + ("; malloc_trim(0) before each sample" if args.trim else "")
        + ("; malloc_trim(0) after every switch" if args.trim_after_switch else ""),
        "",
        table(summary),
        "",
        series(ranks),
        "",
        f"RSS growth < 5% on every rank: {'PASS' if summary['pass_rss'] else 'FAIL'}; "
        f"fds, threads, live groups, meshes not growing after warm-up: "
        f"{'PASS' if summary['pass_fds_threads_groups'] else 'FAIL'}; overall {'PASS' if summary['pass'] else 'FAIL'}",
    ]
    trims = sorted(t for rk in ranks for t in rk.get("trim_after_switch_s") or [])
    if trims:
        out.append(f"malloc_trim(0) after a switch: median {1000 * trims[len(trims) // 2]:.1f} ms, "
                   f"max {1000 * trims[-1]:.1f} ms")
    grows = {r["rank"]: r["changed"] for r in summary["per_rank"] if r["changed"]}
    if grows:
        out.append("changed between start and end (end - start): " + "; ".join(
            f"rank {k}: " + ", ".join(f"{n} {v:+d}" for n, v in g.items()) for k, g in grows.items()))
    for rk in ranks[:1]:
        if rk.get("tracemalloc_growth"):
            d = rk["tracemalloc_growth"][0]
            out.append(f"tracemalloc rank {rk['rank']}: Python allocations alive grew by "
                       f"{d['traced_diff'] / 1024:+.1f} KiB from switch {d['from']} to {d['to']}; largest growth:")
        for d in rk.get("tracemalloc_growth") or []:
            out.append(f"tracemalloc rank {rk['rank']} by {d['by']}: {d['size_diff'] / 1024:+.1f} KiB "
                       f"({d['count_diff']:+d} blocks) "
                       + " <- ".join(d["traceback"][::-1][:6]))
    text = "\n".join(out)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": command, "model": args.model, "layers": args.layers, "devices": args.devices,
            "switches": args.switches, "every_n_steps": args.every_n_steps, "warmup": warmup,
            "budget_mb": args.budget_mb, "trim": args.trim, "trim_after_switch": args.trim_after_switch,
            "cycle": ranks[0]["cycle"], "wall_s": wall, "goals": {"rss_growth_lt": RSS_GOAL, "flat_after_warmup": FLAT,
                                                  "flat_at_same_layout": FLAT_PER_LAYOUT},
            "summary": summary, "ranks": ranks}, indent=1))
        txt = Path(args.txt) if args.txt else Path(args.json).with_suffix(".txt")
        txt.write_text(command + "\n\n" + text + "\n")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
