"""A layout's placements without its processes: a device mesh of any size over fake process groups.

A world change must know how the user's parallelisation places every state in a world that does not exist yet
(more processes than today, or fewer). DTensor and FSDP2 decide placements from the mesh alone, so the module's
parallelisation runs on the meta device over a mesh whose groups are torch's fake backend: nothing is sent and
nothing allocated. The mesh answers to the same names as the strategy's (`ParallelConfig.mesh_dim_names` and
`ParallelConfig.flattened_dims`). This process sits at position 0 of it, which changes no placement, or, to read
the states of another pipeline stage, at the first position of that stage.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.vps.parallel_config import ParallelConfig

_names = itertools.count()
_PROBE_RANKS = 1 << 24  # the first rank id of a probe mesh's other positions


class _Store(dist.Store):
    """A store no fake group ever uses."""


def _fake_group(rank: int, size: int, device_type: str, registered: list[ProcessGroup]) -> ProcessGroup:
    pg = ProcessGroup(_Store(), rank, size)
    backend = FakeProcessGroup._create_internal(rank, size)
    for device in {"cpu", device_type}:
        pg._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    pg._set_group_name(f"dynatrain_probe_{next(_names)}")
    torch._C._distributed_c10d._register_process_group(pg.group_name, pg)  # FSDP2 resolves groups by name
    registered.append(pg)  # the registry holds groups weakly
    return pg


def _flattened_layout(layout):
    """The one-dimensional layout of a sub-mesh, as ``DeviceMesh._flatten`` makes it without forming its group.
    torch 2.13 keeps a mesh layout as a sequence of axes and collapses them; torch 2.11 coalesces one CuTe layout and
    nests it when more than one mode is left."""
    if hasattr(layout, "collapse"):
        from torch.distributed._mesh_layout import _MeshLayout

        return _MeshLayout([layout.collapse()])
    flat = layout.coalesce()
    return flat.nest() if len(flat) > 1 else flat


@contextmanager
def probe_mesh(pcfg: ParallelConfig, device_type: str = "cpu", stage: int = 0):
    """The root mesh of ``pcfg`` (with its flattened names) whose groups send nothing, with this process on pipeline
    stage ``stage``; its groups are forgotten on exit."""
    me = dist.get_rank()
    # Ranks no real process has: a DeviceMesh compares equal to another with the same ranks and shape whatever its
    # groups, and DTensor's sharding cache would hand the real mesh's operations this probe's (unregistered) groups.
    others = [_PROBE_RANKS + r for r in range(pcfg.world_size - 1)]
    at = stage * pcfg.stage_size
    ranks = others[:at] + [me] + others[at:]
    ranks_t = torch.tensor(ranks, dtype=torch.int).view(pcfg.mesh_shape)
    registered: list[ProcessGroup] = []
    try:
        coordinate = [stage] + [0] * (len(pcfg.mesh_shape) - 1) if pcfg.pp > 1 else [0] * len(pcfg.mesh_shape)
        groups = [_fake_group(c, n, device_type, registered) for c, n in zip(coordinate, pcfg.mesh_shape)]
        mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks_t, mesh_dim_names=pcfg.mesh_dim_names)
        for name, dims in pcfg.flattened_dims().items():
            sub = mesh[dims]
            flat = DeviceMesh(mesh._device_type, _layout=_flattened_layout(sub._layout),
                              _rank_map=mesh._rank_map, mesh_dim_names=(name,), _root_mesh=mesh, _init_backend=False)
            group = _fake_group(0, sub.size(), device_type, registered)
            flat._dim_group_names = [group.group_name]
            mesh._flatten_mapping[name] = flat
        yield mesh
    finally:
        for pg in registered:
            torch._C._distributed_c10d._unregister_process_group(pg.group_name)
