"""How many intra-op threads the engine copies with on CPU.

On CPU the copies share the cores with gloo's thread, which moves the bytes through the socket, and with the
other processes on the host. An OpenMP team waits at the end of each copy for its slowest thread, spinning on its
cores meanwhile, so a team that does not fit beside the wire and the other processes' teams makes every copy wait
for a thread that has no core. Two processes of 16 threads on 16 cores took 0.6 to 0.8 s for each of packing,
local copies and unpacking of 74 MiB (1.3 to 1.4 s a switch); 8 threads each took 0.10 to 0.16 s in all
(`bench/cpu_threads.sh`). The copies therefore run with `default_copy_threads` threads: one fewer than the
process has, at most `COPY_THREADS_MAX` (on 16 cores, 2 to 7 copy threads took the same time), and the count is
restored after the transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dynatrain.engine.checks import TransitionError

COPY_THREADS_MAX = 4


def default_copy_threads(process_threads: int | None = None) -> int:
    """The intra-op threads a CPU transfer copies with: one fewer than the process's (``process_threads``, default
    torch's current count), so that gloo's thread keeps a core of the process's share, and at most
    `COPY_THREADS_MAX`, so that the team fits even where the processes' threads oversubscribe the host."""
    n = torch.get_num_threads() if process_threads is None else process_threads
    return max(1, min(n - 1, COPY_THREADS_MAX))


@contextmanager
def intra_op_threads(device: torch.device, requested: int | None) -> Iterator[int | None]:
    """Run the block with ``requested`` (default `default_copy_threads`) intra-op threads on CPU, then restore the
    count."""
    if device.type != "cpu":
        yield None
        return
    if requested is not None and requested < 1:
        raise TransitionError(f"copy_threads={requested}: pass at least 1, or None for the default")
    before = torch.get_num_threads()
    n = default_copy_threads(before) if requested is None else requested
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if n != before:
            torch.set_num_threads(before)
