"""A node that arrives under stock torchrun: training time it costs with the dynatrain rendezvous backend (an online
scale-out) against torchrun's own way (stop every worker, start the group again, resume from a checkpoint).

    python bench/launchers.py --model 125m --json bench/results/launchers/125m.json

Every way starts one agent per "node" on this machine (``--nproc-per-node 1``, `bench/_torchrun_worker.py`): two
train, and a third arrives after ``--warmup`` steps.

* **dynatrain**: ``--rdzv-backend dynatrain``; the third node's worker gets ready while the two train on and is
  admitted at a step boundary.
* **c10d**: ``--rdzv-backend c10d``, the arrival as it is: torchrun stops the running workers and re-forms the group.
  On torch 2.13 here its re-rendezvous never completes (the agents wait for each other's rank assignment until the
  store's read timeout, then fail), so the job is lost; recorded are the seconds from the arrival until the running
  workers were stopped and until the agents gave up.
* **restart**: the best torchrun's restart could do had it completed: at the arrival every worker saves a checkpoint
  (DCP) and the two agents stop; three fresh agents (c10d) start the job again and resume from it.

**Lost time** of the arrival at ``T0`` (the third agent's start), as in `bench/lost_time.py`:
``T(end of step k+m) - T0 - m * median step of the new world``, ``k`` the last step ended before ``T0``, ``k+m`` the
``--after``-th step on three processes, the median over the ``--steady`` steps after it; ``lost_at_own_rate_s``
charges each step in between at the median of the world it ran on instead. Marks are rank 0's ``time.time()``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynatrain.launch.local import kill_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = str(HERE / "_torchrun_worker.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """torchrun agents of one job on this machine, logged to files under ``out``."""

    def __init__(self, out: Path, backend: str, worker_args: list[str], rdzv_conf: str = "") -> None:
        self.out, self.port = out, free_port()
        out.mkdir(parents=True, exist_ok=True)
        self.cmd = [TORCHRUN, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", backend,
                    "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "bench", "--monitor-interval", "0.2",
                    *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []), WORKER, "--out", str(out), *worker_args]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DYNATRAIN_", "TORCHELASTIC_"))}
        self.env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline")
        self.agents: list[subprocess.Popen] = []

    def start(self) -> float:
        with open(self.out / f"agent{len(self.agents)}.log", "w") as log:
            self.agents.append(subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True))
        return time.time()

    def serving(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def control(self, **value) -> None:
        tmp = self.out / "control.json.tmp"
        tmp.write_text(json.dumps(value))
        tmp.replace(self.out / "control.json")

    def marks(self) -> list[dict]:
        path = self.out / "marks.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def log(self, i: int) -> str:
        return (self.out / f"agent{i}.log").read_text(errors="replace")

    def wait(self, condition, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f}s:\n" + "\n".join(
                    self.log(i)[-2000:] for i in range(len(self.agents))))
            time.sleep(0.1)

    def start_two(self, warmup: int, timeout: float) -> None:
        """The first two nodes (the first serves the store), trained to step ``warmup``."""
        self.start()
        self.wait(self.serving, "store", 120)
        self.start()
        self.wait(lambda: any(m["step"] >= warmup for m in self.marks()), "warm-up", timeout)

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_group(agent.pid)
                agent.wait()


def lost_time(marks: list[dict], t0: float, after: int, steady: int) -> dict:
    before = [m for m in marks if m["t"] < t0]
    k = before[-1]["step"] if before else 0
    new = [m for m in marks if m["world"] == 3]
    end = new[after - 1]
    tail = new[after - 1:after + steady]
    median = statistics.median(b["t"] - a["t"] for a, b in zip(tail, tail[1:]))
    old = [m for m in marks if m["world"] == 2]
    old_steps = [b["t"] - a["t"] for a, b in zip(old, old[1:]) if b["step"] == a["step"] + 1]
    m = end["step"] - k
    # The same, with each step between charged at the median of the world it ran on (old steps are not free when
    # the new world's steps are slower, as three processes on two cores are).
    median_old = statistics.median(old_steps) if old_steps else median
    on_old = sum(1 for x in marks if k < x["step"] <= end["step"] and x["world"] == 2)
    at_own_rate = end["t"] - t0 - on_old * median_old - (m - on_old) * median
    return {"k": k, "m": m, "lost_s": end["t"] - t0 - m * median, "lost_at_own_rate_s": at_own_rate,
            "median_step_new_s": median,
            "median_step_old_s": statistics.median(old_steps) if old_steps else None,
            "first_step_on_three": new[0]["step"], "steps_during_arrival": new[0]["step"] - 1 - k}


def run_dynatrain(args, out: Path) -> dict:
    nodes = Nodes(out, "dynatrain", worker_args(args))
    try:
        nodes.start_two(args.warmup, args.timeout)
        t0 = nodes.start()
        nodes.wait(lambda: sum(m["world"] == 3 for m in nodes.marks()) >= args.after + args.steady + 1,
                   "steps on three processes", args.timeout)
        nodes.control(stop_at=nodes.marks()[-1]["step"] + 1)
        for a in nodes.agents:
            a.wait(timeout=args.timeout)
        marks = nodes.marks()
        switches = [json.loads(x) for x in (out / "switches.jsonl").read_text().splitlines()] \
            if (out / "switches.jsonl").exists() else []
        return {"way": "dynatrain", "t0": t0, "exit_codes": [a.returncode for a in nodes.agents], "marks": marks,
                "switches": switches, **lost_time(marks, t0, args.after, args.steady)}
    finally:
        nodes.stop()


def run_c10d(args, out: Path) -> dict:
    nodes = Nodes(out, "c10d", worker_args(args), rdzv_conf="last_call_timeout=1")
    try:
        nodes.start_two(args.warmup, args.timeout)
        t0 = nodes.start()
        nodes.wait(lambda: all("closing signal SIGTERM" in nodes.log(i) for i in range(2)), "workers stopped", 120)
        stopped = time.time() - t0
        deadline = time.monotonic() + args.c10d_patience
        while time.monotonic() < deadline and not any(m["world"] == 3 for m in nodes.marks()) \
                and any(a.poll() is None for a in nodes.agents[:2]):
            time.sleep(0.2)
        resumed = any(m["world"] == 3 for m in nodes.marks())
        gave_up = [a.poll() for a in nodes.agents]
        return {"way": "c10d", "t0": t0, "workers_stopped_after_s": stopped, "resumed": resumed,
                "agents_exit_codes_after_patience": gave_up, "ended_after_s": time.time() - t0,
                "marks": nodes.marks()}
    finally:
        nodes.stop()


def run_restart(args, out: Path) -> dict:
    first = Nodes(out / "first", "c10d", worker_args(args), rdzv_conf="last_call_timeout=1")
    second = Nodes(out / "second", "c10d", [*worker_args(args), "--resume", str(out / "first" / "ckpt")],
                   rdzv_conf="last_call_timeout=1")
    try:
        first.start_two(args.warmup, args.timeout)
        # The arrival, at a step boundary: every worker saves, then torchrun's restart stops them all.
        t0 = time.time()
        first.control(save_at=first.marks()[-1]["step"] + 1, stop_at=first.marks()[-1]["step"] + 1)
        for a in first.agents:
            a.wait(timeout=args.timeout)
        second.start()
        second.wait(second.serving, "store", 120)
        second.start()
        second.start()
        second.wait(lambda: len(second.marks()) >= args.after + args.steady + 1, "steps after the restart",
                    args.timeout)
        second.control(stop_at=second.marks()[-1]["step"] + 1)
        for a in second.agents:
            a.wait(timeout=args.timeout)
        marks = first.marks() + second.marks()
        return {"way": "restart", "t0": t0, "marks": marks, **lost_time(marks, t0, args.after, args.steady)}
    finally:
        first.stop()
        second.stop()


def worker_args(args) -> list[str]:
    return ["--model", args.model, "--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch),
            "--micro-batch", str(args.micro_batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125m")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--after", type=int, default=2, help="k+m is the this-many-th step on three processes")
    ap.add_argument("--steady", type=int, default=4)
    ap.add_argument("--ways", default="dynatrain,c10d,restart")
    ap.add_argument("--c10d-patience", type=float, default=150.0,
                    help="seconds to wait for torchrun's c10d restart to train again")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runners = {"dynatrain": run_dynatrain, "c10d": run_c10d, "restart": run_restart}
    results = []
    with tempfile.TemporaryDirectory(prefix="dynatrain-launchers-") as tmp:
        for way in args.ways.split(","):
            result = runners[way](args, Path(tmp) / way)
            results.append(result)
            shown = {k: v for k, v in result.items() if k != "marks"}
            print(json.dumps(shown), flush=True)
    by_way = {r["way"]: r for r in results}
    summary = {}
    if "dynatrain" in by_way and "restart" in by_way:
        summary["online_over_restart"] = by_way["dynatrain"]["lost_s"] / by_way["restart"]["lost_s"]
    print(json.dumps({"summary": summary}))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args) | {
            "json": str(args.json)}, "results": results, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
