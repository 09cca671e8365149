"""A layout's device mesh from process groups made beforehand.

`init_mesh` makes a group for every root dimension and flattened name of a layout (`new_group` under the default
group's store: a rendezvous each and, on gloo, a connect). A world change known ahead forms those groups while the
old world trains (`elastic.next_world`); these functions say which groups a layout's mesh has, for any arrangement of
ranks, and make the mesh from groups once they exist. The probe meshes of `switch.probe` are made the same way, from
groups that send nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.vps.parallel_config import ParallelConfig


def _grid(pcfg: ParallelConfig, ranks: Sequence[int]) -> np.ndarray:
    return np.asarray([int(r) for r in ranks], dtype=np.int64).reshape(pcfg.mesh_shape)


def _axes(pcfg: ParallelConfig) -> dict[str, set[int]]:
    """Per root dimension and flattened name (in `mesh_groups`' order), the root axes it spans."""
    names = pcfg.mesh_dim_names
    spans = {name: (name,) for name in names} | pcfg.flattened_dims()
    return {name: {names.index(d) for d in dims} for name, dims in spans.items()}


def rank_groups(pcfg: ParallelConfig, ranks: Sequence[int], rank: int) -> dict[str, tuple[int, ...]]:
    """Per root dimension and flattened name of the mesh with ``ranks[i]`` at position i, the ranks of ``rank``'s
    group along it, sorted (a group's rank order, which `mesh_safe` arrangements keep equal to the mesh order)."""
    grid = _grid(pcfg, ranks)
    found = np.argwhere(grid == rank)
    if not len(found):
        raise ValueError(f"rank {rank} is not in the mesh of {pcfg.short()} over ranks {list(ranks)}")
    coord = [int(c) for c in found[0]]
    out = {}
    for name, axes in _axes(pcfg).items():
        index = tuple(slice(None) if a in axes else c for a, c in enumerate(coord))
        out[name] = tuple(sorted(int(r) for r in grid[index].ravel()))
    return out


def layout_groups(pcfg: ParallelConfig, ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """Every process group of that mesh, each once, sorted: the same list on every process. Along each root
    dimension and flattened name, the grid's spanned axes moved last make one group per row."""
    grid = _grid(pcfg, ranks)
    groups: set[tuple[int, ...]] = set()
    for axes in _axes(pcfg).values():
        spanned = sorted(axes)
        rows = np.transpose(grid, [a for a in range(grid.ndim) if a not in axes] + spanned)
        rows = np.sort(rows.reshape(-1, int(np.prod([grid.shape[a] for a in spanned]))), axis=1)
        groups.update(map(tuple, rows.tolist()))
    return sorted(groups)


def flattened_layout(layout):
    """The one-dimensional layout of a sub-mesh, as ``DeviceMesh._flatten`` makes it without forming its group.
    torch 2.13 keeps a mesh layout as a sequence of axes and collapses them; torch 2.11 coalesces one CuTe layout and
    nests it when more than one mode is left."""
    if hasattr(layout, "collapse"):
        from torch.distributed._mesh_layout import _MeshLayout

        return _MeshLayout([layout.collapse()])
    flat = layout.coalesce()
    return flat.nest() if len(flat) > 1 else flat


def mesh_from_groups(pcfg: ParallelConfig, ranks: Sequence[int], groups: Mapping[str, object],
                     device_type: str) -> DeviceMesh:
    """The root mesh of ``pcfg`` over ``ranks`` (with its flattened names, as `init_mesh` makes it), whose group
    along each root dimension and flattened name is ``groups[name]``; no group is made."""
    shape = pcfg.mesh_shape
    mesh = DeviceMesh.from_group([groups[n] for n in pcfg.mesh_dim_names], device_type,
                                 mesh=torch.tensor([int(r) for r in ranks], dtype=torch.int).view(shape),
                                 mesh_dim_names=pcfg.mesh_dim_names)
    for name, dims in pcfg.flattened_dims().items():
        sub = mesh[dims]
        flat = DeviceMesh(mesh._device_type, _layout=flattened_layout(sub._layout), _rank_map=mesh._rank_map,
                          mesh_dim_names=(name,), _root_mesh=mesh, _init_backend=False)
        flat._dim_group_names = [groups[name].group_name]
        mesh._pg_registry[groups[name].group_name] = groups[name]  # a sub-mesh's groups live in its root's
        mesh._flatten_mapping[name] = flat
    return mesh
