"""A world whose peer is gone: how its failure reaches Python on NCCL, and how its groups are ended.

NCCL's defaults are made for jobs that restart whole. Its watchdog handles an error or a timeout of a collective
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, default 3, "SkipCleanUp") by tearing the process down: the survivors of a
lost peer would die at the group's timeout before Python sees an exception, and the recovery from replicas would
never run. Mode 2 ("CleanUpOnly") aborts the failed communicators and leaves the process alive: the failed work and
every later operation of those groups raise in Python, where `switch.recovery.is_peer_loss` recognises them. An
elastic world sets that mode where the user did not choose one (`let_python_see_nccl_errors`), before its first NCCL
group is made (the variable is read when a group is constructed); a user's choice is kept, with a warning where it
tears the process down.

Ending a broken world's groups must not wait on the dead peer. ``destroy_process_group`` shuts every backend
down, which on NCCL waits for the group's pending work, and a collective the dead peer never joined never ends.
``abort_groups`` aborts them instead (torch's ``_abort_process_group``: every group, NCCL's inside one group
call, then the same registry clean-up as a destroy, the group counter reset included). On gloo an abort and a
destroy both return at once (its pending work has already failed with the peer's closed connection); a torch
without the abort, or a backend that refuses it, is destroyed instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping

import torch.distributed as dist

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LEGACY_ERROR_HANDLING_ENV = "NCCL_ASYNC_ERROR_HANDLING"  # torch reads it when the new name is unset
CLEAN_UP_ONLY = "2"  # abort the failed communicators, keep the process: the error surfaces in Python
TEARS_DOWN = {"1": "TearDown", "3": "SkipCleanUp"}


def let_python_see_nccl_errors(backend: str, env: MutableMapping[str, str] | None = None) -> str | None:
    """Before a group of ``backend`` is made: where it uses NCCL and the user set no error handling, set
    `CLEAN_UP_ONLY` in ``env`` (default ``os.environ``, which NCCL reads). Returns the mode NCCL will use (None: the
    backend is not NCCL). A user's value is kept; one that tears the process down is warned about, since a lost
    peer then ends every survivor instead of being recovered from."""
    if "nccl" not in backend.lower():
        return None
    env = os.environ if env is None else env
    for name in (ERROR_HANDLING_ENV, LEGACY_ERROR_HANDLING_ENV):
        value = (env.get(name) or "").strip()
        if value:
            if value in TEARS_DOWN:
                warnings.warn(
                    f"{name}={value} ({TEARS_DOWN[value]}): NCCL's watchdog ends this process when a peer is lost, "
                    f"so the survivors cannot recover from replicas; unset it (dynatrain then sets "
                    f"{CLEAN_UP_ONLY}, CleanUpOnly) or set {CLEAN_UP_ONLY}", stacklevel=2)
            return value
    env[ERROR_HANDLING_ENV] = CLEAN_UP_ONLY
    return CLEAN_UP_ONLY


def abort_groups() -> str:
    """End every process group of this process without waiting for work a lost peer never joins; returns how:
    ``"aborted"``, ``"destroyed"`` (no abort in this torch, or the backend refused it) or ``"none"`` (no group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
            return "aborted"
        except (RuntimeError, NotImplementedError) as e:
            warnings.warn(f"aborting the process groups failed ({e}); destroying what is left", stacklevel=2)
        if not dist.is_initialized():  # it failed after the registry was cleared: every group is gone
            return "aborted"
    dist.destroy_process_group()
    return "destroyed"
