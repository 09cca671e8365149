"""A member's switches, each as the driver's stages in its own order (`switch.driver`):

- `InWorld`: the same processes, another layout; the target is built on its mesh, which exists, before the old
  shards are released, and the transfer runs on the current world.
- `WorldChange`: a member's side of a change of processes (``leave`` go, ``joiners`` come); the transfer runs on
  the union of old and new members and the target is built after it, or, when nobody leaves, on the target world
  itself, built right before the transfer.

A process joining runs `switch.joining.Join`; the survivors of a lost process `switch.survivors.Recovery`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dynatrain.check import verify
from dynatrain.elastic.world import NextGeneration
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.driver import Move, Planned, Stages, ranks_in
from dynatrain.switch.in_world import InWorldPrep, in_world_inputs, plan_in_world, planner_rank_map
from dynatrain.switch.payload import JoinPayload, encode_kept
from dynatrain.switch.prepare import ChangeInputs, MemberPrep, WorldPlan, plan_world_change
from dynatrain.switch.report import SwitchReport
from dynatrain.switch.states import Held
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass
class InWorld(Move):
    target: ParallelConfig
    targets: TargetLayouts
    reports: list  # the job's switch reports, which measure the wire for ``rank_map="auto"``
    rank_map: str | None = None
    budget_mb: float | None = None
    prepared: InWorldPrep | None = None  # the request's plan made ahead, used when its inputs still hold

    def run(self, s: Stages) -> SwitchReport:
        ctx = s.ctx
        s.capture()
        s.plan(self.plan)
        s.check_before()
        s.build()  # on the target's mesh, which exists now for the same processes
        s.release()
        s.transfer()
        report = s.finish()
        ctx.publish(report)
        return report

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        # The build on the target's mesh in the default rank order: the one the request made, or made now.
        _, probe = self.targets.shardings(self.target, held.captured)
        inputs = in_world_inputs(ctx, self.targets, self.target, held.captured, self.reports,
                                 rank_map=self.rank_map, budget_mb=self.budget_mb, built=probe is not None)
        prepared = isinstance(self.prepared, InWorldPrep) and self.prepared.inputs == inputs
        plan, old_layout = self.prepared.plan() if prepared else plan_in_world(inputs)
        return Planned(plan, old_layout, self.target, ctx.rank, list(plan.new.rank_map), prepared, probe)


def change_inputs(ctx: SwitchContext, targets: TargetLayouts, target: ParallelConfig, leave, joiners,
                  captured) -> ChangeInputs:
    """What a world change is planned from; equal on every member (the plan derives from nothing else)."""
    new_shardings, _ = targets.shardings(target, captured, probe=True)
    return ChangeInputs.build(captured.specs, captured.shardings, new_shardings, ctx.layout, ctx.positions,
                              ctx.elastic.world.members, target, leave, joiners,
                              planner_rank_map(ctx.settings.rank_map), ctx.settings.budget_bytes)


@dataclass
class WorldChange(Move):
    target: ParallelConfig
    leave: tuple[int, ...]
    joiners: list[str]
    targets: TargetLayouts
    prepared: MemberPrep | None = None  # planned in the background while the job waited for its joiners
    formed: NextGeneration | None = None  # the target generation a scale-out formed while training went on
    forming_step: int | None = None  # the trainer's step when the target generation began to form

    def run(self, s: Stages) -> SwitchReport:
        ctx = s.ctx
        s.capture()
        planned = s.plan(self.plan)
        s.check_before()
        members = self.world_plan.target_members(planned.union)
        stay = set(members) == set(planned.union)
        if not stay:  # a leaver's sums of before are summed on the old world, which it leaves
            s.reduce_before()
        self._publish(ctx, s, planned)
        self.targets.forget_builds()  # they hold the old world's meshes
        s.release()
        if stay:
            # Nobody leaves: the transfer runs on the target world itself, and the target is built there before
            # it, while the joiners run their Lightning set-up (see `Join`).
            world = ctx.elastic.change_world(members, lambda world: self._on_target(s, world), order=members,
                                             ahead=self.ahead)
            s.timer.lap("world")
        else:
            world = ctx.elastic.change_world(members, lambda world: self._on_union(s, world), order=members,
                                             ahead=self.ahead)
            s.timer.lap("world")  # the target world formed (or, formed ahead, entered) after the transfer, or left
            if world is None:
                report = s.leave()
                ctx.publish(report)
                return report
            self._enter(ctx, world)
            s.timer.lap("world")
            s.build()
        report = s.finish()
        ctx.publish(report)
        return report

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        inputs = change_inputs(ctx, self.targets, self.target, self.leave, self.joiners, held.captured)
        prepared = self.prepared is not None and self.prepared.inputs == inputs
        self.world_plan: WorldPlan = self.prepared.plan() if prepared else plan_world_change(inputs)
        # The target generation formed while training went on: entered here by the members it keeps (the same
        # inputs on every process, so all of them take this branch alike), departed by the others.
        self.ahead = False
        if self.formed is not None:
            if not prepared:  # its joiners formed the world from the plan the members prepared
                raise RuntimeError(f"the world change to {self.target.short()} formed its world ahead from a plan "
                                   "whose inputs no longer hold")
            self.ahead = self.formed
        elif self.prepared is not None and self.prepared.forms_ahead:
            if prepared:
                self.ahead = self.prepared.ahead or True
            else:
                self.prepared.discard()
        union = tuple(inputs.union)
        steps = ctx.step - self.forming_step if self.ahead and self.forming_step is not None else None
        return Planned(self.world_plan.plan, self.world_plan.old_layout, self.target,
                       union.index(ctx.elastic.member_id), list(self.world_plan.target_ranks), prepared,
                       union=union, formed_ahead_steps=steps)

    def _publish(self, ctx: SwitchContext, s: Stages, planned: Planned) -> None:
        """Rank 0 hands the joiners what they cannot capture: the plan's inputs, kept states, loop state, loggers;
        before the change is announced."""
        if not self.joiners or ctx.rank != 0:
            return
        payload = JoinPayload(intent=self.world_plan.intent(), target_ranks=list(planned.target_ranks),
                              union=list(planned.union), kept=encode_kept(s.kept), checkpoint=ctx.loop_state(),
                              before=verify.to_json(s.before) if s.before is not None else None,
                              loggers=ctx.logger_versions())
        ctx.elastic.publish(ctx.elastic.world.generation + 1, asdict(payload))

    def _on_union(self, s: Stages, world) -> None:
        s.timer.lap("world")  # forming the union of old and new members
        s.transfer(ranks_in(world, s.planned.union))

    def _on_target(self, s: Stages, world) -> None:
        s.timer.lap("world")
        self._enter(s.ctx, world)
        s.timer.lap("world")
        s.build()
        s.transfer(ranks_in(world, s.planned.union))

    @staticmethod
    def _enter(ctx: SwitchContext, world) -> None:
        ctx.enter_world(world.rank, world.world_size)
        ctx.forget_meshes()  # every group of the old generation is gone
