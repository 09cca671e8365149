"""Start worker scripts of tests/workers on N ranks. Lightning under pytest would re-launch pytest itself."""

from __future__ import annotations

from pathlib import Path

from dynatrain.launcher import LaunchError, launch_local

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parent.parent


def launch(script: str, nprocs: int, args: list[str], tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        return launch_local([str(WORKERS / script), *args], nprocs, tmp_path, timeout=timeout, env=env,
                            name=Path(script).stem)
    except LaunchError as e:
        raise AssertionError(str(e)) from None


def launch_elastic(script: str, nprocs: int, args: list[str], tmp_path: Path, joiners: list[list[str]] = (),
                   timeout: float = 240.0, grace: float = 2.0) -> tuple[list[dict], list[dict]]:
    """An elastic job: the store, ``nprocs`` members, and one process per entry of ``joiners`` started at once
    with ``DYNATRAIN_JOIN=1`` (they wait for admission). Returns (members' results, joiners' results)."""
    import json
    import os
    import secrets
    import subprocess
    import sys
    import time

    from dynatrain.elastic.store import start_store

    token = secrets.token_hex(8)
    store = start_store(token, tmp_path, host="127.0.0.1")
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DYNATRAIN_ENDPOINT": store.endpoint,
           "DYNATRAIN_TOKEN": token, "WANDB_MODE": "offline"}
    procs, outs, logs = [], [], []
    try:
        for i, extra in enumerate(joiners):
            out, log = tmp_path / f"joiner{i}.json", tmp_path / f"joiner{i}.log"
            outs.append(out)
            logs.append(log)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKERS / script), *args, *extra, "--out", str(out)],
                    env={**os.environ, **env, "DYNATRAIN_JOIN": "1", "PYTHONUNBUFFERED": "1"},
                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            members = launch_local([str(WORKERS / script), *args], nprocs, tmp_path, timeout=timeout, env=env,
                                   name=Path(script).stem, grace=grace)
        except LaunchError as e:
            raise AssertionError(str(e) + _joiner_tails(logs)) from None
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        bad = [i for i, p in enumerate(procs) if p.poll() != 0]
        if bad:
            raise AssertionError(f"joiners {bad} failed" + _joiner_tails(logs))
        return members, [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        store.stop()


def _joiner_tails(logs: list[Path]) -> str:
    return "".join(f"\n--- joiner {i} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                   for i, log in enumerate(logs) if log.exists())


def retry_on_lost_peer(run, attempts: int = 2):
    """Run a multi-process launch again when a peer was lost to a transport timeout (seen rarely on a loaded
    2-core machine); any other failure, or the same one twice, fails the test."""
    import warnings

    for attempt in range(attempts):
        try:
            return run()
        except AssertionError as e:
            lost = "Timed out waiting" in str(e) or "Connection closed by peer" in str(e)
            if not lost or attempt == attempts - 1:
                raise
            warnings.warn(f"lost a peer to a transport timeout, running once more: {str(e)[:300]}", stacklevel=2)
