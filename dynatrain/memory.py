"""Process memory around a switch: cheap cycle collections and freed heap given back to the OS.

A switch must collect the old model's reference cycles (FSDP state and modules point at each other) before the
engine allocates new shards, so it runs full collections. A full collection scans every tracked object, and the
imports of torch, Lightning and W&B leave about 420,000 of them: 0.2 s per collection on a 2-core machine, three
or four times per world change. Those objects live as long as the process, so they are moved out of the
collector's sight once (``gc.freeze``); collections then scan only what training created.
"""

from __future__ import annotations

import ctypes
import gc
import os

FREEZE_ENV = "DYNATRAIN_GC_FREEZE"  # "0" keeps every object visible to the collector

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc
except (OSError, AttributeError):
    _malloc_trim = None


def freeze_import_time_objects() -> int:
    """Exclude the objects that exist now (modules, classes, functions of the libraries imported so far) from
    later collections; returns how many are frozen. Objects frozen are never collected, so this runs at import,
    before any model or Trainer exists."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return 0
    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()


def release_freed_memory() -> None:
    """Collect the old model's cycles and give the heap a switch freed (old shards, staging) back to the OS:
    glibc keeps freed memory otherwise, and over hundreds of switches the process's RSS creeps up."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
