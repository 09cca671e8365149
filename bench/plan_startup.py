"""Wall time of the `dynatrain plan` console command for Llama-3-70B at 1,024 ranks, split into what the process
pays before planning (interpreter, imports) and the planning itself (`plan_seconds`, what the command reports).

    python bench/plan_startup.py --runs 5 --json bench/results/plan_startup.json

Each figure is a separate process, run ``--runs`` times; the JSON keeps every run and the load average at the start,
since the development machine's two cores are shared; wall and CPU seconds are both kept (CPU time is what other jobs
distort least). ``import_seconds`` is `import dynatrain.cli, dynatrain.cli.plan` less the bare interpreter;
``plan_seconds`` is the command's own timing of its planning (wall); ``heavy_modules`` lists any torch or Lightning
module that path loaded (it should be none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARGS = ["plan", "--model", "llama3-70b", "--from", "dp_shard=128,tp=8", "--to", "dp_shard=256,tp=4",
        "--gpus-per-node", "8", "--json"]
PROBE = ("import sys, dynatrain.cli, dynatrain.cli.plan\n"
         "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'lightning_fabric')))")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one process (CPU time is what a busy shared machine distorts least)."""
    start, cpu = time.perf_counter(), _cpu()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    wall, cpu = time.perf_counter() - start, _cpu() - cpu
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return wall, cpu, res.stdout


def _summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "runs": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    console = Path(sys.executable).with_name("dynatrain")
    if not console.exists():
        raise SystemExit(f"no console script at {console}: `pip install -e .` in this environment first")
    load = os.getloadavg()
    wall = {k: [] for k in ("interpreter", "import", "total")}
    cpu = {k: [] for k in ("interpreter", "import", "total")}
    planning, heavy = [], ""
    for _ in range(args.runs):
        for key, cmd in (("interpreter", [sys.executable, "-c", "pass"]), ("import", [sys.executable, "-c", PROBE]),
                         ("total", [str(console), *ARGS])):
            w, c, out = _run(cmd)
            wall[key].append(w)
            cpu[key].append(c)
            if key == "import":
                heavy = out
            if key == "total":
                planning.append(json.loads(out)["plan_seconds"])
    result = {
        "command": f"{console.name} {' '.join(ARGS)}",
        "load_average_at_start": load,
        "cpus": os.cpu_count(),
        "plan_seconds": _summary(planning),
        "heavy_modules": heavy.split(),
    }
    for kind, figures in (("wall", wall), ("cpu", cpu)):
        result[kind] = {
            "interpreter_seconds": _summary(figures["interpreter"]),
            "import_seconds": _summary([i - b for i, b in zip(figures["import"], figures["interpreter"])]),
            "total_seconds": _summary(figures["total"]),
        }
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
