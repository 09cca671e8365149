"""What a resource-change signal asks for: a :class:`ScaleRequest`, checked when it is made.

A request names a target (a device count or a layout) and the global ranks that are going away. Requests that
arrive between two optimizer steps are merged by :func:`coalesce`: the latest target wins, and a rank that
announced it is leaving stays gone.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from dynatrain.vps.parallel_config import ParallelConfig

SOURCES = ("preemption", "control", "file", "trace", "arrival")
PAYLOAD_EXAMPLE = '{"devices": 3} or {"layout": "dp_shard=2,tp=2"}, optionally with "wait": true'
MAX_BODY = 64 * 1024


def describe_request(devices: int | None, layout: str | None, leave: tuple[int, ...], wait: bool = False) -> str:
    """``devices=3 layout=... leave=1,2 wait``: the parts a request sets."""
    parts = []
    if devices is not None:
        parts.append(f"devices={devices}")
    if layout is not None:
        parts.append(f"layout={layout}")
    if leave:
        parts.append(f"leave={','.join(map(str, leave))}")
    if wait:
        parts.append("wait")
    return " ".join(parts)


@dataclass(frozen=True)
class ScaleRequest:
    """Run on ``devices`` devices, or on ``layout``; ``leave`` are global ranks that are going away.

    A preemption names no target (``devices`` and ``layout`` both None): the job shrinks by the ranks in ``leave``.
    ``deadline`` (``time.monotonic()`` clock) is when the first of them is expected to die. ``wait``: a larger
    target holds training at the next step boundary until its joiners are ready, instead of training on while they
    start (the strategy's ``request_switch(..., wait=True)``). The layout is kept in its short form
    (``"dp_shard=2,tp=2"``), so equal layouts compare equal.
    """

    devices: int | None = None
    layout: str | None = None
    leave: tuple[int, ...] = ()
    source: str = "control"
    reason: str = ""
    received_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    wait: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.devices is not None and self.layout is not None:
            raise ValueError(f"give devices or layout, not both (got devices={self.devices!r}, "
                             f"layout={self.layout!r})")
        if self.devices is not None:
            _check_devices(self.devices)
        if self.layout is not None:
            object.__setattr__(self, "layout", _parse_layout(self.layout).short())
        object.__setattr__(self, "leave", _normalise_leave(self.leave))
        if self.devices is None and self.layout is None and not self.leave:
            raise ValueError(f"a scale request needs a target: {PAYLOAD_EXAMPLE}")
        if not isinstance(self.wait, bool):
            raise ValueError(f"wait must be true or false, got {self.wait!r}")
        if self.wait and self.devices is None and self.layout is None:
            raise ValueError("wait needs a target (devices or layout): it holds training until the joiners of a "
                             "larger target are ready")

    @property
    def parallel_config(self) -> ParallelConfig | None:
        return None if self.layout is None else ParallelConfig.parse(self.layout)

    @property
    def world_size(self) -> int | None:
        """Devices the request asks for; None for a pure preemption, whose size depends on the current world."""
        if self.layout is not None:
            return ParallelConfig.parse(self.layout).world_size
        return self.devices

    def describe(self) -> str:
        return describe_request(self.devices, self.layout, self.leave, self.wait)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_devices(devices: Any) -> None:
    if not is_int(devices):
        raise ValueError(f"devices must be an integer, got {devices!r}")
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}: a job cannot run on no device")


def _parse_layout(layout: Any) -> ParallelConfig:
    if not isinstance(layout, str):
        raise ValueError(f"layout must be a string like 'dp_shard=2,tp=2', got {layout!r}")
    return ParallelConfig.parse(layout)


def _normalise_leave(leave: Iterable[Any]) -> tuple[int, ...]:
    ranks = tuple(leave)
    bad = [r for r in ranks if not is_int(r) or r < 0]
    if bad:
        raise ValueError(f"leave holds global ranks (integers >= 0), got {bad!r}")
    return tuple(sorted(set(ranks)))


def request_from_payload(payload: Any, source: str, reason: str) -> ScaleRequest:
    """The request a JSON document (control body or watched file) asks for; ValueError saying what is wrong."""
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, {PAYLOAD_EXAMPLE}, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"devices", "layout", "wait"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}: send {PAYLOAD_EXAMPLE}")
    if len(set(payload) & {"devices", "layout"}) != 1:
        raise ValueError(f"give exactly one of 'devices' or 'layout': {PAYLOAD_EXAMPLE}")
    return ScaleRequest(devices=payload.get("devices"), layout=payload.get("layout"), source=source, reason=reason,
                        wait=payload.get("wait", False))


def check_limits(request: ScaleRequest, max_devices: int | None) -> None:
    """ValueError when the request asks for more devices than the job may have."""
    size = request.world_size
    if max_devices is not None and size is not None and size > max_devices:
        what = f"layout {request.layout} needs {size} devices" if request.layout else f"devices={size}"
        raise ValueError(f"{what}, above max_devices={max_devices}: ask for at most {max_devices}")


def coalesce(earlier: ScaleRequest | None, later: ScaleRequest) -> ScaleRequest:
    """The latest target wins, but a rank that announced it is leaving stays gone.

    A pure preemption carries no target, so it keeps the target (and its ``wait``) of the request it joins.
    """
    if earlier is None:
        return later
    deadlines = [d for d in (earlier.deadline, later.deadline) if d is not None]
    target = {} if later.world_size is not None else {"devices": earlier.devices, "layout": earlier.layout,
                                                      "wait": earlier.wait}
    return dataclasses.replace(
        later, **target,
        leave=tuple(sorted(set(earlier.leave) | set(later.leave))),
        deadline=min(deadlines) if deadlines else None,
        reason=f"{later.reason} (coalesced with an earlier {earlier.source} request: {earlier.describe()})",
    )
