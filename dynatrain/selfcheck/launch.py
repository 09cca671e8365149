"""Start an elastic selfcheck run on this machine: the job's store, the first world's ranks, and the joiners.

Joiners start with the job and wait for admission (``DYNATRAIN_JOIN=1``); each scale-out admits as many as it
needs. Processes that leave exit, so every process added later is a new one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from dynatrain.elastic.manager import ENDPOINT_ENV, JOIN_ENV, TOKEN_ENV
from dynatrain.elastic.store import start_store
from dynatrain.launcher import LaunchError, launch_local


def joiners_needed(worlds: list[int]) -> int:
    """New processes a sequence of world sizes needs: every increase, since leavers do not come back."""
    return sum(max(0, b - a) for a, b in zip(worlds, worlds[1:]))


def launch_elastic(argv: list[str], nprocs: int, joiners: int, workdir: Path, timeout: float,
                   name: str = "elastic") -> tuple[list[dict], list[dict]]:
    """Run ``python <argv> --out F`` on ``nprocs`` ranks plus ``joiners`` joining processes, all under one store.

    Returns (the ranks' results in rank order, the joiners' results). On a failure or timeout every process is
    killed and the error carries the tail of each one's log.
    """
    workdir = Path(workdir)
    token = secrets.token_hex(8)
    store = start_store(token, workdir, host="127.0.0.1")
    env = {ENDPOINT_ENV: store.endpoint, TOKEN_ENV: token}
    procs, outs, logs = [], [], []
    try:
        for i in range(joiners):
            out, log = workdir / f"{name}-joiner{i}.json", workdir / f"{name}-joiner{i}.log"
            outs.append(out)
            logs.append(log)
            procs.append(_start_joiner([*argv, "--out", str(out)], env, log, nprocs + joiners))
        try:
            members = launch_local(argv, nprocs, workdir, timeout=timeout, env=env, name=name)
        except LaunchError as e:
            raise LaunchError(str(e) + _tails(logs)) from None
        # The joiners finish with the members' last collective; a grace covers their exit.
        end = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.1)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise LaunchError(f"{name}: joiners {failed} failed" + _tails(logs))
        return members, [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        store.stop()


def _start_joiner(argv: list[str], env: dict[str, str], log: Path, max_procs: int) -> subprocess.Popen:
    full = {**os.environ, **env, JOIN_ENV: "1", "PYTHONUNBUFFERED": "1"}
    full.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max_procs)))
    full.setdefault("WANDB_MODE", "offline")
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *argv], env=full, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _tails(logs: list[Path], n: int = 40) -> str:
    return "".join(f"\n--- joiner {i} ({log}) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-n:])
                   for i, log in enumerate(logs) if log.exists())
