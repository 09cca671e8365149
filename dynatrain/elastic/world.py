"""World generations: each membership of the job is a numbered generation with its own process group.

A member is a stable process id (a string chosen by the process, unique for its lifetime), not a rank: a
generation's ranks are the indices of its member list (sorted, unless a world change gives the target an order),
so ranks are renumbered at every change and any member, rank 0 included, may leave. Every generation keys its
rendezvous under ``gen{g}/`` of the job's long-lived store (:mod:`dynatrain.elastic.store`): re-forming a group
on a used port or under used keys hangs or fails on torch 2.13, and a fresh prefix on a store that never moves
avoids both. Generation numbers are never re-used; a failed attempt at ``g`` is retried as ``g + 1``.

Moving state between an old and a new member set needs a group that contains both. :func:`union_then_target`
forms generation ``g + 1`` over the union of the two sets, runs the transfer on it, then forms ``g + 2`` over the
target set alone; members outside the target leave. Steps that would repeat the current set are skipped. A
:class:`WorldChange` is that plan; current members and admitted joiners take part in it with
:func:`run_world_change`.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from dynatrain.elastic.broken_world import abort_groups, let_python_see_nccl_errors
from dynatrain.elastic import next_world
from dynatrain.elastic.next_world import FormedGroup, form_group
from dynatrain.elastic.registry import canonical_json, config_hash, deregister, processes_on_host
from dynatrain.runtime.background import Background

def _bound_device(backend: str) -> dict:
    """``device_id`` for an NCCL world: the process's current CUDA device, which Lightning (a member) or
    `dynatrain join --device` (a joiner, its one visible GPU) has set. A bound group creates its communicator at
    once, inside the world's formation, and splits its subgroups' from it; unbound, each is set up at its first
    collective, which NCCL makes wait for every rank of the group."""
    if "nccl" in backend and torch.cuda.is_available():
        return {"device_id": torch.device("cuda", torch.cuda.current_device())}
    return {}


def default_backend() -> str:
    """gloo, and NCCL for CUDA tensors where CUDA is visible: CPU tensors stay legal on a GPU host."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _members(members: Iterable[str]) -> tuple[str, ...]:
    out = tuple(sorted({str(m) for m in members}))
    if not out:
        raise ValueError("a generation needs at least one member")
    return out


def _ordered(members: Iterable[str]) -> tuple[str, ...]:
    """Members in the given rank order."""
    out = tuple(str(m) for m in members)
    if not out:
        raise ValueError("a generation needs at least one member")
    if len(set(out)) != len(out):
        raise ValueError(f"members {list(out)} repeat a process")
    return out


CANCEL_POLL = 0.005  # seconds between looks at a cancellable formation's arrivals


def _wait_for(store, keys: list[str], deadline: float, cancel: threading.Event | None) -> bool:
    """Whether every key exists before ``deadline`` (and before ``cancel`` is set): a cancellable wait polls, so a
    formation given up on ends at once instead of at its timeout, inside the store's client when the interpreter
    exits (which aborts the process)."""
    if cancel is None:
        try:
            store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            return True
        except RuntimeError:
            return False
    while not store.check(keys):
        if cancel.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(CANCEL_POLL)
    return True


def _arrive_and_form(store, generation: int, member_id: str, members: tuple[str, ...], timeout: float,
                     backend: str, key: str | None = None, cancel: threading.Event | None = None,
                     subgroups=()) -> FormedGroup:
    """Every member of generation ``generation`` meets under its prefix of the store (``key``, default
    ``gen{generation}``), then they form its group and its ``subgroups`` (`next_world.form_group`; not registered
    with torch yet: `next_world.install`). Any thread may run it, with its own connection to the store; ``cancel``
    set ends its wait for the others."""
    key = key or f"gen{generation}"
    deadline = time.monotonic() + timeout
    ours = dist.PrefixStore(f"{key}/dynatrain/", store)
    agreed = ours.compare_set("members", "", canonical_json(members)).decode()
    if agreed != canonical_json(members):
        raise ValueError(f"generation {generation} is being formed with members {json.loads(agreed)}, this "
                         f"process asked for {list(members)}: every member must pass the same list")
    if ours.add(f"arrived/{member_id}", 1) != 1:
        raise RuntimeError(f"member {member_id!r} already joined generation {generation}: generation numbers "
                           f"are never re-used, form generation {generation + 1} instead")
    keys = [f"arrived/{m}" for m in members]
    if not _wait_for(ours, keys, deadline, cancel):
        missing = [m for m in members if not ours.check([f"arrived/{m}"])]
        if cancel is not None and cancel.is_set():
            raise RuntimeError(f"generation {generation}: formation cancelled while waiting for {missing}")
        raise TimeoutError(
            f"generation {generation}: member(s) {missing} did not arrive within {timeout:.1f}s "
            f"(arrived: {[m for m in members if m not in missing]}); drop them from the member list and form "
            f"generation {generation + 1}, or raise the timeout")

    let_python_see_nccl_errors(backend)  # before the group exists: NCCL reads it when a group is made
    try:
        # The group's timeout is also every later collective's: the full timeout, not what the wait left.
        return form_group(dist.PrefixStore(f"{key}/pg/", store), members.index(member_id), len(members),
                          backend, timedelta(seconds=timeout), subgroups=subgroups, **_bound_device(backend))
    except RuntimeError as e:
        # Every member arrived, so a failure here means one died or hung between arriving and connecting.
        kind = TimeoutError if "timeout" in str(e).lower() or "timed out" in str(e).lower() else RuntimeError
        raise kind(f"generation {generation}: the {backend} group of {list(members)} did not form within "
                   f"{timeout:.1f}s after every member arrived (a member died or hung): {e}") from None


@dataclass
class WorldGeneration:
    store: Any
    generation: int
    members: tuple[str, ...]
    member_id: str
    backend: str
    timeout: float
    active: bool = field(default=True)
    _attempts: dict = field(default_factory=dict, repr=False)  # members -> generations formed ahead for them

    @property
    def rank(self) -> int:
        return self.members.index(self.member_id)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @classmethod
    def join(cls, store, generation: int, member_id: str, members: Iterable[str], timeout: float = 60.0,
             backend: str | None = None, ordered: bool = False, key: str | None = None, subgroups=()
             ) -> "WorldGeneration":
        """Form generation ``generation`` as the default process group; every member calls this (or, on a member
        of the current generation, `form_ahead`: then with its ``key`` and ``subgroups``).

        Ranks follow the sorted member list, or the list as given with ``ordered``. Raises ``TimeoutError``
        naming the absent members when not all of them arrive within ``timeout`` seconds.
        """
        members = _ordered(members) if ordered else _members(members)
        member_id = str(member_id)
        if member_id not in members:
            raise ValueError(f"member {member_id!r} is not in generation {generation}'s members {list(members)}")
        if dist.is_initialized():
            raise RuntimeError("a process group is already initialised: leave the current generation first "
                               "(WorldGeneration.leave or next_generation)")
        backend = backend or default_backend()
        formed = _arrive_and_form(store, generation, member_id, members, timeout, backend, key, subgroups=subgroups)
        next_world.install(formed)  # looked up here: a test's checker wraps it as it wraps init_process_group
        return cls(store, generation, members, member_id, backend, timeout)

    def leave(self) -> None:
        """Destroy this generation's groups, every member together (a barrier first)."""
        if not self._release():
            return
        try:
            dist.barrier()
        except RuntimeError as e:
            warnings.warn(f"generation {self.generation}: barrier before leaving failed ({e}); destroying "
                          f"the group anyway", stacklevel=2)
        dist.destroy_process_group()

    def abort(self) -> str:
        """End this generation's groups when a peer may be gone: no barrier (it would only time out), and an abort
        instead of a destroy, which on NCCL waits for work the dead peer never joins (`broken_world`). Returns
        how the groups ended (`abort_groups`)."""
        if not self._release():
            return "none"
        return abort_groups()

    def _release(self) -> bool:
        if not self.active:
            return False
        self.active = False
        # Dead DTensors and pending work of the old group must be released before the group is ended;
        # skipping this aborts about one exit in ten with "terminate called without an active exception".
        gc.collect()
        return True

    def form_ahead(self, connect: Callable[[], Any], members: Iterable[str], generation: int | None = None,
                   subgroups=()) -> "NextGeneration":
        """Start forming generation ``generation`` (default: the next) of ``members`` (in rank order) on a
        background thread, with its own connection to the store (``connect``), while this one trains on; every
        member of it calls this or `join` for the same generation. This process must be one of ``members``.
        ``subgroups``: rank lists of the groups to form with it (its mesh's: `models.mesh_groups.layout_groups`),
        the same on every member."""
        members = _ordered(members)
        if self.member_id not in members:
            raise ValueError(f"member {self.member_id!r} forms generation of {list(members)} without being in it")
        generation = self.generation + 1 if generation is None else generation
        # Its own keys per attempt: a formation a dropped request left half done never meets a later one, and the
        # generation number stays the one the change after it will use. Every member of ``members`` forms alike
        # for the same requests, so each counts the same attempts.
        attempt = self._attempts[members] = self._attempts.get(members, 0) + 1
        key = f"gen{generation}/ahead/{config_hash(members)}-{attempt}"
        backend, timeout, me = self.backend, self.timeout, self.member_id
        cancel = threading.Event()

        def form() -> tuple[FormedGroup, int]:
            store = connect()
            formed = _arrive_and_form(store, generation, me, members, timeout, backend, key, cancel, subgroups)
            return formed, processes_on_host(store, me, members)  # read here, not in the stall

        return NextGeneration(generation, members, Background(key, form, "dynatrain-form-world"), key, cancel)

    def enter(self, ahead: "NextGeneration", timeout: float | None = None) -> "WorldGeneration":
        """This process's world becomes generation ``ahead`` (formed in the background; waited for here if it is
        not yet): its group is torch's default one at once, and this generation's groups end on a background
        thread, with no barrier: every member of this generation enters the next or `depart`s at the same
        boundary, and nothing of this one is used any more."""
        formed, _ = ahead.formation.result(self.timeout if timeout is None else timeout)
        old = next_world.install(formed)  # looked up here: a test's checker wraps it as it wraps init_process_group
        self.active = False
        next_world.retire(old)
        return WorldGeneration(self.store, ahead.generation, ahead.members, self.member_id, self.backend,
                               self.timeout)

    def depart(self) -> None:
        """Leave the job's world at a change whose next generation formed without this process: out of the
        registry, this generation's groups ended on a background thread, no barrier (see `enter`)."""
        deregister(self.store, self.member_id)
        if self.active:
            self.active = False
            next_world.retire(next_world.detach_all())

    def next_generation(self, members: Iterable[str], timeout: float | None = None,
                        ordered: bool = False) -> "WorldGeneration | None":
        """Every current member calls this with the same list; returns ``None`` on a member that is not in it.

        A process that gets ``None`` has left the job's world (and the registry) and should exit with status 0.
        """
        members = _ordered(members) if ordered else _members(members)
        leaving = self.member_id not in members
        if leaving:
            # Before the barrier in leave(), so survivors never list a leaver as a pending joiner.
            deregister(self.store, self.member_id)
        self.leave()
        if leaving:
            return None
        return WorldGeneration.join(self.store, self.generation + 1, self.member_id, members,
                                    self.timeout if timeout is None else timeout, self.backend, ordered)


join = WorldGeneration.join


@dataclass
class NextGeneration:
    """A generation being formed in the background (`WorldGeneration.form_ahead`), entered with
    `WorldGeneration.enter`."""

    generation: int
    members: tuple[str, ...]
    formation: Background  # of (the `FormedGroup`, how many of its members share this process's host)
    key: str  # its keys in the store, which a joiner forming it with the members takes from the announcement
    cancel: threading.Event  # set: a formation still waiting for its members gives up

    @property
    def host_processes(self) -> int:
        return self.formation.result()[1]

    def discard(self) -> None:
        """Not entered: a formation still waiting for a member gives up; a group formed already ends."""
        formation = self.formation
        self.cancel.set()

        def end() -> None:
            try:
                formed, _ = formation.result()
            except Exception:  # noqa: BLE001 - nothing formed, nothing to end
                return
            next_world.retire(formed.groups, wait=True)

        threading.Thread(target=end, name="dynatrain-discard-world", daemon=True).start()


# ---------------------------------------------------------------------------------------------------------------
# World changes: old members and joiners run the same plan, read from the store by the joiners.


@dataclass(frozen=True)
class WorldChange:
    generation: int  # the first generation the change forms
    old: tuple[str, ...]
    new: tuple[str, ...]
    order: tuple[str, ...] | None = None  # the target generation's rank order (default: sorted)
    key: str | None = None  # the target's keys in the store, when formed ahead (`WorldGeneration.form_ahead`)
    subgroups: tuple = ()  # rank lists of the groups formed ahead with the target

    @property
    def union(self) -> tuple[str, ...]:
        return _members(self.old + self.new)

    @property
    def target(self) -> tuple[str, ...]:
        return self.order or self.new

    @property
    def steps(self) -> list[tuple[str, ...]]:
        """Member lists, in rank order, of the generations to form: the union (unless it is ``old``), then the
        target. When nobody leaves, the union is the target: one generation, in the target's order."""
        if set(self.new) == set(self.union):
            return [] if self.target == self.old else [self.target]
        return ([] if self.union == self.old else [self.union]) + [self.target]

    def to_json(self) -> str:
        return canonical_json({"generation": self.generation, "old": self.old, "new": self.new, "order": self.order,
                               "key": self.key, "subgroups": [list(g) for g in self.subgroups]})

    @classmethod
    def from_json(cls, text: str) -> "WorldChange":
        d = json.loads(text)
        order = _ordered(d["order"]) if d.get("order") else None
        return cls(d["generation"], _members(d["old"]), _members(d["new"]), order, d.get("key"),
                   tuple(tuple(g) for g in d.get("subgroups", ())))


def plan_union_then_target(generation: int, old: Iterable[str], new: Iterable[str],
                           order: Iterable[str] | None = None, key: str | None = None, subgroups=()) -> WorldChange:
    """The world change from the current generation ``generation`` with ``old`` to ``new`` (ranked by ``order``;
    ``key``: the target formed ahead under these keys, with these ``subgroups``)."""
    new = _members(new)
    if order is not None:
        order = _ordered(order)
        if set(order) != set(new):
            raise ValueError(f"order {list(order)} is not an arrangement of the new members {list(new)}")
    return WorldChange(generation + 1, _members(old), new, order, key, tuple(tuple(g) for g in subgroups))


def announce(store, t: WorldChange) -> None:
    store.set(f"transition/{t.generation}", t.to_json())
    for m in t.union:
        if m not in t.old:
            store.set(f"admit/{m}", str(t.generation))


def await_admission(store, member_id: str, timeout: float) -> WorldChange:
    """Block a joiner until current members admit it; return the world change it takes part in."""
    try:
        store.wait([f"admit/{member_id}"], timedelta(seconds=timeout))
    except RuntimeError:
        raise TimeoutError(f"member {member_id!r} was not admitted within {timeout:.1f}s: the current members "
                           f"did not include it in a world change (is it registered with this job's store?)") from None
    return WorldChange.from_json(store.get(f"transition/{int(store.get(f'admit/{member_id}'))}").decode())


# Moves the training state over the generation that spans the old and the new members.
StateMover = Callable[[WorldGeneration], None]


def union_then_target(world: WorldGeneration, new: Iterable[str], transfer: StateMover | None = None,
                      timeout: float | None = None, order: Iterable[str] | None = None,
                      ahead: NextGeneration | bool = False) -> WorldGeneration | None:
    """Run by every current member: move to ``new``, calling ``transfer`` on the group spanning old and new.

    Rank 0 announces the plan so admitted joiners (:func:`await_admission`, then :func:`run_world_change`) follow
    it. ``order``: the target generation's rank order. ``ahead``: the target generation was formed in the
    background, on a member of it this `NextGeneration`, on one that leaves True. Returns the target generation, or
    ``None`` on a member that left.
    """
    t = plan_union_then_target(world.generation, world.members, new, order)
    if world.rank == 0 and not ahead:  # a change formed ahead was announced when it began to form
        announce(world.store, t)
    return run_world_change(t, world=world, transfer=transfer, timeout=timeout, ahead=ahead)


def run_world_change(t: WorldChange, world: WorldGeneration | None = None, store=None,
                     member_id: str | None = None, transfer: StateMover | None = None, timeout: float | None = None,
                     backend: str | None = None, ahead: NextGeneration | bool = False) -> WorldGeneration | None:
    """Take part in ``t``: with ``world`` on a current member, with ``store`` and ``member_id`` on a joiner.
    ``ahead``: the target generation was formed in the background (see `union_then_target`)."""
    if world is None and (store is None or member_id is None or member_id in t.old):
        raise ValueError("a joiner passes store and member_id (and is not an old member); a current member "
                         "passes its world")
    if world is not None and world.generation + 1 != t.generation:
        raise ValueError(f"the world change starts at generation {t.generation}, this member is at "
                         f"{world.generation}")
    if timeout is None:
        timeout = world.timeout if world is not None else 60.0
    if transfer is not None and t.union == t.old:
        transfer(world)  # a pure scale-in: the current group already spans everyone
    current = world
    steps = t.steps
    for i, members in enumerate(steps):
        if ahead and i == len(steps) - 1 and current is not None:
            if current.member_id not in members:
                current.depart()
                return None
            if not isinstance(ahead, NextGeneration) or (ahead.generation, ahead.members) != (t.generation + i,
                                                                                              members):
                raise ValueError(f"the world change forms generation {t.generation + i} of {list(members)}; this "
                                 f"member formed {getattr(ahead, 'members', None)} ahead")
            current = current.enter(ahead, timeout)
        elif current is None:
            last = i == len(steps) - 1
            current = WorldGeneration.join(store, t.generation + i, member_id, members, timeout, backend,
                                           ordered=True, key=t.key if last else None,
                                           subgroups=t.subgroups if last and t.key else ())
        else:
            current = current.next_generation(members, timeout, ordered=True)
        if current is None:
            return None
        if transfer is not None and set(members) == set(t.union):
            transfer(current)
    return current
