"""Planning a switch among the same processes.

A request planned ahead has its plan made on a background thread from the states captured at the request
(`InWorldPrep`); the switch takes it when what it would plan from is still the same, which a training step does
not change (it moves values, not shapes or placements).

Under ``rank_map="auto"`` (the strategy's default) the planner's fewest-bytes arrangement of the processes is weighed
against the default one, whose target the request built already: another arrangement needs another mesh and
another build inside the stall, which can cost more than the bytes it saves (a third of a second against a few MiB
for `debug` on 4 processes). The weights are measured: that build's time, and the wire's seconds per byte over the
switches this job ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dynatrain.planner.schedule import SwitchPlan, plan_switch
from dynatrain.runtime import control_group
from dynatrain.switch.capture import Captured
from dynatrain.switch.context import SwitchContext
from dynatrain.runtime.background import Background
from dynatrain.switch.prepare import plan_mesh_safe
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.placement import Sharding

AUTO = "auto"


def planner_rank_map(rank_map):
    """What the planner takes for a strategy's ``rank_map``: ``"auto"`` starts from its fewest-bytes arrangement."""
    return "optimal" if rank_map == AUTO else rank_map


@dataclass(frozen=True)
class InWorldInputs:
    """Everything a switch within the world plans from; ``costs``: under ``"auto"`` with the default arrangement's
    target built, (seconds to build the target again, seconds per byte on the wire), agreed by every rank."""

    specs: tuple[StateSpec, ...]
    old_shardings: tuple[Sharding, ...]
    new_shardings: tuple[Sharding, ...]
    old: ParallelConfig
    positions: tuple[int, ...]  # old mesh position -> rank
    target: ParallelConfig
    rank_map: str | tuple[int, ...]
    budget: int
    costs: tuple[float, float] | None = None


def _agreed_costs(ctx: SwitchContext, targets: TargetLayouts, target: ParallelConfig, reports: list
                  ) -> tuple[float, float] | None:
    """(the build's seconds, the wire's seconds per byte), the slowest rank's, or None with no switch to measure
    by. A collective: every rank calls it alike, as they all hold the same builds; a rank that joined the job has
    no reports of its own and takes the others'."""
    moved = [r for r in reports if r.bytes_moved and r.phases.get("transfer")]
    local = [targets.build_seconds.get(target, 0.0), sum(r.phases["transfer"] for r in moved),
             float(sum(r.bytes_moved for r in moved))]
    if ctx.world_size > 1:
        local = control_group.all_reduce_floats(local, ctx.control_group, op=dist.ReduceOp.MAX)
    build_s, transfer_s, nbytes = local
    return (build_s, transfer_s / nbytes) if build_s > 0 and nbytes > 0 else None


def in_world_inputs(ctx: SwitchContext, targets: TargetLayouts, target: ParallelConfig, captured: Captured,
                    reports: list, *, rank_map: str | None = None, budget_mb: float | None = None,
                    built: bool = False) -> InWorldInputs:
    """``built``: the request's build of ``target`` on the default arrangement is there for the switch to take;
    ``reports``: the job's switch reports, which measure the wire."""
    # probe=True: read the target's placements without taking the build the request kept for the switch.
    new_shardings, _ = targets.shardings(target, captured, probe=True)
    rank_map = rank_map or ctx.settings.rank_map
    if ctx.data_fixed:
        rank_map = "identity"  # a loader dynatrain cannot re-split keeps each process on its data-parallel rank
    budget = ctx.settings.budget_bytes if budget_mb is None else int(budget_mb * 2**20)
    costs = _agreed_costs(ctx, targets, target, reports) if rank_map == AUTO and built else None
    return InWorldInputs(tuple(captured.specs), tuple(captured.shardings), tuple(new_shardings),
                         ctx.layout, tuple(int(r) for r in ctx.positions), target,
                         rank_map if isinstance(rank_map, str) else tuple(rank_map), budget, costs)


def plan_in_world(inputs: InWorldInputs) -> tuple[SwitchPlan, Layout]:
    """The plan and the old layout it starts from."""
    old_layout = Layout.from_shardings(inputs.specs, inputs.old_shardings, inputs.old, rank_map=list(inputs.positions))
    new_layout = Layout.from_shardings(inputs.specs, inputs.new_shardings, inputs.target)

    def plan_for(rank_map) -> SwitchPlan:
        plan, _ = plan_mesh_safe(
            lambda order: plan_switch(old_layout, new_layout, rank_map=order or rank_map, budget_bytes=inputs.budget),
            lambda plan: list(plan.new.rank_map), inputs.target)
        return plan

    rank_map = inputs.rank_map if isinstance(inputs.rank_map, str) else list(inputs.rank_map)
    plan = plan_for(planner_rank_map(rank_map))
    default = list(range(inputs.target.world_size))
    if inputs.costs is None or list(plan.new.rank_map) == default:
        return plan, old_layout
    build_s, seconds_per_byte = inputs.costs
    built = plan_for(default)
    if (built.bytes_moved - plan.bytes_moved) * seconds_per_byte < build_s:
        return built, old_layout
    return plan, old_layout


class InWorldPrep:
    """A switch within the world, planned on its own thread, with the pieces of process ``rank`` (its rank)."""

    def __init__(self, inputs: InWorldInputs, rank: int | None = None) -> None:
        self.inputs = inputs

        def plan() -> tuple[SwitchPlan, Layout]:
            planned = plan_in_world(inputs)
            if rank is not None:  # the expansion the check and the engine read (milliseconds), off the stall
                planned[0].rank_plan(rank)
            return planned

        self._plan = Background(inputs, plan, "dynatrain-plan-in-world")

    def plan(self) -> tuple[SwitchPlan, Layout]:
        return self._plan.result()
