"""Every benchmark of docs/benchmarks.md, one after another: `make bench` runs this.

    python bench/all.py [--only step_time,step_profile,switch,restart,scale]
    python bench/all.py --only soak       # optional, not in the default run (about 15 minutes on 2 cores)
    python bench/all.py --only lost_time  # optional (27 to 46 minutes on 2 cores)
    python bench/all.py --only first_step # optional (2 minutes)
    python bench/all.py --only launchers  # optional (about 10 minutes: a node arriving under torchrun, three ways)
    python bench/all.py --only first_touch # optional (1.5 minutes)
    python bench/all.py --only chaos      # optional (about 8 minutes: 8 seeds of 8 switches and a death)

Each script prints its tables and writes bench/results/<name>.json; this prints the wall time of each and of the
whole run (goal: under 20 minutes on the 2-core development machine) and keeps each script's output in
bench/results/<name>.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# The exact commands behind the tables of docs/benchmarks.md, in its order.
BENCHMARKS = {
    "step_time": ["bench/step_time.py", "--repeats", "2", "--steps", "15", "--json", "bench/results/step_time.json"],
    "step_profile": ["bench/step_profile.py", "--json", "bench/results/step_profile.json"],
    "switch": ["bench/switch.py", "--model", "125m", "--devices", "4", "--budget-mb", "64", "--sweep", "16,256",
               "--json", "bench/results/switch.json"],
    "restart": ["bench/restart.py", "--models", "debug,125m", "--json", "bench/results/restart.json"],
    "scale": ["bench/scale.py", "--json", "bench/results/scale.json"],
}
# Run only when named in --only (too long for `make bench`).
OPTIONAL = {
    "soak": ["bench/soak.py", "--switches", "200", "--devices", "4", "--json", "bench/results/soak.json"],
    "chaos": ["bench/chaos.py", "--seeds", "0-7", "--inject", "--json", "bench/results/chaos/debug_inject_0-7.json"],
    "lost_time": ["bench/lost_time.py", "--model", "125m", "--seq-len", "32", "--repeats", "5", "--json",
                  "bench/results/lost_time/125m.json"],
    "first_step": ["bench/first_step.py", "--json", "bench/results/first_step.json"],
    "launchers": ["bench/launchers.py", "--model", "125m", "--json", "bench/results/launchers/125m.json"],
    "first_touch": ["bench/first_touch.py", "--model", "125m", "--repeats", "6", "--json",
                    "bench/results/first_touch.json"],
}


def run(name: str, argv: list[str]) -> float:
    print(f"== {name}: python {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=HERE.parent, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (RESULTS / f"{name}.txt").write_text(proc.stdout + proc.stderr)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} failed with status {proc.returncode}")
    print(f"== {name}: {wall:.0f}s\n", flush=True)
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of " + ", ".join(BENCHMARKS)
                    + "; optional: " + ", ".join(OPTIONAL))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    known = {**BENCHMARKS, **OPTIONAL}
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {', '.join(known)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    load = {"start": os.getloadavg()}  # other jobs on the cores stretch every figure: say how busy they were
    t0 = time.perf_counter()
    walls = {}
    for name in names:
        walls[name] = run(name, known[name])
        load[name] = os.getloadavg()
    total = time.perf_counter() - t0
    print("wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in walls.items()) + f"; total {total:.0f} (goal < 1200); "
          "load average (1, 5, 15 min) after each: " + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}/{v[2]:.1f}"
                                                               for k, v in load.items()))
    if set(names) == set(BENCHMARKS):
        (RESULTS / "all.json").write_text(json.dumps({"wall_s": walls, "total_s": total, "load_average": load},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
