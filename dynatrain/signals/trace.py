"""A scripted trace of ``(step, devices or layout)`` entries, for experiments and replayed traces.

It is polled by optimizer step instead of feeding a hub, so every rank sees the same entries at the same step
without talking to the others.
"""

from __future__ import annotations

from typing import Any, Sequence

from dynatrain.signals.request import ScaleRequest, check_limits, is_int


class TraceSource:
    """A scripted list of ``(step, devices or layout)`` from a recipe: for experiments and replayed traces.

    Entries are tuples ``(10, 2)`` / ``(10, "dp_shard=2,tp=2")`` or dicts ``{"step": 10, "devices": 2}`` /
    ``{"step": 10, "layout": "..."}``. A dict may add ``"wait": True``: a larger target then holds training at that
    boundary until its joiners are ready, so the change comes at that step, not at a later one. A bad trace raises
    ``ValueError`` at construction, naming the entry, so the recipe is fixed before any training. :meth:`due`
    depends only on the step, so every rank agrees without communicating.
    """

    def __init__(self, entries: Sequence[Any], max_devices: int | None = None) -> None:
        if isinstance(entries, (str, bytes, dict)) or not isinstance(entries, Sequence):
            raise ValueError(f"a trace is a list of (step, devices or layout) entries, got {entries!r}")
        self.entries: tuple[tuple[int, int | str, bool], ...] = tuple(
            _trace_entry(i, entry, max_devices) for i, entry in enumerate(entries))
        for i in range(1, len(self.entries)):
            if self.entries[i][0] <= self.entries[i - 1][0]:
                raise ValueError(f"trace entry {i} ({entries[i]!r}): step {self.entries[i][0]} does not come after "
                                 f"step {self.entries[i - 1][0]} of entry {i - 1}; list entries in strictly "
                                 f"increasing step order")
        self._next = 0

    def due(self, step: int) -> list[ScaleRequest]:
        """Entries with ``entry step <= step`` not returned before, in order (usually none or one)."""
        out = []
        while self._next < len(self.entries) and self.entries[self._next][0] <= step:
            at, value, wait = self.entries[self._next]
            target = {"devices": value} if is_int(value) else {"layout": value}
            out.append(ScaleRequest(**target, source="trace", reason=f"trace entry {self._next} at step {at}",
                                    wait=wait))
            self._next += 1
        return out

    @property
    def fired(self) -> int:
        """How many entries :meth:`due` has returned."""
        return self._next

    def __len__(self) -> int:
        return len(self.entries)


def _trace_entry(index: int, entry: Any, max_devices: int | None) -> tuple[int, int | str, bool]:
    try:
        step, value, wait = _split_entry(entry)
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        request = _trace_target(value, wait)
        check_limits(request, max_devices)
    except ValueError as err:
        raise ValueError(f"trace entry {index} ({entry!r}): {err}") from None
    return step, request.devices if request.devices is not None else request.layout, request.wait


def _split_entry(entry: Any) -> tuple[Any, Any, Any]:
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"step", "devices", "layout", "wait"})
        if unknown or "step" not in entry or len(set(entry) & {"devices", "layout"}) != 1:
            raise ValueError("write it as {step: N, devices: D} or {step: N, layout: 'dp_shard=2,tp=2'}, "
                             "optionally with wait: true"
                             + (f" (unknown key(s) {', '.join(map(repr, unknown))})" if unknown else ""))
        return entry["step"], entry.get("devices", entry.get("layout")), entry.get("wait", False)
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        return entry[0], entry[1], False
    raise ValueError("write it as (step, devices) or (step, 'dp_shard=2,tp=2'), or as a dict to add wait: true")


def _trace_target(value: Any, wait: Any) -> ScaleRequest:
    if isinstance(value, str):
        return ScaleRequest(layout=value, source="trace", wait=wait)
    if is_int(value):
        return ScaleRequest(devices=value, source="trace", wait=wait)
    raise ValueError(f"the target must be a device count (integer >= 1) or a layout string, got {value!r}")
