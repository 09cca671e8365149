"""Small pages for the planner's arrays.

Planning a 405B change at 16,384 ranks allocates on the order of a gigabyte of arrays (millions of pairs and
(region, holder) rows) that each live for milliseconds. NumPy asks the kernel for transparent huge pages on every
large array (``madvise(MADV_HUGEPAGE)``). Where the kernel's THP ``defrag`` setting is ``madvise`` (a common
default), a fault in such a region first tries to compact memory into a huge page. For arrays that short-lived that
is pure cost: `dynatrain plan` turning pp on for Llama-3.1-405B took 4.8 to 6.5 s of CPU with the hint and 3.4 to
3.6 s without it, almost all of the difference in system time (`bench/results/plan405/small_pages.json`,
`docs/planner.md`).

:func:`small_pages` switches NumPy's hint off while a plan is computed and restores it after. The hint is
process-wide; concurrent planners (a background prepare thread and the training thread) share one switch-off.
Without the private NumPy hook (a NumPy that lacks it) it does nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # NumPy 1.x
    try:
        from numpy.core.multiarray import _set_madvise_hugepage
    except ImportError:
        _set_madvise_hugepage = None

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_depth = 0
_previous = True


@contextmanager
def small_pages() -> Iterator[None]:
    """NumPy's huge-page hint off inside, back to what it was when the outermost user leaves."""
    global _depth, _previous
    if _set_madvise_hugepage is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _previous = _set_madvise_hugepage(False)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set_madvise_hugepage(_previous)


def with_small_pages(function: F) -> F:
    """``function`` run inside :func:`small_pages`."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with small_pages():
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]
