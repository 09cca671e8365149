"""What one layout switch reports (its phases, bytes and memory, as every rank saw them), and what a recovery from a
lost process reports."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


# A GPU's caching allocator over the transfer, from `TransitionStats` (None off CUDA).
DEVICE_FIELDS = ("device_peak_allocated", "device_peak_reserved", "device_reserved_bound", "cache_releases")


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
    verified: bool | None  # checked against the tensors' own placements (`check.verify`); None: not checked
    phases: dict[str, float] = field(default_factory=dict)
    old_world_size: int | None = None
    prepared: bool = False  # planned in the background while training went on (a scale-out, or plan_ahead)
    # A world change whose target world formed in the background: the optimizer steps trained while it formed (its
    # ``world`` phase is then only the swap); None where it formed in the stall, or no world formed.
    formed_ahead_steps: int | None = None
    # torch.compile of the target's blocks, None when off: compiled at the first step on the new layout (it needs the
    # moved weights), outside the stall; filled in as that step runs.
    compile_s: float | None = None
    # The freed heap was given back to the OS after the switch (`memory.release_freed_memory`): the next step maps
    # its working memory again.
    heap_trimmed: bool = False
    # On CUDA (None elsewhere), the caching allocator over the transfer (`engine.device_memory`): its peaks of allocated
    # and reserved bytes (reserved holds freed blocks kept for reuse, and is what the device lacks), the bound the
    # reserved bytes are kept within, and how often the cache was given back to keep it.
    device_peak_allocated: int | None = None
    device_peak_reserved: int | None = None
    device_reserved_bound: int | None = None
    cache_releases: int | None = None
    # Seconds this rank waited at the step boundary for the slowest rank to end its step (in the agreement on the
    # states): the skew the next step's first collective absorbs without a switch, so not part of the stall.
    boundary_wait_s: float = 0.0
    # On the process that joined the job by this switch (None elsewhere): its seconds outside the switch's phases,
    # from ready to its first step: waiting for admission, forming the world ahead, waiting for the switch's
    # payload, Lightning's set-up of the module and of the optimizer, and its restore of the loop.
    joined: dict[str, float] | None = None

    @property
    def verify_share(self) -> float | None:
        """The check's share of the stall."""
        return self.phases["verify"] / self.stall_s if "verify" in self.phases and self.stall_s else None

    @property
    def stall_s(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stall_s"] = self.stall_s
        d["verify_share"] = self.verify_share
        return d


class PhaseTimer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.aside: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        self._t = now

    def set_aside(self, name: str, seconds: float) -> None:
        """``seconds`` just spent, kept out of the next lap and recorded under ``name`` apart from the phases."""
        self.aside[name] = self.aside.get(name, 0.0) + seconds
        self._t += seconds


@dataclass
class RecoveryReport:
    step: int
    lost: list[str]
    survivors: int
    old_layout: str
    new_layout: str
    bytes_moved: int
    seconds: float
    cause: str
    phases: dict
    replicas_compared: int = 0  # regions and scalars two or more survivors held, found equal before recovering

    def as_dict(self) -> dict:
        return dict(self.__dict__)
