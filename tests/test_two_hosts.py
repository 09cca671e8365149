"""Two hosts rehearsed on one machine: two network namespaces joined by a veth pair, each with its own address.

One torchrun agent per host with `--rdzv-backend dynatrain`: the agent on host A serves the job's store at the
endpoint, the agent on host B joins it, and the two start the job. A second agent on host B arrives while the job
trains: its worker is admitted online (2 -> 3 processes), and the recipe's trace scales the job back to 2; the
strategy verifies every switch bitwise (``switching.verify_switches``). Needs root (network namespaces); skipped elsewhere.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from _launch import python_path

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).parent / "workers"
IP = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
STORE_PORT = 29400  # free in namespaces this test has just created
JOB_TIMEOUT = 240.0


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str  # the veth end inside the namespace: gloo binds to it (GLOO_SOCKET_IFNAME)
    addr: str

    def cmd(self, *argv: str) -> list[str]:
        return [IP, "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213-10.220 that no address or route of this machine overlaps."""
    shown = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    taken = [ipaddress.ip_network(m, strict=False) for m in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", shown)]
    for second in range(213, 221):
        net = ipaddress.ip_network(f"10.{second}.0.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    pytest.skip("two-host rehearsal: every 10.213-10.220 /24 subnet is in use on this machine")


@pytest.fixture
def two_hosts():
    if IP is None:
        pytest.skip("two-host rehearsal: the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("two-host rehearsal: creating network namespaces needs root (run `make test` as root)")
    tag = f"dt{os.getpid()}"
    net = _free_subnet()
    a_addr, b_addr = (str(net.network_address + i) for i in (1, 2))
    a = Host(f"{tag}a", f"{tag}va", a_addr)
    b = Host(f"{tag}b", f"{tag}vb", b_addr)
    setup = [("netns", "add", a.netns), ("netns", "add", b.netns),
             ("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname),
             ("link", "set", a.ifname, "netns", a.netns), ("link", "set", b.ifname, "netns", b.netns),
             ("-n", a.netns, "addr", "add", f"{a.addr}/{net.prefixlen}", "dev", a.ifname),
             ("-n", b.netns, "addr", "add", f"{b.addr}/{net.prefixlen}", "dev", b.ifname),
             ("-n", a.netns, "link", "set", "lo", "up"), ("-n", b.netns, "link", "set", "lo", "up"),
             ("-n", a.netns, "link", "set", a.ifname, "up"), ("-n", b.netns, "link", "set", b.ifname, "up")]
    try:
        for i, args in enumerate(setup):
            done = _ip(*args)
            if done.returncode != 0:
                msg = f"`ip {' '.join(args)}` failed: {done.stderr.strip()}"
                if i == 0:  # no namespace may be created here (a container without CAP_NET_ADMIN, say)
                    pytest.skip(f"two-host rehearsal: network namespaces are not permitted here: {msg}")
                raise AssertionError(msg)
        yield a, b
    finally:
        for host in (a, b):
            _ip("netns", "delete", host.netns)  # takes the veth end inside it along
        _ip("link", "delete", a.ifname)  # only still here when the set-up stopped before moving it
        left = _ip("netns", "list").stdout + _ip("link", "show").stdout
        assert tag not in left, f"the rehearsal's namespaces or veth pair are still there:\n{left}"


def _recipe(tmp_path: Path) -> Path:
    """The debug elastic recipe, small: one process per host at start, no num_nodes (torchrun says the world), the
    scale-out left to the arriving node (its trace entry only holds training at step 2 until the worker is ready),
    a scale-in to 2 at step 4, switches verified."""
    cfg = yaml.safe_load((REPO / "recipes/llama-debug-elastic.yaml").read_text())
    trainer = cfg["trainer"]
    trainer.update(devices=1, max_steps=6, log_every_n_steps=1, default_root_dir=str(tmp_path / "run"))
    trainer.pop("num_nodes", None)
    strategy = trainer["strategy"]["init_args"]
    strategy.update(parallel="auto", switching={**strategy.get("switching", {}), "verify_switches": True},
                    elastic={"max_devices": 3, "join_timeout": 120.0, "timeout": 60.0})
    elastic = next(c for c in trainer["callbacks"] if c["class_path"].endswith("ElasticCallback"))
    elastic["init_args"].update(trace=[{"step": 2, "devices": 3, "wait": True}, {"step": 4, "devices": 2}],
                                max_devices=3)
    # The trace's callback and the step printer only: snapshots or a reference run would only add time here.
    trainer["callbacks"] = [c for c in trainer["callbacks"] if c["class_path"].endswith(("ElasticCallback",
                                                                                       "StepPrinter"))]
    trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                          "init_args": {"save_dir": str(tmp_path / "run"), "name": "csv"}}]
    cfg["model"]["model_overrides"] = {"n_layers": 2}
    cfg["data"].update(seq_len=64, global_batch_size=12, micro_batch_size=1, max_corpus_bytes=400_000)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Processes:
    """The processes of the rehearsal, each in a session of its own (torchrun's workers included), logged to files."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.finished: set[str] = set()

    def start(self, name: str, cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tails(self, chars: int = 2500) -> str:
        return "\n".join(f"----- {n} (status {p.poll()}):\n{self.log(n)[-chars:]}" for n, p in self.procs.items())

    def wait(self, names: list[str], deadline: float, until=None) -> None:
        """Until every process of ``names`` has exited, or ``until()`` holds. Fails at once when a process exits
        with an error, or one not waited for exits (any of ``names`` too while ``until`` does not hold yet)."""
        while not (until() if until else all(self.procs[n].poll() is not None for n in names)):
            failed = [n for n, p in self.procs.items() if p.poll() not in (None, 0)]
            gone = [n for n, p in self.procs.items()
                    if p.poll() is not None and n not in self.finished and (until or n not in names)]
            assert not failed and not gone, f"{failed or gone} exited (waiting for {names})\n{self.tails()}"
            assert time.monotonic() < deadline, f"{names} not done in time\n{self.tails()}"
            time.sleep(0.1)
        if not until:
            self.finished.update(names)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            proc.wait(timeout=30)


def test_a_job_scales_across_two_hosts_with_one_torchrun_agent_per_host(two_hosts, tmp_path):
    a, b = two_hosts
    venv_bin = Path(sys.executable).parent
    token_file = tmp_path / "token"
    token_file.write_text("two-hosts-" + os.urandom(8).hex())
    recipe = _recipe(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DYNATRAIN_", "TORCHELASTIC_")) and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    base.update(PYTHONPATH=python_path(REPO, WORKERS), OMP_NUM_THREADS="1", WANDB_MODE="offline",
                PYTHONUNBUFFERED="1")
    env = {host: dict(base, GLOO_SOCKET_IFNAME=host.ifname) for host in (a, b)}

    def agent(host: Host) -> list[str]:
        # Host A's agent serves the store at the endpoint (its address is A's own, which torch's host-name match
        # does not see inside a namespace: say so).
        return host.cmd(str(venv_bin / "torchrun"), "--nnodes", "2:3", "--nproc-per-node", "1",
                        "--rdzv-backend", "dynatrain", "--rdzv-endpoint", f"{a.addr}:{STORE_PORT}", "--rdzv-id",
                        "two-hosts", "--rdzv-conf", f"token_file={token_file},is_host={int(host is a)}",
                        "--local-addr", host.addr, "-m", "dynatrain.cli", "fit", "--config", str(recipe))

    procs = Processes(tmp_path)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        procs.start("agent_a", agent(a), env[a], tmp_path)
        procs.start("agent_b", agent(b), env[b], tmp_path)
        # The job trains before the second agent of host B arrives: it joins the running job.
        procs.wait(["agent_a"], deadline, until=lambda: "training on 2 process(es)" in procs.log("agent_a"))
        procs.start("agent_b2", agent(b), env[b], tmp_path)
        procs.wait(["agent_a", "agent_b", "agent_b2"], deadline)
        failed = {n: p.returncode for n, p in procs.procs.items() if p.returncode != 0}
        assert not failed, f"{failed}\n{procs.tails()}"
    finally:
        procs.stop_all()

    jsonl = list((tmp_path / "run").rglob("switches.jsonl"))
    assert len(jsonl) == 1, procs.tails()
    records = [json.loads(line) for line in jsonl[0].read_text().splitlines()]
    assert [(r["old_world_size"], r["world_size"]) for r in records] == [(2, 3), (3, 2)], procs.tails()
    assert all(r["verified"] is True for r in records), records
    logs = "".join(procs.log(n) for n in procs.procs)
    assert logs.count("verified bitwise") == 2, procs.tails()
