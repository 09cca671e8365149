"""Preemption: a signal (SIGTERM by default) tells this process it goes away soon; the job scales in without it."""

from __future__ import annotations

import logging
import signal
import threading
import time

from dynatrain.signals.hub import SignalHub
from dynatrain.signals.request import ScaleRequest, is_int

LOGGER = logging.getLogger("dynatrain.elastic")


class PreemptionSource:
    """``signum`` (SIGTERM by default) means "this process goes away within ``grace_seconds``".

    The handler only queues a request with ``leave=(rank,)``; the process keeps running so the job can scale in
    without it before it dies. It replaces whatever handler was installed (Lightning's SIGTERM handler would stop
    training) and puts that one back on :meth:`close`.
    """

    def __init__(self, hub: SignalHub, rank: int, signum: int = signal.SIGTERM, grace_seconds: float = 30.0) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionSource must be created on the main thread: Python lets only the main "
                               "thread install signal handlers")
        if not is_int(rank) or rank < 0:
            raise ValueError(f"rank must be a global rank (integer >= 0), got {rank!r}")
        if not grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds!r}")
        self.hub, self.rank, self.signum, self.grace_seconds = hub, rank, signal.Signals(signum), grace_seconds
        self.deadline: float | None = None
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        hub.attach(self)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.deadline is None:
            # A repeated signal does not extend the grace period the first one started.
            self.deadline = now + self.grace_seconds
        self.hub.submit_from_signal_handler(ScaleRequest(
            leave=(self.rank,), source="preemption", received_at=now, deadline=self.deadline,
            reason=f"rank {self.rank} received {self.signum.name}; it leaves within {self.grace_seconds:g} s",
        ))

    def close(self) -> None:
        if not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"close the PreemptionSource on the main thread: only it can restore the "
                               f"{self.signum.name} handler")
        self._installed = False
        if signal.getsignal(self.signum) != self._handle:
            # Someone installed a handler after ours; putting the older one back would silently drop theirs.
            LOGGER.warning("%s handler was replaced after the preemption source installed its own; leaving it",
                           self.signum.name)
            return
        # None means a handler installed outside Python, which cannot be put back from here.
        signal.signal(self.signum, signal.SIG_DFL if self._previous is None else self._previous)
