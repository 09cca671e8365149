"""A process joining a running job: its side of the members' world change (`switch.moves.WorldChange`).

It holds nothing, so it captures and releases nothing; it plans the members' plan from rank 0's payload and
receives its shards, on the union world or, when nobody leaves, on the target world once its module is built.
Lightning's own set-up builds that module (`configure_model` on meta) and makes the optimizer, so the move is a
generator: it waits (`Await`) for each of them, and for the loop state Lightning restores.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from enum import Enum

from torch import nn

from dynatrain import engine
from dynatrain.check import verify
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.driver import Move, Planned, Stages, ranks_in
from dynatrain.switch.payload import JoinPayload, decode_kept
from dynatrain.switch.prepare import JoinerPrep, plan_from_payload
from dynatrain.switch.report import SwitchReport
from dynatrain.switch.states import Held
from dynatrain.vps.parallel_config import ParallelConfig


class Await(Enum):
    """What a joining process's switch waits for."""

    MODULE = "Lightning's set-up parallelised the module for the target layout"
    OPTIMIZER = "Lightning's set-up made the optimizer"
    LOOP = "Lightning restored the loop state"


def _awaited(s: Stages, what: Await, name: str) -> Generator[Await, nn.Module | None, nn.Module | None]:
    """Wait for ``what`` of Lightning; its seconds are the joiner's, outside the switch's phases (``name``)."""
    start = time.perf_counter()
    value = yield what
    s.timer.set_aside(name, time.perf_counter() - start)
    return value


class Join(Move):
    def __init__(self, prep: JoinerPrep, change, payload: JoinPayload) -> None:
        self.prep, self.change, self.payload = prep, change, payload
        # Nobody leaves (as `WorldChange` decides it): the transfer runs on the target world, once the module is built.
        self.transfer_after_setup = set(change.new) == set(change.union)
        self._ready: dict | None = None

    def stages(self, s: Stages) -> Generator[Await, nn.Module | None, SwitchReport]:
        ctx = s.ctx
        s.plan(self.plan)
        s.kept = decode_kept(self.payload.kept, ctx.device)
        deferred = self.transfer_after_setup
        world = ctx.elastic.join_world(self.change, None if deferred else lambda world: self._receive(s, world))
        self._enter(ctx, world, s.planned)
        module = yield from _awaited(s, Await.MODULE, "lightning_setup")
        s.built = ctx.mesh, None  # Lightning parallelised the module itself on the target mesh
        if deferred:
            self._receive(s, world)
        s.adopt_module(module)
        optimizer = yield from _awaited(s, Await.OPTIMIZER, "lightning_optimizer")
        # The LR schedulers' states come with the loop state Lightning restores after its set-up.
        s.adopt_optimizer(optimizer, schedulers=False)
        verified = None
        if self.payload.before is not None:  # checked against the members' checksums
            verified = s.check_after(verify.from_json(self.payload.before),
                                     self.payload.checkpoint.get("lr_schedulers", []))
        yield from _awaited(s, Await.LOOP, "loop_restore")
        # The members report the switch; a joining process has no old layout of its own.
        report = s.report(verified, heap_trimmed=s.restart())
        report.joined = dict(s.timer.aside)
        return report

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
                       union=tuple(p.union))

    def _receive(self, s: Stages, world) -> None:
        s.timer.lap("world")  # forming the world the bytes travel on
        ready, self._ready = self._ready, None
        s.transfer(ranks_in(world, s.planned.union), preallocated=ready)

    def _enter(self, ctx: SwitchContext, world, planned: Planned) -> None:
        ctx.enter_world(world.rank, world.world_size)
        ctx.install(ctx.build_mesh(planned.target, ranks=planned.target_ranks), planned.target,
                    planned.target_ranks)
        ctx.adopt_logger_versions(self.payload.loggers)
