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
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup
from dynatrain.models.mesh_groups import mesh_from_groups
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
    registered: list[ProcessGroup] = []
    try:
        coordinate = [stage] + [0] * (len(pcfg.mesh_shape) - 1) if pcfg.pp > 1 else [0] * len(pcfg.mesh_shape)
        groups = {name: _fake_group(c, n, device_type, registered)
                  for name, c, n in zip(pcfg.mesh_dim_names, coordinate, pcfg.mesh_shape)}
        for name, dims in pcfg.flattened_dims().items():
            size = math.prod(pcfg.mesh_shape[pcfg.mesh_dim_names.index(d)] for d in dims)
            groups[name] = _fake_group(0, size, device_type, registered)
        mesh = mesh_from_groups(pcfg, ranks, groups, device_type)
        yield mesh
    finally:
        for pg in registered:
            torch._C._distributed_c10d._unregister_process_group(pg.group_name)
