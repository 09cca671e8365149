"""A switch that changes the processes, as a current member runs it: ``leave`` (current ranks) go, ``joiners``
(ready member ids) come.

The plan runs over the union of old and new members (process id = rank in the union's sorted member list,
which is what the union generation's ranks are); the transfer over the union generation; the new mesh is built
on the target generation. Joiners run the same plan from what rank 0 publishes (`joiner`). When nobody leaves,
the transfer runs on the target generation itself, and the members build the target mesh and model before it,
while the joiners run their Lightning set-up.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from dynatrain import engine
from dynatrain.engine.verify import differing, local_checksums, reduce_sums
from dynatrain.memory import release_freed_memory, resident_bytes
from dynatrain.strategies.adopt import adopt_module
from dynatrain.strategies.capture import capture
from dynatrain.strategies.join_payload import encode_scalars, loop_checkpoint
from dynatrain.strategies.lightning_world import detach, logger_versions, set_world
from dynatrain.strategies.prepare import ChangeInputs, plan_world_change
from dynatrain.strategies.same_world import planner_rank_map
from dynatrain.strategies.report import PhaseTimer, SwitchReport, check_unchanged, publish_report
from dynatrain.strategies.states import capture_agreed, capture_states, keep_states, release_module
from dynatrain.strategies.target import transplant
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


def ranks_in(world, union: list[str]) -> dict[int, int]:
    """Plan process id (index in the sorted union) -> rank in ``world``."""
    return {p: world.members.index(m) for p, m in enumerate(union) if m in world.members}


def change_inputs(switcher: "Switcher", target: ParallelConfig, leave, joiners: list[str] | None, captured=None
                  ) -> ChangeInputs:
    """What a world change is planned from; equal on every member (the plan derives from nothing else)."""
    strategy = switcher.strategy
    if captured is None:
        captured = capture_states(switcher, strategy.lightning_module, switcher.optimizer())
    new_shardings, _ = switcher.targets.shardings(target, captured, probe=True)
    return ChangeInputs.build(captured.specs, captured.shardings, new_shardings,
                              strategy.parallel_config, strategy.positions, strategy.elastic.world.members, target,
                              leave, joiners, planner_rank_map(strategy.rank_map), strategy.switch_budget_bytes)


class WorldSwitch:
    """One world change on a current member: the plan and its inputs, the timer, and what the transfer hands on
    (``moved``: the target mesh and model, the moved shards, the engine's stats)."""

    def __init__(self, switcher: "Switcher", target: ParallelConfig, leave: tuple[int, ...],
                 joiners: list[str]) -> None:
        self.switcher, self.strategy = switcher, switcher.strategy
        self.manager = self.strategy.elastic
        self.target, self.leave, self.joiners = target, leave, joiners
        self.moved: dict = {}

    def run(self) -> SwitchReport:
        switcher, strategy = self.switcher, self.strategy
        switcher.require_boundary()
        self.timer = timer = PhaseTimer()
        footprint = resident_bytes()  # the old layout's, its steps' working memory included
        module, optimizer, captured = capture_agreed(switcher)
        self.old_cfg = strategy.parallel_config
        self._plan(captured)
        timer.lap("plan")

        old_totals = None
        if strategy.verify_switches:
            old_totals = reduce_sums(local_checksums(self.old_layout, self.me, self.src), strategy.root_device)
        kept = keep_states(switcher, captured, optimizer)
        self._publish(kept, old_totals)
        names = release_module(switcher, module, optimizer)
        switcher.targets.forget_builds()
        del optimizer, captured
        gc.collect()
        timer.lap("release")

        # The engine empties `src` as it sends.
        world = self.manager.change_world(self.target_members, self._transfer, order=self.target_members)
        timer.lap("transfer")
        stats = self.moved["stats"]
        if world is None:
            return self._leave(module, names, stats)
        if not self.ahead:
            self._build(world)
            timer.lap("build")
        moved = self.moved
        adopt_module(switcher, moved.pop("model"), names, moved.pop("mesh"), self.target, self.target_ranks,
                     moved.pop("dst"), kept)
        timer.lap("adopt")
        verified = None
        if old_totals is not None:
            verified = self._verify(module, old_totals)
            timer.lap("verify")
        trimmed = release_freed_memory(footprint)
        return publish_report(switcher, self.plan, self.old_cfg, self.target, self.target_ranks, stats, verified,
                              timer, prepared=self.prepared is not None, heap_trimmed=trimmed)

    def _plan(self, captured) -> None:
        """The plan over the union, from the one prepared in the background when its inputs still hold."""
        switcher = self.switcher
        inputs = change_inputs(switcher, self.target, self.leave, self.joiners, captured)
        prepared, switcher.prepared = switcher.prepared, None
        if prepared is not None and prepared.inputs == inputs:
            world_plan = prepared.plan()
        else:
            world_plan, prepared = plan_world_change(inputs), None
        self.world_plan, self.prepared = world_plan, prepared
        self.plan, self.old_layout = world_plan.plan, world_plan.old_layout
        self.target_members, self.target_ranks = world_plan.target_members(inputs.union), world_plan.target_ranks
        self.union = list(inputs.union)
        self.me = self.union.index(self.manager.member_id)
        self.src = captured.sources
        engine.validate_sources(self.plan, self.me, self.src)
        # When nobody leaves, the transfer runs on the target generation itself: build the target mesh and model
        # before it, while the joiners run their Lightning set-up (see `joiner`), instead of after it.
        self.ahead = set(self.target_members) == set(self.union)

    def _publish(self, kept: dict, old_totals) -> None:
        """Rank 0 hands the joiners what they cannot capture: the plan's inputs, kept states, loop state, loggers."""
        strategy, manager = self.strategy, self.manager
        if self.joiners and strategy.global_rank == 0:
            manager.publish(manager.world.generation + 1, {
                **self.world_plan.intent(), "target_ranks": self.target_ranks, "union": self.union,
                "scalars": encode_scalars(kept["scalars"]), "groups": kept["groups"], "order": kept["order"],
                "param_of": kept["param_of"], "checkpoint": loop_checkpoint(self.switcher.trainer),
                "old_totals": old_totals, "loggers": logger_versions(self.switcher.trainer),
            })

    def _build(self, world) -> None:
        strategy = self.strategy
        set_world(strategy, world.rank, world.world_size)
        strategy._meshes.clear()  # every group of the old generation is gone
        self.moved["mesh"] = mesh = strategy._build_mesh(self.target, ranks=self.target_ranks)
        self.moved["model"] = strategy.build_target(mesh, self.target)

    def _transfer(self, world) -> None:
        if self.ahead:
            self.timer.lap("transfer")
            self._build(world)
            self.timer.lap("build")
        # Looked up on the package at call time: the selfcheck's fault injection and the benchmarks replace it there.
        self.moved["dst"], self.moved["stats"] = engine.run_transition(
            self.plan, self.me, self.src, group_ranks=ranks_in(world, self.union), device=self.strategy.root_device)

    def _leave(self, module, names: list[str], stats) -> SwitchReport:
        """A member that left: no model, no group; it keeps a meta copy of the module for the hooks still to run."""
        strategy = self.strategy
        detach(strategy, self.switcher.trainer)
        if strategy._template is not None:
            transplant(module, strategy._template.fresh(), names)
        return publish_report(self.switcher, self.plan, self.old_cfg, self.target, [], stats, None, self.timer,
                              prepared=self.prepared is not None)

    def _verify(self, module, old_totals) -> bool:
        strategy = self.strategy
        new_totals = reduce_sums(local_checksums(self.plan.new, self.me, capture(module, self.switcher.optimizer(),
                                                                                 strategy.device_mesh).sources),
                                 strategy.root_device)
        return check_unchanged(differing(self.old_layout, old_totals, self.plan.new, new_totals), self.old_cfg,
                               self.target)
