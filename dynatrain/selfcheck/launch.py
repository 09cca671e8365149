"""Start an elastic selfcheck run on this machine: the job's store, the first world's ranks, and the joiners.

Joiners start with the job and wait for admission; each scale-out admits as many as it needs. Processes that
leave exit, so every process added later is a new one.
"""

from __future__ import annotations

from dynatrain.launcher import launch_elastic

__all__ = ["joiners_needed", "launch_elastic"]


def joiners_needed(worlds: list[int]) -> int:
    """New processes a sequence of world sizes needs: every increase, since leavers do not come back."""
    return sum(max(0, b - a) for a, b in zip(worlds, worlds[1:]))
