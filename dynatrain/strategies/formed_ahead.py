"""A scale-out whose target generation forms while the members train: admitted at one boundary, switched at a later.

When rank 0 finds enough ready joiners for a scale-out nobody leaves, the members do not switch at that boundary.
Every member starts forming the target generation in the background (`WorldGeneration.form_ahead`, in the rank
order of the plan prepared while the job waited, `switch.prepare.MemberPrep`) and rank 0 announces it with its
keys, so the admitted joiners form it with them (`ElasticManager.await_admission`, then `join_world`). Training goes
on. At each later boundary the members agree (one all-reduce on the current world) whether every one of them has
it formed; the switch then runs on it, with no world to form in its stall.

A joiner that dies meanwhile leaves the formation unfinished: its beats stop, rank 0 sees it within
``5 * heartbeat`` seconds (`ElasticManager.silent_for`), and the members drop the formation with a warning and go
back to waiting for ready joiners; the world that trains never depended on it. A formation that has not finished
within the elastic timeout is dropped alike.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from dynatrain.elastic.registry import ready_pending
from dynatrain.elastic.world import announce, plan_union_then_target
from dynatrain.runtime import control_group
from dynatrain.switch.moves import change_inputs
from dynatrain.switch.prepare import MemberPrep
from dynatrain.switch.states import capture_states


POLL = 0.01  # seconds between a watcher's looks at the store


class Watcher:
    """While a scale-out planned ahead waits for joiners: on a thread with its own store connection, rank 0 admits
    the first ready ones as soon as they are ready, inside a step, and every member starts forming the target
    generation as soon as rank 0 has, so that it is formed by the next boundary more often than not. The boundary
    decides as without it when it has not (`take`)."""

    def __init__(self, manager, prep: MemberPrep, need: int, rank0: bool, attempt: int, connect, step: int) -> None:
        self.joiners: list[str] | None = None  # rank 0's admission, once made (read from the store elsewhere)
        self.step = step  # the trainer's step it began at: what it forms, it forms while the next step trains
        self.ahead = None  # the target generation, forming, once started on this member
        self._stop = threading.Event()
        key = f"elastic/forming/{manager.world.generation + 1}/{attempt}"
        self._thread = threading.Thread(target=self._run, args=(manager, prep, need, rank0, key, connect),
                                        name="dynatrain-admit-ahead", daemon=True)
        self._thread.start()

    def _run(self, manager, prep: MemberPrep, need: int, rank0: bool, key: str, connect) -> None:
        try:
            store = connect()
            members = manager.world.members
            while not self._stop.is_set():
                joiners = _ready(store, members, need) if rank0 else _admitted(store, key)
                # Joiners that sort after every member keep the prepared plan's process ids (`ChangeInputs`).
                if joiners is not None and min(joiners) > max(members):
                    union = tuple(sorted(set(members) | set(joiners)))
                    if rank0:
                        store.set(key, json.dumps(joiners))
                    self.ahead = form_target(manager, prep.plan(), union, store if rank0 else None)
                    self.joiners = joiners
                    return
                self._stop.wait(POLL)
        except Exception:  # noqa: BLE001 - the boundary admits and forms as without the watcher
            return

    def take(self) -> "Watcher":
        """Stop watching (at a boundary, before the members agree): what it started stays."""
        self._stop.set()
        self._thread.join()
        return self


def _ready(store, members, need: int) -> list[str] | None:
    ready = ready_pending(store, members)
    return ready[:need] if len(ready) >= need else None


def _admitted(store, key: str) -> list[str] | None:
    return json.loads(store.get(key).decode()) if store.check([key]) else None


def watch(orchestrator, request) -> None:
    """A scale-out planned ahead that waits for joiners, once planned in the background: watch for them until the
    next boundary (every member alike, each boundary a new attempt)."""
    strategy = orchestrator.strategy
    if not request.plan_ahead or request.leave or not isinstance(request.prep, MemberPrep):
        return
    need = request.target.world_size - strategy.world_size
    request.attempts += 1
    connect = orchestrator.store_connection()
    request.watcher = Watcher(strategy.elastic, request.prep, need, strategy.global_rank == 0, request.attempts,
                              connect, orchestrator.ctx.step)


def taken(request) -> list[str] | None:
    """At a boundary: the watcher stopped; the joiners rank 0's admitted, if it did."""
    watcher = request.watcher
    return watcher.take().joiners if watcher is not None else None


def start(orchestrator, request, joiners: list[str]) -> bool:
    """At the boundary that admits ``joiners``: start forming the target generation (unless this member's watcher
    did), announce it; False (switch now, forming in the stall) when the change is not one to form ahead. The same
    answer on every member: it follows from the request alone. Its rank order comes from the plan: the one
    prepared while the job waited, when it was made for these inputs, else one made now in the background, which
    then forms and announces."""
    strategy, ctx = orchestrator.strategy, orchestrator.ctx
    if (not request.plan_ahead or not joiners or request.leave
            or strategy.world_size + len(joiners) != request.target.world_size):
        return False  # switch now; someone leaving too moves the bytes on a union world formed in the stall
    watcher, request.watcher = request.watcher, None
    inputs = change_inputs(ctx, orchestrator.targets, request.target, request.leave, joiners, capture_states(ctx))
    manager, rank0 = strategy.elastic, strategy.global_rank == 0
    prep = request.prep
    forming_step = ctx.step
    if watcher is not None and watcher.take().joiners == list(joiners) and watcher.ahead is not None:
        request.ahead, forming_step = watcher.ahead, watcher.step
    elif isinstance(prep, MemberPrep) and prep.inputs == inputs:
        request.ahead = form_target(manager, prep.plan(), inputs.union, manager.store if rank0 else None)
    else:
        connect = orchestrator.intent_store()  # on rank 0: the plan's thread announces on a connection of its own
        request.prepared(MemberPrep(inputs, form=lambda plan: form_target(
            manager, plan, inputs.union, connect() if connect is not None else None)))
    request.admitted, request.forming_since, request.forming_step = list(joiners), time.monotonic(), forming_step
    return True


def form_target(manager, plan, union, store=None):
    """Start forming the target generation of ``plan`` (a `WorldPlan` over ``union``) with its mesh's groups, and
    return it; None on a member the plan leaves out. With ``store`` (rank 0's), announce it to the joiners."""
    members, subgroups = plan.target_members(union), plan.mesh_groups()
    if manager.member_id not in members:
        return None
    ahead = manager.form_ahead(members, subgroups)
    if store is not None:
        world = manager.world
        announce(store, plan_union_then_target(world.generation, world.members, members, members, ahead.key,
                                               subgroups))
    return ahead


def generation(request):
    """The generation a request forms ahead, once its plan has started it (None before)."""
    prep = request.prep
    return request.ahead or (prep.ahead if isinstance(prep, MemberPrep) and prep.done() else None)


def formed(orchestrator, request) -> bool:
    """At a later boundary: whether every member has the generation formed (the switch runs now). A formation a
    joiner's death or the timeout ended is dropped here, on every member alike, and the request waits for ready
    joiners again."""
    strategy = orchestrator.strategy
    ahead = generation(request)
    error = ahead.formation.error if ahead is not None else request.prep.error
    ok = ahead is not None and ahead.formation.done() and error is None
    if strategy.world_size > 1:
        ok = control_group.all_reduce_ints([int(ok)], strategy.control_group, op=dist.ReduceOp.MIN)[0] == 1
    if ok:
        return True
    reason = None
    if strategy.global_rank == 0:
        manager = strategy.elastic
        silent = {m: manager.silent_for(m) for m in request.admitted}
        dead = {m: s for m, s in silent.items() if s is not None}
        if dead:
            reason = ", ".join(f"joiner {m} stopped beating for {s:.1f}s" for m, s in dead.items())
        elif time.monotonic() - request.forming_since > manager.config.timeout:
            reason = f"it did not form within the {manager.config.timeout:.0f}s elastic timeout"
        elif error is not None:
            reason = f"it failed: {error}"
        if reason is not None:
            for m in request.admitted:
                manager.drop_joiner(m, f"the world formed for the scale-out to {request.target.short()} was "
                                       f"dropped: {reason}")
    reason = strategy.broadcast(reason)
    if reason is not None:
        rank_zero_warn(f"scale-out to {request.target.short()}: the next world, forming while training went on, "
                       f"was dropped ({reason}); training goes on with {strategy.world_size} processes and the "
                       f"scale-out waits for ready joiners again")
        if ahead is not None:
            ahead.discard()
        request.prep.discard()
        request.ahead = request.admitted = request.forming_since = request.forming_step = None
    return False
