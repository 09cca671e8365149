"""Start N local ranks the way a cluster launcher does (env vars per rank), for selfcheck, benchmarks and tests.

Each call hosts a fresh store for its ranks, as torchrun's agent does: re-forming a process group on a used store
hangs or fails on torch 2.13. The launcher binds it on a port the kernel picks and holds it until its ranks are
done. Picking a free port for rank 0 to bind later lost, now and then, to a process that bound port 0 in between
(every gloo listener does): with two test workers, a rank 0 failed with EADDRINUSE.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

from dynatrain.runtime.memory import heap_env
from dynatrain.runtime.threads import launch_env


# Every rank started here is a client of the store its launcher holds (torch's env:// rendezvous reads it).
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class LaunchError(RuntimeError):
    pass


def host_store():
    """A rendezvous store for ranks this process starts, on a port the kernel picks: hold it until they are done."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def rank_env(rank: int, world: int, port: int, env: dict[str, str] | None = None, heap: str | None = None
             ) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``world`` whose store its launcher hosts on ``port`` (`host_store`):
    this process's environment, then ``env``, then the rank's identity; threads split the cores unless ``env`` sets
    ``OMP_NUM_THREADS`` (and are split again at every world change, `threads`), and the heap keeps PyTorch's blocks
    unless ``heap`` (else ``$DYNATRAIN_HEAP``) is ``"glibc"`` (`memory.heap_env`). Every rank, rank 0 included,
    connects to that store as a client."""
    full = heap_env({**os.environ, **(env or {})}, heap)
    full.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1")
    full[AGENT_STORE_ENV] = "True"
    full = launch_env(full, world)
    full.setdefault("WANDB_MODE", "offline")
    return full


def joiner_env(env: dict[str, str] | None, processes: int, heap: str | None = None) -> dict[str, str]:
    """The environment of a process that joins a running job (`dynatrain join`): this process's environment, then
    ``env`` (the job's store endpoint and token), then the join flag (the default of `ElasticConfig.join`); threads
    split the cores among ``processes`` unless ``env`` sets ``OMP_NUM_THREADS``, and the heap as for `rank_env`."""
    from dynatrain.settings import JOIN_ENV

    full = launch_env(heap_env({**os.environ, **(env or {}), JOIN_ENV: "1", "PYTHONUNBUFFERED": "1"}, heap),
                      processes)
    full.setdefault("WANDB_MODE", "offline")
    return full


# What a rank of dynatrain's own workers imports first: a launch with ``preload=PRELOAD`` pays it once.
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "dynatrain")


def launch_local(
    argv: list[str], nprocs: int, workdir: Path, timeout: float = 600.0, env: dict[str, str] | None = None,
    name: str = "worker", grace: float = 2.0, may_die: Collection[int] = (), preload: Collection[str] = (),
    keep_zygote: bool = False, heap: str | None = None,
) -> list[dict | None]:
    """Run ``python <argv> --out <file>`` on ``nprocs`` ranks; return each rank's JSON result in rank order.

    On a failure or timeout every rank is killed and the error carries the tail of each rank's log; after a
    rank fails, the others get ``grace`` seconds to report their side of it first. Ranks in ``may_die`` are
    expected to be killed (fault injection): their exit is no failure, and their result is None unless they exited
    cleanly. With
    ``preload`` (module names, e.g. `PRELOAD`) the ranks are forked from one process that imported them
    (`dynatrain.launch.forked`), where the platform can fork. With ``keep_zygote`` that process outlives the launch and
    forks every later one of this process with the same ``preload`` and environment (but for the store's address
    and pytest's test name, `_server`), which then pays no imports at all: for a caller that launches many jobs in
    turn, as a test session does. ``heap``: the ranks' heap, ``"reuse"`` or ``"glibc"`` (`rank_env`).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = host_store()
    port = store.port
    outs = [workdir / f"{name}-{port}-rank{r}.json" for r in range(nprocs)]
    logs = [workdir / f"{name}-{port}-rank{r}.log" for r in range(nprocs)]
    envs = [rank_env(rank, nprocs, port, env, heap) for rank in range(nprocs)]
    _forget_earlier_launch(outs, logs, workdir / f"{name}-{port}")
    if preload and hasattr(os, "fork"):
        procs = _fork_ranks(argv, envs, outs, logs, workdir / f"{name}-{port}", preload, keep_zygote)
    else:
        procs = []
        for rank in range(nprocs):
            with open(logs[rank], "w") as log:
                procs.append(subprocess.Popen([sys.executable, *argv, "--out", str(outs[rank])], env=envs[rank],
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        # Every process is polled each round: `any` over poll() would stop at the first live rank and never notice
        # a later rank that already died, so its peers would wait for the full timeout.
        while [p.poll() for p in procs].count(None):
            if time.monotonic() > deadline:
                raise LaunchError(f"{name} on {nprocs} ranks timed out after {timeout:.0f}s\n" + log_tails(logs))
            if any(p.returncode not in (None, 0) for r, p in enumerate(procs) if r not in may_die):
                end = min(deadline, time.monotonic() + grace)  # let the peers report their side of the failure
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p.pid)
                p.wait()
        for p in procs:
            getattr(p, "close", lambda: None)()
        del store
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 and r not in may_die]
    if failed:
        forked = isinstance(procs[0], _ForkedRank)
        zygote = log_tails(procs[0].zygote.logs(), "zygote", skip_empty=True) if forked else ""
        raise LaunchError(f"{name}: ranks {failed} failed\n" + log_tails(logs) + ("\n" + zygote if zygote else ""))
    # A rank that may die and did not (a fault that picks its victim as it runs) reports like any other.
    return [json.loads(o.read_text()) if o.exists() and (r not in may_die or p.returncode == 0) else None
            for r, (o, p) in enumerate(zip(outs, procs))]


def launch_elastic(
    argv: list[str], nprocs: int, workdir: Path, joiners: "int | list[list[str]]" = 0, timeout: float = 600.0,
    env: dict[str, str] | None = None, name: str = "elastic", grace: float = 2.0, may_die: Collection[int] = (),
    joiners_may_die: bool = False, preload: Collection[str] = (), keep_zygote: bool = False, heap: str | None = None,
) -> tuple[list[dict | None], list[dict | None]]:
    """An elastic job on this machine: the job's store, ``nprocs`` ranks, and joining processes.

    ``joiners`` is a count, or one list of extra arguments per joiner. Joiners start with the job and wait for
    admission (``DYNATRAIN_JOIN=1``); each scale-out admits as many as it needs. Returns (the ranks' results in
    rank order, the joiners' results). On a failure or timeout every process is killed and the error carries
    the tail of each one's log. Ranks in ``may_die`` (and every joiner, with ``joiners_may_die``) are expected
    to be killed by a fault injection: their result is None. ``preload`` and ``keep_zygote``: as for `launch_local`,
    for the ranks (a joiner starts as a process of its own, as on a cluster); ``heap``: as for `launch_local`, for
    every process.
    """
    import secrets

    from dynatrain.settings import ENDPOINT_ENV, TOKEN_ENV
    from dynatrain.elastic.store import start_store

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    extras = [[] for _ in range(joiners)] if isinstance(joiners, int) else [list(x) for x in joiners]
    token = secrets.token_hex(8)
    store = start_store(token, workdir, host="127.0.0.1")
    env = {**(env or {}), ENDPOINT_ENV: store.endpoint, TOKEN_ENV: token}
    procs, outs, logs = [], [], []
    try:
        for i, extra in enumerate(extras):
            out, log = workdir / f"{name}-joiner{i}.json", workdir / f"{name}-joiner{i}.log"
            out.unlink(missing_ok=True)  # an earlier launch's in this folder would pass for this joiner's
            outs.append(out)
            logs.append(log)
            full = joiner_env(env, nprocs + len(extras), heap)
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, *argv, *extra, "--out", str(out)], env=full,
                                              stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            members = launch_local(argv, nprocs, workdir, timeout=timeout, env=env, name=name, grace=grace,
                                   may_die=may_die, preload=preload, keep_zygote=keep_zygote, heap=heap)
        except LaunchError as e:
            raise LaunchError(str(e) + log_tails(logs, "joiner")) from None
        # The joiners finish with the members' last collective; a grace covers their exit.
        end = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.1)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0 and not joiners_may_die]
        if failed:
            raise LaunchError(f"{name}: joiners {failed} failed\n" + log_tails(logs, "joiner"))
        return members, [json.loads(o.read_text()) if p.returncode == 0 else None for p, o in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p.pid)
                p.wait()
        store.stop()


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads. A group whose last process has just ended (reaped between the check
    that it runs and this kill: a served launch's zygote, whose status its server is still writing) is no error."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def teardown_distributed() -> None:
    """End this rank's process group cleanly. Drop every reference to DTensors first: torch 2.13 aborts about
    1 in 10 DTensor programs at interpreter exit unless they are collected and the group destroyed before."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class _ForkedRank:
    """A rank forked by a zygote of `dynatrain.launch.forked`, polled like a `subprocess.Popen`: its status is the one
    the zygote wrote on reaping it; if the zygote's launch is gone without writing one, the rank is gone too."""

    def __init__(self, zygote: "_OwnZygote | _ServedLaunch", log: Path) -> None:
        from dynatrain.launch.forked import rc_path

        self.zygote, self.rc_file = zygote, rc_path(log)
        self.pid = zygote.pid  # the process group every rank is in
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.rc_file.exists():
                self.returncode = int(self.rc_file.read_text())
            else:
                ended = self.zygote.poll()
                if ended is not None and not self.rc_file.exists():
                    self.returncode = ended or -signal.SIGKILL
        return self.returncode

    def wait(self) -> int:
        self.zygote.wait()
        return self.poll()

    def close(self) -> None:
        self.zygote.close()


class _OwnZygote:
    """The zygote of one launch: a process of its own (its pid is the launch's process group)."""

    def __init__(self, spec_file: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "dynatrain.launch.forked", str(spec_file)], env=env,
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        return self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.pid)
        self.proc.wait()

    def logs(self) -> list[Path]:
        return [self.log]


class _Server:
    """A zygote kept for every launch of this process with its preload and environment (`launch.forked.serve`)."""

    def __init__(self, preload: Collection[str], env: dict[str, str]) -> None:
        import atexit
        import tempfile

        self.log = Path(tempfile.mkdtemp(prefix="dynatrain-zygote-")) / "zygote.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "dynatrain.launch.forked", "--serve", *preload],
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True,
                                         start_new_session=True)
        atexit.register(self.stop)

    def start(self, spec_file: Path) -> int:
        """Have the server fork the launch of ``spec_file``; its pid."""
        try:
            self.proc.stdin.write(f"{spec_file}\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            answer = ""
        if not answer.strip().isdigit():
            self.proc.wait()
            raise LaunchError("the zygote that forks the ranks is gone\n" + log_tails([self.log], "zygote"))
        return int(answer)

    def stop(self, wait: bool = True) -> None:
        """End the server: it ends by itself once its running launches have (``wait=False`` leaves it to that)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if not wait:
            return
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.log.parent, ignore_errors=True)


_SERVERS: dict[tuple, _Server] = {}  # least recently used first
KEPT_ZYGOTES = 2  # each holds torch and Lightning imported (about 0.5 GB resident)


def _server(preload: Collection[str], env: dict[str, str]) -> _Server:
    """The kept zygote for ``preload`` and ``env`` (started on first use, again if it died). Only the elastic store's
    address and token, and pytest's name of the test it runs, tell one launch's environment from the next's; a change
    in any other variable, which the imports may have read, gets a zygote of its own."""
    from dynatrain.settings import ENDPOINT_ENV, TOKEN_ENV

    per_launch = (ENDPOINT_ENV, TOKEN_ENV, "PYTEST_CURRENT_TEST")
    key = (tuple(preload), tuple(sorted((k, v) for k, v in env.items() if k not in per_launch)))
    server = _SERVERS.pop(key, None)
    if server is None or server.proc.poll() is not None:
        while len(_SERVERS) >= KEPT_ZYGOTES:
            _SERVERS.pop(next(iter(_SERVERS))).stop(wait=False)
        server = _Server(preload, env)
    _SERVERS[key] = server
    return server


class _ServedLaunch:
    """One launch forked by a kept zygote: its pid leads the launch's process group; the server writes its status."""

    def __init__(self, server: _Server, spec_file: Path, rc_file: Path, log: Path) -> None:
        self.server, self.rc_file, self.log = server, rc_file, log
        self.pid = server.start(spec_file)

    def poll(self) -> int | None:
        if self.rc_file.exists():
            return int(self.rc_file.read_text())
        if self.server.proc.poll() is not None:  # no one left to reap it: it is gone with its server
            return -signal.SIGKILL
        return None

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.02)
        return code

    def close(self) -> None:
        if self.poll() is None:
            kill_group(self.pid)
            self.wait()

    def logs(self) -> list[Path]:
        return [self.log, self.server.log]


def _forget_earlier_launch(outs: list[Path], logs: list[Path], stem: Path) -> None:
    """Delete what an earlier launch in ``workdir`` left under these names. A store's port is free again once the
    store is gone, so a later launch may get the same port and names; a rank's exit status or result left from the
    earlier one would then pass for its own (a launch that returned at once with the earlier results)."""
    from dynatrain.launch.forked import rc_path

    zygote_log = Path(f"{stem}-zygote.log")
    for path in (*outs, *logs, *map(rc_path, logs), zygote_log, Path(f"{zygote_log}.rc")):
        path.unlink(missing_ok=True)


def _fork_ranks(argv: list[str], envs: list[dict], outs: list[Path], logs: list[Path], stem: Path,
                preload: Collection[str], keep: bool) -> list[_ForkedRank]:
    from dynatrain.launch.forked import SINGLE_THREADED

    zygote_log = Path(f"{stem}-zygote.log")
    spec = {"preload": list(preload), "cwd": os.getcwd(), "log": str(zygote_log), "rc": f"{zygote_log}.rc",
            "caller": os.getpid(),
            "ranks": [{"argv": [*argv, "--out", str(out)], "env": env, "log": str(log)}
                      for out, env, log in zip(outs, envs, logs)]}
    spec_file = Path(f"{stem}-zygote.json")
    spec_file.write_text(json.dumps(spec))
    zygote_env = {**envs[0], **SINGLE_THREADED}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        zygote_env.pop(key, None)  # nothing imported may read a rank's identity
    if keep:
        zygote = _ServedLaunch(_server(preload, zygote_env), spec_file, Path(spec["rc"]), zygote_log)
    else:
        zygote = _OwnZygote(spec_file, zygote_env, zygote_log)
    return [_ForkedRank(zygote, log) for log in logs]


def finish_rank(out: str | Path, result: dict) -> None:
    """Write this rank's JSON result for `launch_local`, then tear the process group down."""
    Path(out).write_text(json.dumps(result))
    teardown_distributed()


def log_tails(logs: list[Path], what: str = "rank", n: int = 40, skip_empty: bool = False) -> str:
    """The last ``n`` lines of each log, headed by what wrote it (``what`` and its index): for error messages."""
    parts = []
    for r, log in enumerate(logs):
        log = Path(log)
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        if skip_empty and not lines:
            continue
        parts.append(f"--- {what} {r} ({log}) ---\n" + "\n".join(lines[-n:]))
    return "\n".join(parts)


def joiners_needed(worlds: list[int]) -> int:
    """New processes a sequence of world sizes needs: every increase, since leavers do not come back."""
    return sum(max(0, b - a) for a, b in zip(worlds, worlds[1:]))
