"""Where a switch's stall goes (issue 47 item 4): the stall and each phase against the transfer phase, per way.

Drives `dynatrain fit` with an elastic recipe (a copy of recipes/llama-debug-elastic.yaml's settings, without the
reference run, snapshots and W&B) and a scripted trace that repeats one cycle of switches, so the ways interleave
within a run:

* ``pool`` runs (``--elastic.standby 2``): per cycle dp_shard=4 -> dp_shard=2,tp=2 -> dp_shard=4 (same-world, twice),
  4 -> 2 processes (scale-in; the leavers wait as standby processes), 2 -> 4 (scale-out from the warm pool).
* ``cold`` runs (no standby pool): per cycle 4 -> 2 (scale-in; the leavers exit) and 2 -> 4, for which this script
  starts two fresh ``dynatrain join`` processes when the scale-out is requested (cold joiners; the trace entry holds
  training at the boundary until they are ready, so the start-up is outside the stall by design).

Pool and cold runs alternate (``--runs`` of each). Every process writes every `SwitchReport` it holds
(`bench/_stall_worker.AllRankSwitchReports`); per switch the figures are the maximum over the ranks that train
after it (world_size > 0) of the stall and of each phase, so stall/transfer is max stall over max transfer and the
fixed cost is max stall - max transfer. Ranks that leave in a scale-in are recorded apart (``leavers``); joiners
hold no report of the switch that admits them (their side is not in these figures). Rank 0's own figures (what
``switches.jsonl`` and `make demo`'s table show) are kept beside them. Verification is on (the recipe's default).
A rank's stall starts when every rank has ended the step: the time it waited at the boundary for the slowest one
(the step's own skew, which the next step's first collective would absorb without a switch) is the report's
``boundary_wait_s``, shown apart. Forming a world (``world``) and a mesh's groups (``mesh``) are phases of their own,
not part of ``transfer``, which is the engine's alone.

    .venv/bin/python bench/stall.py --model debug --cycles 5 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DYNATRAIN = str(Path(sys.executable).with_name("dynatrain"))
PHASES = ("plan", "verify", "release", "world", "mesh", "build", "transfer", "adopt", "restart")
WAYS = ("same-world", "scale-in", "scale-out-pool", "scale-out-cold")

RECIPE = """\
seed_everything: 1234
trainer:
  accelerator: cpu
  devices: 4
  strategy:
    class_path: dynatrain.DynaTrainStrategy
    init_args:
      parallel: dp_shard=4
      switching:
        verify_switches: true
  precision: 32-true
  max_steps: {max_steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: bench._stall_worker.AllRankSwitchReports
    - class_path: dynatrain.callbacks.ElasticCallback
      init_args:
        trace:
{trace}
        max_devices: 4
  default_root_dir: {run_dir}
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args:
        save_dir: {run_dir}
        name: csv
model:
  model: {model}
  lr: 3.0e-3
  warmup_steps: 10
  min_lr_ratio: 0.1
data:
  seq_len: {seq_len}
  global_batch_size: {global_batch}
  micro_batch_size: {micro}
"""


def trace_entries(mode: str, cycles: int, first: int, gap: int) -> tuple[list[str], int]:
    if mode == "pool":
        cycle = ['layout: "dp_shard=2,tp=2"', 'layout: "dp_shard=4"', "devices: 2", "devices: 4, wait: true"]
    else:
        cycle = ["devices: 2", "devices: 4, wait: true"]
    entries, step = [], first
    for _ in range(cycles):
        for what in cycle:
            entries.append(f"          - {{step: {step}, {what}}}")
            step += gap
    return entries, step + 2


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_once(mode: str, args, work: Path, index: int) -> dict:
    run_dir = work / f"{mode}{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "reports").mkdir(parents=True)
    entries, max_steps = trace_entries(mode, args.cycles, args.first, args.gap)
    recipe = run_dir / "recipe.yaml"
    recipe.write_text(RECIPE.format(max_steps=max_steps, trace="\n".join(entries), run_dir=run_dir / "run",
                                    model=args.model, seq_len=args.seq_len, micro=args.micro_batch_size,
                                    global_batch=args.global_batch_size))
    cmd = [DYNATRAIN, "fit", "--config", str(recipe), "--elastic.max_devices", "4",
           "--elastic.workdir", str(run_dir / "elastic")]
    if mode == "pool":
        cmd += ["--elastic.standby", "2"]
    from dynatrain.launch.job import standby_env
    from dynatrain.settings import ELASTIC_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DYNATRAIN_STALL_DIR": str(run_dir / "reports"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.time()
    log = open(run_dir / "out.txt", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joiners, endpoint, token_file = [], None, None
    try:
        for line in proc.stdout:
            log.write(line)
            m = re.search(r"dynatrain join --endpoint (\S+) --token-file (\S+)", line)
            if m:
                endpoint, token_file = m.group(1), m.group(2)
                if not os.path.isabs(token_file):
                    token_file = str(ROOT / token_file)
            if mode == "cold" and "trace request devices=4" in line and endpoint:
                # Cold joiners: fresh interpreters started now, with the environment the launcher gives its own
                # standby processes (`launch.job.standby_env`: the job's elastic config, one thread until
                # admitted), on the two devices the leavers freed.
                jenv = {**env, ELASTIC_ENV: json.dumps({"max_devices": 4, "join_timeout": 300.0,
                                                        "timeout": 120.0}), "PYTHONUNBUFFERED": "1"}
                for device in (2, 3):
                    jlog = open(run_dir / f"joiner{len(joiners)}.txt", "w")
                    joiners.append(subprocess.Popen([DYNATRAIN, "join", "--endpoint", endpoint, "--token-file",
                                                     token_file], cwd=ROOT, env=standby_env(jenv, device),
                                                    stdout=jlog, stderr=subprocess.STDOUT))
            if time.time() - t0 > args.timeout:
                raise TimeoutError(f"{mode} run {index} past {args.timeout} s")
        rc = proc.wait(timeout=60)
    except BaseException:
        proc.kill()
        raise
    finally:
        for j in joiners:
            try:
                j.wait(timeout=30)
            except subprocess.TimeoutExpired:
                j.kill()
        log.close()
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{mode} run {index} exited {rc}; see {run_dir / 'out.txt'}")
    records = []
    for f in sorted((run_dir / "reports").glob("reports.*.jsonl")):
        records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {"mode": mode, "index": index, "wall_s": round(wall, 1), "command": " ".join(cmd),
            "switches": summarise_switches(mode, records)}


def way_of(mode: str, old: int, new: int) -> str:
    if old == new:
        return "same-world"
    if new < old:
        return "scale-in"
    return "scale-out-pool" if mode == "pool" else "scale-out-cold"


def summarise_switches(mode: str, records: list[dict]) -> list[dict]:
    by_switch: dict[tuple, list[dict]] = {}
    for r in records:
        by_switch.setdefault((r["step"], r["old_layout"], r["new_layout"]), []).append(r)
    out = []
    for (step, old, new), rs in sorted(by_switch.items()):
        members = [r for r in rs if r["world_size"] > 0]
        leavers = [r for r in rs if r["world_size"] == 0]
        if not members:
            continue
        phase_max = {p: max(r["phases"].get(p, 0.0) for r in members) for p in PHASES}
        stall = max(r["stall_s"] for r in members)
        rank0 = next((r for r in members if r["rank"] == 0), None)
        out.append({
            "step": step, "old_layout": old, "new_layout": new,
            "old_world": rs[0]["old_world_size"], "new_world": members[0]["world_size"],
            "way": way_of(mode, rs[0]["old_world_size"], members[0]["world_size"]),
            "ranks_reporting": len(members), "leavers_reporting": len(leavers),
            "stall_s": stall, "phases_max_s": phase_max,
            # the step's skew at the boundary, which the agreement absorbs and the stall leaves out
            "boundary_wait_max_s": max(r.get("boundary_wait_s", 0.0) for r in members),
            "stall_over_transfer": stall / phase_max["transfer"] if phase_max["transfer"] else None,
            "fixed_s": stall - phase_max["transfer"],
            "bytes_moved_max": max(r["bytes_moved"] for r in members),
            "verified": all(r.get("verified") for r in members),
            "rank0": None if rank0 is None else {"stall_s": rank0["stall_s"], "phases": rank0["phases"]},
            "leavers_stall_s": max((r["stall_s"] for r in leavers), default=None),
        })
    return out


def stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4)}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for way in WAYS:
        sw = [s for r in runs for s in r["switches"] if s["way"] == way]
        if not sw:
            continue
        out[way] = {"repeats": len(sw), "stall_s": stats([s["stall_s"] for s in sw]),
                    "transfer_s": stats([s["phases_max_s"]["transfer"] for s in sw]),
                    "stall_over_transfer": stats([s["stall_over_transfer"] for s in sw]),
                    "fixed_s": stats([s["fixed_s"] for s in sw]),
                    "boundary_wait_s": stats([s.get("boundary_wait_max_s") for s in sw]),
                    "phases_s": {p: stats([s["phases_max_s"][p] for s in sw]) for p in PHASES},
                    "rank0_fixed_s": stats([s["rank0"]["stall_s"] - s["rank0"]["phases"].get("transfer", 0.0)
                                            for s in sw if s["rank0"]]),
                    "all_verified": all(s["verified"] for s in sw)}
    return out


def table(summary: dict) -> str:
    head = ["way", "n", "stall s", "transfer s", "stall/transfer", "stall-transfer s", *[f"{p} s" for p in PHASES],
            "boundary wait s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for way, s in summary.items():
        def f(d):
            return f"{d['median']:.3f} ({d['min']:.3f}-{d['max']:.3f})" if d.get("n") else "-"
        cells = [way, str(s["repeats"]), f(s["stall_s"]), f(s["transfer_s"]), f(s["stall_over_transfer"]),
                 f(s["fixed_s"]), *[f"{s['phases_s'][p]['median']:.3f}" for p in PHASES],
                 f"{s['boundary_wait_s']['median']:.3f}" if s["boundary_wait_s"].get("n") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="debug")
    ap.add_argument("--cycles", type=int, default=5, help="switch cycles per run")
    ap.add_argument("--runs", type=int, default=1, help="pool runs and cold runs, alternating")
    ap.add_argument("--modes", default="pool,cold")
    ap.add_argument("--first", type=int, default=6, help="step of the first switch")
    ap.add_argument("--gap", type=int, default=4, help="steps between switches")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/stall/<model>.json)")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "bench" / "results" / "stall" / f"{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": loadavg()}
    work = Path(tempfile.mkdtemp(prefix=f"stall-{args.model}-"))
    runs = []
    modes = args.modes.split(",")
    for i in range(args.runs):
        for mode in modes:
            r = run_once(mode, args, work, i)
            runs.append(r)
            print(f"[{mode} {i}] {len(r['switches'])} switches in {r['wall_s']} s", flush=True)
    summary = summarise(runs)
    result = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "start": start,
              "end": {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": loadavg()},
              "per_switch": "max over the ranks that train after the switch, of the stall and of each phase; "
                            "stall_over_transfer = max stall / max transfer, fixed_s = max stall - max transfer",
              "summary": summary, "runs": runs}
    out.write_text(json.dumps(result, indent=1))
    print(table(summary))
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
