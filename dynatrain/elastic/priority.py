"""A standby process starts and waits at a low CPU priority, and trains at its normal one.

A standby process (one of the pool `dynatrain fit --elastic.standby K` keeps, or a member that left and waits again)
imports torch and Lightning, builds its Trainer and plans its side of the next scale-out on the cores the members
train on. With its niceness raised, the scheduler gives that work a smaller share of busy cores (and all of idle
ones), so the pool's start-up slows the members' steps less; the higher the niceness, the later the pool is
ready. Once admitted it is in every collective of the job and must run as fast as the
members, so it takes its normal priority back before it enters the world.

Linux lets a process raise its niceness freely but lower it again only within RLIMIT_NICE (soft limit r: down to
20 - r) or with CAP_SYS_NICE (root has it, root in a container often not). A process that could not take its
priority back would train niced and hold back every collective, so that is checked first: where it would be refused,
the process is not niced at all and says once which limit to raise.

Niceness belongs to each thread on Linux and a new thread inherits its creator's, so the threads a standby starts
while it waits (operator threads, its planning thread, the heartbeat) are niced as well: every thread of the process
is lowered and restored, not only the calling one.
"""

from __future__ import annotations

import json
import logging
import os
import resource

from dynatrain.settings import ELASTIC_ENV, explicit_or_env

# Where the members keep every core busy, a standby at niceness 10 gets a tenth of a member's share and may never be
# ready (`make demo` on 2 cores: not by the run's end); at 4 it gets about 40 % of a member's share and is ready
# within a dozen steps, while the members keep most of the speed an un-niced refill takes (docs/elastic.md).
DEFAULT_STANDBY_NICE = 4
MAX_NICE = 19
_CAP_SYS_NICE = 23  # bit of the capability in /proc/<pid>/status CapEff
LOGGER = logging.getLogger("dynatrain.elastic")

_normal: int | None = None  # the niceness to go back to, while lowered
_refusal_said = False


def check_amount(by: int, name: str = "standby_nice") -> int:
    """``by`` when it is a niceness increment this module accepts (0, off, to 19); ValueError otherwise."""
    if isinstance(by, bool) or not isinstance(by, int) or not 0 <= by <= MAX_NICE:
        raise ValueError(f"{name} must be an integer from 0 (standby processes keep their priority) to {MAX_NICE}, "
                         f"got {by!r}")
    return by


def launcher_amount(env=None) -> int:
    """The increment a job's launcher gave its processes (``--elastic.standby_nice``, carried in
    ``$DYNATRAIN_ELASTIC``), else the default: what a standby process uses before its strategy's config is read."""
    raw = explicit_or_env(None, ELASTIC_ENV, env=env)
    try:
        carried = json.loads(raw) if raw else None
    except ValueError:
        carried = None
    value = carried.get("standby_nice") if isinstance(carried, dict) else None
    return DEFAULT_STANDBY_NICE if value is None else check_amount(value)


def _privileged() -> bool:
    """CAP_SYS_NICE in this process's effective set (where /proc cannot say: running as root)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def restorable(normal: int) -> bool:
    """Whether this process may lower its niceness back to ``normal`` after raising it."""
    if _privileged():
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or normal >= 20 - soft


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no per-thread view: the call applies to the process


def _set_all(niceness: int) -> None:
    # Two passes at most: a thread started by one not yet set inherits the old value.
    for _ in range(2):
        changed = False
        for tid in _threads():
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                    changed = True
            except ProcessLookupError:
                pass  # the thread ended
        if not changed:
            return


def lower(by: int) -> bool:
    """Run this process ``by`` steps of niceness below its normal priority (at most 19); 0 gives the normal one.
    Idempotent: the normal priority is the one the first call found. Returns whether the process is now lowered;
    False also where it could not take its priority back (said once in the log)."""
    global _normal, _refusal_said
    check_amount(by)
    normal = os.getpriority(os.PRIO_PROCESS, 0) if _normal is None else _normal
    if by == 0 or normal >= MAX_NICE:
        restore()
        return False
    if not restorable(normal):
        if not _refusal_said:
            soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
            LOGGER.warning(
                "standby process %d waits at its normal priority: once niced it could not take niceness %d back "
                "when admitted (RLIMIT_NICE soft limit %d allows down to %d, and it lacks CAP_SYS_NICE). Raise the "
                "limit to at least %d (`ulimit -e %d`, or a 'nice' line in /etc/security/limits.conf), or set "
                "--elastic.standby_nice 0 to silence this", os.getpid(), normal, soft, 20 - soft, 20 - normal,
                20 - normal)
            _refusal_said = True
        return False
    _normal = normal
    _set_all(min(normal + by, MAX_NICE))
    return True


def restore() -> None:
    """Give every thread of this process its normal priority back (nothing to do when it was not lowered). Raises
    RuntimeError where the system refuses: a process must not train niced."""
    global _normal
    if _normal is None:
        return
    try:
        _set_all(_normal)
    except PermissionError as e:
        raise RuntimeError(f"process {os.getpid()} cannot take its normal priority (niceness {_normal}) back and "
                           f"would train niced: {e}. Raise RLIMIT_NICE (`ulimit -e {20 - _normal}`) or set "
                           "--elastic.standby_nice 0") from None
    _normal = None


def lowered() -> bool:
    return _normal is not None
