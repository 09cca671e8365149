"""`MeshCache`: the device meshes of one world, one per layout and rank arrangement visited, and the retirement of
their process groups."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.elastic import next_world
from dynatrain.models.mesh_groups import mesh_from_groups, rank_groups
from dynatrain.models.parallelize import connect_mesh_groups, init_mesh, mesh_groups
from dynatrain.vps.parallel_config import ParallelConfig


def forget_old_meshes() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches. They key a DeviceMesh by its rank layout,
    not by this process's rank or groups: after a world change, an op on a mesh of the same shape would otherwise
    get back tensors of an old generation's mesh (a stale rank, dead groups), which DCP and `full_tensor` read."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()


def formed_mesh(pcfg: ParallelConfig, device_type: str, ranks: tuple[int, ...]) -> DeviceMesh | None:
    """The mesh of ``pcfg`` over ``ranks`` from the groups formed ahead with this generation
    (`next_world.formed_subgroup`), connected already; None unless every one of its groups was. Every rank of the
    generation gets the same answer: they formed the same list of groups, or none."""
    if not next_world.has_formed_subgroups() or dist.get_rank() not in ranks:
        return None
    groups = {name: next_world.formed_subgroup(r)
              for name, r in rank_groups(pcfg, ranks, dist.get_rank()).items()}
    if any(g is None for g in groups.values()):
        return None
    return mesh_from_groups(pcfg, ranks, groups, device_type)


class MeshCache:
    """Meshes keyed by ``(layout, ranks)``; ``retire_groups`` (None: on NCCL) says whether `retire` destroys the
    groups of the meshes left behind."""

    def __init__(self) -> None:
        self._meshes: dict[tuple, DeviceMesh] = {}
        self.retire_groups: bool | None = None

    def __len__(self) -> int:
        return len(self._meshes)

    def __iter__(self):
        return iter(self._meshes)

    def items(self):
        return self._meshes.items()

    def get(self, pcfg: ParallelConfig, device: torch.device, ranks=None) -> DeviceMesh:
        """The mesh of a layout and rank arrangement, built once per world and reused when a switch returns to it.

        Reuse keeps the number of process groups bounded by the layouts visited; every rank takes the same
        branch (the key is rank-identical), so group creation stays in step everywhere.
        """
        key = (pcfg, tuple(range(pcfg.world_size)) if ranks is None else tuple(int(r) for r in ranks))
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = formed_mesh(pcfg, device.type, key[1])
            if mesh is None:
                # Also under Lightning's own names, so a configure_model written for ModelParallelStrategy runs
                # unchanged.
                mesh = init_mesh(pcfg, device.type, key[1])
                # Before the first step: a layout's first collectives should not carry its communicators' set-up.
                connect_mesh_groups(mesh, pcfg, device)
            self._meshes[key] = mesh
        return mesh

    def retire(self, running: DeviceMesh | None, keep: Callable[[ParallelConfig], bool]) -> int:
        """Destroy the process groups of this world's meshes but ``running`` and those of the layouts ``keep`` names
        (a build kept for a switch to come); returns how many groups went.

        An NCCL group holds its communicator's buffers on the device for as long as it lives, and a job that wanders
        through layouts would keep them all; destroying it shuts the communicator down. A layout visited again is
        connected again when its switch builds it, before the stall. Gloo's connections close only when the last
        reference to the group goes, and torch keeps some of a mesh's (6 file descriptors more per switch on 2
        ranks, measured): there the meshes stay and are reused instead, bounded by the layouts visited. Every rank
        calls this at the same point after a switch, when no operation on an old group is pending; destroying a
        group is local."""
        if not dist.is_initialized() or running is None:
            return 0
        if not (self.retire_groups if self.retire_groups is not None else "nccl" in str(dist.get_backend())):
            return 0
        live = {id(dist.group.WORLD)}
        kept = {key: mesh for key, mesh in self._meshes.items() if mesh is running or keep(key[0])}
        for key, mesh in kept.items():
            live.update(id(g) for g in mesh_groups(mesh, key[0], min_size=1))
        retired = 0
        for key in [k for k in self._meshes if k not in kept]:
            for group in mesh_groups(self._meshes.pop(key), key[0], min_size=1):
                if id(group) not in live:
                    live.add(id(group))  # two meshes may share a group: destroy it once
                    dist.destroy_process_group(group)
                    retired += 1
        if retired:
            forget_old_meshes()
        return retired

    def forget(self, running: DeviceMesh | None, drop_groups: bool = False) -> None:
        """Forget every mesh of this world, ``running`` included (its world is gone). ``drop_groups``: also empty
        their process-group registries and DTensor's caches, so that a broken world's groups go with their last
        reference."""
        if drop_groups:
            for mesh in [*self._meshes.values(), running]:
                for m in (mesh, getattr(mesh, "_root_mesh", None)):
                    registry = getattr(m, "_pg_registry", None)
                    if registry is not None:
                        registry.clear()
            forget_old_meshes()
        self._meshes.clear()
