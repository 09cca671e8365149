"""Start local ranks by forking one process that has already imported torch and Lightning.

A rank started as ``python worker.py`` spends about 6 CPU seconds importing torch, Lightning and their imports
(torchmetrics, scipy, dynamo) before it runs a line of its own; four ranks on two cores wait about 12 s for that.
Here one parent process (the *zygote*) imports the named modules once and forks every rank from that state, so the
imports are paid once per launch.

Fork is safe here because the zygote is single-threaded when it forks: it runs no tensor op, and OpenBLAS (numpy's
and scipy's, the only threads the imports start) is held to one thread. A rank then runs its script as
``python script args`` would: its own environment, ``sys.argv``, ``__main__``, stdout and stderr to its log.

The zygote stays in its process group with the ranks (killing the group kills every rank) and writes each rank's
exit status to ``<log>.rc`` as it reaps it (the code, or minus the signal that killed it, as `subprocess` does).

    python -m dynatrain.launch.forked SPEC.json

A process that launches many jobs in turn (a test session, a benchmark's repeats) can keep one zygote for all of them
(*serving*): it imports once, then reads one spec path per line from its stdin and answers each with the pid of a
child that runs that launch as above, leading a process group of its own (the launch's: the child and its ranks) with
its output in the spec's ``log``; the server writes the child's exit status to the spec's ``rc`` when it reaps it.
It ends when its stdin closes and its launches have ended, or at once when the process that started it is gone.

    python -m dynatrain.launch.forked --serve MODULE...

Every process here ends with the one that forked or started it (on Linux): a launch whose caller was killed (a test
run stopped from outside) does not leave ranks behind that wait forever on peers or a store that are gone.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

# Set before the imports: a pool started by an import would not exist in the forked ranks.
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


PR_SET_PDEATHSIG = 1
GONE_POLL = 0.05  # seconds between a server's looks at its caller once its requests have ended


def rc_path(log: str | Path) -> Path:
    return Path(f"{log}.rc")


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` (the thread that forked or started it, which waits for it)
    ends; end now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _run_rank(rank: dict) -> None:
    """In the forked child: become ``python <argv>`` (a script, or ``-m module``) with ``env``, output to ``log``;
    never return."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(rank["env"])
        fd = os.open(rank["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # the zygote's libgomp read its own value at import
        argv = list(rank["argv"])
        try:
            if argv[0] == "-m":  # python -m module args: argv[0] becomes the module's file, cwd leads the path
                sys.argv = argv[1:]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # python script args: the script's folder leads the path
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what the interpreter would run at exit; os._exit skips it
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _write_status(path: str | Path, code: int) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(str(code))
    os.replace(tmp, path)


def _reap(running: dict[int, str | Path], block: bool) -> bool:
    """Reap ended children, writing the status of each one in ``running`` (pid -> its status file) and dropping it:
    with ``block``, wait for one child to end; without, take every child that has. False once no child is left."""
    while True:
        try:
            pid, raw = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        path = running.pop(pid, None)
        if path is not None:
            _write_status(path, _status(raw))
        if block:
            return True


def _run_launch(spec: dict) -> int:
    """Fork every rank of ``spec`` from this process and reap them, writing each one's status as it ends."""
    running = {}
    me = os.getpid()
    for rank in spec["ranks"]:
        pid = os.fork()
        if pid == 0:
            _die_with(me)
            _run_rank(rank)
        running[pid] = rc_path(rank["log"])
    while running and _reap(running, block=True):
        pass
    return 0


def _preload(names: list[str]) -> None:
    """Import ``names``, then freeze what the imports made (`memory.freeze_import_time_objects`, which importing
    dynatrain leaves to the entry points): the ranks forked from here keep their switches' collections cheap, and the
    frozen objects' pages are not copied into each rank by the collector touching them."""
    for name in names:
        importlib.import_module(name)
    if names:
        from dynatrain.runtime.memory import freeze_import_time_objects

        freeze_import_time_objects()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if "caller" in spec:
        _die_with(spec["caller"])
    _preload(spec["preload"])
    return _run_launch(spec)


def serve(preload: list[str]) -> int:
    """Import ``preload``, then run each launch whose spec path arrives on stdin in a child of its own."""
    caller = os.getppid()  # not killed with it: the thread that started a kept server may end long before it
    _preload(preload)
    me = os.getpid()
    running: dict[int, str] = {}  # pid of a launch -> where its status goes
    signal.signal(signal.SIGCHLD, lambda *_: _reap(running, block=False))
    while line := sys.stdin.readline():
        spec = json.loads(Path(line.strip()).read_text())
        # A launch that ends before it is registered would find no entry in `_reap`: hold SIGCHLD until it is.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _die_with(me)
            _become_launch(spec)
        try:
            os.setpgid(pid, pid)  # as the child does: the group exists before its pid is answered, for a kill
        except OSError:
            pass  # it has already ended
        running[pid] = spec["rc"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)
    # No more requests: wait for the launches still running, unless the caller is gone (its exit closed the pipe,
    # and it may not have been reaped yet when the end of input is read): then end, and the launches with it.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while running and _reap(running, block=False) and os.getppid() == caller:
        time.sleep(GONE_POLL)
    return 0


def _become_launch(spec: dict) -> None:
    """In a child of the server: a launch's own zygote, leading its own process group; never return."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process reaps its ranks itself
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setpgid(0, 0)
        os.chdir(spec["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the ranks must not read the server's requests
        os.close(null)
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = _run_launch(spec)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    sys.exit(main(sys.argv[1]))
