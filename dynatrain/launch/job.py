"""`dynatrain fit --elastic.max_devices M ...`: run a recipe as an elastic job on this machine.

The launcher starts the job's store (a process of its own, so any rank may leave), the initial members (one
process per device, as torchrun would) and a standby pool of joiners that wait, already set up, for a
scale-out. A member that leaves exits with status 0; its slot in the pool is refilled with a fresh joiner while
the job runs. Across machines, start the members with torchrun or SLURM variables and
``$DYNATRAIN_ENDPOINT``/``$DYNATRAIN_TOKEN``, and add processes with `dynatrain join` (``--device`` or
``$LOCAL_RANK`` picks its GPU).

Every process it starts gets a device of its own, as torchrun's workers do: ``$LOCAL_RANK``, an index among the
visible GPUs (torchrun sets no ``CUDA_VISIBLE_DEVICES``; Lightning trains a member on ``cuda:$LOCAL_RANK``). A
member's is its rank; a standby process's is the lowest index no live process of the job holds, which
`dynatrain join` makes its only visible GPU. A process keeps its device for its life, through leaving and
waiting again as a standby, so two processes never share one: at most ``max_devices`` run at once, one per index
below it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from dynatrain.elastic.manager import FINISHED_KEY, initial_member
from dynatrain.elastic.priority import DEFAULT_STANDBY_NICE, check_amount
from dynatrain.runtime.threads import launch_env
from dynatrain.settings import ELASTIC_ENV, ENDPOINT_ENV, REJOIN_ENV, TOKEN_ENV

OPTIONS = {"max_devices": int, "devices": int, "standby": int, "join_timeout": float, "timeout": float,
           "host": str, "workdir": str, "restarts": int, "standby_nice": int}
JOB_ARGV_KEY = "elastic/job_argv"


def split_elastic_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Take ``--elastic.NAME VALUE`` (or ``=VALUE``) out of a LightningCLI command line."""
    opts: dict = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--elastic."):
            name, eq, value = arg[len("--elastic."):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            if name not in OPTIONS:
                raise ValueError(f"unknown option --elastic.{name}; known: "
                                 + ", ".join(f"--elastic.{k}" for k in OPTIONS))
            try:
                opts[name] = OPTIONS[name](value)
            except ValueError:
                raise ValueError(f"--elastic.{name} takes a {OPTIONS[name].__name__}, got {value!r}") from None
        else:
            rest.append(arg)
        i += 1
    return opts, rest


def member_env(env: dict[str, str], rank: int, devices: int) -> dict[str, str]:
    """The environment of initial member ``rank`` of ``devices``: its identity and its device, as torchrun's."""
    out = dict(env, RANK=str(rank), WORLD_SIZE=str(devices), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(devices),
               NODE_RANK="0")
    return launch_env(out, devices)


def standby_env(env: dict[str, str], device: int) -> dict[str, str]:
    """The environment of a standby process (`dynatrain join`) on local device ``device``: no rank (the job gives
    it one when it admits it), one thread while it waits (its share once admitted)."""
    out = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    out["LOCAL_RANK"] = str(device)
    return launch_env(out, 1, start=1)


def free_device(taken: Iterable[int], devices: int) -> int:
    """The lowest local device index below ``devices`` that no live process holds."""
    held = set(taken)
    for d in range(devices):
        if d not in held:
            return d
    raise RuntimeError(f"every one of the {devices} local devices is held by a live process ({sorted(held)}): "
                       "no standby process can start until one ends")


def _config_devices(argv: list[str]) -> int | None:
    """trainer.devices from the recipe (--config) or the command line, when it is a number."""
    import yaml

    devices = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            cfg = yaml.safe_load(Path(argv[i + 1]).read_text()) or {}
            devices = (cfg.get("trainer") or {}).get("devices", devices)
        elif arg.startswith("--trainer.devices"):
            devices = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return int(devices) if devices is not None else None
    except (TypeError, ValueError):
        return None


class ElasticLauncher:
    def __init__(self, opts: dict, argv: list[str]) -> None:
        for name in ("devices", "max_devices"):
            if name in opts and opts[name] < 1:
                raise ValueError(f"--elastic.{name} must be at least 1, got {opts[name]}: a job cannot run on no "
                                 "device")
        self.devices = opts.get("devices") or _config_devices(argv) or 1
        self.store = None  # the job's, while it runs
        self.max_devices = opts.get("max_devices") or self.devices
        if self.devices > self.max_devices:
            raise ValueError(f"--elastic.devices {self.devices} is above --elastic.max_devices {self.max_devices}")
        self.standby = opts.get("standby", 0)
        if self.standby < 0:
            raise ValueError(f"--elastic.standby must be >= 0, got {self.standby}")
        standby_nice = check_amount(opts.get("standby_nice", DEFAULT_STANDBY_NICE), "--elastic.standby_nice")
        self.restarts = opts.get("restarts", 1)
        if self.restarts < 0:
            raise ValueError(f"--elastic.restarts must be >= 0, got {self.restarts}")
        self.argv = argv
        self.workdir = Path(opts.get("workdir") or "runs/.elastic")
        self.host = opts.get("host", "127.0.0.1")
        self.config = {"max_devices": self.max_devices, "join_timeout": opts.get("join_timeout", 300.0),
                       "timeout": opts.get("timeout", 120.0), "standby_nice": standby_nice}
        # pid -> (process, "member" | "standby" | "leaving"), the rank of each process started as a member, and
        # each process's local device (`free_device`)
        self.procs: dict[int, tuple[subprocess.Popen, str]] = {}
        self.ranks: dict[int, int] = {}
        self.devices_of: dict[int, int] = {}

    def run(self) -> int:
        """Run the job; after a fault its processes could not recover from in memory, start it again from its
        latest committed snapshot on the processes still there (at most ``restarts`` times)."""
        from dynatrain.callbacks.snapshot import latest_snapshot

        devices, resume = self.devices, None
        for attempt in range(self.restarts + 1):
            rc, left, snapshots = self._run_once(devices, resume)
            latest = latest_snapshot(snapshots) if snapshots else None
            if rc == 0 or attempt == self.restarts or latest is None or left < 1:
                if rc and latest is None:
                    print("dynatrain elastic job: no committed snapshot to restart from (add the "
                          "dynatrain.callbacks.Snapshot callback)", file=sys.stderr, flush=True)
                return rc
            devices, resume = min(left, self.max_devices), str(latest)
            print(f"dynatrain elastic job: restarting on {devices} processes from snapshot {latest} "
                  f"(restart {attempt + 1} of {self.restarts})", flush=True)
        return 1

    def _run_once(self, devices: int, resume: str | None) -> tuple[int, int, str | None]:
        """One life of the job: its store, members and standby pool. Returns (status, processes still there,
        the snapshot directory the job announced)."""
        from dynatrain.callbacks.snapshot import SNAPSHOTS_KEY
        from dynatrain.elastic.store import connect, start_store

        self.workdir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        token_file = self.workdir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        store_proc = start_store(token, self.workdir, host=self.host)
        store = self.store = connect(store_proc.endpoint, token)
        argv = [*self.argv, "--trainer.devices", str(devices)]
        if resume is not None:
            # The layout the job had may not fit the processes left: let the strategy pick one for them.
            argv += ["--ckpt_path", resume, "--trainer.strategy.init_args.parallel", "auto"]
        store.set(JOB_ARGV_KEY, json.dumps(self.argv))
        self.env = {**os.environ, ENDPOINT_ENV: store_proc.endpoint, TOKEN_ENV: token,
                    ELASTIC_ENV: json.dumps(self.config), "PYTHONUNBUFFERED": "1"}
        if self.standby:
            self.env[REJOIN_ENV] = "1"  # a process that leaves stays as a standby instead of exiting
        print(f"dynatrain elastic job: store {store_proc.endpoint}, {devices} processes, up to "
              f"{self.max_devices}; add one with: dynatrain join --endpoint {store_proc.endpoint} "
              f"--token-file {token_file}", flush=True)
        self.procs, self.ranks, self.devices_of = {}, {}, {}
        try:
            for rank in range(devices):
                self._start_member(rank, devices, argv)
            self._refill()
            rc = self._watch(store)
            left = self._wind_down() if rc else devices
            snapshots = store.get(SNAPSHOTS_KEY).decode() if store.check([SNAPSHOTS_KEY]) else None
            return rc, left, snapshots
        finally:
            for proc, _ in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc, _ in self.procs.values():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            store_proc.stop()

    def _wind_down(self) -> int:
        """After a failure: give the members the elastic timeout to stop on their own (they raise a clear error
        once a peer is gone), then count those that are still there, i.e. not killed from outside."""
        deadline = time.monotonic() + self.config["timeout"] + 30
        members = [p for p, k in self.procs.values() if k == "member"]
        while any(p.poll() is None for p in members) and time.monotonic() < deadline:
            time.sleep(0.5)
        return sum(1 for p in members if p.poll() is None or p.returncode >= 0)

    def _start_member(self, rank: int, devices: int, argv: list[str]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "dynatrain.cli", *argv], env=member_env(self.env, rank, devices))
        self.procs[proc.pid] = (proc, "member")
        self.ranks[proc.pid] = self.devices_of[proc.pid] = rank

    def _start_standby(self) -> None:
        """A process that waits to join: exactly what `dynatrain join` starts on another machine, on a device no
        live process of the job holds."""
        device = free_device((self.devices_of[p.pid] for p in self._alive()), self.max_devices)
        proc = subprocess.Popen([sys.executable, "-m", "dynatrain.cli", "join"], env=standby_env(self.env, device))
        self.procs[proc.pid] = (proc, "standby")
        self.devices_of[proc.pid] = device
        print(f"dynatrain elastic job: standby process {proc.pid} started on local device {device}", flush=True)

    def _alive(self, kind: str | None = None) -> list[subprocess.Popen]:
        return [p for p, k in self.procs.values() if p.poll() is None and (kind is None or k == kind)]

    def _refill(self) -> None:
        finished = self.store is not None and self.store.check([FINISHED_KEY])
        if finished or any(p.poll() == 0 for p, k in self.procs.values() if k == "member"):
            return  # training ended (a standby that waited exits): the job is ending, no process will join it any more
        while len(self._alive("standby")) < self.standby and len(self._alive()) < self.max_devices:
            self._start_standby()

    def _state(self, store, pid: int) -> str | None:
        """Where a process stands, from its latest member id in the store: "admitted", "waiting" (a registered
        joiner), "left" (it left the world and has not registered again yet), or None (nothing to change)."""
        ids = [f"{n:06d}-{pid}" for n in range(store.add("elastic/joiner_seq", 0), 0, -1)]
        rank = self.ranks.get(pid)
        if rank is not None:
            ids.append(initial_member(rank))
        for member in ids:
            if store.check([f"registry/info/{member}"]):
                if store.check([f"registry/left/{member}"]):
                    return "left"
                started_with_the_job = rank is not None and member == initial_member(rank)
                return "admitted" if started_with_the_job or store.check([f"admit/{member}"]) else "waiting"
        return None

    def _watch(self, store) -> int:
        while True:
            for pid, (proc, kind) in list(self.procs.items()):
                if proc.poll() is not None:
                    continue
                state = self._state(store, pid)
                if kind != "member" and state == "admitted":
                    self.procs[pid] = (proc, "member")
                elif state == "waiting":
                    self.procs[pid] = (proc, "standby")  # new, or a member that left and waits to join again
                elif kind == "member" and state == "left":
                    # Between leaving and registering again: neither a member the job waits for nor a standby.
                    self.procs[pid] = (proc, "leaving")
            members = [(p, k) for p, k in self.procs.values() if k == "member"]
            failed = [p for p, _ in members if p.poll() not in (None, 0)]
            if failed:
                print(f"dynatrain elastic job: process {failed[0].pid} failed with status {failed[0].returncode}; "
                      "stopping the job", file=sys.stderr, flush=True)
                return 1
            if all(p.poll() is not None for p, _ in members):
                return 0
            self._refill()
            time.sleep(0.5)
