"""What one layout switch reports: its phases, bytes and memory, as every rank saw them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field



@dataclass
class SwitchReport:
    """One layout switch, as every rank saw it (bytes and peak are this rank's unless named total)."""

    step: int
    old_layout: str
    new_layout: str
    world_size: int  # processes in the new world (0 on a process that left)
    bytes_total: int
    bytes_moved: int
    bytes_moved_identity: int | None
    rounds: int
    rank_map: list[int]
    peak_bytes: int
    peak_bound: int
    verified: bool | None
    phases: dict[str, float] = field(default_factory=dict)
    old_world_size: int | None = None
    prepared: bool = False  # a world change planned in the background while training went on

    @property
    def stall_s(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stall_s"] = self.stall_s
        return d


class PhaseTimer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        self._t = now
