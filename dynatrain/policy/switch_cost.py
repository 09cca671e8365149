"""What a switch between two layouts costs, from the routing planner's plan and its network model, and whether a
switch on the same devices saves more than it costs over a horizon."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dynatrain.models.registry import spec_for
from dynatrain.models.specs import layout_for_model
from dynatrain.planner.schedule import plan_switch
from dynatrain.policy.inputs import DEFAULT_SWITCH_BUDGET, CostModel, Devices, Workload
from dynatrain.policy.search import LayoutCandidate, estimate_layout
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class SwitchCost:
    """What the routing planner predicts for moving every state from one layout to another."""

    bytes_moved: int
    bytes_total: int
    rounds: int
    transfer_seconds: float  # the network model's time for the plan's rounds
    fixed_seconds: float     # the stall besides the transfer (rebuilding model and optimizer, agreement)

    @property
    def seconds(self) -> float:
        return self.transfer_seconds + self.fixed_seconds


def price_switch(current: ParallelConfig | str, target: ParallelConfig | str, devices: Devices, work: Workload,
                 *, budget_bytes: int = DEFAULT_SWITCH_BUDGET, fixed_seconds: float = 0.0,
                 rank_map: Sequence[int | None] | None = None, leave: Iterable[int] = (),
                 lost: Iterable[int] = ()) -> SwitchCost:
    """Plan the switch as the strategy would (optimal rank map, TP groups inside nodes) and time it.

    ``rank_map``: the process at each position of ``current`` (identity by default). ``leave``/``lost`` pass
    through to `plan_switch` for a change of device count."""
    current, target = ParallelConfig.parse(current), ParallelConfig.parse(target)
    spec = spec_for(work.model)
    if spec.placed_by_rules and current.pp == 1 and target.pp == 1:
        old = Layout.from_config(spec.states(work.model, work.state_kind), current, rank_map)
    else:
        # Placements outside the rules (routed experts), and a pipeline stage holding the layers of the model's
        # stage split: both layouts come from the analytic placements.
        old = layout_for_model(work.model, current, work.state_kind, rank_map)
        target = layout_for_model(work.model, target, work.state_kind)
    plan = plan_switch(old, target, leave=leave, lost=lost, rank_map="optimal", budget_bytes=budget_bytes,
                       gpus_per_node=devices.per_node, compare_identity=False)
    return SwitchCost(plan.bytes_moved, plan.bytes_total, plan.num_rounds,
                      devices.network.predict_seconds(plan.traffic), fixed_seconds)


@dataclass(frozen=True)
class SwitchVerdict:
    """A same-device-count switch weighed: the time it saves over ``horizon_steps`` against what it costs."""

    current: LayoutCandidate
    candidate: LayoutCandidate
    horizon_steps: int
    cost: SwitchCost

    @property
    def gain_seconds(self) -> float:
        """Predicted training time saved over the horizon; infinite when the current layout cannot run."""
        if self.current.step_seconds is None or not self.current.runnable:
            return math.inf
        return self.horizon_steps * (self.current.step_seconds - self.candidate.step_seconds)

    @property
    def net_seconds(self) -> float:
        return self.gain_seconds - self.cost.seconds

    @property
    def pays(self) -> bool:
        return self.candidate.runnable and self.net_seconds > 0


def weigh_switch(current: ParallelConfig | str, candidate: ParallelConfig | str, devices: Devices,
                 work: Workload, *, horizon_steps: int, cost: CostModel = CostModel(),
                 budget_bytes: int = DEFAULT_SWITCH_BUDGET, fixed_seconds: float = 0.0,
                 rank_map: Sequence[int | None] | None = None) -> SwitchVerdict:
    """Whether switching ``current`` -> ``candidate`` on the same devices pays over ``horizon_steps`` steps."""
    current, candidate = ParallelConfig.parse(current), ParallelConfig.parse(candidate)
    if isinstance(horizon_steps, bool) or not isinstance(horizon_steps, int) or horizon_steps < 0:
        raise ValueError(f"horizon_steps must be a non-negative integer, got {horizon_steps!r}")
    for name, cfg in (("current", current), ("candidate", candidate)):
        if cfg.world_size != devices.count:
            raise ValueError(
                f"{name} layout {cfg.short()} needs {cfg.world_size} devices, {devices.count} are at hand: only a "
                "switch on the same devices is weighed; a change of device count is never skipped (plan_layout)"
            )
    return SwitchVerdict(
        estimate_layout(current, devices, work, cost), estimate_layout(candidate, devices, work, cost),
        horizon_steps,
        price_switch(current, candidate, devices, work, budget_bytes=budget_bytes, fixed_seconds=fixed_seconds,
                     rank_map=rank_map),
    )
