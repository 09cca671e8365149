"""Process memory around a switch: cheap cycle collections and freed heap given back to the OS when it piles up.

A world change runs full collections: the old world's dead DTensors and pending work must go before its process
group is ended (`elastic.world`); so does a recovery, whose broken world's groups must lose their last reference at
once. The old model's shards need none: the engine empties each one's storage after its last use, though FSDP's
reference cycles still hold the tensor objects (`engine.storages`). A full collection scans every tracked object,
and the imports of torch, Lightning and W&B leave about 420,000 of them: 0.2 s per collection on a 2-core machine.
Those objects live as long as the process, so they are moved out of the collector's sight once (``gc.freeze``,
`freeze_import_time_objects`); collections then scan only what training created. Importing dynatrain does not do it
(importing changes nothing beyond registering the strategy): its entry points do, after their imports and before any
model exists (`dynatrain fit|validate|test|join`, `dynatrain plan`, and the zygote that forks the ranks of
`launcher.launch_local(preload=...)`); a training script of your own calls it after its imports.

A training process on CPU also pays for how glibc's malloc serves PyTorch's large blocks (`heap_env`): without the
settings below, a `125m` step on 2 processes maps about 250,000 fresh pages (a gigabyte) and spends 38 % of its CPU
time in the kernel (`bench/heap.py`). So a process dynatrain starts (its launchers, ``dynatrain fit`` and
``dynatrain join``) gets them in its environment, unless ``heap="glibc"`` (the launchers' argument, ``--heap glibc``
on the command line, or ``DYNATRAIN_HEAP=glibc`` carried in the environment) keeps glibc's own; glibc reads
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

from dynatrain.settings import FREEZE_ENV, HEAP_ENV, explicit_or_env

# Each variable here is the default of an argument, which wins when given (dynatrain.settings lists them; this
# module sits below it and applies the same precedence itself).

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc
except (OSError, AttributeError):
    _malloc_trim = None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


try:
    _mallinfo2 = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    _mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):
    _mallinfo2 = None


HEAP_CHOICES = ("reuse", "glibc")
TUNABLES_ENV = "GLIBC_TUNABLES"
# glibc maps every block above its mmap threshold (at most 32 MiB) afresh and unmaps it when freed, so each step
# faults in its gathered parameters and gradients again. Instead every block comes from the heap, and the heap keeps
# what is freed: glibc never trims it by itself, `release_freed_memory` decides when. PyTorch allocates aligned
# blocks, and glibc serves one by splitting a few bytes off the front of a larger chunk. Those bytes must stay free
# to merge with the block again when it is freed: in the per-thread cache or a fast bin they are taken by small
# blocks, the freed block is then a little too small for the same request, and the heap grows by one block each
# time (`tests/test_heap.py`), so both are off. A thread other than the main one gets an arena of its own, made of
# 64 MiB heaps, and glibc maps a larger block there afresh whatever the settings say (the collectives' threads
# allocate such blocks every step: a `125m` step faulted in 190 MiB that way), so one arena serves every thread.
HEAP_TUNABLES = (
    ("glibc.malloc.mmap_max", "0"),
    ("glibc.malloc.trim_threshold", str(1 << 40)),
    ("glibc.malloc.tcache_count", "0"),
    ("glibc.malloc.mxfast", "0"),
    ("glibc.malloc.arena_max", "1"),
)


def heap_env(env: Mapping[str, str], heap: str | None = None) -> dict[str, str]:
    """``env`` for a training process about to start: `HEAP_TUNABLES` added to ``GLIBC_TUNABLES`` (a
    ``glibc.malloc`` setting ``env`` already has is kept), unless the choice is ``"glibc"``, which leaves the
    tunables as they are. The choice: ``heap`` when given (it wins, and is written to the result's
    ``DYNATRAIN_HEAP`` so the processes this one starts keep it), else ``env``'s ``DYNATRAIN_HEAP``, else
    ``"reuse"``. Other C libraries than glibc ignore the variable."""
    out = dict(env)
    choice = heap if heap is not None else out.get(HEAP_ENV) or "reuse"
    if choice not in HEAP_CHOICES:
        hint = (" ('default' named glibc's own settings while they were the default: now say 'glibc')"
                if choice == "default" else "")
        named = "heap" if heap is not None else HEAP_ENV
        raise ValueError(f"{named}={choice!r}: use 'reuse' (the default: serve PyTorch's blocks from a heap that "
                         f"keeps them) or 'glibc' (glibc's own settings){hint}")
    if heap is not None:
        out[HEAP_ENV] = heap  # what the processes this one starts inherit
    if choice == "glibc" or not sys.platform.startswith("linux"):
        return out
    current = [t for t in out.get(TUNABLES_ENV, "").split(":") if t]
    named = {t.split("=", 1)[0] for t in current}
    added = [f"{k}={v}" for k, v in HEAP_TUNABLES if k not in named]
    if added:
        out[TUNABLES_ENV] = ":".join(current + added)
    return out


def heap_keeps_freed_memory() -> bool:
    """Whether this process runs with `HEAP_TUNABLES` as they are (glibc reads them at start-up): the heap then
    keeps what is freed, mapped, for the next allocation of any thread."""
    current = set(os.environ.get(TUNABLES_ENV, "").split(":"))
    return _mallinfo2 is not None and all(f"{k}={v}" in current for k, v in HEAP_TUNABLES)


def heap_free_bytes() -> int:
    """Bytes the heap holds free now (0 where glibc cannot say). Between two steps, with the heap settings, that is
    mostly the memory a step works in."""
    return malloc_figures().get("malloc_free_bytes", 0)


def malloc_figures() -> dict[str, int]:
    """glibc's view of the heap (every arena): bytes handed out and not freed (heap and mapped blocks), bytes it holds
    free, and bytes in mapped blocks; empty where glibc cannot say. In use flat while RSS grows is memory the heap
    keeps (fragmentation), not a leak."""
    if _mallinfo2 is None:
        return {}
    m = _mallinfo2()
    return {"malloc_in_use_bytes": int(m.uordblks + m.hblkhd), "malloc_free_bytes": int(m.fordblks),
            "malloc_mmapped_bytes": int(m.hblkhd)}


def trim_heap() -> None:
    """Give every free page of the heap back to the OS now (glibc's ``malloc_trim(0)``), whatever the footprint."""
    if _malloc_trim is not None:
        _malloc_trim(0)


# Measured: after importing torch, torch.distributed, lightning.pytorch (with its CLI), dynatrain's strategy, CausalLM
# and the datamodule, about 444,000 objects are tracked and one full gc.collect() took 0.14 to 0.20 s (median
# 0.15 to 0.16 s over 3 processes of 7 collections each, Python 3.11, 2 cores, load 1.3); after gc.freeze() the
# same collection took 0.2 microseconds (nothing else alive yet).
# A world change then ran three or four full collections, so without the freeze it stalled every process 0.45 to
# 0.6 s more; docs/benchmarks.md records the online stalls that fell when the freeze came in.
_frozen = False  # this process froze once: objects made since (a model, a Trainer) may become garbage


def freeze_import_time_objects(enabled: bool | None = None) -> int:
    """Exclude the objects that exist now (modules, classes, functions of the libraries imported so far) from
    later collections; returns how many are frozen (0 when off). Objects frozen are never collected when they
    become cyclic garbage, so call it after the imports and before any model or Trainer exists; only the first call
    of a process freezes. ``enabled``: an explicit argument wins; None takes ``$DYNATRAIN_GC_FREEZE`` ("0": off;
    ``--no-gc-freeze`` on the command line sets it for every process of the job), on by default."""
    global _frozen
    if explicit_or_env(enabled, FREEZE_ENV, lambda raw: raw != "0") is False:
        return 0
    if _frozen:
        return gc.get_freeze_count()
    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    _frozen = True
    return gc.get_freeze_count()


TRIM_SLACK = 0.02  # RSS after a switch may exceed the largest footprint known by this fraction before a trim
_footprint: list[int] = []  # the largest footprint known: RSS at a switch's start, or after a trim


def release_freed_memory(before: int | None = None) -> bool:
    """Collect what the switch left in cycles and, when the switch left the process larger than any footprint it
    had, give the heap back to the OS. ``before``: RSS when the switch started (`resident_bytes`).

    The old model's shards went in the transfer (the engine empties their storage); what is left of it is small
    objects in reference cycles, old ones, left to the next full collection (a world change's end of a generation
    runs one). What became garbage during the switch is young, so the two younger generations are collected here
    instead of walking every object the process holds (a full collection costs 20 to 100 ms of the stall on 2
    cores).

    glibc keeps freed memory, and over hundreds of switches the fragments of old shards make RSS creep up.
    Trimming bounds that, but it also returns the memory a step works in, which the heap keeps mapped between
    steps: the first step after the switch must then map it again (1.3 GiB, about a second more of kernel time per
    process on 2 cores, for a `125m` step after a scale-out). RSS at a switch's start is the footprint of the layout it
    leaves, that working memory included. So the heap is trimmed only when RSS after the switch exceeds the
    largest footprint known by ``TRIM_SLACK``: RSS stays within that of the largest layout's footprint, and first
    steps find their memory in place. Returns whether it trimmed."""
    gc.collect(1)
    if _malloc_trim is None:
        return False
    if before is not None:
        _footprint[:] = [max(_footprint + [before])]
    rss = resident_bytes()
    if not _footprint:
        _footprint.append(rss)
        return False
    if rss <= _footprint[0] * (1 + TRIM_SLACK):
        return False
    _malloc_trim(0)
    _footprint[0] = max(_footprint[0], resident_bytes())
    return True


def resident_bytes() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
