"""Process memory around a switch: cheap cycle collections and freed heap given back to the OS when it piles up.

A switch must collect the old model's reference cycles (FSDP state and modules point at each other) before the
engine allocates new shards, so it runs full collections. A full collection scans every tracked object, and the
imports of torch, Lightning and W&B leave about 420,000 of them: 0.2 s per collection on a 2-core machine, three
or four times per world change. Those objects live as long as the process, so they are moved out of the
collector's sight once (``gc.freeze``); collections then scan only what training created.

A training process on CPU also pays for how glibc's malloc serves PyTorch's large blocks (`heap_env`): without the
settings below, a `125m` step on 2 processes maps about 250,000 fresh pages (a gigabyte) and spends 38 % of its CPU
time in the kernel (`bench/heap.py`). So a process dynatrain starts (its launchers, ``dynatrain fit`` and
``dynatrain join``) gets them in its environment, unless ``DYNATRAIN_HEAP=glibc`` keeps glibc's own; glibc reads
them only at start-up. They became the default once a joiner prepared its shards before admission (a fresh
process maps the pages of its heap more slowly than freshly mapped blocks, which lengthened the scale-out's stall
before) and the suite passed with them on.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Mapping

FREEZE_ENV = "DYNATRAIN_GC_FREEZE"  # "0" keeps every object visible to the collector

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc
except (OSError, AttributeError):
    _malloc_trim = None


HEAP_ENV = "DYNATRAIN_HEAP"  # "reuse" (the default): the settings below; "glibc": glibc's malloc as it is
HEAP_CHOICES = ("reuse", "glibc")
TUNABLES_ENV = "GLIBC_TUNABLES"
# glibc maps every block above its mmap threshold (at most 32 MiB) afresh and unmaps it when freed, so each step
# faults in its gathered parameters and gradients again. Instead every block comes from the heap, and the heap keeps
# what is freed: glibc never trims it by itself, `release_freed_memory` decides when. PyTorch allocates aligned
# blocks, and glibc serves one by splitting a few bytes off the front of a larger chunk. Those bytes must stay free
# to merge with the block again when it is freed: in the per-thread cache or a fast bin they are taken by small
# blocks, the freed block is then a little too small for the same request, and the heap grows by one block each
# time (`tests/test_heap.py`), so both are off.
HEAP_TUNABLES = (
    ("glibc.malloc.mmap_max", "0"),
    ("glibc.malloc.trim_threshold", str(1 << 40)),
    ("glibc.malloc.tcache_count", "0"),
    ("glibc.malloc.mxfast", "0"),
)


def heap_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a training process about to start: `HEAP_TUNABLES` added to ``GLIBC_TUNABLES`` (a
    ``glibc.malloc`` setting ``env`` already has is kept), unless ``DYNATRAIN_HEAP=glibc``, which leaves ``env`` as it
    is. Other C libraries than glibc ignore the variable."""
    out = dict(env)
    choice = out.get(HEAP_ENV, "reuse")
    if choice not in HEAP_CHOICES:
        hint = (" ('default' named glibc's own settings while they were the default: now say 'glibc')"
                if choice == "default" else "")
        raise ValueError(f"{HEAP_ENV}={choice!r}: use 'reuse' (the default: serve PyTorch's blocks from a heap that "
                         f"keeps them) or 'glibc' (glibc's own settings){hint}")
    if choice == "glibc" or not sys.platform.startswith("linux"):
        return out
    current = [t for t in out.get(TUNABLES_ENV, "").split(":") if t]
    named = {t.split("=", 1)[0] for t in current}
    added = [f"{k}={v}" for k, v in HEAP_TUNABLES if k not in named]
    if added:
        out[TUNABLES_ENV] = ":".join(current + added)
    return out


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
