"""The :class:`SignalHub`: where the asynchronous sources (a signal, HTTP, a file) leave their requests.

It validates each request, keeps only the latest (requests arriving between two optimizer steps are coalesced)
and lets the training loop take it with :meth:`SignalHub.poll` at a step boundary. A bad request never raises
into training: it is logged on the ``dynatrain.elastic`` logger and kept in :attr:`SignalHub.rejected`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dynatrain.signals.request import ScaleRequest, check_limits, coalesce, is_int

LOGGER = logging.getLogger("dynatrain.elastic")
MAX_REJECTED = 256


class Verdict(NamedTuple):
    accepted: bool
    reason: str


@dataclass(frozen=True)
class Rejection:
    source: str
    reason: str
    request: ScaleRequest | None = None
    received_at: float = field(default_factory=time.monotonic)


class SignalHub:
    """Collects requests from any thread; the training loop takes the latest with :meth:`poll`."""

    def __init__(self, max_devices: int | None = None) -> None:
        if max_devices is not None and (not is_int(max_devices) or max_devices < 1):
            raise ValueError(f"max_devices must be a positive integer or None, got {max_devices!r}")
        self.max_devices = max_devices
        self._lock = threading.Lock()
        self._pending: ScaleRequest | None = None
        self._rejected: collections.deque[Rejection] = collections.deque(maxlen=MAX_REJECTED)
        self._sources: list[Any] = []
        # A signal handler runs on the main thread between two bytecodes, possibly while that thread holds
        # _lock: it must not take the lock, so it drops its request here and the next poll picks it up.
        self._from_signals: queue.SimpleQueue[ScaleRequest] = queue.SimpleQueue()

    def submit(self, request: ScaleRequest) -> Verdict:
        """Validate against the limits and make ``request`` the pending one (merged with any earlier one)."""
        if not isinstance(request, ScaleRequest):
            return self.reject("unknown", f"not a ScaleRequest: {request!r}")
        try:
            check_limits(request, self.max_devices)
        except ValueError as err:
            return self.reject(request.source, str(err), request)
        with self._lock:
            self._pending = coalesce(self._pending, request)
        LOGGER.info("scale request from %s queued: %s (%s)", request.source, request.describe(), request.reason)
        return Verdict(True, f"queued {request.describe()}: applied at the next optimizer-step boundary")

    def submit_from_signal_handler(self, request: ScaleRequest) -> None:
        """Queue without locking or logging, both unsafe inside a signal handler; :meth:`poll` submits it."""
        self._from_signals.put(request)

    def reject(self, source: str, reason: str, request: ScaleRequest | None = None) -> Verdict:
        """Record and log a refused request; training goes on."""
        with self._lock:
            self._rejected.append(Rejection(source, reason, request))
        LOGGER.warning("scale request from %s rejected: %s", source, reason)
        return Verdict(False, reason)

    def poll(self) -> ScaleRequest | None:
        """Take the pending request, if any."""
        self._drain_signals()
        with self._lock:
            request, self._pending = self._pending, None
        return request

    def peek(self) -> ScaleRequest | None:
        """The pending request, left pending."""
        self._drain_signals()
        with self._lock:
            return self._pending

    @property
    def rejected(self) -> list[Rejection]:
        """The most recent rejections, oldest first (bounded, so a flood of bad requests cannot grow memory)."""
        with self._lock:
            return list(self._rejected)

    def attach(self, source: Any) -> None:
        """Have :meth:`close` stop ``source`` (anything with a ``close()``)."""
        with self._lock:
            self._sources.append(source)

    def close(self) -> None:
        """Stop every attached source, newest first; the first failure is raised once all were tried."""
        with self._lock:
            sources, self._sources = self._sources[::-1], []
        errors = []
        for source in sources:
            try:
                source.close()
            except Exception as err:  # one broken source must not keep the others running
                LOGGER.exception("closing %r failed", source)
                errors.append(err)
        if errors:
            raise errors[0]

    def __enter__(self) -> "SignalHub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain_signals(self) -> None:
        while True:
            try:
                request = self._from_signals.get_nowait()
            except queue.Empty:
                return
            self.submit(request)
