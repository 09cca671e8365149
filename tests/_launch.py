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
