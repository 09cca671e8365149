"""Start a change's new processes the moment a rank decides it, as a cluster's scheduler would: the benchmarks count
their start-up from the decision, so it must not wait for the parent's next look."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from dynatrain.launch.local import LaunchError, log_tails


class Spawner:
    """Waits, each on a thread of its own, for a signal file, then starts ``python <argv> --out <file>`` per process.
    ``spawned[key]``: when the processes of ``key`` were started (``time.time()``, the ranks' clock)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.spawned: dict = {}
        self.procs: list[dict] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def when(self, signal: Path, key, argvs_envs: list[tuple[list[str], dict]]) -> None:
        """Start one process per (argv, env) once ``signal`` exists (never, if `finish` or `kill` comes first)."""
        t = threading.Thread(target=self._run, args=(Path(signal), key, argvs_envs), daemon=True)
        t.start()
        self._threads.append(t)

    def _run(self, signal: Path, key, argvs_envs) -> None:
        while not signal.exists():
            if self._stop.wait(0.01):
                return
        self.spawned[key] = time.time()
        for i, (argv, env) in enumerate(argvs_envs):
            out, log = self.workdir / f"new-{key}-{i}.json", self.workdir / f"new-{key}-{i}.log"
            spawned = time.time()
            with open(log, "w") as f:
                proc = subprocess.Popen([sys.executable, *argv, "--out", str(out)], env=env, stdout=f,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append({"proc": proc, "out": out, "log": log, "spawned": spawned})

    def finish(self, timeout: float) -> list[dict]:
        """Each started process's JSON result, with ``spawned``: when it was started. Raises if one failed or did
        not end within ``timeout`` seconds."""
        self._stop.set()
        for t in self._threads:
            t.join()
        results = []
        for p in self.procs:
            try:
                p["proc"].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p["proc"].kill()
                raise LaunchError(f"a started process did not end within {timeout:.0f}s\n"
                                  + log_tails([p["log"]], "process")) from None
            if p["proc"].returncode != 0:
                raise LaunchError(f"a started process failed ({p['proc'].returncode})\n"
                                  + log_tails([p["log"]], "process"))
            results.append({"spawned": p["spawned"], **json.loads(Path(p["out"]).read_text())})
        return results

    def tails(self) -> str:
        return log_tails([p["log"] for p in self.procs], "started process")

    def kill(self) -> None:
        self._stop.set()
        for p in self.procs:
            if p["proc"].poll() is None:
                p["proc"].kill()
                p["proc"].wait()
