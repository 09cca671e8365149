"""The one switch driver: every kind of layout switch runs this stage sequence, written once.

    capture -> plan -> prepare target -> release -> move -> build -> adopt -> verify -> restart -> report

What differs between a switch among the same processes, a world change as a member runs it, a process joining
and the survivors of a lost process is data, given as a `Move` (`switch.moves`): who sends (a joining process holds
nothing), who receives (a leaving one keeps nothing), over which world the bytes travel (the current one, the union
of old and new members, the survivors'), how the plan is made, and when the target can be built: before the old
shards are released (the same processes: the target's mesh exists, and the request built it), on the target world
right before the transfer (nobody leaves: the transfer runs there), after the transfer (the target world exists
only then), or by Lightning's own set-up (a joining process, whose module is parallelised by `configure_model`).

That last case is why the driver is a generator: a joining process runs it from its `setup_environment`, and it
waits (`yield`) for Lightning to build the module (then, if its transfer waited for the module, it moves the
bytes), to make the optimizer, and to restore the loop state. Every other process runs it to the end at once (`run`).

Every rank runs the same stages on the same inputs, so every collective matches.
"""

from __future__ import annotations

import gc
from collections.abc import Generator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch import nn

from dynatrain import engine
from dynatrain.check import verify
from dynatrain.engine.stats import TransitionStats
from dynatrain.runtime.memory import release_freed_memory, resident_bytes
from dynatrain.switch.adopt import adopt_module, adopt_optimizer
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.moves import SAME_WORLD, Build, Move, Planned
from dynatrain.switch.report import DEVICE_FIELDS, PhaseTimer, SwitchReport
from dynatrain.switch.states import hold, release
from dynatrain.switch.target import transplant


class Await(Enum):
    """What a joining process's driver waits for."""

    MODULE = "Lightning's set-up parallelised the module for the target layout"
    OPTIMIZER = "Lightning's set-up made the optimizer"
    LOOP = "Lightning restored the loop state"


@dataclass
class Moved:
    world: Any  # the world the process trains in next; None: it left the job
    dst: dict
    stats: TransitionStats


def run(ctx: SwitchContext, move: Move) -> SwitchReport | None:
    """A switch of a process that holds a module: every stage, now."""
    stages = switch_stages(ctx, move)
    try:
        waiting = stages.send(None)
    except StopIteration as done:
        return done.value
    stages.close()
    raise RuntimeError(f"a {move.kind} waited for: {waiting.value}; only a joining process waits for Lightning")


def switch_stages(ctx: SwitchContext, move: Move) -> Generator[Await, nn.Module | None, SwitchReport | None]:
    timer = PhaseTimer()
    footprint = resident_bytes()  # the old layout's, its steps' working memory included

    # capture: the live states, agreed across ranks
    held = hold(ctx, agree=move.agree) if move.sends else None
    if held is not None:
        timer.set_aside("boundary_wait", held.waited)
    names: list[str] = []
    if held is not None and move.broken_world:
        # Nothing may reference the broken groups while the survivors agree: a peer blocked in a collective with
        # this process fails at once when its last reference goes, instead of at the group's timeout.
        names = release(ctx, held)
        gc.collect()

    # plan: the same plan on every process, from the same inputs
    planned: Planned = move.plan(ctx, held)
    if held is not None:
        engine.validate_sources(planned.plan, planned.me, held.captured.sources)
    timer.lap("plan")
    # the check's side of before: what this process sends, hashed by its live tensors' own placements
    before = None
    if held is not None and move.verified(ctx):
        before = verify.before(held, planned.plan, planned.me)
        timer.lap("verify")

    # prepare target: on the target's mesh, which exists now for the same processes
    built: list[tuple[Any, nn.Module | None]] = []
    if planned.build is Build.BEFORE_RELEASE:
        built.append(_build(ctx, planned, timer))
        timer.lap("build")

    # release: the old shards go to the engine, which frees each after its last send
    if held is not None:
        if before is not None and move.world_changes:
            before = verify.reduce(ctx, before)  # on the old world, which the change ends
            timer.lap("verify")
        move.publish(ctx, held, planned, before)
        if not move.broken_world:
            names = release(ctx, held)
        move.forget_old_world(ctx)
        gc.collect()
        timer.lap("release")
    sources = held.captured.sources if held is not None else {}
    kept = held.kept if held is not None else move.kept(ctx)
    module = held.module if held is not None else ctx.module
    del held

    # move: over the world the move names; nobody leaving, on the target world, whose target is built first
    moved: list[Moved] = []

    def transfer(world) -> None:
        if world is not None:
            timer.lap("world")  # forming the world the bytes travel on
        if planned.build is Build.ON_TARGET_WORLD:
            move.enter(ctx, world, planned)
            timer.lap("world")
            built.append(_build(ctx, planned, timer))
            timer.lap("build")
        dst, stats = engine.run_transition(  # looked up at call time: fault injection and benchmarks replace it
            planned.plan, planned.me, sources, group_ranks=move.group_ranks(world, planned), device=ctx.device,
            preallocated=move.preallocated(planned))
        moved.append(Moved(world, dst, stats))
        timer.lap("transfer")

    deferred = planned.build is Build.BY_LIGHTNING and move.transfer_after_setup
    world = move.reach(ctx, planned, None if deferred else transfer)
    if world is not SAME_WORLD and planned.build is not Build.BY_LIGHTNING:
        timer.lap("world")  # forming the target world after a transfer on the union, or leaving the job
    if world is None:  # this process left the job
        ctx.leave_job()
        placeholder = ctx.placeholder()
        if placeholder is not None:  # for the hooks still to run as its loop winds down
            transplant(module, placeholder, names)
        return _report(ctx, move, planned, moved[0].stats, None, timer, left=True)

    # build: the target world exists now
    if planned.build is Build.AFTER_TRANSFER:
        move.enter(ctx, world, planned)
        timer.lap("world")
        built.append(_build(ctx, planned, timer))
        timer.lap("build")
    elif planned.build is Build.BY_LIGHTNING:
        move.enter(ctx, world, planned)
        module = yield Await.MODULE
        built.append((ctx.mesh, None))  # Lightning parallelised the module itself on the target mesh
        if deferred:
            transfer(world)
    mesh, target_module = built[0]
    result = moved[0]

    # adopt: the moved shards in the target, which takes the live module's place; the optimizer as it was
    adopt_module(ctx, module, target_module, names, mesh, planned.target, planned.target_ranks, result.dst)
    if planned.build is Build.BY_LIGHTNING:
        optimizer = yield Await.OPTIMIZER
    else:
        optimizer = ctx.make_optimizer()
    adopt_optimizer(ctx, module, optimizer, result.dst, kept, schedulers=planned.build is not Build.BY_LIGHTNING)
    timer.lap("adopt")

    # verify: every state, indexed by the adopted tensors' own placements
    verified = None
    if before is not None or move.checks_received():
        verified = verify.after(ctx, before if before is not None else move.before(), planned,
                                reduced=move.world_changes, schedulers=move.scheduler_states(ctx))
        timer.lap("verify")

    # restart: the pipeline schedule and the data split for the new layout
    if planned.build is Build.BY_LIGHTNING:
        yield Await.LOOP
    ctx.restart_steps(planned.target)
    trimmed = release_freed_memory(footprint)
    timer.lap("restart")
    return _report(ctx, move, planned, result.stats, verified, timer, heap_trimmed=trimmed)


def _build(ctx: SwitchContext, planned: Planned, timer: PhaseTimer) -> tuple[Any, nn.Module]:
    """(the target's mesh, the module parallelised on it, on meta); the mesh's groups are their own phase."""
    mesh = ctx.build_mesh(planned.target, ranks=planned.target_ranks)
    timer.lap("mesh")
    if planned.probe is not None and list(planned.target_ranks) == list(range(planned.target.world_size)):
        return mesh, planned.probe  # the request built it on this very mesh
    return mesh, ctx.build_target(mesh, planned.target)


def _report(ctx: SwitchContext, move: Move, planned: Planned, stats: TransitionStats, verified: bool | None,
            timer: PhaseTimer, left: bool = False, heap_trimmed: bool = False) -> SwitchReport:
    plan, old = planned.plan, planned.old_layout.config
    report = SwitchReport(
        step=ctx.step, old_layout=old.short(), new_layout=planned.target.short(),
        world_size=0 if left else planned.target.world_size,
        bytes_total=plan.bytes_total, bytes_moved=plan.bytes_moved, bytes_moved_identity=plan.bytes_moved_identity,
        rounds=plan.num_rounds, rank_map=[] if left else list(planned.target_ranks), peak_bytes=stats.peak_bytes,
        peak_bound=stats.peak_bound, verified=verified, phases=timer.phases, old_world_size=old.world_size,
        prepared=planned.prepared, heap_trimmed=heap_trimmed,
        boundary_wait_s=timer.aside.get("boundary_wait", 0.0),
        **{k: getattr(stats, k) for k in DEVICE_FIELDS},
    )
    move.report(ctx, report)
    return report
