"""Stock torchrun with `--rdzv-backend dynatrain`: nodes arrive, leave and fail while a user's script trains, and no
running worker restarts. The script (tests/workers/torchrun_lm.py) is a stock Hugging Face causal LM in a plain
LightningModule with its own DataLoader and no line for elasticity; the reference is the same job on the first
two processes throughout, and every step's global loss must equal it within 1e-5 relative."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _launch import python_path
from dynatrain.launch.local import kill_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "workers" / "torchrun_lm.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
REFERENCE_STEPS = 60


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Agents of one job on loopback, each a torchrun of its own (a "node"), and what their workers recorded."""

    def __init__(self, tmp_path: Path, backend: str = "dynatrain", nnodes: str = "2:3", nproc: int = 1,
                 extra: tuple[str, ...] = (), script_args: tuple[str, ...] = ()) -> None:
        self.dir, self.out = tmp_path, tmp_path / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.cmd = [TORCHRUN, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
                    "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "job", "--monitor-interval", "0.2",
                    *extra, str(SCRIPT), "--out", str(self.out), *script_args]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DYNATRAIN_", "TORCHELASTIC_"))}
        self.env.update(PYTHONPATH=python_path(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.agents: list[subprocess.Popen] = []
        self.control({"sleep": 0.3})

    def control(self, value: dict) -> None:
        tmp = self.out / "control.json.tmp"
        tmp.write_text(json.dumps(value))
        tmp.replace(self.out / "control.json")

    def start(self) -> subprocess.Popen:
        log = open(self.dir / f"agent{len(self.agents)}.log", "w")
        agent = subprocess.Popen(self.cmd, env=self.env, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        log.close()
        self.agents.append(agent)
        return agent

    def serving(self) -> bool:
        """The first agent serves the job's store at the endpoint (start the others after it, so it is that one)."""
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start_first(self) -> subprocess.Popen:
        agent = self.start()
        self.wait_until(self.serving, "the first agent serving the store", timeout=60)
        return agent

    def losses(self) -> list[dict]:
        path = self.out / "losses.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def workers(self) -> dict[int, list[dict]]:
        """pid -> the steps that worker trained (its records), for every worker that trained."""
        return {int(p.stem.split("-")[1]): [json.loads(x) for x in p.read_text().splitlines()]
                for p in self.out.glob("pid-*.jsonl")}

    def ends(self) -> dict[int, dict]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in self.out.glob("end-*.json")}

    def logs(self) -> str:
        return "\n".join(f"----- agent {i} (status {a.poll()}):\n"
                         + (self.dir / f"agent{i}.log").read_text(errors="replace")[-4000:]
                         for i, a in enumerate(self.agents))

    def wait_until(self, condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [i for i, a in enumerate(self.agents) if a.poll() not in (None, 0)]
            assert not failed, f"agents {failed} failed while waiting for {what}\n{self.logs()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s\n{self.logs()}"
            time.sleep(0.2)

    def step_reached(self, step: int, world: int | None = None) -> bool:
        return any(r["step"] >= step and (world is None or r["world"] == world) for r in self.losses())

    def stop_after(self, steps_more: int) -> int:
        """End the run ``steps_more`` steps after the last one recorded, at full speed; the last step."""
        stop = self.losses()[-1]["step"] + steps_more
        self.control({"sleep": 0, "stop_at": stop})
        return stop

    def finish(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for i, agent in enumerate(self.agents):
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {i} did not finish within {timeout:.0f}s\n{self.logs()}") from None

    def kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_group(agent.pid)
                agent.wait()


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def make(name: str = "job", **kwargs) -> Job:
        jobs.append(Job(tmp_path / name, **kwargs))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The same job without any change: two processes under one agent, at full speed; step -> global loss."""
    ref = Job(tmp_path_factory.mktemp("reference"), nnodes="1", nproc=2,
              script_args=("--max-steps", str(REFERENCE_STEPS)))
    try:
        ref.control({"sleep": 0})
        ref.start()
        ref.finish(timeout=180)
        assert ref.agents[0].returncode == 0, ref.logs()
        return {r["step"]: r["loss"] for r in ref.losses()}
    finally:
        ref.kill()


def _assert_losses_equal(switched: list[dict], reference: dict[int, float]) -> None:
    steps = [r["step"] for r in switched]
    assert steps == list(range(1, len(steps) + 1)), f"steps trained: {steps}"
    for r in switched:
        ref = reference[r["step"]]
        assert abs(r["loss"] - ref) <= 1e-5 * abs(ref), (r, ref)


def test_a_node_arrives_and_one_leaves_online_and_the_loss_equals_the_run_without_them(job, reference):
    """Two agents start the job; a third arrives and its worker is admitted at a step boundary; SIGTERM to the second
    makes its worker leave at the next boundary and the agent exit 0 within torchrun's grace. No worker restarts."""
    switched = job("switched")
    first = switched.start_first()
    second = switched.start()
    switched.wait_until(lambda: switched.step_reached(3), "step 3 on two processes")
    third = switched.start()
    switched.wait_until(lambda: switched.step_reached(1, world=3), "the third node's worker admitted")
    assert first.poll() is None and second.poll() is None
    sent = time.monotonic()
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=60)
    left_in = time.monotonic() - sent
    assert second.returncode == 0, switched.logs()
    assert left_in < 30, f"the agent took {left_in:.1f}s to leave: more than torchrun's default grace"
    switched.wait_until(lambda: switched.losses()[-1]["world"] == 2, "the scale-in")
    last = switched.stop_after(3)
    switched.finish()
    assert [a.returncode for a in switched.agents] == [0, 0, 0], switched.logs()
    assert third.returncode == 0

    losses = switched.losses()
    assert losses[-1]["step"] == last
    worlds = [r["world"] for r in losses]
    assert 3 in worlds and worlds[0] == 2 and worlds[-1] == 2
    # Three workers in all, one per agent, none restarted: the first agent's trained every step.
    workers = switched.workers()
    assert len(workers) == 3, sorted(workers)
    assert all(r["restarts"] == "0" for records in workers.values() for r in records)
    steps_of = {pid: [r["step"] for r in records] for pid, records in workers.items()}
    [throughout] = [pid for pid, steps in steps_of.items() if steps == list(range(1, last + 1))]
    joined = [r for records in workers.values() for r in records[:1] if r["step"] > 1]
    assert len(joined) == 1 and joined[0]["world"] == 3, joined  # the arrival, admitted mid-run
    ends = switched.ends()
    assert sorted(e["detached"] for e in ends.values()) == [False, False, True]
    switches = ends[throughout]["switches"]
    assert [(s["world_from"], s["world_to"]) for s in switches] == [(2, 3), (3, 2)], switches
    assert all(s["verified"] for s in switches)

    _assert_losses_equal(losses, reference)


def test_a_killed_worker_is_restarted_by_torchrun_and_rejoins_the_running_job(job, reference):
    """SIGKILL of one worker of a layout that keeps every shard twice: the survivor rebuilds the state from the
    replicas in memory and trains on; torchrun restarts the dead worker (``--max-restarts 1``), and the new process
    joins the running job instead of starting a new one."""
    run = job("killed", extra=("--max-restarts", "1"), script_args=("--parallel", "dp_replicate=2"))
    run.start_first()
    second = run.start()
    run.wait_until(lambda: run.step_reached(3), "step 3 on two processes")
    [victim] = [pid for pid, records in run.workers().items() if records[0]["rdzv_rank"] == "1"]
    os.kill(victim, signal.SIGKILL)
    run.wait_until(lambda: any(r["restarts"] == "1" and r["world"] == 2 for records in run.workers().values()
                               for r in records), "the restarted worker admitted", timeout=180)
    last = run.stop_after(2)
    run.finish()
    assert [a.returncode for a in run.agents] == [0, 0], run.logs()
    assert second.returncode == 0
    losses = run.losses()
    assert losses[-1]["step"] == last
    assert 1 in [r["world"] for r in losses] and losses[-1]["world"] == 2  # on the survivor alone, then two again
    workers = run.workers()
    assert len(workers) == 3 and victim in workers
    [rejoined] = [pid for pid, records in workers.items() if records[0]["restarts"] == "1"]
    assert workers[rejoined][0]["step"] > 3  # it joined the running job, at its step
    [survivor] = [pid for pid in workers if pid not in (victim, rejoined)]
    assert [r["step"] for r in workers[survivor]] == list(range(1, last + 1))
    _assert_losses_equal(losses, reference)


def test_under_torchrun_s_c10d_backend_the_same_arrival_stops_every_running_worker(job):
    """Side by side: stock torchrun's c10d backend answers the same arrival by stopping every running worker to start
    the whole group again (`num_nodes_waiting() > 0`): the progress since the last checkpoint is lost, and on this
    machine the re-rendezvous that should follow fails (torch 2.13; docs/launchers.md). The dynatrain backend exists
    to avoid exactly this."""
    run = job("c10d", backend="c10d", extra=("--rdzv-conf", "last_call_timeout=1"))
    run.start_first()
    run.start()
    run.wait_until(lambda: run.step_reached(3), "step 3 on two processes")
    first_workers = set(run.workers())
    assert len(first_workers) == 2
    run.start()

    def stopped_by_their_agents() -> bool:
        logs = "".join((run.dir / f"agent{i}.log").read_text(errors="replace") for i in range(2))
        return all(f"Sending process {pid} closing signal SIGTERM" in logs for pid in first_workers)

    run.wait_until(stopped_by_their_agents, "the running workers stopped by their agents", timeout=120)
    for pid in first_workers:
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"worker {pid} still runs after its agent stopped it"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
