"""Rank 0 of an elastic job tells its warm standby pool how much memory a step works in.

A process that joins maps its working memory during its first step unless its allocator holds it already, and on
CPU that is a gigabyte of page faults for a `125m` step, seconds on a loaded host, every other process waiting for it
at the step's first collective. A standby process can warm its allocator while it waits (`JoinerPrep`), but only
once it knows how much: rank 0 measures what its allocator holds free at a step boundary and publishes it under
`WORKING_KEY`, again whenever it has grown."""

from __future__ import annotations

import time

from dynatrain.switch.prepare import WORKING_KEY, free_working_bytes


class WorkingMemoryNotice:
    EVERY = 10.0  # seconds between two reads of the allocator on rank 0 (each walks the heap's free lists)
    GROWTH = 1 / 16  # what the working memory must grow by to be published again

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.published = 0
        self._next = 0.0

    def at_step_end(self) -> None:
        """At an optimizer-step boundary, on every rank (only rank 0 of an elastic world reads and publishes)."""
        strategy = self.strategy
        manager = getattr(strategy, "elastic", None)
        if manager is None or manager.world is None or strategy.global_rank != 0 or strategy.detached:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.EVERY
        working = free_working_bytes(strategy.root_device)
        if working > self.published * (1 + self.GROWTH):
            try:
                manager.store.set(WORKING_KEY, str(working))
            except RuntimeError:
                return  # the store is unreachable: the pool warms from the next change's intent instead
            self.published = working
