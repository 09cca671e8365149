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
import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from dynatrain.elastic.broken_world import abort_groups, let_python_see_nccl_errors

MATCH_FIELDS = ("model_config_hash", "code_version")


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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@dataclass
class WorldGeneration:
    store: Any
    generation: int
    members: tuple[str, ...]
    member_id: str
    backend: str
    timeout: float
    active: bool = field(default=True)

    @property
    def rank(self) -> int:
        return self.members.index(self.member_id)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @classmethod
    def join(cls, store, generation: int, member_id: str, members: Iterable[str], timeout: float = 60.0,
             backend: str | None = None, ordered: bool = False) -> "WorldGeneration":
        """Form generation ``generation`` as the default process group; every member calls this.

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
        deadline = time.monotonic() + timeout
        ours = dist.PrefixStore(f"gen{generation}/dynatrain/", store)

        agreed = ours.compare_set("members", "", _dumps(members)).decode()
        if agreed != _dumps(members):
            raise ValueError(f"generation {generation} is being formed with members {json.loads(agreed)}, this "
                             f"process asked for {list(members)}: every member must pass the same list")
        if ours.add(f"arrived/{member_id}", 1) != 1:
            raise RuntimeError(f"member {member_id!r} already joined generation {generation}: generation numbers "
                               f"are never re-used, form generation {generation + 1} instead")
        keys = [f"arrived/{m}" for m in members]
        try:
            ours.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError:
            missing = [m for m in members if not ours.check([f"arrived/{m}"])]
            raise TimeoutError(
                f"generation {generation}: member(s) {missing} did not arrive within {timeout:.1f}s "
                f"(arrived: {[m for m in members if m not in missing]}); drop them from the member list and form "
                f"generation {generation + 1}, or raise the timeout") from None

        let_python_see_nccl_errors(backend)  # before the group exists: NCCL reads it when a group is made
        try:
            # The group's timeout is also every later collective's: the full timeout, not what the wait left.
            dist.init_process_group(backend, store=dist.PrefixStore(f"gen{generation}/pg/", store),
                                    rank=members.index(member_id), world_size=len(members),
                                    timeout=timedelta(seconds=timeout), **_bound_device(backend))
        except RuntimeError as e:
            # Every member arrived, so a failure here means one died or hung between arriving and connecting.
            kind = TimeoutError if "timeout" in str(e).lower() or "timed out" in str(e).lower() else RuntimeError
            raise kind(f"generation {generation}: the {backend} group of {list(members)} did not form within "
                       f"{timeout:.1f}s after every member arrived (a member died or hung): {e}") from None
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


# ---------------------------------------------------------------------------------------------------------------
# Registry: joiners announce themselves; current members decide when to admit them.


class RegistrationError(ValueError):
    pass


def config_hash(obj: Any) -> str:
    """A short stable hash of a JSON-able model/training configuration, for ``info["model_config_hash"]``."""
    return hashlib.sha256(_dumps(obj).encode()).hexdigest()[:16]


def register(store, member_id: str, info: dict, match: Iterable[str] = MATCH_FIELDS) -> None:
    """Record ``member_id`` as willing to join, after checking ``info`` against the job's.

    The first process to register (or :func:`set_job_info`) fixes the job's values of the ``match`` fields; a
    later process whose values differ is refused, since it would build a different model or run different code.
    """
    set_job_info(store, info, match)
    store.set(f"registry/info/{member_id}", _dumps(info))
    # The id is published after its info, so a reader that sees the id also sees the info.
    n = store.add("registry/count", 1)
    store.set(f"registry/id/{n}", str(member_id))


def set_job_info(store, info: dict, match: Iterable[str] = MATCH_FIELDS) -> None:
    ref = {k: info.get(k) for k in match}
    job = json.loads(store.compare_set("registry/job", "", _dumps(ref)).decode())
    diff = {k: (job.get(k), ref.get(k)) for k in set(job) | set(ref) if job.get(k) != ref.get(k)}
    if diff:
        lines = ", ".join(f"{k}: job has {a!r}, this process has {b!r}" for k, (a, b) in sorted(diff.items()))
        raise RegistrationError(f"registration refused, this process does not match the job ({lines}): start it "
                                f"with the job's model config and code version")


def deregister(store, member_id: str) -> None:
    store.set(f"registry/left/{member_id}", "1")


def registered(store) -> dict[str, dict]:
    """Every registered process that has not left, with its info."""
    out: dict[str, dict] = {}
    for i in range(1, store.add("registry/count", 0) + 1):
        if not store.check([f"registry/id/{i}"]):
            continue  # counted but not yet published: it shows up on the next call
        mid = store.get(f"registry/id/{i}").decode()
        if not store.check([f"registry/left/{mid}"]):
            out[mid] = json.loads(store.get(f"registry/info/{mid}").decode())
    return out


def pending_joiners(store, members: Iterable[str]) -> dict[str, dict]:
    """Registered processes that are not in ``members``: candidates for the next generation."""
    current = set(members)
    return {m: info for m, info in registered(store).items() if m not in current}


# ---------------------------------------------------------------------------------------------------------------
# World changes: old members and joiners run the same plan, read from the store by the joiners.


@dataclass(frozen=True)
class WorldChange:
    generation: int  # the first generation the change forms
    old: tuple[str, ...]
    new: tuple[str, ...]
    order: tuple[str, ...] | None = None  # the target generation's rank order (default: sorted)

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
        return _dumps({"generation": self.generation, "old": self.old, "new": self.new, "order": self.order})

    @classmethod
    def from_json(cls, text: str) -> "WorldChange":
        d = json.loads(text)
        order = _ordered(d["order"]) if d.get("order") else None
        return cls(d["generation"], _members(d["old"]), _members(d["new"]), order)


def plan_union_then_target(generation: int, old: Iterable[str], new: Iterable[str],
                           order: Iterable[str] | None = None) -> WorldChange:
    """The world change from the current generation ``generation`` with ``old`` to ``new`` (ranked by ``order``)."""
    new = _members(new)
    if order is not None:
        order = _ordered(order)
        if set(order) != set(new):
            raise ValueError(f"order {list(order)} is not an arrangement of the new members {list(new)}")
    return WorldChange(generation + 1, _members(old), new, order)


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
                      timeout: float | None = None, order: Iterable[str] | None = None) -> WorldGeneration | None:
    """Run by every current member: move to ``new``, calling ``transfer`` on the group spanning old and new.

    Rank 0 announces the plan so admitted joiners (:func:`await_admission`, then :func:`run_world_change`) follow
    it. ``order``: the target generation's rank order. Returns the target generation, or ``None`` on a member
    that left.
    """
    t = plan_union_then_target(world.generation, world.members, new, order)
    if world.rank == 0:
        announce(world.store, t)
    return run_world_change(t, world=world, transfer=transfer, timeout=timeout)


def run_world_change(t: WorldChange, world: WorldGeneration | None = None, store=None,
                     member_id: str | None = None, transfer: StateMover | None = None, timeout: float | None = None,
                     backend: str | None = None) -> WorldGeneration | None:
    """Take part in ``t``: with ``world`` on a current member, with ``store`` and ``member_id`` on a joiner."""
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
    for i, members in enumerate(t.steps):
        if current is None:
            current = WorldGeneration.join(store, t.generation + i, member_id, members, timeout, backend,
                                           ordered=True)
        else:
            current = current.next_generation(members, timeout, ordered=True)
        if current is None:
            return None
        if transfer is not None and set(members) == set(t.union):
            transfer(current)
    return current
