"""Helpers of the tests: start worker scripts of tests/workers on N ranks (Lightning under pytest would re-launch
pytest itself), compare their step losses, wait for a condition, replace a watched file at once."""

from __future__ import annotations

from pathlib import Path

from dynatrain.launch.local import PRELOAD, LaunchError, launch_local
from dynatrain.launch.local import launch_elastic as launch_elastic_local

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parent.parent


def python_path(*paths) -> str:
    """``paths``, then this process's PYTHONPATH: it holds the NCCL rules' start-up hook (tests/conftest.py)."""
    import os

    return os.pathsep.join([*(str(p) for p in paths), *filter(None, [os.environ.get("PYTHONPATH")])])


def launch(script: str, nprocs: int, args: list[str], tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    env = {"PYTHONPATH": python_path(REPO), "OMP_NUM_THREADS": "1"}
    try:
        return launch_local([str(WORKERS / script), *args], nprocs, tmp_path, timeout=timeout, env=env,
                            name=Path(script).stem, preload=PRELOAD, keep_zygote=True)
    except LaunchError as e:
        raise AssertionError(str(e)) from None


def launch_elastic(script: str, nprocs: int, args: list[str], tmp_path: Path, joiners: list[list[str]] = (),
                   timeout: float = 240.0, grace: float = 2.0, may_die=(), threads: str | None = "1",
                   joiners_may_die: bool = False) -> tuple[list[dict], list[dict]]:
    """An elastic job: the store, ``nprocs`` members, and one joining process per entry of ``joiners`` (its extra
    arguments). Returns (members' results, joiners' results). ``threads``: every process's OMP_NUM_THREADS; None
    leaves it to the launcher (the cores split among the processes, again at each world change)."""
    env = {"PYTHONPATH": python_path(REPO), "WANDB_MODE": "offline"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    try:
        return launch_elastic_local([str(WORKERS / script), *args], nprocs, tmp_path, joiners=list(joiners),
                                    timeout=timeout, env=env, name=Path(script).stem, grace=grace,
                                    may_die=may_die, joiners_may_die=joiners_may_die, preload=PRELOAD,
                                    keep_zygote=True)
    except LaunchError as e:
        raise AssertionError(str(e)) from None


def wait_for(predicate, timeout: float = 10.0):
    """Poll ``predicate`` until it returns something truthy (returned), or fail the test after ``timeout``."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("condition not met within the timeout")


def replace_file(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` the way a writer should for a file another process watches: all at once."""
    import os

    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def selfcheck_module(module: str, layouts: list[str]) -> dict:
    """`dynatrain selfcheck --module MODULE` (from tests/workers) through ``layouts``; its JSON result, after
    checking that it ran and that every switch and the step after it equal the DCP oracle bit for bit."""
    import json
    import os
    import subprocess
    import sys

    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=python_path(tests / "workers", tests.parent))
    cmd = [sys.executable, "-m", "dynatrain.cli", "selfcheck", "--module", module,
           "--switches", " > ".join(layouts), "--steps-between", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["model"] == module
    assert [s["to"] for s in result["switches"]] == layouts[1:]
    assert all(s["bitwise_equal"] is True and s["step_after_equal"] is True for s in result["switches"])
    assert result["loss_max_rel_diff"] <= 1e-5
    return result


def assert_close(losses, reference, rel=1e-5):
    """Step losses equal the reference's within ``rel`` relative, step by step."""
    assert len(losses) == len(reference)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= rel * abs(b), f"step {step}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"
