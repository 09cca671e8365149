"""Training time a device-count change loses: online switch against a cold and a warm checkpoint-and-restart.

    python bench/lost_time.py --model 125m --repeats 5 --json bench/results/lost_time/125m.json

Every trial runs one chain, ``dp_shard=4`` on 4 processes -> ``dp_shard=2`` on 2 -> ``dp_shard=4`` on 4, one of three
ways (`bench/_lost_time_worker.py`):
* **cold**: Lightning's `ModelParallelStrategy`; at the decision every process writes its share of a DCP checkpoint
  (`trainer.save_checkpoint`) and exits, and a new launch on the new device count resumes from it: a restart as it
  is done today.
* **warm**: the same, but the processes the next world keeps stay alive: they destroy the process group, form the
  next one and load the checkpoint in place (what an in-process restart would do); only the processes a scale-out
  adds are new.
* **online**: one elastic dynatrain job; at the decision it requests the switch with ``plan_ahead=True`` (a
  scale-out goes on training on the old world until its new processes are ready, a scale-in for one more step while
  its plan is made in the background).
* **online-pool**: the same job, but the processes a scale-out adds start with it and wait as its warm standby pool
  (`docs/elastic.md`): a scale-out admits processes that are ready, the way to scale out the docs give.

**Lost time** of the change decided at the end of step k:
``T(end of step k+m) - T0 - m * median step of the new world`` with ``T0`` the earlier of the end of step k and the
start of any new process (for a scale-out the parent starts the new processes the moment rank 0 signals the
decision, both ways, so their start-up and its CPU count; a pool's processes were there before it), and the median
taken over the ``--steady`` steps after k+m, same trial. Marks are ``time.time()`` written by every process on one
machine clock; a step's end is its latest process's. The **first step** after a change is its first new-world step
from its latest first micro-batch to its latest end, divided by the median of the same span over the steady steps.

Trials run in a random order (``--seed``), ``--repeats`` of each way; each figure is reported as median and range.
Four processes share the machine's cores: these figures are for what a change costs a job, not for bandwidth
(`bench/switch.py` measures that on 2 processes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _spawn import Spawner  # this folder

from dynatrain.elastic.store import start_store
from dynatrain.launch.local import PRELOAD, host_store, joiner_env, launch_local, rank_env
from dynatrain.settings import HEAP_ENV

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_lost_time_worker.py")
CHAIN = [("dp_shard=4", 4), ("dp_shard=2", 2), ("dp_shard=4", 4)]
WAYS = ("cold", "warm", "online", "online-pool")


# ---------------------------------------------------------------------------------------------- the schedule
def base_argv(args, mode: str, tmp: Path, segment: int = 0) -> list[str]:
    return [WORKER, "--mode", mode, "--chain", ",".join(f"{l}@{p}" for l, p in CHAIN), "--warmup", str(args.warmup),
            "--m", str(args.m), "--steady", str(args.steady), "--segment", str(segment), "--signal-dir", str(tmp),
            "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--global-batch", str(args.global_batch)]


def scale_outs() -> list[int]:
    return [i for i in range(len(CHAIN) - 1) if CHAIN[i + 1][1] > CHAIN[i][1]]


ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def forked(args) -> dict:
    """With ``--fork-ranks``, the launches fork their ranks from one process that imported torch and Lightning once
    (`launcher.PRELOAD`, kept across trials): a restart then skips the start-up a real one pays, so the lost times
    mean nothing; what is left is a check that every way runs its chain (the processes a scale-out adds still
    start as their own)."""
    return {"preload": PRELOAD, "keep_zygote": True} if args.fork_ranks else {}


def run_cold(args, tmp: Path) -> dict:
    ranks, launched = [], []
    for s, (_, procs) in enumerate(CHAIN):
        argv = base_argv(args, "cold", tmp, s) + ["--ckpt-dir", str(tmp)]
        launched.append(time.time())
        ranks += launch_local(argv, procs, tmp, timeout=args.timeout, env=ENV, name=f"cold-{s}", **forked(args))
    return {"ranks": ranks, "spawned": {i: launched[i + 1] for i in range(len(CHAIN) - 1)}}


def run_warm(args, tmp: Path) -> dict:
    # Each later segment rendezvouses on a store this process hosts, as `launch_local` does for the first: its ranks
    # are clients of their launcher's store, and none of them hosts one.
    stores = [host_store() for _ in CHAIN[1:]]
    ports = ",".join(str(s.port) for s in stores)
    argv = base_argv(args, "warm", tmp) + ["--ckpt-dir", str(tmp), "--ports", ports]
    spawner = Spawner(tmp)
    for i in scale_outs():
        old, new = CHAIN[i][1], CHAIN[i + 1][1]
        seg = base_argv(args, "warm", tmp, i + 1) + ["--ckpt-dir", str(tmp), "--ports", ports]
        spawner.when(tmp / f"decided-{i}", i, [(seg, rank_env(r, new, stores[i].port, ENV)) for r in range(old, new)])
    try:
        ranks = launch_local(argv, CHAIN[0][1], tmp, timeout=args.timeout, env=ENV, name="warm", **forked(args))
        ranks += spawner.finish(args.timeout)
    finally:
        spawner.kill()
    return {"ranks": ranks, "spawned": dict(spawner.spawned)}


def run_online(args, tmp: Path, pool: bool = False) -> dict:
    """``pool``: the processes a scale-out adds start with the job and wait as its warm standby pool (niced, as
    `dynatrain fit --elastic.standby` starts them), instead of at the decision."""
    token = secrets.token_hex(8)
    store = start_store(token, tmp, host="127.0.0.1")
    env = {**ENV, "DYNATRAIN_ENDPOINT": store.endpoint, "DYNATRAIN_TOKEN": token}
    spawner = Spawner(tmp)
    for i in scale_outs():
        joiner = base_argv(args, "online", tmp, i + 1)
        added = CHAIN[i + 1][1] - CHAIN[i][1]
        signal = tmp / "pool" if pool else tmp / f"decided-{i}"
        spawner.when(signal, i, [(joiner, joiner_env(env, CHAIN[i + 1][1]))] * added)
    if pool:
        (tmp / "pool").touch()
    try:
        ranks = launch_local(base_argv(args, "online", tmp), CHAIN[0][1], tmp, timeout=args.timeout, env=env,
                             name="online", **forked(args))
        ranks += spawner.finish(args.timeout)
    finally:
        spawner.kill()
        store.stop()
    return {"ranks": ranks, "spawned": dict(spawner.spawned)}


RUNNERS = {"cold": run_cold, "warm": run_warm, "online": run_online,
           "online-pool": lambda args, tmp: run_online(args, tmp, pool=True)}


# ---------------------------------------------------------------------------------------------- measuring
def world_marks(ranks: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """Per step, the latest first micro-batch and the latest end over every process that ran it."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for r in ranks:
        for seg in r["segments"]:
            for s, t in seg["starts"]:
                starts[s] = max(starts.get(s, t), t)
            for s, t in seg["ends"]:
                ends[s] = max(ends.get(s, t), t)
    return starts, ends


def last_old_steps(way: str, ranks: list[dict], args) -> list[tuple[int, int]]:
    """Per change: the step it was decided at and the last step the old world ran (the same step for a restart; for a
    switch the step it ran after, later for a scale-out that waited for its new processes)."""
    out, k = [], args.warmup
    online = sorted({rep["step"] for r in ranks for rep in r.get("reports", [])})
    for i in range(len(CHAIN) - 1):
        last = online[i] if way.startswith("online") else k
        out.append((k, last))
        k = last + args.m + args.steady
    return out


def measure(way: str, trial: dict, args) -> list[dict]:
    starts, ends = world_marks(trial["ranks"])
    out = []
    for i, (k, last) in enumerate(last_old_steps(way, trial["ranks"], args)):
        steady = range(last + args.m + 1, last + args.m + args.steady + 1)
        step_s = [ends[s] - ends[s - 1] for s in steady]
        span_s = [ends[s] - starts[s] for s in steady]
        median_step = statistics.median(step_s)
        # A pool's processes were there before the decision: their start-up is not the change's.
        spawned = i in trial["spawned"] and way not in ("cold", "online-pool")
        t0 = min([ends[k]] + ([trial["spawned"][i]] if spawned else []))
        m, first = last + args.m - k, last + 1
        out.append({
            "change": f"{CHAIN[i][0]}@{CHAIN[i][1]} -> {CHAIN[i + 1][0]}@{CHAIN[i + 1][1]}", "decided_at": k,
            "old_world_steps_after_decision": last - k, "m": m, "t0_before_step_end_s": ends[k] - t0,
            "lost_s": ends[k + m] - t0 - m * median_step, "median_step_s": median_step,
            "steady_steps_s": step_s, "first_step_s": ends[first] - starts[first],
            "first_step_ratio": (ends[first] - starts[first]) / statistics.median(span_s),
            "joiners": joiner_sides(trial["ranks"], i + 1, first, steady),
        })
    return out


# `usage` fields: minor page faults, major ones, user and system CPU seconds, context switches, resident bytes
FAULTS, SYS_S = 0, 3


def joiner_sides(ranks: list[dict], segment: int, first: int, steady: range) -> list[dict]:
    """Per process that joined at the change into ``segment``: its seconds from ready to its first step
    (`SwitchReport.joined`: admission, formation, payload, Lightning's set-up and loop restore; the switch's own
    phases), and its first step against its steady ones (seconds, page faults, system CPU)."""
    out = []
    for r in ranks:
        joined = r.get("joined")
        if not joined or r["segments"][0]["segment"] != segment:
            continue
        seg = r["segments"][0]
        starts, ends, usage = dict(seg["starts"]), dict(seg["ends"]), dict(seg["usage"])
        delta = lambda s, k: usage[s][1][k] - usage[s][0][k]
        steady_s = [ends[s] - starts[s] for s in steady if s in ends]
        out.append({"member": r.get("member"), "outside": joined["joined"], "phases": joined["phases"],
                    "first_step_s": ends[first] - starts[first],
                    "first_step_over_steady": (ends[first] - starts[first]) / statistics.median(steady_s),
                    "first_step_faults": delta(first, FAULTS), "first_step_sys_s": delta(first, SYS_S),
                    "steady_faults": statistics.median(delta(s, FAULTS) for s in steady if s in usage),
                    "steady_sys_s": statistics.median(delta(s, SYS_S) for s in steady if s in usage)})
    return out


def joiner_table(raw: list[dict]) -> str:
    """The joiners' side of each scale-out, per online way: median over joiners and trials of each phase."""
    lines = []
    for way in ("online", "online-pool"):
        for i in range(len(CHAIN) - 1):
            trials = [t for t in raw if t["way"] == way]
            sides = [j for t in trials for j in t["figures"][i].get("joiners", [])]
            if not sides:
                continue
            med = lambda xs: statistics.median(xs) if xs else float("nan")
            cells = {k: med([j["outside"][k] for j in sides if k in j["outside"]])
                     for k in ("admission", "formation", "payload", "lightning_setup", "lightning_optimizer",
                               "loop_restore")}
            cells["switch phases"] = med([sum(j["phases"].values()) for j in sides])
            for k in ("first_step_s", "first_step_over_steady", "first_step_faults", "steady_faults",
                      "first_step_sys_s", "steady_sys_s"):
                cells[k] = med([j[k] for j in sides])
            if not lines:
                lines = ["| way | change | " + " | ".join(cells) + " |", "|" + "---|" * (len(cells) + 2)]
            lines.append(f"| {way} | {trials[0]['figures'][i]['change']} | "
                         + " | ".join(f"{v:.3f}" if v < 1000 else f"{v:.0f}" for v in cells.values()) + " |")
    return "\n".join(lines)


def compact(trial: dict) -> dict:
    """The trial's raw marks, without what the figures do not use."""
    keep = ("rank", "member", "start", "imported", "end", "left", "segments", "joined")
    return {"spawned": trial["spawned"],
            "ranks": [{**{k: r[k] for k in keep if k in r},
                       "reports": [{k: rep[k] for k in ("step", "old_layout", "new_layout", "world_size", "phases",
                                                        "stall_s", "bytes_moved", "prepared", "heap_trimmed",
                                                        "formed_ahead_steps")
                                    if k in rep}
                                   for rep in r.get("reports", [])]} for r in trial["ranks"]]}


def summarise(per_way: dict[str, list[list[dict]]]) -> list[dict]:
    rows = []
    n_changes = len(CHAIN) - 1
    for i in range(n_changes):
        row: dict = {"change": None}
        for way, trials in per_way.items():
            figs = [t[i] for t in trials]
            row["change"] = figs[0]["change"]
            row[way] = {key: spread([f[key] for f in figs]) for key in ("lost_s", "first_step_ratio", "median_step_s")}
        for online in ("online", "online-pool"):
            for base in ("cold", "warm"):
                if online in row and base in row:
                    row[f"{online}_over_{base}"] = row[online]["lost_s"]["median"] / row[base]["lost_s"]["median"]
        rows.append(row)
    return rows


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def table(rows: list[dict], ways: list[str]) -> str:
    head = ["change"] + [f"{w} lost s" for w in ways] + [f"{w} first step / median" for w in ways]
    ratios = [f"{o}_over_{b}" for o in ("online", "online-pool") for b in ("cold", "warm")
              if f"{o}_over_{b}" in rows[0]]
    head += [r.replace("_over_", " / ") for r in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda d, p: f"{d['median']:.{p}f} ({d['min']:.{p}f} to {d['max']:.{p}f})"
    for r in rows:
        cells = [r["change"]] + [fmt(r[w]["lost_s"], 2) for w in ways]
        cells += [fmt(r[w]["first_step_ratio"], 2) for w in ways]
        cells += [f"{r[k]:.3f}" for k in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="debug")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the first decision")
    ap.add_argument("--m", type=int, default=5, help="steps counted after the old world's last (>= 5)")
    ap.add_argument("--steady", type=int, default=3, help="steps after those that give the new world's median")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--seed", type=int, default=0, help="of the trials' order")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--table-from", default=None, help="print the table of an earlier --json and exit")
    ap.add_argument("--fork-ranks", action="store_true",
                    help="fork the launched ranks from one preloaded process: a quick check of the chains whose "
                         "figures are not a restart's (see `forked`)")
    args = ap.parse_args()
    if args.table_from:
        data = json.loads(Path(args.table_from).read_text())
        ways = [w for w in data["args"]["ways"].split(",") if w in data["summary"][0]]
        print(f"{data['trials_done']} of {len(data['order'])} trials")
        print(table(data["summary"], ways))
        print(joiner_table(data["trials"]))
        return
    if args.m < 5:
        ap.error("--m must be at least 5: fewer steps do not leave a change room to finish")
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        ap.error(f"unknown --ways {sorted(unknown)}; choose from {', '.join(WAYS)}")
    order = [w for w in ways for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(order)
    per_way: dict[str, list] = {w: [] for w in ways}
    raw, t_start = [], time.time()
    for n, way in enumerate(order):
        with tempfile.TemporaryDirectory(prefix=f"lost-{way}-") as d:
            t = time.time()
            trial = RUNNERS[way](args, Path(d))
            figs = measure(way, trial, args)
        per_way[way].append(figs)
        raw.append({"way": way, "wall_s": time.time() - t, "load": os.getloadavg()[0], "figures": figs,
                    **compact(trial)})
        print(f"[{n + 1}/{len(order)}] {way}: " + "; ".join(f"{f['change']} lost {f['lost_s']:.2f} s, first step "
                                                          f"x{f['first_step_ratio']:.2f}" for f in figs), flush=True)
        if args.json:  # after every trial: a run cut short keeps what it measured, and says how far it got
            write(args, order, n + 1, t_start, summarise({w: v for w, v in per_way.items() if v}), raw)
    print(table(summarise(per_way), ways))
    print("The joiners' side (seconds; page faults):")
    print(joiner_table(raw))


def write(args, order: list[str], done: int, t_start: float, summary: list[dict], raw: list[dict]) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "args": vars(args), "order": order, "trials_done": done,
        # The settings every rank starts with (the launchers add the heap's from DYNATRAIN_HEAP).
        "env": {k: os.environ[k] for k in ("DYNATRAIN_HEAP", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "PYTHONPATH")
                if k in os.environ},
        "heap": os.environ.get(HEAP_ENV, "reuse"),  # what the launchers give the ranks (`memory.heap_env`)
        "wall_s": time.time() - t_start, "summary": summary, "trials": raw}, indent=1))


if __name__ == "__main__":
    main()
