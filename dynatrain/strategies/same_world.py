"""A layout switch among the same processes, for any module the strategy set up: the states are read from the
live module and optimizer, the target from the module's own parallelisation.

Every rank runs the same stages on the same inputs, so every collective matches: capture (agreed across ranks)
-> plan (pure, identical everywhere) -> build the new mesh (the same group calls in the same order everywhere)
and the target on meta -> release the old shards to the engine -> move -> adopt weights, optimizer state,
schedules and data position -> verify bitwise (optional) -> report.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from dynatrain import engine
from dynatrain.engine.verify import compare, local_checksums
from dynatrain.memory import release_freed_memory, resident_bytes
from dynatrain.planner.schedule import plan_switch
from dynatrain.strategies.adopt import adopt_module
from dynatrain.strategies.capture import capture
from dynatrain.strategies.prepare import plan_mesh_safe
from dynatrain.strategies.report import PhaseTimer, SwitchReport, check_unchanged, publish_report
from dynatrain.strategies.states import capture_agreed, keep_states, release_module
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


def switch_in_world(switcher: "Switcher", target: str | ParallelConfig, *, rank_map: str | None = None,
                    budget_mb: float | None = None) -> SwitchReport:
    switcher.require_boundary()
    timer = PhaseTimer()
    footprint = resident_bytes()  # the old layout's, its steps' working memory included
    strategy = switcher.strategy
    target = switcher.check(target)
    module, optimizer, captured = capture_agreed(switcher)
    old_cfg, rank = strategy.parallel_config, strategy.global_rank
    budget = strategy.switch_budget_bytes if budget_mb is None else int(budget_mb * 2**20)
    old_layout = Layout.from_shardings(captured.specs, captured.shardings, old_cfg, rank_map=strategy.positions)
    target_layout, probe = switcher.targets.layout(target, captured)
    plan, _ = plan_mesh_safe(
        lambda order: plan_switch(old_layout, target_layout, rank_map=order or rank_map or strategy.rank_map,
                                  budget_bytes=budget),
        lambda plan: list(plan.new.rank_map), target)
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
    return publish_report(switcher, plan, old_cfg, target, positions, stats, verified, timer, heap_trimmed=trimmed)
