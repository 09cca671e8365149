"""The pays-back decision: the best layout for the devices at hand, and on the same devices a switch only when the
time it saves over the horizon exceeds what it costs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynatrain.policy.inputs import DEFAULT_SWITCH_BUDGET, CostModel, Devices, Workload
from dynatrain.policy.search import LayoutCandidate, estimate_layout, no_fit_message, rank_key, rank_layouts
from dynatrain.policy.switch_cost import SwitchCost, SwitchVerdict, price_switch
from dynatrain.vps.parallel_config import ParallelConfig


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class LayoutDecision:
    """What to run next. ``target == current`` means keep the current layout."""

    current: ParallelConfig | None
    target: ParallelConfig
    reason: str
    estimate: LayoutCandidate                # the target's predictions
    current_estimate: LayoutCandidate | None
    switch: SwitchCost | None                # None when nothing was priced
    gain_seconds: float | None               # predicted time saved over the horizon by the chosen switch
    horizon_steps: int
    ranked: tuple[LayoutCandidate, ...] = field(repr=False, default=())

    @property
    def checkpointing(self) -> str:
        """The activation checkpointing the target's predictions assume (what a recipe should set)."""
        return self.estimate.checkpointing

    @property
    def changes(self) -> bool:
        return self.target != self.current

    @property
    def switch_seconds(self) -> float | None:
        return None if self.switch is None else self.switch.seconds

    @property
    def bytes_moved(self) -> int | None:
        return None if self.switch is None else self.switch.bytes_moved


@dataclass(frozen=True)
class LayoutPolicy:
    """Choose the best layout for the devices at hand; on the same devices, switch only when it pays.

    ``horizon_steps``: optimizer steps the new layout is expected to run (until the next resource change).
    ``fixed_seconds``: stall of a switch besides the transfer. ``max_priced``: how many of the layouts faster
    than the current one are priced (each costs one routing plan); the one with the largest net gain wins."""

    horizon_steps: int = 200
    cost: CostModel = CostModel()
    budget_bytes: int = DEFAULT_SWITCH_BUDGET
    fixed_seconds: float = 0.0
    max_priced: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.horizon_steps, bool) or not isinstance(self.horizon_steps, int) or self.horizon_steps < 0:
            raise ValueError(f"horizon_steps must be a non-negative integer, got {self.horizon_steps!r}")
        if self.max_priced < 1:
            raise ValueError(f"max_priced must be at least 1, got {self.max_priced!r}")
        if self.fixed_seconds < 0:
            raise ValueError(f"fixed_seconds must be >= 0, got {self.fixed_seconds!r}")

    def decide(self, devices: Devices, work: Workload, current: ParallelConfig | str | None = None, *,
               rank_map: Sequence[int | None] | None = None, leave: Iterable[int] = (),
               lost: Iterable[int] = ()) -> LayoutDecision:
        ranked = tuple(rank_layouts(devices, work, self.cost))
        if not ranked[0].runnable:
            raise ValueError(no_fit_message(devices, work, ranked))
        best = ranked[0]
        if current is None:
            return self._decision(None, best, "no current layout: the best predicted throughput", ranked)
        current = ParallelConfig.parse(current)
        leave, lost = tuple(leave), tuple(lost)
        if current.world_size != devices.count or leave or lost:
            cost = self._price(current, best.config, devices, work, rank_map, leave, lost)
            change = (f"device count changed from {current.world_size} to {devices.count}"
                      if current.world_size != devices.count else "processes leave or were lost")
            reason = (f"{change}: the current layout cannot run, so the switch is never skipped; "
                      f"{best.config.short()} is the best predicted")
            return self._decision(current, best, reason, ranked, switch=cost)
        now = estimate_layout(current, devices, work, self.cost)
        if not now.runnable:
            cost = self._price(current, best.config, devices, work, rank_map, leave, lost)
            return self._decision(current, best, f"the current layout cannot run: {now.excluded}", ranked,
                                  now=now, switch=cost, gain=math.inf)
        return self._weigh(current, now, ranked, devices, work, rank_map)

    def _weigh(self, current: ParallelConfig, now: LayoutCandidate, ranked: tuple[LayoutCandidate, ...],
               devices: Devices, work: Workload, rank_map) -> LayoutDecision:
        faster = [c for c in ranked if c.runnable and rank_key(c)[0] < rank_key(now)[0]][: self.max_priced]
        if not faster:
            return self._decision(current, now, "the current layout is already the best predicted", ranked, now=now)
        verdicts = [
            SwitchVerdict(now, c, self.horizon_steps,
                          self._price(current, c.config, devices, work, rank_map, (), ()))
            for c in faster
        ]
        pick = max(verdicts, key=lambda v: v.net_seconds)
        figures = (f"{pick.candidate.config.short()} saves {pick.gain_seconds:.3g} s over {self.horizon_steps} "
                   f"steps ({now.step_seconds:.4g} -> {pick.candidate.step_seconds:.4g} s/step), the switch costs "
                   f"{pick.cost.seconds:.3g} s ({_size(pick.cost.bytes_moved)} moved)")
        if pick.pays:
            return self._decision(current, pick.candidate, f"switch: {figures}", ranked, now=now,
                                  switch=pick.cost, gain=pick.gain_seconds)
        return self._decision(current, now, f"keep {current.short()}: {figures}, which does not pay", ranked,
                              now=now, switch=pick.cost, gain=pick.gain_seconds)

    def _price(self, current, target, devices, work, rank_map, leave, lost) -> SwitchCost | None:
        if current == target and not leave and not lost:
            return None
        return price_switch(current, target, devices, work, budget_bytes=self.budget_bytes,
                            fixed_seconds=self.fixed_seconds, rank_map=rank_map, leave=leave, lost=lost)

    def _decision(self, current, target: LayoutCandidate, reason: str, ranked, *, now=None, switch=None,
                  gain=None) -> LayoutDecision:
        if target.checkpointing != "none":
            reason += f"; with activation checkpointing {target.checkpointing} to fit memory"
        return LayoutDecision(current, target.config, reason, target, now, switch, gain, self.horizon_steps, ranked)


def plan_layout(devices: Devices, work: Workload, current: ParallelConfig | str | None = None, *,
                policy: LayoutPolicy | None = None, rank_map: Sequence[int | None] | None = None,
                leave: Iterable[int] = (), lost: Iterable[int] = ()) -> LayoutDecision:
    """The layout to run on ``devices`` next, given the ``current`` one (None at start); see `LayoutPolicy`."""
    return (policy or LayoutPolicy()).decide(devices, work, current, rank_map=rank_map, leave=leave, lost=lost)
