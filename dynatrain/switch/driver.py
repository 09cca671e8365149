"""The one switch driver: the stages every kind of layout switch is made of, written once.

    capture -> plan -> check before -> release -> move -> build -> adopt -> check after -> restart -> report

`Stages` holds each stage; a `Move` runs them in the order its kind needs, in one method a reader follows top to
bottom (`run`): a switch among the same processes (`switch.moves.InWorld`) builds its target before the old shards
are released, since the target's mesh exists already; a world change as a member runs it (`switch.moves.WorldChange`)
builds on the target world right before the transfer when nobody leaves (the transfer runs there), else after the
transfer, when the target world exists; the survivors of a lost process (`switch.survivors.Recovery`) let go of the
broken world before they wait on anyone; a process joining (`switch.joining.Join`) holds nothing, and Lightning's
own set-up builds its module. That last move is a generator: a joining process runs it from its
`setup_environment`, and it waits (`yield`) for Lightning to build the module, to make the optimizer and to restore
the loop state (`switch_stages`). Every other process runs its move to the end at once (`run`).

The bytes move through ``transfer``, `engine.run_transition` unless the caller hands another (fault injection, a
benchmark's instrumented copy). Every rank runs the same stages on the same inputs, so every collective matches.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from torch import nn

from dynatrain import engine
from dynatrain.check import verify
from dynatrain.planner.schedule import SwitchPlan
from dynatrain.runtime.memory import release_freed_memory, resident_bytes
from dynatrain.switch.adopt import adopt_module, adopt_optimizer
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.report import DEVICE_FIELDS, PhaseTimer, SwitchReport
from dynatrain.switch.states import Held, Kept, hold, release
from dynatrain.switch.target import transplant
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

Transfer = Callable[..., tuple[dict, Any]]  # `engine.run_transition`'s signature


@dataclass
class Planned:
    """The plan and where it leads: ``me`` is this process's id in the plan, ``target_ranks`` per new mesh position
    its rank in the target world; ``probe``: a build of the target the request made on the default arrangement."""

    plan: SwitchPlan
    old_layout: Layout
    target: ParallelConfig
    me: int
    target_ranks: list[int]
    prepared: bool = False  # planned in the background while training went on
    probe: nn.Module | None = None
    union: tuple[str, ...] = ()  # member ids of the plan's processes, in plan-id order
    formed_ahead_steps: int | None = None  # the target world formed while this many steps trained


def ranks_in(world, union) -> dict[int, int]:
    """Plan process id (index in the sorted union) -> rank in ``world``."""
    return {p: world.members.index(m) for p, m in enumerate(union) if m in world.members}


class Move:
    """One kind of switch: how it plans (`plan`) and the order it runs the stages in (`run`)."""

    def plan(self, ctx: SwitchContext, held: Held | None) -> Planned:
        raise NotImplementedError

    def run(self, s: "Stages") -> SwitchReport | None:
        raise NotImplementedError


class Stages:
    """One switch's stages on this process, and what they hand each other: the live states (``held``, until the
    release), the plan, the check's side of before, the target's build, the moved tensors."""

    def __init__(self, ctx: SwitchContext, transfer: Transfer) -> None:
        self.ctx, self._transfer = ctx, transfer
        self.timer = PhaseTimer()
        self.footprint = resident_bytes()  # the old layout's, its steps' working memory included
        self.held: Held | None = None
        self.names: list[str] | None = None  # the live module's children the target replaces, once released
        self.sources: dict = {}
        self.kept: Kept | None = None
        self.module: nn.Module = ctx.module
        self.planned: Planned | None = None
        self.before: verify.Before | None = None
        self.built: tuple[Any, nn.Module | None] | None = None  # (the target's mesh, its module; None: the live one)
        self.dst: dict = {}
        self.stats = None

    # ---- before anything moves ------------------------------------------------------------------------------
    def capture(self, agree: bool = True) -> None:
        """The live states, agreed across ranks (``agree``; a broken world cannot)."""
        held = self.held = hold(self.ctx, agree=agree)
        self.timer.set_aside("boundary_wait", held.waited)
        self.sources, self.kept, self.module = held.captured.sources, held.kept, held.module

    def release_broken_world(self) -> None:
        """Nothing may reference the broken groups while the survivors agree: a peer blocked in a collective with
        this process fails at once when its last reference goes, instead of at the group's timeout."""
        self.names = release(self.ctx, self.held)
        gc.collect()

    def plan(self, move_plan: Callable[[SwitchContext, Held | None], Planned]) -> Planned:
        """The same plan on every process, from the same inputs."""
        planned = self.planned = move_plan(self.ctx, self.held)
        if self.held is not None:
            engine.validate_sources(planned.plan, planned.me, self.sources)
        planned.plan.rank_plan(planned.me)  # this process's pieces (kept, once made ahead): the check reads them first
        self.timer.lap("plan")
        return planned

    def check_before(self) -> None:
        """The check's side of before: what this process sends, hashed by its live tensors' own placements."""
        if self.ctx.settings.verify:
            self.before = verify.before(self.held, self.planned.plan, self.planned.me)
            self.timer.lap("verify")

    def reduce_before(self) -> None:
        """The check's side of before, summed on the old world, which a world change that some member leaves ends."""
        if self.before is not None:
            self.before = verify.reduce(self.ctx, self.before)
            self.timer.lap("verify")

    def build(self) -> None:
        """The target's mesh and the module parallelised on it, on meta; the mesh's groups are their own phase."""
        planned, ctx = self.planned, self.ctx
        mesh = ctx.build_mesh(planned.target, ranks=planned.target_ranks)
        self.timer.lap("mesh")
        if planned.probe is not None and list(planned.target_ranks) == list(range(planned.target.world_size)):
            self.built = mesh, planned.probe  # the request built it on this very mesh
        else:
            self.built = mesh, ctx.build_target(mesh, planned.target)
        self.timer.lap("build")

    def release(self) -> None:
        """The old shards go to the engine, which empties each one's storage after its last send whoever still holds
        the tensor, so the old module's reference cycles (FSDP2's modules, states and parameters) are left to
        Python's collector instead of a full collection in the stall."""
        if self.names is None:
            self.names = release(self.ctx, self.held)
        self.held = None
        self.timer.lap("release")

    # ---- the move ---------------------------------------------------------------------------------------------
    def transfer(self, group_ranks=None, preallocated: dict | None = None) -> None:
        planned = self.planned
        self.dst, self.stats = self._transfer(planned.plan, planned.me, self.sources, group_ranks=group_ranks,
                                              device=self.ctx.device, preallocated=preallocated)
        self.timer.lap("transfer")

    def leave(self) -> SwitchReport:
        """This process left the job: it holds an unparallelised placeholder for the hooks still to run as its loop
        winds down."""
        self.ctx.leave_job()
        placeholder = self.ctx.placeholder()
        if placeholder is not None:
            transplant(self.module, placeholder, self.names or [])
        return self.report(None, left=True)

    # ---- after it ---------------------------------------------------------------------------------------------
    def adopt_module(self, module: nn.Module | None = None) -> None:
        """The moved shards in the target, which takes the live module's place (``module``: the live one, when
        Lightning parallelised it for the target itself)."""
        mesh, target = self.built
        planned = self.planned
        adopt_module(self.ctx, module if module is not None else self.module, target, self.names or [], mesh,
                     planned.target, planned.target_ranks, self.dst)
        if module is not None:
            self.module = module

    def adopt_optimizer(self, optimizer, schedulers: bool = True) -> None:
        """The optimizer as it was; ``schedulers``: and the LR schedulers' states."""
        adopt_optimizer(self.ctx, self.module, optimizer, self.dst, self.kept, schedulers=schedulers)
        self.timer.lap("adopt")

    def check_after(self, before: verify.Before, schedulers: list[dict]) -> bool:
        """Every state, indexed by the adopted tensors' own placements, against ``before``."""
        verified = verify.after(self.ctx, before, self.planned, schedulers=schedulers)
        self.timer.lap("verify")
        return verified

    def restart(self) -> bool:
        """The pipeline schedule and the data split for the new layout; whether the freed heap went back."""
        self.ctx.restart_steps(self.planned.target)
        trimmed = release_freed_memory(self.footprint)
        self.timer.lap("restart")
        return trimmed

    def finish(self) -> SwitchReport:
        """The end of a switch of a process that held a module: the target adopted with the optimizer
        `configure_optimizers()` makes, checked against before, the steps restarted; its report, to publish."""
        self.adopt_module()
        self.adopt_optimizer(self.ctx.make_optimizer())
        verified = None
        if self.before is not None:
            verified = self.check_after(self.before, self.ctx.scheduler_states())
        return self.report(verified, heap_trimmed=self.restart())

    def report(self, verified: bool | None, left: bool = False, heap_trimmed: bool = False) -> SwitchReport:
        planned, stats, timer = self.planned, self.stats, self.timer
        plan, old = planned.plan, planned.old_layout.config
        return SwitchReport(
            step=self.ctx.step, old_layout=old.short(), new_layout=planned.target.short(),
            world_size=0 if left else planned.target.world_size,
            bytes_total=plan.bytes_total, bytes_moved=plan.bytes_moved,
            bytes_moved_identity=plan.bytes_moved_identity, rounds=plan.num_rounds,
            rank_map=[] if left else list(planned.target_ranks), peak_bytes=stats.peak_bytes,
            peak_bound=stats.peak_bound, verified=verified, phases=timer.phases, old_world_size=old.world_size,
            prepared=planned.prepared, heap_trimmed=heap_trimmed, formed_ahead_steps=planned.formed_ahead_steps,
            boundary_wait_s=timer.aside.get("boundary_wait", 0.0),
            **{k: getattr(stats, k) for k in DEVICE_FIELDS},
        )


def run(ctx: SwitchContext, move: Move, transfer: Transfer = engine.run_transition) -> SwitchReport | None:
    """A switch of a process that holds a module: every stage, now. The cycle collector waits for its end: the old
    module's objects are garbage from the release on, and the build allocates enough objects to start a full
    collection of them inside the stall. After it one collection runs on a thread of its own, mostly while the
    next step's operators hold no interpreter lock."""
    enabled, report = gc.isenabled(), None
    gc.disable()
    try:
        report = move.run(Stages(ctx, transfer))
        return report
    finally:
        if enabled:
            gc.enable()
            if report is not None and report.world_size:  # not on a process that left, which soon exits
                threading.Thread(target=gc.collect, name="dynatrain-collect-old-layout", daemon=True).start()


def switch_stages(ctx: SwitchContext, move, transfer: Transfer = engine.run_transition) -> Generator:
    """A joining process's switch, which waits for Lightning's set-up (see `switch.joining.Await`)."""
    return move.stages(Stages(ctx, transfer))
