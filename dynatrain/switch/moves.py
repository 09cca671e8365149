"""The kinds of switch, as the driver's inputs: who sends, who receives, over which world, how the plan is made and
when the target is built (`Build`). The stages themselves are in `switch.driver`, once.

- `InWorld`: the same processes, another layout; the transfer runs on the current world.
- `WorldChange`: a member's side of a change of processes (``leave`` go, ``joiners`` come); the transfer runs on
  the union of old and new members, or on the target world itself when nobody leaves.
- `Join`: a process entering a running job; it sends nothing and Lightning's set-up builds its module.
- `Recovery`: the survivors of a lost process; the broken world is left first, the transfer runs on theirs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from torch import nn

from dynatrain import engine
from dynatrain.check import replicas, verify
from dynatrain.planner.schedule import SwitchPlan, plan_switch
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.in_world import InWorldPrep, in_world_inputs, plan_in_world, planner_rank_map
from dynatrain.switch.payload import JoinPayload, decode_kept, encode_kept
from dynatrain.switch.prepare import (
    ChangeInputs,
    JoinerPrep,
    MemberPrep,
    WorldPlan,
    plan_from_payload,
    plan_mesh_safe,
    plan_world_change,
)
from dynatrain.switch.recovery import RecoveryStop, survivors_target
from dynatrain.switch.report import RecoveryReport, SwitchReport
from dynatrain.switch.states import Held, Kept
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig


class Build(Enum):
    """When the target module is built."""

    BEFORE_RELEASE = "before the old shards are released: the target's mesh exists now"
    ON_TARGET_WORLD = "on the target world, right before the transfer, which runs there"
    AFTER_TRANSFER = "after the transfer: the target world exists only then"
    BY_LIGHTNING = "by Lightning's set-up of a joining process (configure_model on meta)"


@dataclass
class Planned:
    """The plan and where it leads: ``me`` is this process's id in the plan, ``target_ranks`` per new mesh position
    its rank in the target world; ``probe``: a build of the target the request made on the default arrangement."""

    plan: SwitchPlan
    old_layout: Layout
    target: ParallelConfig
    me: int
    target_ranks: list[int]
    build: Build
    prepared: bool = False  # planned in the background while training went on
    probe: nn.Module | None = None
    union: tuple[str, ...] = ()  # member ids of the plan's processes, in plan-id order
    rank_of: dict[int, int] | None = None  # plan id -> rank in the transfer's world, where it is not the union's


SAME_WORLD = object()  # what `reach` returns for a switch that keeps its world


def ranks_in(world, union) -> dict[int, int]:
    """Plan process id (index in the sorted union) -> rank in ``world``."""
    return {p: world.members.index(m) for p, m in enumerate(union) if m in world.members}


class Move:
    """The defaults: a process that holds a module, in a world that works, sends and receives."""

    kind = "switch"
    agree = True  # the ranks agree on their states before anything moves
    sends = True
    broken_world = False  # the old world's groups are gone: release before waiting on anyone
    world_changes = False  # the check after it runs on another world than the check before
    transfer_after_setup = False  # a joining process's transfer waits for its module

    def verified(self, ctx: SwitchContext) -> bool:
        return ctx.settings.verify

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        raise NotImplementedError

    def publish(self, ctx: SwitchContext, held: Held, planned: Planned, before) -> None:
        """What processes joining need before the change is announced."""

    def forget_old_world(self, ctx: SwitchContext) -> None:
        """Drop what holds the old world's meshes."""

    def kept(self, ctx: SwitchContext) -> Kept:
        raise NotImplementedError(f"a {self.kind} keeps its own states")

    def reach(self, ctx: SwitchContext, planned: Planned, transfer):
        """Run ``transfer(world)`` (None: deferred) on the transfer's world; the world trained in next, or None on a
        process that left."""
        raise NotImplementedError

    def enter(self, ctx: SwitchContext, world, planned: Planned) -> None:
        """This process is a member of the target world ``world`` from now on."""

    def group_ranks(self, world, planned: Planned):
        return planned.rank_of if planned.rank_of is not None else ranks_in(world, planned.union)

    def preallocated(self, planned: Planned):
        return None

    def checks_received(self) -> bool:
        """A process that sent nothing checks what it received against the members' checksums."""
        return False

    def before(self):
        return None

    def scheduler_states(self, ctx: SwitchContext) -> list[dict]:
        """The LR schedulers' states this process trains on with after the switch."""
        return ctx.scheduler_states()

    def report(self, ctx: SwitchContext, report: SwitchReport) -> None:
        ctx.publish(report)


@dataclass
class InWorld(Move):
    target: ParallelConfig
    targets: TargetLayouts
    reports: list  # the job's switch reports, which measure the wire for ``rank_map="auto"``
    rank_map: str | None = None
    budget_mb: float | None = None
    prepared: InWorldPrep | None = None  # the request's plan made ahead, used when its inputs still hold

    kind = "switch within the world"

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        # The build on the target's mesh in the default rank order: the one the request made, or made now.
        _, probe = self.targets.shardings(self.target, held.captured)
        inputs = in_world_inputs(ctx, self.targets, self.target, held.captured, self.reports,
                                 rank_map=self.rank_map, budget_mb=self.budget_mb, built=probe is not None)
        prepared = isinstance(self.prepared, InWorldPrep) and self.prepared.inputs == inputs
        plan, old_layout = self.prepared.plan() if prepared else plan_in_world(inputs)
        positions = list(plan.new.rank_map)
        return Planned(plan, old_layout, self.target, ctx.rank, positions, Build.BEFORE_RELEASE, prepared, probe)

    def reach(self, ctx: SwitchContext, planned: Planned, transfer):
        transfer(None)
        return SAME_WORLD

    def group_ranks(self, world, planned: Planned):
        return None


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

    kind = "world change"
    world_changes = True

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        inputs = change_inputs(ctx, self.targets, self.target, self.leave, self.joiners, held.captured)
        prepared = self.prepared is not None and self.prepared.inputs == inputs
        self.world_plan: WorldPlan = self.prepared.plan() if prepared else plan_world_change(inputs)
        union = tuple(inputs.union)
        # When nobody leaves, the transfer runs on the target generation itself: the target is built there before
        # it, while the joiners run their Lightning set-up (see `Join`), instead of after it.
        ahead = set(self.world_plan.target_members(union)) == set(union)
        return Planned(self.world_plan.plan, self.world_plan.old_layout, self.target,
                       union.index(ctx.elastic.member_id), list(self.world_plan.target_ranks),
                       Build.ON_TARGET_WORLD if ahead else Build.AFTER_TRANSFER, prepared, union=union)

    def publish(self, ctx: SwitchContext, held: Held, planned: Planned, before) -> None:
        """Rank 0 hands the joiners what they cannot capture: the plan's inputs, kept states, loop state, loggers."""
        if not self.joiners or ctx.rank != 0:
            return
        payload = JoinPayload(intent=self.world_plan.intent(), target_ranks=list(planned.target_ranks),
                              union=list(planned.union), kept=encode_kept(held.kept), checkpoint=ctx.loop_state(),
                              before=verify.to_json(before) if before is not None else None,
                              loggers=ctx.logger_versions())
        ctx.elastic.publish(ctx.elastic.world.generation + 1, asdict(payload))

    def forget_old_world(self, ctx: SwitchContext) -> None:
        self.targets.forget_builds()

    def reach(self, ctx: SwitchContext, planned: Planned, transfer):
        members = self.world_plan.target_members(planned.union)
        return ctx.elastic.change_world(members, transfer, order=members)

    def enter(self, ctx: SwitchContext, world, planned: Planned) -> None:
        ctx.enter_world(world.rank, world.world_size)
        ctx.forget_meshes()  # every group of the old generation is gone


class Join(Move):
    """A process admitted to a world change: it plans the members' plan from rank 0's payload and receives its
    shards, now on the union world or, when nobody leaves, on the target world once its module is built."""

    kind = "join"
    sends = False
    world_changes = True

    def __init__(self, prep: JoinerPrep, change, payload: JoinPayload) -> None:
        self.prep, self.change, self.payload = prep, change, payload
        self.transfer_after_setup = set(change.new) == set(change.union)  # as `WorldChange` decides it
        self._ready: dict | None = None

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        p = self.payload
        plan, old_layout = self.prep.plan_for(p.intent) or plan_from_payload(p.intent)
        me = p.union.index(ctx.elastic.member_id)
        # A joiner holds no sources, so its destinations fit its memory bound now: allocated (and on CPU mapped)
        # before the members' transfer starts instead of while their bytes arrive, if not while it waited.
        self._ready = self.prep.destinations_for(plan, me)
        if self._ready is None:
            self._ready = engine.allocate_destinations(plan, me, ctx.device)
        return Planned(plan, old_layout, ParallelConfig.parse(p.intent["target"]), me, list(p.target_ranks),
                       Build.BY_LIGHTNING, union=tuple(p.union))

    def kept(self, ctx: SwitchContext) -> Kept:
        return decode_kept(self.payload.kept, ctx.device)

    def reach(self, ctx: SwitchContext, planned: Planned, transfer):
        return ctx.elastic.join_world(self.change, transfer)

    def enter(self, ctx: SwitchContext, world, planned: Planned) -> None:
        ctx.enter_world(world.rank, world.world_size)
        ctx.install(ctx.build_mesh(planned.target, ranks=planned.target_ranks), planned.target,
                    planned.target_ranks)
        ctx.adopt_logger_versions(self.payload.loggers)

    def preallocated(self, planned: Planned):
        ready, self._ready = self._ready, None
        return ready

    def checks_received(self) -> bool:
        return self.payload.before is not None

    def before(self):
        return verify.from_json(self.payload.before)

    def scheduler_states(self, ctx: SwitchContext) -> list[dict]:
        # Lightning restores them from the loop state after its set-up, where this check runs.
        return self.payload.checkpoint.get("lr_schedulers", [])

    def report(self, ctx: SwitchContext, report: SwitchReport) -> None:
        """The members report the switch; a joining process has no old layout of its own."""


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

    kind = "recovery"
    agree = False
    broken_world = True
    world_changes = True

    def __init__(self, targets: TargetLayouts, cause: str) -> None:
        self.targets, self.cause = targets, cause
        self.world: Any = None
        self.lost: list[str] = []
        self.checked: replicas.Comparison | None = None  # the survivors' copies compared before recovering from them

    def verified(self, ctx: SwitchContext) -> bool:
        return False  # the lost processes' checksums are gone with them

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
        rank_of = {members.index(m): new_members.index(m) for m in new_members}  # plan id (old rank) -> new rank
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
        return Planned(plan, old_layout, target, members.index(manager.member_id), target_ranks,
                       Build.AFTER_TRANSFER, rank_of=rank_of)

    def reach(self, ctx: SwitchContext, planned: Planned, transfer):
        transfer(self.world)
        return self.world

    def report(self, ctx: SwitchContext, report: SwitchReport) -> None:
        ctx.on_recovered(RecoveryReport(
            step=report.step, lost=self.lost, survivors=report.world_size, old_layout=report.old_layout,
            new_layout=report.new_layout, bytes_moved=report.bytes_moved, seconds=report.stall_s, cause=self.cause,
            phases=report.phases, replicas_compared=self.checked.compared if self.checked else 0))
