"""CPU seconds per planner stage of one `dynatrain plan` computation, and the process's user and system time: where
a slow plan spends its time, without a profiler's overhead.

    python bench/plan_stages.py --repeats 3 --json bench/results/plan405/pp_on_stages.json -- \\
        --model llama3-405b --from dp_shard=2048,tp=8 --to pp=16,dp_shard=128,tp=8 --gpus-per-node 8

Each repeat runs in a fresh process (the first plan of a process is the one a switch pays).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # planning is timed as one rank computes it: one core

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

STAGES = ("overlaps", "saved_matrix", "assign", "route_table", "state_groups", "schedule_groups")


def one(plan_argv: list[str]) -> dict:
    """Time one computation in this process: each stage `plan_switch` calls, the layouts, and the whole."""
    import resource

    import dynatrain.cli.plan as cli
    import dynatrain.planner.schedule as schedule

    spent: dict[str, float] = {}

    def timed(module, name: str, label: str) -> None:
        inner = getattr(module, name)

        def run(*args, **kwargs):
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - start

        setattr(module, name, run)

    for name in STAGES:
        timed(schedule, name, name)
    timed(cli, "layout_for_model", "layouts")
    timed(cli, "plan_switch", "plan_switch")
    args = cli.configure(argparse.ArgumentParser()).parse_args(plan_argv)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.process_time()
    cli.compute(args)
    total = time.process_time() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": round(total, 3), "user_s": round(after.ru_utime - before.ru_utime, 3),
            "sys_s": round(after.ru_stime - before.ru_stime, 3),
            "minor_faults": after.ru_minflt - before.ru_minflt,
            "stages_cpu_s": {k: round(v, 3) for k, v in spent.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, plan_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a repeat, in its own process
    args = ap.parse_args(ours)
    if not plan_argv:
        ap.error("give the `dynatrain plan` arguments after --")
    if args.one:
        print(json.dumps(one(plan_argv)))
        return 0
    runs = []
    for i in range(args.repeats):
        out = subprocess.run([sys.executable, __file__, "--one", "--", *plan_argv], check=True,
                             capture_output=True, text=True).stdout
        runs.append({"run": i + 1, **json.loads(out.strip().splitlines()[-1])})
        print(runs[-1], flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "plan": "dynatrain plan " + " ".join(plan_argv),
            "command": "python bench/plan_stages.py " + " ".join(ours) + " -- " + " ".join(plan_argv),
            "note": "stages_cpu_s: CPU seconds inside each planner stage (plan_switch holds the stages; layouts are "
                    "the two layouts `dynatrain plan` builds); cpu_s: the whole computation, including the busiest "
                    "rank's pieces and the network model",
            "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
