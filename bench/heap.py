"""Training steps with and without dynatrain's heap settings (`dynatrain.runtime.memory.heap_env`), in one run.

    python bench/heap.py --model 125m --repeats 3 --json bench/results/heap/steps_125m.json

Runs ``--model`` under strategy="dynatrain" on ``--devices`` CPU processes, started by dynatrain's launcher once with
its heap settings (``DYNATRAIN_HEAP=reuse``, the default) and once with glibc's own (``DYNATRAIN_HEAP=glibc``),
taking turns (the first way rotates from one repeat to the next) so the machine's noise hits them alike. ``--ways
reuse,arenas,glibc`` adds a third: the settings with glibc's per-thread arenas (``glibc.malloc.arena_max`` at glibc's
own limit, eight per core), as they were before one arena served every thread. Per
optimizer step and process: wall time, CPU seconds in user space and in the kernel, and minor page faults (pages the
kernel mapped afresh); the first ``--warmup`` steps of each run are dropped. Per way: the median of each over every
process and step, and the processes' peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dynatrain.launch.local import launch_local
from dynatrain.runtime.memory import TUNABLES_ENV
from dynatrain.settings import HEAP_ENV

HERE = Path(__file__).resolve().parent
WAYS = {
    "reuse": {HEAP_ENV: "reuse"},
    "glibc": {HEAP_ENV: "glibc"},
    # heap_env keeps a glibc.malloc setting the environment has, so this is the settings but arena_max
    "arenas": {HEAP_ENV: "reuse", TUNABLES_ENV: f"glibc.malloc.arena_max={8 * (os.cpu_count() or 1)}"},
}
FIGURES = ("step_times", "step_user_s", "step_system_s", "step_minor_faults")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="125m")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--ways", default="reuse,glibc", help=f"of {', '.join(WAYS)}; the first two are compared")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ways = args.ways.split(",")
    if len(ways) < 2 or len(set(ways)) < len(ways) or set(ways) - set(WAYS):
        ap.error(f"--ways: two or more of {', '.join(WAYS)}, each once")
    if args.steps - 1 <= args.warmup:
        ap.error("--steps must leave steps after --warmup")
    got = {w: {f: [] for f in FIGURES} | {"max_rss_bytes": [], "runs": 0} for w in ways}
    order = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                order.append(way)
                argv = [str(HERE / "_step_worker.py"), "--strategy", "dynatrain", "--model", args.model,
                        "--steps", str(args.steps), "--seq-len", str(args.seq_len),
                        "--micro-batch", str(args.micro_batch)]
                ranks = launch_local(argv, args.devices, Path(tmp), timeout=1200, name=f"{way}-{rep}",
                                     env={"OMP_NUM_THREADS": "1", **WAYS[way]})
                for r in ranks:
                    for f in FIGURES:
                        got[way][f].extend(r[f][args.warmup:])
                    got[way]["max_rss_bytes"].append(r["max_rss_bytes"])
                got[way]["runs"] += 1
    summary = {w: {f: statistics.median(v[f]) for f in FIGURES} | {"max_rss_bytes": max(v["max_rss_bytes"])}
               for w, v in got.items()}
    a, b = ways[:2]
    ratio = {f: summary[a][f] / summary[b][f] for f in FIGURES if summary[b][f]}
    print(f"model {args.model}, {args.devices} CPU processes, seq_len {args.seq_len}, micro-batch {args.micro_batch}, "
          f"{args.repeats} runs per way, {args.steps - args.warmup - 1} steps timed per run and process")
    print("| heap | median step s | user s per step | kernel s per step | minor faults per step | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for w in ways:
        s = summary[w]
        print(f"| {w} | {s['step_times']:.3f} | {s['step_user_s']:.2f} | {s['step_system_s']:.2f} "
              f"| {s['step_minor_faults']:.0f} | {s['max_rss_bytes'] / 2**20:.0f} |")
    print(f"{a} / {b}: " + ", ".join(f"{f} {r:.2f}" for f, r in ratio.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                               "order": order, "summary": summary, f"{a}_over_{b}": ratio,
                                               "raw": got}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
