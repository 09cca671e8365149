"""Start N worker processes the way a cluster launcher does (env vars per rank) and collect their results.

Lightning under pytest would re-launch pytest itself, so tests start plain scripts instead. Each run gets
a fresh port: re-using one hangs or fails on torch 2.13.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, nprocs: int, args: list[str], tmp_path: Path, timeout: float = 180.0) -> list[dict]:
    """Run ``tests/workers/<script>`` on ``nprocs`` ranks; return each rank's JSON result (rank order)."""
    port = free_port()
    procs = []
    outs = [tmp_path / f"result-{script}-{r}-{port}.json" for r in range(nprocs)]
    logs = [tmp_path / f"log-{script}-{r}-{port}.txt" for r in range(nprocs)]
    for rank in range(nprocs):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs), RANK=str(rank),
            LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(nprocs), PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
        )
        cmd = [sys.executable, str(WORKERS / script), "--out", str(outs[rank]), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(logs[rank], "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"{script} on {nprocs} ranks timed out after {timeout}s\n" + _tails(logs)) from None
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"{script}: ranks {failed} failed\n" + _tails(logs))
    return [json.loads(o.read_text()) for o in outs]


def _tails(logs: list[Path], n: int = 40) -> str:
    parts = []
    for r, log in enumerate(logs):
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        parts.append(f"--- rank {r} ---\n" + "\n".join(lines[-n:]))
    return "\n".join(parts)
