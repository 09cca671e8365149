"""Process memory around a switch: cheap cycle collections and freed heap given back to the OS when it piles up.

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


TRIM_SLACK = 0.02  # RSS may exceed its high-water mark after the last trim by this fraction before the next
_rss_mark: list[int] = []  # the high-water mark: RSS after the first switch or after the last trim


def release_freed_memory() -> bool:
    """Collect the old model's cycles and, when the process has grown, give the heap back to the OS.

    glibc keeps freed memory, and over hundreds of switches the fragments of old shards make RSS creep up.
    Trimming after every switch bounds that, but it also returns the training step's own working set, which the
    first step after the switch must then fault in again (a third more time for that step on CPU). So the heap is
    trimmed only when RSS exceeds the mark by ``TRIM_SLACK``: RSS stays within that of the largest layout's
    footprint, and most first steps find their memory in place. Returns whether it trimmed."""
    gc.collect()
    if _malloc_trim is None:
        return False
    rss = _rss_bytes()
    if not _rss_mark:
        _rss_mark.append(rss)
        return False
    if rss <= _rss_mark[0] * (1 + TRIM_SLACK):
        return False
    _malloc_trim(0)
    _rss_mark[0] = max(_rss_mark[0], _rss_bytes())
    return True


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
