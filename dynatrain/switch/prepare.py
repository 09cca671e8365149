"""The next world, prepared in the background while the current one trains.

A scale-out waits across optimizer-step boundaries until enough joiners are ready, and joiners take seconds to
get there (imports, Trainer, data). Meanwhile every member plans the world change in a background thread: the
routing plan (pure Python, up to a second for a 70B model on a thousand ranks) and the target generation's rank
order, from the target's placements probed when the change was requested.

A plan works on process ids, the indices of the sorted union of members and joiners. Joiner ids carry the job's
joiner counter, so joiners sort after every current member, and the plan does not depend on which joiners come:
it is made for the next ``n`` ids before any joiner is known. At the switch the inputs are computed again from the
admitted joiners; when they equal the prepared ones (always, unless an older standby process is admitted after a
newer one) the switch starts from the prepared plan, otherwise it plans at the boundary. Rank 0
publishes the prepared plan's inputs, and waiting joiners plan their side from them in their own background
thread.

A change whose members are all known ahead (no joiner: a scale-in) also forms its target generation in the
background once planned (`WorldGeneration.form_ahead`): torch holds one default group per process, but a group
can be built beside it and made the default one at the boundary (`elastic.next_world`), with the groups of the
target's mesh (`WorldPlan.mesh_groups`)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from dynatrain import engine
from dynatrain.runtime import memory
from dynatrain.runtime.background import Background
from dynatrain.engine import torch_dtype
from dynatrain.engine.checks import expected_destinations
from dynatrain.models.mesh_groups import layout_groups
from dynatrain.models.parallelize import mesh_safe
from dynatrain.planner.schedule import SwitchPlan, plan_switch
from dynatrain.switch.payload import decode_specs, encode_specs
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.placement import Sharding
from dynatrain.vps.parallel_config import ParallelConfig

INTENT_KEY = "elastic/intent"  # rank 0's prepared plan inputs, read by waiting joiners
WORKING_KEY = "elastic/working_bytes"  # what rank 0's steps work in (`free_working_bytes`), kept up to date
# What a joiner's plan is computed from; the same values in the intent and in the switch payload give the same plan.
PLAN_FIELDS = ("old", "old_ids", "target", "positions", "leave", "joiners", "budget", "specs")


def plan_mesh_safe(plan_with: Callable[[Any], SwitchPlan], ranks_of: Callable[[SwitchPlan], list[int]],
                   target: ParallelConfig) -> tuple[SwitchPlan, list[int]]:
    """The planner's arrangement (``plan_with(None)``) when every mesh group's ranks ascend in the target world
    (``ranks_of``: each new position's rank there); otherwise the same processes in ascending order, since
    `new_group` sorts its ranks and any other order would permute the group's collectives."""
    plan = plan_with(None)
    ranks = ranks_of(plan)
    if not mesh_safe(ranks, target):
        plan = plan_with(sorted(plan.new.processes))
        ranks = ranks_of(plan)
    return plan, ranks


def target_order(plan: SwitchPlan, member_ids: Collection[int]) -> tuple[list[int], list[int]]:
    """The target generation's process ids in rank order and, per new mesh position, its rank there.

    Ranks follow the mesh positions, so every mesh group's ranks ascend whatever arrangement the planner chose;
    except when that would hand rank 0 (logging, checkpoints) to a joiner while a current member
    (``member_ids``) stays: then ranks follow the sorted ids, as the members' ranks always did."""
    order = list(plan.new.rank_map)
    if order[0] in member_ids or not any(p in member_ids for p in order):
        return order, list(range(len(order)))
    ranked = sorted(order)
    return ranked, [ranked.index(p) for p in order]


@dataclass(frozen=True)
class ChangeInputs:
    """Everything a world change's plan depends on, in process ids (indices in the sorted union of members and
    joiners); ``union`` names them and takes no part in comparisons."""

    specs: tuple[StateSpec, ...]
    old_shardings: tuple[Sharding, ...]
    new_shardings: tuple[Sharding, ...]
    old: ParallelConfig
    old_ids: tuple[int, ...]
    target: ParallelConfig
    leave: tuple[int, ...]
    joiners: tuple[int, ...]
    rank_map: str | tuple[int, ...]
    budget: int
    union: tuple[str, ...] = field(compare=False)

    @classmethod
    def build(cls, specs, old_shardings, new_shardings, old: ParallelConfig, positions: Sequence[int],
              members: Sequence[str],
              target: ParallelConfig, leave: Sequence[int], joiners: Sequence[str] | None, rank_map, budget: int
              ) -> "ChangeInputs":
        """From the current world: ``positions`` (old mesh position -> rank), ``leave`` as current ranks,
        ``joiners`` as member ids; None stands for as many joiners as the target needs, not known yet."""
        if joiners is None:
            count = target.world_size - (len(members) - len(set(leave)))
            joiners = [f"~{i:06d}" for i in range(count)]  # sorts after every member id, as joiners do
        union = tuple(sorted(set(members) | set(joiners)))
        uid = {m: i for i, m in enumerate(union)}
        rank_map = rank_map if isinstance(rank_map, str) else tuple(rank_map)
        return cls(tuple(specs), tuple(old_shardings), tuple(new_shardings), old,
                   tuple(uid[members[p]] for p in positions), target,
                   tuple(uid[members[r]] for r in leave), tuple(uid[j] for j in joiners), rank_map, int(budget),
                   union)

    @property
    def member_ids(self) -> set[int]:
        joining = set(self.joiners)
        return {i for i in range(len(self.union)) if i not in joining}


@dataclass(frozen=True)
class WorldPlan:
    inputs: ChangeInputs
    old_layout: Layout
    plan: SwitchPlan
    order: list[int]  # the target generation's process ids in rank order
    target_ranks: list[int]  # per new mesh position, its rank in the target generation

    def target_members(self, union: Sequence[str]) -> list[str]:
        return [union[p] for p in self.order]

    def mesh_groups(self) -> list[tuple[int, ...]]:
        """Every process group of the target's mesh, by rank in the target generation (formed with it ahead)."""
        return layout_groups(self.inputs.target, self.target_ranks)

    def intent(self) -> dict:
        """The plan inputs a joiner needs (the fields of the switch payload it plans from)."""
        i = self.inputs
        return {"old": i.old.short(), "old_ids": list(i.old_ids), "target": i.target.short(),
                "positions": list(self.plan.new.rank_map), "leave": list(i.leave), "joiners": list(i.joiners),
                "budget": i.budget, "specs": encode_specs(i.specs, i.old_shardings, i.new_shardings)}


def plan_world_change(inputs: ChangeInputs) -> WorldPlan:
    old_layout = Layout.from_shardings(inputs.specs, inputs.old_shardings, inputs.old, rank_map=list(inputs.old_ids))
    new_layout = Layout.from_shardings(inputs.specs, inputs.new_shardings, inputs.target)
    rank_map = inputs.rank_map if isinstance(inputs.rank_map, str) else list(inputs.rank_map)
    members = inputs.member_ids

    def plan_with(order):
        return plan_switch(old_layout, new_layout, leave=inputs.leave, joiners=inputs.joiners,
                           rank_map=rank_map if order is None else order, budget_bytes=inputs.budget)

    plan, _ = plan_mesh_safe(plan_with, lambda plan: target_order(plan, members)[1], inputs.target)
    return WorldPlan(inputs, old_layout, plan, *target_order(plan, members))


def plan_from_payload(payload: dict) -> tuple[SwitchPlan, Layout]:
    """A joiner's side of the plan, from the switch payload (or an intent with the same fields)."""
    specs, old_shardings, new_shardings = decode_specs(payload["specs"])
    old_layout = Layout.from_shardings(specs, old_shardings, ParallelConfig.parse(payload["old"]),
                                       rank_map=payload["old_ids"])
    new_layout = Layout.from_shardings(specs, new_shardings, ParallelConfig.parse(payload["target"]))
    plan = plan_switch(old_layout, new_layout, leave=payload["leave"],
                       joiners=payload["joiners"], rank_map=payload["positions"], budget_bytes=payload["budget"])
    return plan, old_layout


WARM_KEY = "working_bytes"  # in a published intent, beside the plan's inputs
PAGE = 4096  # the smallest page of the hosts this runs on: a write every PAGE bytes maps a larger page too


def free_working_bytes(device: "torch.device | str") -> int:
    """What this process's allocator holds free now, at a step boundary: about the memory its steps work in, which
    the allocator keeps between steps (CUDA's caching allocator; on CPU, the heap with dynatrain's settings). 0 where
    nothing is kept."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu" and memory.heap_keeps_freed_memory():
        return memory.heap_free_bytes()
    return 0


def warm_allocator(nbytes: int, device: "torch.device | str") -> int:
    """Have the allocator hold at least ``nbytes`` free and mapped, as a member's does between steps: a new process's
    first step then takes its working memory from there instead of mapping it page by page (a gigabyte of page
    faults for a `125m` step on CPU). Returns the bytes it added (0 where the allocator would not keep them)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and not memory.heap_keeps_freed_memory()):
        return 0
    need = int(nbytes) - free_working_bytes(device)
    if need <= 0:
        return 0
    block = torch.empty(need, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        block[::PAGE].fill_(0)  # one write per page maps it
    del block
    return need


class MemberPrep:
    """A member's preparation of one world change: the plan, on its own thread."""

    def __init__(self, inputs: ChangeInputs, connect: Callable[[], Any] | None = None, working_bytes: int = 0,
                 form: Callable[[WorldPlan], Any] | None = None, member: str | None = None) -> None:
        """``connect``: on rank 0, a new connection to the job's store, to publish the intent from the plan's thread
        as soon as it is planned; joiners that get ready before the next step boundary then prepare their side
        before they are admitted, which can be at that boundary. ``working_bytes``: what this member's steps work in
        (`free_working_bytes`), published with the intent for the joiners to warm their allocators with. ``form``:
        given the plan, starts forming the target generation in the background (`WorldGeneration.form_ahead`) and
        returns it, or None on a process the plan leaves out; a change whose members are all known ahead (no
        joiner) has it. ``member``: this member's id, whose pieces are expanded there too."""
        self.inputs = inputs
        self.published = False
        self.working_bytes = working_bytes
        self.forms_ahead = form is not None
        self.ahead = None  # the target generation, forming, once planned (on a process that stays)

        def plan() -> WorldPlan:
            world_plan = plan_world_change(inputs)
            if form is not None:
                self.ahead = form(world_plan)
            if connect is not None:
                try:
                    connect().set(INTENT_KEY, self._intent(world_plan))
                    self.published = True
                except Exception:  # noqa: BLE001 - `publish` at the next boundary tries again
                    pass
            if member in inputs.union:  # the expansion the check and the engine read (milliseconds), off the stall
                world_plan.plan.rank_plan(inputs.union.index(member))
            return world_plan

        self._plan = Background(inputs, plan, "dynatrain-plan-next-world")

    @property
    def error(self) -> BaseException | None:
        """What the plan's thread raised, once done."""
        return self._plan.error

    def discard(self) -> None:
        """The change will not run as prepared: the generation formed for it ends once formed."""
        def end() -> None:
            self._plan.wait()
            if self.ahead is not None:
                self.ahead.discard()
                self.ahead = None

        if self.forms_ahead:
            threading.Thread(target=end, name="dynatrain-discard-prep", daemon=True).start()

    def done(self) -> bool:
        return self._plan.done()

    def plan(self) -> WorldPlan:
        return self._plan.result()

    def publish(self, store) -> None:
        """Rank 0, on the training thread (a store connection is not shared across threads), once planned."""
        if self.published or not self.done():
            return
        self.published = True
        try:
            intent = self._intent(self.plan())
        except Exception:  # raised again, on every rank, where the switch uses the plan
            return
        store.set(INTENT_KEY, intent)

    def _intent(self, world_plan: WorldPlan) -> str:
        return json.dumps({**world_plan.intent(), WARM_KEY: self.working_bytes})


class JoinerPrep:
    """A joiner's view of rank 0's intents while it waits: plans its side of the latest one and, once planned,
    allocates the shards it will receive (given a device); and warms its allocator with the members' working memory
    (`WORKING_KEY`, or the intent's) so that its first step does not map it page by page.

    Allocating and warming run on a thread of their own, one job at a time: mapping a gigabyte takes seconds on a
    loaded host, and the joiner's main thread must see its admission or the switch's payload the moment it comes."""

    POLL = 0.2  # seconds between reads of the intent

    def __init__(self, store, device: "torch.device | str | None" = None) -> None:
        self.store = store
        self.device = device
        self._seen: str | None = None
        self._next = 0.0
        self.prepared: Background | None = None
        self.ahead: dict[str, torch.Tensor] | None = None  # None: not tried for this intent; {}: tried, none
        self.working_bytes = 0  # the members' working memory, from the latest intent or `WORKING_KEY`
        self.warmed = 0  # bytes the allocator was warmed by, in all
        self._work: Background | None = None  # the allocation or warming under way
        self._warmed_for = 0  # the working memory the allocator was last warmed to hold

    def poll(self, now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.POLL
        if self.store.check([WORKING_KEY]):
            self.working_bytes = max(self.working_bytes, int(self.store.get(WORKING_KEY)))
        self._read_intent()
        self._start_work()

    def _read_intent(self) -> None:
        if not self.store.check([INTENT_KEY]):
            return
        text = self.store.get(INTENT_KEY).decode()
        if text == self._seen:
            return
        self._seen = text
        self.settle()
        self.ahead = None  # another intent: the shards held for the last one are freed
        intent = json.loads(text)
        self.working_bytes = max(self.working_bytes, int(intent.pop(WARM_KEY, 0)))
        # Which joiners are admitted is not known yet, but the plan is the same for any of them.
        self.prepared = Background(intent, lambda: plan_from_payload(intent), "dynatrain-plan-next-world")

    def prepare_now(self) -> None:
        """Plan the published intent and allocate its shards now, if one is published: a joiner does this before it
        says it is ready, since the members may admit it at once, before its first poll while it waits."""
        self.poll(self._next)
        if self.prepared is not None:
            self.prepared.wait()
            self.settle()
            self._start_work()
        self.settle()

    def settle(self) -> None:
        """Wait for the allocation or warming under way, if any."""
        if self._work is not None:
            self._work.wait()

    def _start_work(self) -> None:
        if self.device is None or (self._work is not None and not self._work.done()):
            return
        prepared = self.prepared
        if prepared is not None and not prepared.done():
            return  # planned in milliseconds: its shards come first, then the warming tops the heap up
        allocate = self.ahead is None and prepared is not None
        if not allocate and self.working_bytes <= self._warmed_for:
            return
        if allocate:
            self.ahead = {}  # tried for this intent: the thread fills it in
        self._work = Background(prepared, lambda: self._allocate_ahead(prepared if allocate else None),
                                "dynatrain-joiner-allocate")

    def _allocate_ahead(self, prepared: Background | None) -> None:
        """The joiner's destinations, once the intent is planned (``prepared``), allocated and (on CPU) mapped while
        it waits: at admission they would be mapped inside the members' stall. Only when every joiner the intent
        names would receive the same shapes, since which one this process becomes is known only then. A joiner holds
        no other shards, so this is the memory it needs at admission, taken a little earlier."""
        allocated = False
        if prepared is not None and prepared.error is None:
            plan, _ = prepared.result()
            joiners = prepared.key.get("joiners") or []
            shapes = {json.dumps(sorted(expected_destinations(plan, j).items())) for j in joiners}
            if len(shapes) == 1:
                ahead = engine.allocate_destinations(plan, joiners[0], self.device)
                allocated = True
                if self.prepared is prepared:  # not replaced by a later intent meanwhile
                    self.ahead = ahead
        working = self.working_bytes
        if allocated or working > self._warmed_for:  # the shards took from what an earlier warming left free
            self.warmed += warm_allocator(working, self.device)
            self._warmed_for = working

    def destinations_for(self, plan: SwitchPlan, me: int) -> dict[str, torch.Tensor] | None:
        """The destinations allocated while waiting when they are process ``me``'s in ``plan`` (handed over once),
        else None."""
        self.settle()
        ahead, self.ahead = self.ahead, {}
        want = {name: (tuple(shape), torch_dtype(dtype)) for name, (shape, dtype) in
                expected_destinations(plan, me).items()}
        if not ahead or {name: (tuple(t.shape), t.dtype) for name, t in ahead.items()} != want:
            return None
        return ahead

    def plan_for(self, intent: dict) -> tuple[SwitchPlan, Layout] | None:
        """The prepared plan when the switch's inputs (its payload's intent) are the prepared intent's; None
        otherwise (or if it failed)."""
        prepared = self.prepared
        if prepared is None or {k: intent[k] for k in PLAN_FIELDS} != prepared.key:
            return None
        try:
            return prepared.result()
        except ValueError:
            return None
