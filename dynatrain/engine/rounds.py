"""One round's bookkeeping, kept alike by both ways a round runs (`transition`: batched for NCCL, streamed on gloo):
its wire operations and their slots in the staging buffer, the sources the wire reads in place, and where its
seconds went."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from dynatrain.engine.stats import TransitionStats
from dynatrain.engine.wire import WireOp, round_slots

_TIMED = ("pack", "local", "unpack")


class Round:
    """One round of one rank's run: its wire operations (`engine.wire.split_message`) with each one's offset in the
    staging buffer (the sends' slots first, the receives' after them), and ``on_wire``: the sources the wire reads in
    place, which are freed only after the wait. Packing, local copies and unpacking are timed as they run
    (`timed`); the wire gets the rest of the round (posting and waiting), so a phase that runs while the wire is
    busy is counted once. ``messages``: the plan's messages the round sends and receives."""

    def __init__(self, sends: list[WireOp], recvs: list[WireOp], messages: tuple[int, int]) -> None:
        self.sends, self.recvs, self.messages = sends, recvs, messages
        send_offs, recv_offs, _ = round_slots(sends, recvs)
        self.staged_sends = list(zip(sends, send_offs))
        self.staged_recvs = list(zip(recvs, recv_offs))
        self.on_wire: set[str] = set()
        self.seconds = dict.fromkeys(_TIMED, 0.0)
        self.start = time.perf_counter()

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Count the seconds inside towards ``phase`` (``pack``, ``local`` or ``unpack``)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t

    def close(self, stats: TransitionStats) -> None:
        """Add the round's seconds, by phase, and its messages to ``stats``."""
        wire = time.perf_counter() - self.start - sum(self.seconds.values())
        stats.seconds_pack += self.seconds["pack"]
        stats.seconds_local += self.seconds["local"]
        stats.seconds_unpack += self.seconds["unpack"]
        stats.seconds_wire += wire
        stats.messages_sent += self.messages[0]
        stats.messages_received += self.messages[1]
