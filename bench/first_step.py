"""Why the first step after an online switch is slower than the steps after it.

    python bench/first_step.py --json bench/results/first_step.json

Two processes, one fixed world, switching along ``--chain`` every ``--every`` steps (no process starts or leaves, so
nothing competes for the cores but the job). For each switch: the first step after it (first micro-batch to end,
the slower rank) against the median of the steps from the third after it to the next switch (the second still meets
operations the first did not run, such as gradients accumulating into existing ones), over ``--repeats`` unprofiled
runs; then one profiled run
where rank 0 profiles that first step and a later step of the same layout, and the operators whose self CPU time
grew most are listed. Then a probe (`bench/_warm_probe_worker.py`, tensor parallel over the 2 processes) asks
whether that cost can be paid before the first step: a forward and backward of a meta-device copy of the model, on
the main thread or on another thread, then the real model's first passes, counting DTensor's sharding-propagation
cache misses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from dynatrain.launch.local import launch_local

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_first_step_worker.py")
PROBE = str(HERE / "_warm_probe_worker.py")


def run(args, tmp: Path, profile: bool) -> list[dict]:
    argv = [WORKER, "--chain", args.chain, "--every", str(args.every), "--steady-offset", str(args.steady_offset),
            "--model", args.model, "--seq-len", str(args.seq_len)] + (["--profile"] if profile else [])
    return launch_local(argv, 2, tmp, timeout=args.timeout, name="first-step")


def probe(args, tmp: Path) -> list[dict]:
    """Rank 0's record of the warm-up probe, once without a warm-up and once per place it can run."""
    out = []
    for warm in ("none", "main", "thread"):
        ranks = launch_local([PROBE, "--warm", warm, "--model", args.model, "--seq-len", str(args.seq_len)], 2, tmp,
                             timeout=args.timeout, name=f"probe-{warm}")
        out.append(ranks[0])
    return out


def ratios(ranks: list[dict], args) -> list[dict]:
    spans = {int(s): max(r["spans"][s] for r in ranks) for s in ranks[0]["spans"]}
    layouts = args.chain.split(",")
    out = []
    for i, after in enumerate(ranks[0]["switched_after"]):
        first = after + 1
        steady = [spans[s] for s in range(first + 2, after + args.every + 1) if s in spans]
        out.append({"change": f"{layouts[i]} -> {layouts[i + 1]}", "first_step_s": spans[first],
                    "median_step_s": statistics.median(steady), "ratio": spans[first] / statistics.median(steady)})
    return out


def grown_ops(profile: dict, first: int, later: int, top: int) -> list[dict]:
    a, b = profile[str(first)], profile[str(later)]
    rows = [{"op": k, "first_s": a.get(k, 0.0), "later_s": b.get(k, 0.0), "grew_s": a.get(k, 0.0) - b.get(k, 0.0)}
            for k in set(a) | set(b)]
    return sorted(rows, key=lambda r: -r["grew_s"])[:top] + [
        {"op": "(all operators)", "first_s": sum(a.values()), "later_s": sum(b.values()),
         "grew_s": sum(a.values()) - sum(b.values())}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", default="dp_shard=2,tp=2,dp_shard=2")
    ap.add_argument("--every", type=int, default=8, help="steps between switches (>= steady-offset + 2)")
    ap.add_argument("--steady-offset", type=int, default=4, help="the profiled later step, after the first")
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.every < args.steady_offset + 2:
        sys.exit("--every must be at least --steady-offset + 2: the later profiled step must come before the next "
                 "switch")
    with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
        runs = [ratios(run(args, Path(tmp), profile=False), args) for _ in range(args.repeats)]
        profiled = run(args, Path(tmp), profile=True)
        warm_probe = probe(args, Path(tmp))
    changes = []
    for i, row in enumerate(runs[0]):
        after = profiled[0]["switched_after"][i]
        rs = [r[i]["ratio"] for r in runs]
        changes.append({"change": row["change"], "ratio_median": statistics.median(rs), "ratios": rs,
                        "first_step_s": [r[i]["first_step_s"] for r in runs],
                        "median_step_s": [r[i]["median_step_s"] for r in runs],
                        "grown_ops_rank0": grown_ops(profiled[0]["profiles"], after + 1,
                                                     after + 1 + args.steady_offset, args.top)})
    for c in changes:
        print(f"{c['change']}: first step / median {c['ratio_median']:.2f} "
              f"({', '.join(f'{r:.2f}' for r in c['ratios'])})")
        for op in c["grown_ops_rank0"]:
            print(f"    {op['op'][:60]:60s} {op['first_s']:7.3f} s against {op['later_s']:7.3f} s")
    print("first forward and backward of a tensor-parallel model (rank 0), by where a meta copy ran it before:")
    for p in warm_probe:
        before = f"warm-up {p['warm_s']:.3f} s with {p['warm_misses']} misses, then " if "warm_s" in p else ""
        steps = ", ".join(f"{s['s']:.3f} s ({s['misses']} misses)" for s in p["steps"])
        print(f"    {p['warm']:6s} {before}passes {steps}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(["python"] + sys.argv), "args": vars(args),
                                               "changes": changes, "warm_probe": warm_probe},
                                              indent=1))


if __name__ == "__main__":
    main()
