"""A generation's process group formed beside the current one, and made torch's default group at a boundary.

torch keeps one default process group per process (`init_process_group` refuses a second), and every group made
afterwards (`new_group`, a DeviceMesh's dimensions) meets its peers under the default group's store. But a group
does not have to be the default one while it forms: its gloo or NCCL backend is an object built from a store, a
rank and a size. So the next generation's group is built here, on a background thread while the current generation
trains (the store rendezvous; gloo's full-mesh connect and a first collective, NCCL's eager communicator set-up),
and registered as the default group only at the boundary (`install`), in the place the current generation's groups
held.
Those are detached from torch's registry at that moment and shut down on a background thread (`retire`): no barrier
and no wait inside the stall. The groups of the next layout's mesh are formed the same way, beside the world's, and
registered with it (`form_group`'s ``subgroups``, `formed_subgroup`).

The group is named and prefixed in the store exactly as `init_process_group` names a default group on a fresh
process ("0", then the device), and torch's group counter is left where `init_process_group` leaves it, so every
group made later on it has the same name on a member that swapped and on a process that formed the generation
afresh. Only torch's private registry (`distributed_c10d._world` and the group-name table) is touched; its fields
are the ones `init_process_group` and `destroy_process_group` themselves maintain.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dynatrain.runtime.control_group import new_control_group

DEFAULT_NAME = "0"  # `init_process_group`'s name for the default group of a process with no group yet
CONTROL_NAME = "control"


@dataclass
class FormedGroup:
    """A generation's group, connected and through its first collective, not yet registered with torch; with the
    subgroups formed beside it (its mesh's, keyed by their ranks)."""

    group: Any  # torch.distributed.ProcessGroup
    store: Any  # the group's own prefix store, which groups made on it later rendezvous under
    backend: str
    config: str  # torch's string form of the backend per device
    rank: int
    size: int
    subgroups: dict = field(default_factory=dict)  # sorted ranks -> (ProcessGroup, its prefix store)
    control: tuple | None = None  # (a gloo group of every rank, its prefix store): the world's control group

    @property
    def groups(self) -> list:
        """Every group formed: the world's first, as torch's registry lists a generation's."""
        return [self.group, *([self.control[0]] if self.control else []), *(g for g, _ in self.subgroups.values())]


def _backend(name: str, store, rank: int, size: int, timeout: timedelta, group_name: str, ranks: list[int]):
    """(torch's backend type, the backend object) for one backend name, as `init_process_group` (``ranks`` empty)
    or `new_group` makes it."""
    kind = dist.ProcessGroup.BackendType
    if name == dist.Backend.GLOO:
        impl = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
        impl.options.global_ranks_in_group = ranks
        impl.options.group_name = group_name
        out = kind.GLOO, impl
    elif name == dist.Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = ranks
        options.group_name = group_name
        out = kind.NCCL, dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        raise ValueError(f"a generation's group can be formed ahead with gloo or nccl, not {name!r}: pass "
                         "backend='gloo', 'nccl' or 'cpu:gloo,cuda:nccl'")
    out[1]._set_sequence_number_for_group()
    return out


def _group(prefix, rank: int, size: int, devices: dict[str, str], timeout: timedelta, name: str, ranks: list[int],
           device_id: torch.device | None):
    """A process group over ``prefix`` with one backend per backend name of ``devices``, connected and through its
    first collective."""
    group = dist.ProcessGroup(prefix, rank, size)
    nccl = dist.Backend.NCCL in devices.values()
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL if nccl else dist.ProcessGroup.BackendType.GLOO)
    if device_id is not None:
        group.bound_device_id = device_id
    made: dict[str, tuple] = {}
    for device, backend in devices.items():
        if backend not in made:  # one backend serves every device that names it, under the first one's prefix
            made[backend] = _backend(backend, dist.PrefixStore(f"{device}/", prefix), rank, size, timeout, name,
                                     ranks)
        group._register_backend(torch.device(device), *made[backend])
    group._set_group_name(name)
    if device_id is not None and group._get_backend(device_id).supports_splitting:
        group._get_backend(device_id).eager_connect_single_device(device_id)
    first_collective(group, devices)
    return group


def subgroup_name(ranks: tuple[int, ...]) -> str:
    """The name of a subgroup formed ahead: from its ranks, the same on each of them; torch's own names are
    numbers."""
    return "ahead:" + ",".join(str(r) for r in ranks)


def form_group(store, rank: int, size: int, backend: str, timeout: timedelta,
               device_id: torch.device | None = None, subgroups=()) -> FormedGroup:
    """Build a generation's group on ``store`` (every member calls this with its own rank; it returns once all of
    them connected) and run its first collective; nothing of torch's registry changes, so any thread may call it
    while the current generation's groups train. ``device_id``: the CUDA device an NCCL group is bound to, which
    creates its communicator now instead of at its first collective. ``subgroups``: rank lists (of this group's
    ranks) of groups to form too, this process in those that hold its rank, in the order given: every process
    passes the same list."""
    config = c10d.BackendConfig(dist.Backend(backend))
    devices = config.get_device_backend_map()
    prefix = dist.PrefixStore(f"{DEFAULT_NAME}/", store)
    if device_id is not None:
        torch.cuda.set_device(device_id)  # this thread's current device, where the communicators are created
    group = _group(prefix, rank, size, devices, timeout, DEFAULT_NAME, [], device_id)
    group._set_group_desc("default_pg")
    formed = FormedGroup(group, prefix, backend, str(config), rank, size)
    # The control group (`runtime.control_group`): gloo over every rank whatever the world's backend.
    control_prefix = dist.PrefixStore(f"{CONTROL_NAME}/", prefix)
    control = _group(control_prefix, rank, size, {"cpu": "gloo"}, timeout, CONTROL_NAME, list(range(size)), None)
    control._set_group_desc("control")
    formed.control = control, control_prefix
    for ranks in subgroups:
        ranks = tuple(sorted(int(r) for r in ranks))
        if rank in ranks and ranks not in formed.subgroups:
            name = subgroup_name(ranks)
            sub_prefix = dist.PrefixStore(f"{name}/", prefix)
            sub = _group(sub_prefix, ranks.index(rank), len(ranks), devices, timeout, name, list(ranks), device_id)
            sub._set_group_desc("mesh_formed_ahead")
            formed.subgroups[ranks] = sub, sub_prefix
    return formed


def first_collective(group, devices: dict[str, str]) -> None:
    """One small all-reduce on the gloo backend, which connects every pair; an NCCL communicator is set up by its
    eager, device-bound initialisation instead. Its first collective waits for the main thread: two NCCL
    communicators whose kernels run concurrently on one device, in orders that differ between ranks, can deadlock."""
    if devices.get("cpu") == dist.Backend.GLOO:
        group.allreduce([torch.zeros(1)]).wait()


def _detach(group) -> None:
    """Remove ``group`` from torch's registry without ending it."""
    world = c10d._world
    name = world.pg_names.pop(group, None)
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config, world.pg_coalesce_state):
        table.pop(group, None)
    tag = world.pg_to_tag.pop(group, None)
    for key in {tag, ""} - {None}:
        if group in world.tags_to_pg.get(key, []):
            world.tags_to_pg[key].remove(group)
    if name is not None:
        c10d._unregister_process_group(name)


def detach_all() -> list:
    """Every group of this process's current generation, removed from torch's registry but not ended (see
    `retire`); torch then has no default group, as after `destroy_process_group`."""
    world = c10d._world
    old = list(world.pg_names)
    for group in old:
        _detach(group)
    c10d._update_default_pg(None)
    _formed.clear()
    _control.clear()
    world.group_count = 0  # as `destroy_process_group` leaves it: later groups are named alike on every member
    return old


def install(formed: FormedGroup) -> list:
    """Make ``formed`` torch's default group; returns the groups of the generation it replaces, detached from
    torch's registry but not ended (see `retire`). Call it on the main thread, at a boundary, with no collective of
    the current generation in flight."""
    old = detach_all()
    group, everyone = formed.group, range(formed.size)
    _register(group, formed.store, formed.backend, formed.config, c10d._process_group_name([], use_hashed_name=False),
              everyone)
    c10d._update_default_pg(group)
    if formed.control is not None:
        control, store = formed.control
        _register(control, store, "gloo", "cpu:gloo", CONTROL_NAME, everyone)
        _control.append(control)
    for ranks, (sub, sub_store) in formed.subgroups.items():
        _register(sub, sub_store, formed.backend, formed.config, sub.group_name, ranks)
        _formed[ranks] = sub
    return old


def _register(group, store, backend: str, config: str, name: str, ranks) -> None:
    """``group`` (of global ``ranks``) in torch's registry, as `init_process_group` or `new_group` enters one."""
    world = c10d._world
    world.pg_map[group] = (dist.Backend(backend), store)
    world.pg_names[group] = name
    world.pg_backend_config[group] = config
    world.pg_group_ranks[group] = {int(r): i for i, r in enumerate(ranks)}
    c10d._register_process_group(name, group)
    world.tags_to_pg.setdefault("", []).append(group)
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(group)
    world.pg_to_tag[group] = f"ptd:{name}"


_formed: dict = {}  # the current generation's subgroups formed ahead, by their ranks
_control: list = []  # the current generation's control group, formed with it


def formed_control_group() -> Any | None:
    """The current generation's control group, formed with it (`form_group`), or None (a world torch's
    `init_process_group` made)."""
    group = _control[-1] if _control else None
    return group if group is not None and group in c10d._world.pg_names else None


def world_control_group(device: torch.device, timeout: timedelta | None = None):
    """Right after a world forms, on every rank of it, at the same point: one collective on the default group, so
    that its first operation is one every rank joins (NCCL sets a communicator up at its first use and waits for
    every rank there; the first could otherwise be a switch's send, which a rank with nothing to send never posts),
    then the world's control group (`runtime.control_group`): the one formed with it, else a new one. None without a
    world."""
    if not dist.is_initialized():
        return None
    dist.all_reduce(torch.zeros(1, device=device))
    formed = formed_control_group()
    return formed if formed is not None else new_control_group(timeout)


def has_formed_subgroups() -> bool:
    """Whether the current generation was formed with subgroups (`form_group`)."""
    return bool(_formed)


def formed_subgroup(ranks) -> Any | None:
    """The current generation's group of ``ranks`` (any order) formed with it ahead, or None (also once destroyed:
    a mesh retired on NCCL destroys its groups)."""
    group = _formed.get(tuple(sorted(int(r) for r in ranks)))
    return group if group is not None and group in c10d._world.pg_names else None


_retired: list = []  # ended groups stay referenced: their destructors then never run inside a step or the stall


def retire(groups: list, wait: bool = False) -> threading.Thread | None:
    """End a replaced generation's groups on a background thread (``wait``: here), each member alone: nothing of
    it is used any more, and a peer that left already has closed its side."""
    if not groups:
        return None
    _retired.extend(groups)

    def end() -> None:
        for group in reversed(groups):  # subgroups first, the default group last, as torch ends them
            try:
                group.shutdown()
            except RuntimeError:
                pass  # a backend a peer's exit already broke is ended as far as this process is concerned

    if wait:
        end()
        return None
    thread = threading.Thread(target=end, name="dynatrain-retire-world", daemon=True)
    thread.start()
    return thread
