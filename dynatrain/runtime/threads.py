"""Intra-op threads of a training process: the host's cores split evenly among the job's processes on it, and split
again whenever the world changes.

A process whose OpenMP team does not fit on its share of the cores makes every operator wait for a thread without a
core (the engine's copies took 16 times longer with 2 processes of 16 threads on 16 cores, docs/benchmarks.md "Copy
threads"), and a process with fewer threads than its share is the straggler every collective waits for. A count
that is right for the world a process started in is wrong after a scale-out (more processes on the host) or a
scale-in (fewer). So when dynatrain chooses the count (the user set no ``OMP_NUM_THREADS``), it marks the process
(`THREADS_ENV`) and, after each world change, sets cores // (this world's processes on the host). A count the user
chose is left alone. The mark is only how a launcher tells the process it starts; ``ElasticConfig.split_threads``
(True or False) overrides it (`splits_threads`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from dynatrain.settings import THREADS_ENV, explicit_or_env

# "split": dynatrain chose this process's count and keeps it split; the default of ElasticConfig.split_threads
# (dynatrain.settings; this module sits below it and applies the same precedence itself, `splits_threads`).
SPLIT = "split"


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share(processes: int) -> int:
    """Each of ``processes`` processes' share of the host's cores, at least one."""
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    return max(1, host_cores() // processes)


def launch_env(env: Mapping[str, str], processes: int, start: int | None = None) -> dict[str, str]:
    """``env`` for a process about to start beside ``processes - 1`` others on this host: unless ``env`` sets
    ``OMP_NUM_THREADS``, the process starts with ``start`` threads (default its share) and is marked for
    `resplit`."""
    out = dict(env)
    if "OMP_NUM_THREADS" not in out:
        out["OMP_NUM_THREADS"] = str(share(processes) if start is None else start)
        out[THREADS_ENV] = SPLIT
    return out


def mark_if_unset() -> None:
    """For a process started without a launcher of dynatrain's (`dynatrain join` on another host): when the user
    set no ``OMP_NUM_THREADS``, dynatrain may choose the count from the next world change on."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ.setdefault(THREADS_ENV, SPLIT)


def host_name() -> str:
    """What tells the processes of one host from another's: registered with each member (`member_info`)."""
    return socket.gethostname()


def splits_threads(split: bool | None = None) -> bool:
    """Whether dynatrain sets this process's thread count after a world change: ``split`` when given (an explicit
    argument wins), else whether a launcher of dynatrain's chose the count (``$DYNATRAIN_THREADS=split``)."""
    return bool(explicit_or_env(split, THREADS_ENV, lambda raw: raw == SPLIT))


def resplit(processes_on_host: int, split: bool | None = None) -> int | None:
    """After a world change: this process's share of the cores among ``processes_on_host`` (itself included), when
    dynatrain sets its count (`splits_threads`: ``split``, else the launcher's mark); returns the count set, or None
    when the count is the user's."""
    if not splits_threads(split):
        return None
    import torch

    n = share(processes_on_host)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)  # what a process this one starts inherits
    return n
