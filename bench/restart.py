"""Training stall of a device-count or layout change: checkpoint-and-restart with Lightning against the online switch.

    python bench/restart.py --models debug,125m --json bench/results/restart.json

Per model, in one run, the same chain of transitions two ways:
* **restart**, the way a Lightning user changes device count today: `ModelParallelStrategy` trains on the old
  world, writes a DCP checkpoint (`trainer.save_checkpoint`) at step k, its processes exit, a new launch on the new
  device count resumes with ``ckpt_path=`` and trains on. Launches: dp_shard=4 (4 processes) -> dp_shard=2 (2)
  -> dp_shard=4 (4) -> dp_shard=2,tp=2 (4).
* **online**, one elastic dynatrain job (store process, 4 members): ``request_switch`` to dp_shard=2 (the planner
  picks the 2 processes that leave; they exit), to dp_shard=4 (2 new processes started with ``DYNATRAIN_JOIN=1``
  once the job trains on 2, admitted when ready), to dp_shard=2,tp=2; then back to dp_shard=4 and once more to
  dp_shard=2,tp=2 with the identity rank map and on to dp_replicate=2,tp=2: two same-world switches that move
  less and more bytes than the scale-out, the references of the scale-out benchmark.

Stall = end of the last optimizer step before the change (latest process) to the end of the first step after it
(latest process), from wall-clock marks every process writes on the one machine clock. Each stall is split into
phases: for a restart the save, the exit, process start-up and imports, Trainer and process group, model and
optimizer, the DCP read, the rest of Lightning's restore, the first step; for a switch the `SwitchReport` phases
(with the world change's `transfer` split into leaving and forming generations and the engine) and the first
step.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

from _spawn import Spawner  # this folder

from dynatrain.elastic.store import start_store
from dynatrain.launch.local import LaunchError, joiner_env, launch_local

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_restart_worker.py")
MiB = 2**20

# (layout, processes) of each restart launch; transition i goes from launch i to launch i + 1.
RESTART_CHAIN = [("dp_shard=4", 4), ("dp_shard=2", 2), ("dp_shard=4", 4), ("dp_shard=2,tp=2", 4)]
# The online job's actions; the first three are the transitions above, the last two serve the scale-out benchmark.
# No same-world switch on 4 processes moves exactly the scale-out's bytes, so two bracket it: the identity map
# into dp_shard=2,tp=2 moves half of all state, dp_shard=2,tp=2 -> dp_replicate=2,tp=2 all of it.
ONLINE_ACTIONS = ["world:dp_shard=2", "world:dp_shard=4", "layout:dp_shard=2,tp=2", "layout:dp_shard=4",
                  "identity:dp_shard=2,tp=2", "layout:dp_replicate=2,tp=2"]
SCALE_OUT, SAME_WORLD = 1, (4, 5)  # indices in ONLINE_ACTIONS
TRANSITIONS = ["4 -> 2 (dp_shard=4 -> dp_shard=2)", "2 -> 4 (dp_shard=2 -> dp_shard=4)",
               "dp_shard=4 -> dp_shard=2,tp=2"]


# ---------------------------------------------------------------------------------------------- running
def common_args(args, model: str) -> list[str]:
    return ["--model", model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--global-batch", str(args.global_batch)]


def run_restart_chain(args, model: str, tmp: Path) -> list[dict]:
    """Each launch: {"layout", "procs", "launched", "returned", "ranks"}; launch i+1 resumes launch i's checkpoint."""
    launches, ckpt, step = [], None, args.start_at
    for i, (layout, procs) in enumerate(RESTART_CHAIN):
        last = i == len(RESTART_CHAIN) - 1
        save = None if last else str(tmp / f"{model}-ckpt-{i}")
        argv = [WORKER, "--mode", "lightning", "--layout", layout, "--stop-at", str(step), *common_args(args, model)]
        argv += (["--save", save] if save else []) + (["--resume", ckpt] if ckpt else [])
        launched = time.time()
        ranks = launch_local(argv, procs, tmp, timeout=args.timeout, name=f"restart-{model}-{i}")
        launches.append({"layout": layout, "procs": procs, "launched": launched, "returned": time.time(),
                         "stop_at": step, "ranks": ranks})
        ckpt, step = save, step + args.restart_steps
    return launches


def run_online(args, model: str, tmp: Path) -> dict:
    token = secrets.token_hex(8)
    store = start_store(token, tmp, host="127.0.0.1")
    env = {"DYNATRAIN_ENDPOINT": store.endpoint, "DYNATRAIN_TOKEN": token, "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    signal = tmp / f"online-{model}.signal"
    spawner = Spawner(tmp)  # the joiners start once the job trains on its smaller world (never, if it ends first)
    online = [WORKER, "--mode", "dynatrain", "--layout", RESTART_CHAIN[0][0], "--actions", ";".join(ONLINE_ACTIONS),
              "--gap", str(args.gap), "--start-at", str(args.start_at), *common_args(args, model)]
    joiner = (online + ["--first", str(SCALE_OUT + 1)], joiner_env(env, 4 + 2))  # the job: 4 members, 2 joiners
    spawner.when(signal, f"joiner-{model}", [joiner] * 2)
    try:
        launched = time.time()
        try:
            members = launch_local(online + ["--signal-file", str(signal)], 4, tmp, timeout=args.timeout, env=env,
                                   name=f"online-{model}")
        except LaunchError as e:
            raise LaunchError(str(e) + spawner.tails()) from None
        return {"launched": launched, "members": members, "joiners": spawner.finish(timeout=120.0)}
    finally:
        spawner.kill()
        store.stop()


# ---------------------------------------------------------------------------------------------- measuring
def step_end(rank: dict, step: int) -> float | None:
    return next((t for s, t in rank["step_ends"] if s == step), None)


def latest(values) -> float:
    return max(v for v in values if v is not None)


def step_time(ranks: list[dict], step: int) -> float | None:
    """Wall time of one step of a world: the latest end of ``step - 1`` to the latest end of ``step``."""
    a = [step_end(r, step - 1) for r in ranks]
    b = [step_end(r, step) for r in ranks]
    if None in a or None in b:
        return None
    return max(b) - max(a)


def steps_before_change(ranks: list[dict], first_change: int) -> list[float]:
    """Step times of the first world before its first change (step 1, which warms up, left out)."""
    return [t for s in range(2, first_change + 1) if (t := step_time(ranks, s)) is not None]


def step_parts(ranks: list[dict], step: int) -> dict:
    """Forward, backward and optimizer seconds of one step, the slowest process for each."""
    parts = [r["step_parts"][str(step)] for r in ranks if str(step) in r["step_parts"]]
    return {k: max(p[k] for p in parts) for k in parts[0]} if parts else {}


def restart_stall(old: dict, new: dict, next_launched: float) -> dict:
    """The stall from launch ``old`` to launch ``new``, phase by phase (each mark: the latest process)."""
    step = old["stop_at"]
    before = latest(step_end(r, step) for r in old["ranks"])
    marks = [
        ("save", latest(step_end(r, step) + r["save_s"] for r in old["ranks"])),
        ("exit", next_launched),
        ("start + imports", latest(r["marks"]["imported"] for r in new["ranks"])),
        ("Trainer + process group", latest(r["marks"]["setup"] for r in new["ranks"])),
        ("model + optimizer", latest(r["load"][0] for r in new["ranks"])),
        ("DCP read", latest(r["load"][1] for r in new["ranks"])),
        ("loop state + data", latest(r["marks"]["train_start"] for r in new["ranks"])),
        ("first step", latest(step_end(r, step + 1) for r in new["ranks"])),
    ]
    phases, prev = {}, before
    for name, t in marks:
        phases[name] = t - prev
        prev = t
    return {"step": step, "stall_s": prev - before, "phases_s": phases,
            "next_step_s": step_time(new["ranks"], step + 2),
            "first_step_parts_s": step_parts(new["ranks"], step + 1),
            "next_step_parts_s": step_parts(new["ranks"], step + 2)}


def online_switches(job: dict) -> list[dict]:
    """One entry per switch of the online job, in order, with its stall and phases."""
    members, joiners = job["members"], job["joiners"]
    everyone = members + joiners
    reports_by_switch: dict[int, list[tuple[dict, dict]]] = {}
    for r in everyone:
        for rep in r["reports"]:
            reports_by_switch.setdefault(rep["step"], []).append((r, rep))
    out = []
    for step in sorted(reports_by_switch):
        pairs = reports_by_switch[step]
        before = latest(step_end(r, step) for r, _ in pairs)
        stayers = [(r, rep) for r, rep in pairs if rep["world_size"] > 0]
        arrived = [j for j in joiners if j["step_ends"] and j["step_ends"][0][0] == step + 1]
        new_ranks = [r for r, _ in stayers] + arrived
        switched = latest([step_end(r, step) + rep["stall_s"] for r, rep in stayers]
                          + [j["marks"]["train_start"] for j in new_ranks if j.get("joiner")])
        after = latest(step_end(r, step + 1) for r in new_ranks)
        rep0 = pairs[0][1]
        phases = {k: max(rep["phases"].get(k, 0.0) for _, rep in pairs) for k in rep0["phases"]}
        out.append({
            "step": step, "switch": f"{rep0['old_layout']} -> {rep0['new_layout']}",
            "processes": f"{len(pairs)} -> {len(new_ranks)}", "stall_s": after - before,
            "switch_s": switched - before, "first_step_s": after - switched, "phases_s": phases,
            "transfer_split_s": transfer_split([r for r, _ in pairs], before, after),
            "joiners_after_transfer_s": joiners_after_transfer(arrived),
            "bytes_moved": rep0["bytes_moved"], "bytes_moved_identity": rep0["bytes_moved_identity"],
            "bytes_total": rep0["bytes_total"], "rounds": rep0["rounds"],
            "rank_map": rep0["rank_map"], "first_step_parts_s": step_parts(new_ranks, step + 1),
            "next_step_s": step_time(new_ranks, step + 2), "next_step_parts_s": step_parts(new_ranks, step + 2),
            "leavers_exit": [r["fit_end"] - before for r, rep in pairs if rep["world_size"] == 0],
            "prepared": any(rep.get("prepared") for _, rep in pairs),
        })
    return out


def joiners_after_transfer(joiners: list[dict]) -> float | None:
    """From the end of a joiner's transfer to its training start (latest joiner): Lightning builds its model from
    the received shards, its optimizer and loop state only after the transfer."""
    if not joiners:
        return None
    first_transfer = lambda j: min(e["end"] for e in j["events"] if e["kind"] == "engine")
    return max(j["marks"]["train_start"] - first_transfer(j) for j in joiners)


def transfer_split(ranks: list[dict], t0: float, t1: float) -> dict:
    """Longest time a current member spent, inside [t0, t1], leaving its generation, forming the next one, and in
    the engine: the parts of the SwitchReport's `transfer` phase of a world change."""
    split: dict[str, float] = {}
    for r in ranks:
        for e in r["events"]:
            if t0 <= e["start"] <= t1:
                key = {"form_generation": f"form generation ({e.get('members')} members)",
                       "leave_generation": "leave generation", "engine": "engine"}[e["kind"]]
                split[key] = max(split.get(key, 0.0), e["end"] - e["start"])
    return split


def joiner_readiness(job: dict, scale_out: dict) -> list[dict]:
    """How long each joiner took to get ready, and the training it overlapped."""
    members = job["members"]
    out = []
    for j in job["joiners"]:
        during = sorted({s for r in members if not r["left"] for s, t in r["step_ends"]
                         if j["spawned"] <= t <= j["ready"]})
        out.append({"member": j["member"], "spawn_to_imported_s": j["marks"]["imported"] - j["spawned"],
                    "spawn_to_ready_s": j["ready"] - j["spawned"], "steps_trained_meanwhile": len(during),
                    "steps": [during[0], during[-1]] if during else None,
                    "ready_to_switch_s": latest(step_end(r, scale_out["step"]) for r in members if not r["left"])
                    - j["ready"]})
    return out


def summarise(model: str, launches: list[dict], job: dict) -> dict:
    switches = online_switches(job)
    rows = []
    for i, name in enumerate(TRANSITIONS):
        restart = restart_stall(launches[i], launches[i + 1], launches[i + 1]["launched"])
        online = switches[i]
        for way in (restart, online):  # the stall beyond one ordinary step of the new world
            way["lost_s"] = way["stall_s"] - way["next_step_s"] if way["next_step_s"] is not None else None
        rows.append({"model": model, "transition": name, "restart": restart, "online": online,
                     "ratio": online["stall_s"] / restart["stall_s"],
                     "ratio_lost": online["lost_s"] / restart["lost_s"]
                     if online["lost_s"] is not None and restart["lost_s"] else None})
    out = switches[SCALE_OUT]
    refs = [switches[i] for i in SAME_WORLD]
    same = {k: same_bytes(refs, out["bytes_moved"], k) for k in ("stall_s", "switch_s")}
    first_change = launches[0]["stop_at"]
    calibration = {"restart": steps_before_change(launches[0]["ranks"], first_change),
                   "online": steps_before_change(job["members"], first_change)}
    return {"model": model, "rows": rows, "switches": switches, "steps_before_change_s": calibration,
            "scale_out": {"scale_out": out, "same_world": refs, "same_bytes": same,
                          "ratio": out["stall_s"] / same["stall_s"], "ratio_switch": out["switch_s"] / same["switch_s"],
                          "joiners": joiner_readiness(job, out)}}


def same_bytes(refs: list[dict], nbytes: int, key: str) -> float:
    """A same-world switch's ``key`` at ``nbytes`` moved: linear between the two references that bracket it."""
    (b0, y0), (b1, y1) = sorted((r["bytes_moved"], r[key]) for r in refs)
    return y0 + (y1 - y0) * (nbytes - b0) / (b1 - b0)


# ---------------------------------------------------------------------------------------------- tables
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def fmt_phases(p: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in p.items() if v >= 0.005)


def table_restart(results: list[dict]) -> str:
    out = ["| model | transition | restart stall s | online stall s | ratio online/restart (goal <= 0.02 on 125m) "
           "| next step s: restart, online | stall beyond that step s: restart, online (ratio) "
           "| online moved MiB (identity map) |", "|" + "---|" * 8]
    opt = lambda x: "-" if x is None else f"{x:.2f}"
    for res in results:
        for r in res["rows"]:
            rs, on = r["restart"], r["online"]
            out.append(f"| {r['model']} | {r['transition']} | {rs['stall_s']:.2f} | {on['stall_s']:.2f} "
                       f"| {r['ratio']:.3f} (1/{1 / r['ratio']:.0f}) "
                       f"| {opt(rs['next_step_s'])}, {opt(on['next_step_s'])} "
                       f"| {opt(rs['lost_s'])}, {opt(on['lost_s'])} ({opt(r['ratio_lost'])}) "
                       f"| {on['bytes_moved'] / MiB:.0f} ({_mib(on['bytes_moved_identity'])}) |")
    return "\n".join(out)


def table_phases(results: list[dict]) -> str:
    out = ["| model | transition | restart phases s | online phases s |", "|" + "---|" * 4]
    for res in results:
        for r in res["rows"]:
            on = r["online"]
            online = {**on["phases_s"], "first step": on["first_step_s"]}
            out.append(f"| {r['model']} | {r['transition']} | {fmt_phases(r['restart']['phases_s'])} "
                       f"| {fmt_phases(online)} |")
    return "\n".join(out)


def table_scale_out(results: list[dict]) -> str:
    out = ["| model | switch | processes | moved MiB | stall s | switch s | first step s | phases s "
           "| transfer split s | joiners: transfer end -> training start s |", "|" + "---|" * 10]
    for res in results:
        so = res["scale_out"]
        for s in [so["scale_out"], *so["same_world"]]:
            joined = s.get("joiners_after_transfer_s")
            name = s["switch"] + (" (planned in the background)" if s.get("prepared") else "")
            out.append(f"| {res['model']} | {name} | {s['processes']} | {s['bytes_moved'] / MiB:.0f} "
                       f"| {s['stall_s']:.2f} | {s['switch_s']:.2f} | {s['first_step_s']:.2f} "
                       f"| {fmt_phases(s['phases_s'])} | {fmt_phases(s['transfer_split_s'])} "
                       f"| {'-' if joined is None else f'{joined:.2f}'} |")
    out += ["", "| model | scale-out stall s (switch s) "
            "| same-world at the same bytes, interpolated: stall s (switch s) "
            "| ratio stall (goal <= 1.2) | ratio switch only |", "|" + "---|" * 5]
    for res in results:
        so = res["scale_out"]
        out.append(f"| {res['model']} | {so['scale_out']['stall_s']:.2f} ({so['scale_out']['switch_s']:.2f}) "
                   f"| {so['same_bytes']['stall_s']:.2f} ({so['same_bytes']['switch_s']:.2f}) | {so['ratio']:.2f} "
                   f"| {so['ratio_switch']:.2f} |")
    return "\n".join(out)


def table_first_steps(results: list[dict]) -> str:
    """The first and second step after each change, split forward/backward/optimizer (slowest process for each),
    with the CPU seconds of the busiest process and the machine's load average."""
    out = ["| model | change | way | first step after s (forward/backward/optimizer); CPU s; load "
           "| second step after s (same) |", "|" + "---|" * 5]
    keys = ("forward", "backward", "optimizer")
    f = lambda p: (f"{sum(p[k] for k in keys):.2f} (" + "/".join(f"{p[k]:.2f}" for k in keys)
                   + f"); CPU {p.get('cpu', 0):.2f}; load {p.get('load', 0):.1f}") if p else "-"
    for res in results:
        for r in res["rows"]:
            for way in ("restart", "online"):
                x = r[way]
                out.append(f"| {r['model']} | {r['transition']} | {way} | {f(x['first_step_parts_s'])} "
                           f"| {f(x['next_step_parts_s'])} |")
    out += ["", "| model | steps 2..k before any change, dp_shard=4 on 4 processes: restart launch s | online job s |",
            "|---|---|---|"]
    for res in results:
        c = res["steps_before_change_s"]
        cells = [", ".join(f"{t:.2f}" for t in c[k]) for k in ("restart", "online")]
        out.append(f"| {res['model']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def table_joiners(results: list[dict]) -> str:
    out = ["| model | joiner | spawn -> imports done s | spawn -> ready s | job's steps during it "
           "| ready -> scale-out step ended s |", "|" + "---|" * 6]
    for res in results:
        for j in res["scale_out"]["joiners"]:
            steps = f"{j['steps_trained_meanwhile']} (steps {j['steps'][0]}-{j['steps'][1]})" if j["steps"] else "0"
            out.append(f"| {res['model']} | {j['member']} | {j['spawn_to_imported_s']:.1f} "
                       f"| {j['spawn_to_ready_s']:.1f} | {steps} | {j['ready_to_switch_s']:.1f} |")
    return "\n".join(out)


def measure(args) -> list[dict]:
    """Run both chains per model; the raw marks of every process, summarised later."""
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            launches = run_restart_chain(args, model, Path(tmp))
            job = run_online(args, model, Path(tmp))
            raw.append({"model": model, "launches": launches, "online_job": job})
    return raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="debug,125m")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=4, help="samples per optimizer step, kept on every world")
    ap.add_argument("--start-at", type=int, default=3, help="step of the first change")
    ap.add_argument("--gap", type=int, default=2, help="online: steps from one switch to the next action")
    ap.add_argument("--restart-steps", type=int, default=2,
                    help="restart: steps each resumed launch trains (the first is the one after the change)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tables-from", default=None, metavar="JSON",
                    help="print the tables of an earlier run's JSON instead of measuring")
    args = ap.parse_args()
    if args.tables_from:
        saved = json.loads(Path(args.tables_from).read_text())
        raw, wall, command = saved["raw"], saved["wall_s"], saved["command"]
    else:
        t0 = time.perf_counter()
        raw = measure(args)
        wall = time.perf_counter() - t0
        command = " ".join(["python", "bench/restart.py", *sys.argv[1:]])
        if args.json:  # the marks first: a summary that fails can be redone with --tables-from
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"command": command, "wall_s": wall, "args": vars(args),
                                                   "raw": raw}, indent=1, default=str))
    results = [summarise(r["model"], r["launches"], r["online_job"]) for r in raw]
    print(f"{command}: CPU processes (gloo), wall {wall:.0f}s")
    for table in (table_restart, table_phases, table_first_steps, table_scale_out, table_joiners):
        print(table(results))
        print()
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "wall_s": wall, "args": vars(args),
                                               "results": results, "raw": raw}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
