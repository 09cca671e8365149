"""The survivors of a lost process: agree on who is left, re-form the world, rebuild the state from replicas
(`Recovery`, the driver's stages in the order a broken world needs, `switch.driver`)."""

from __future__ import annotations

from typing import Any

from dynatrain.check import replicas
from dynatrain.planner.schedule import plan_switch
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.driver import Move, Planned, Stages
from dynatrain.switch.in_world import planner_rank_map
from dynatrain.switch.prepare import plan_mesh_safe
from dynatrain.switch.recovery import RecoveryStop, survivors_target
from dynatrain.switch.report import RecoveryReport, SwitchReport
from dynatrain.switch.states import Held
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.layout import Layout


class Recovery(Move):
    """The survivors of a lost process: agree on who is left, re-form the world, rebuild the state from replicas.

    A fault inside an optimizer step leaves every survivor's weights, Adam moments and step as they were after the
    last step that completed everywhere (the update is local and runs only after the step's collectives). So when
    every shard the lost processes held also lives on a survivor (``dp_replicate >= 2``, or TP-replicated states),
    the survivors hold the whole committed state: the plan starts from the old layout with the lost processes'
    data unreadable and ends on a layout for the survivors. On a GPU the update may already be queued behind a
    collective that failed and run on some survivors only, so their copies are compared first (`check.replicas`):
    copies that differ stop the recovery instead of being trained on.
    """

    def __init__(self, targets: TargetLayouts, cause: str) -> None:
        self.targets, self.cause = targets, cause
        self.world: Any = None
        self.lost: list[str] = []
        self.checked: replicas.Comparison | None = None  # the survivors' copies compared before recovering from them
        self.rank_of: dict[int, int] = {}  # plan id (old rank) -> rank among the survivors

    def run(self, s: Stages) -> SwitchReport:
        """No check: the lost processes' checksums are gone with them."""
        ctx = s.ctx
        s.capture(agree=False)  # a broken world cannot agree
        s.release_broken_world()
        s.plan(self.plan)  # the survivors agree on who is left and re-form the world here
        s.release()
        s.timer.lap("world")
        s.transfer(self.rank_of)
        s.timer.lap("world")
        s.build()
        report = s.finish()
        ctx.on_recovered(RecoveryReport(
            step=report.step, lost=self.lost, survivors=report.world_size, old_layout=report.old_layout,
            new_layout=report.new_layout, bytes_moved=report.bytes_moved, seconds=report.stall_s, cause=self.cause,
            phases=report.phases, replicas_compared=self.checked.compared if self.checked else 0))
        return report

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        manager, old_cfg, step = ctx.elastic, ctx.layout, ctx.step
        old_world = manager.world
        positions = list(ctx.positions)
        self.targets.forget_builds()
        ctx.forget_meshes(drop_groups=True)
        old_world.abort()  # before hashing: work queued behind the failed collective ends (or runs) first
        members = list(old_world.members)
        captured = held.captured
        old_layout = Layout.from_shardings(captured.specs, captured.shardings, old_cfg, rank_map=positions)
        mine = replicas.local_sums(old_layout, members.index(manager.member_id), captured.sources,
                                   replicas.kept_scalars(held.kept))
        survivors = manager.agree_on_survivors({"step": step, "replicas": mine.to_json()})
        self.lost = [m for m in members if m not in survivors]
        steps = sorted({int(info["step"]) for info in survivors.values()})
        if len(steps) != 1:
            raise RecoveryStop(f"the survivors stopped at different optimizer steps {steps}")
        self.checked = replicas.compare(old_layout, {members.index(m): replicas.ReplicaSums.from_json(info["replicas"])
                                                     for m, info in survivors.items()})
        if self.checked.differing:
            raise RecoveryStop(replicas.explain(self.checked.differing, members))
        new_members = sorted(survivors)
        self.rank_of = rank_of = {members.index(m): new_members.index(m) for m in new_members}
        self.world = manager.reform(new_members)
        ctx.enter_world(self.world.rank, self.world.world_size)
        try:
            target = survivors_target(ctx, len(new_members))
            target_layout, _ = self.targets.layout(target, captured, probe=True)
            plan, target_ranks = plan_mesh_safe(
                lambda order: plan_switch(old_layout, target_layout, lost=[members.index(m) for m in self.lost],
                                          rank_map=order or planner_rank_map(ctx.settings.rank_map),
                                          budget_bytes=ctx.settings.budget_bytes),
                lambda plan: [rank_of[p] for p in plan.new.rank_map], target)
        except ValueError as e:
            raise RecoveryStop(str(e)) from None
        return Planned(plan, old_layout, target, members.index(manager.member_id), target_ranks)
