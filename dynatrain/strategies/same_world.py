"""A layout switch among the same processes, for any module the strategy set up: the states are read from the
live module and optimizer, the target from the module's own parallelisation.

Every rank runs the same stages on the same inputs, so every collective matches: capture (agreed across ranks)
-> plan (pure, identical everywhere) -> build the new mesh (the same group calls in the same order everywhere)
and the target on meta -> release the old shards to the engine -> move -> adopt weights, optimizer state,
schedules and data position -> verify bitwise (optional) -> report.

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

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dynatrain import engine
from dynatrain.engine.verify import compare, local_checksums
from dynatrain.memory import release_freed_memory, resident_bytes
from dynatrain.planner.schedule import SwitchPlan, plan_switch
from dynatrain.strategies.adopt import adopt_module
from dynatrain.strategies.capture import capture
from dynatrain.strategies.prepare import Background, plan_mesh_safe
from dynatrain.strategies.report import PhaseTimer, SwitchReport, check_unchanged, publish_report
from dynatrain.strategies.states import capture_agreed, capture_states, keep_states, release_module
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.placement import Sharding
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


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


def _agreed_costs(switcher: "Switcher", target: ParallelConfig) -> tuple[float, float] | None:
    """(the build's seconds, the wire's seconds per byte), the slowest rank's, or None with no switch to measure
    by. A collective: every rank calls it alike, as they all hold the same builds; a rank that joined the job has
    no reports of its own and takes the others'."""
    strategy = switcher.strategy
    reports = [r for r in strategy.switch_reports if r.bytes_moved and r.phases.get("transfer")]
    local = [switcher.targets.build_seconds.get(target, 0.0), sum(r.phases["transfer"] for r in reports),
             float(sum(r.bytes_moved for r in reports))]
    if strategy.world_size > 1:
        t = torch.tensor(local, dtype=torch.float64, device=strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        local = t.tolist()
    build_s, transfer_s, moved = local
    return (build_s, transfer_s / moved) if build_s > 0 and moved > 0 else None


def in_world_inputs(switcher: "Switcher", target: ParallelConfig, captured=None, *, rank_map: str | None = None,
                    budget_mb: float | None = None, built: bool = False) -> InWorldInputs:
    """``built``: the request's build of ``target`` on the default arrangement is there for the switch to take."""
    strategy = switcher.strategy
    if captured is None:
        captured = capture_states(switcher, strategy.lightning_module, switcher.optimizer())
    # probe=True: read the target's placements without taking the build the request kept for the switch.
    new_shardings, _ = switcher.targets.shardings(target, captured, probe=True)
    rank_map = rank_map or strategy.rank_map
    if strategy.data_split.fixed:
        rank_map = "identity"  # a loader dynatrain cannot re-split keeps each process on its data-parallel rank
    budget = strategy.switch_budget_bytes if budget_mb is None else int(budget_mb * 2**20)
    old = strategy.parallel_config
    positions = range(old.world_size) if strategy.positions is None else strategy.positions
    costs = _agreed_costs(switcher, target) if rank_map == AUTO and built else None
    return InWorldInputs(tuple(captured.specs), tuple(captured.shardings), tuple(new_shardings),
                         old, tuple(int(r) for r in positions), target,
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
    """A switch within the world, planned on its own thread."""

    def __init__(self, inputs: InWorldInputs) -> None:
        self.inputs = inputs
        self._plan = Background(inputs, lambda: plan_in_world(inputs), "dynatrain-plan-in-world")

    def plan(self) -> tuple[SwitchPlan, Layout]:
        return self._plan.result()


def switch_in_world(switcher: "Switcher", target: str | ParallelConfig, *, rank_map: str | None = None,
                    budget_mb: float | None = None, prepared=None) -> SwitchReport:
    """``prepared``: the request's plan made ahead (`InWorldPrep`), used when its inputs still hold."""
    switcher.require_boundary()
    timer = PhaseTimer()
    footprint = resident_bytes()  # the old layout's, its steps' working memory included
    strategy = switcher.strategy
    target = switcher.check(target)
    module, optimizer, captured = capture_agreed(switcher)
    old_cfg, rank = strategy.parallel_config, strategy.global_rank
    # The build on the target's mesh in the default rank order: the one the request made, or made now.
    _, probe = switcher.targets.shardings(target, captured)
    inputs = in_world_inputs(switcher, target, captured, rank_map=rank_map, budget_mb=budget_mb,
                             built=probe is not None)
    if isinstance(prepared, InWorldPrep) and prepared.inputs == inputs:
        plan, old_layout = prepared.plan()
    else:
        plan, old_layout, prepared = *plan_in_world(inputs), None
    engine.validate_sources(plan, rank, captured.sources)
    timer.lap("plan")

    positions = list(plan.new.rank_map)
    new_mesh = strategy._build_mesh(target, ranks=positions)
    if probe is None or positions != list(range(target.world_size)):
        probe = strategy.build_target(new_mesh, target)
    timer.lap("build")

    old_sums = local_checksums(old_layout, rank, captured.sources) if strategy.verify_switches else None
    kept = keep_states(switcher, captured, optimizer)
    src = captured.sources
    names = release_module(switcher, module, optimizer)
    del optimizer, captured
    gc.collect()
    timer.lap("release")

    # Looked up on the package at call time: the selfcheck's fault injection and the benchmarks replace it there.
    dst, stats = engine.run_transition(plan, rank, src, device=strategy.root_device)
    del src
    timer.lap("transfer")

    adopt_module(switcher, probe, names, new_mesh, target, positions, dst, kept)
    timer.lap("adopt")

    verified = None
    if old_sums is not None:
        new_sums = local_checksums(plan.new, rank, capture(module, switcher.optimizer(), new_mesh).sources)
        verified = check_unchanged(compare(old_layout, old_sums, plan.new, new_sums, device=strategy.root_device),
                                   old_cfg, target)
        timer.lap("verify")
    trimmed = release_freed_memory(footprint)
    return publish_report(switcher, plan, old_cfg, target, positions, stats, verified, timer,
                          prepared=prepared is not None, heap_trimmed=trimmed)
