"""Where a local tensor lies in its global tensor, by the tensor's own word: a DTensor's device mesh, placements and
global shape, through DTensor's own offset arithmetic (`compute_local_shape_and_global_offset`; per-dimension index
lists where a `_StridedShard` leaves them not contiguous); a plain tensor is whole, at offset 0. Nothing here reads
a `Layout` or a plan: the check indexes each element by what its tensor says, never by the map the engine wrote by,
so a placement error the layout and the engine share cannot pass it."""

from __future__ import annotations

import weakref

import torch

Index = range | torch.Tensor  # the global indices along one dimension: a contiguous range, or any (int64, CPU)

# (id of a mesh, placements, shape) -> (a weak reference to that mesh, its answer): an answer depends on nothing else
# (a mesh's coordinate is fixed when it is made), so tensors placed alike share it, a parameter and its moments in
# one pass, a layout's before and after in the passes of two switches (a `_StridedShard`'s costs 0.2 ms). The
# reference tells the mesh from a later one at the same address.
_KNOWN: dict = {}
_KNOWN_MAX = 4096


def placed_indices(t: torch.Tensor) -> list[Index] | None:
    """Per dimension of the global tensor, the global indices of the local tensor's entries along it, from ``t``'s
    own metadata: a DTensor's mesh, placements and shape; a plain tensor whole. A contiguous run is a ``range``,
    anything else (a `_StridedShard` after another shard of its dimension) an int64 tensor. None: this rank is not
    on the DTensor's mesh and holds nothing. A 0-d tensor gives ``[]`` (one element, flat index 0). Tensors placed
    alike get the same list, which no caller may change.

    ValueError: a pending reduction (`Partial`), whose local values are not elements of the tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return [range(n) for n in t.shape]
    mesh, placements, shape = t.device_mesh, tuple(t.placements), tuple(t.shape)
    key = (id(mesh), placements, shape)
    known = _KNOWN.get(key)
    if known is None or known[0]() is not mesh:
        try:
            answer = _placed(mesh, placements, shape)
        except ValueError as e:
            answer = e
        if len(_KNOWN) >= _KNOWN_MAX:  # the answers of meshes long gone
            _KNOWN.clear()
        known = _KNOWN[key] = weakref.ref(mesh), answer
    if isinstance(known[1], ValueError):
        raise known[1]
    return known[1]


def remember(module: torch.nn.Module) -> None:
    """Work out now the placed indices of a module's parameters: for a target built ahead of its switch, outside the
    stall, so that the check after it finds the adopted tensors' answers made (a `_StridedShard`'s costs 0.2 ms).
    The check still asks each adopted tensor by its own mesh, placements and shape."""
    for p in module.parameters():
        try:
            placed_indices(p)
        except ValueError:  # asked again, and reported, by the check
            pass


def _placed(mesh, placements: tuple, shape: tuple[int, ...]) -> list[Index] | None:
    if mesh.get_coordinate() is None:
        return None
    if any(p.is_partial() for p in placements):
        raise ValueError(f"placements {placements} hold a pending reduction, not the tensor's elements")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if not _strided(placements):  # Shard gives a contiguous range per dimension: the box is exact
        return [range(o, o + n) for o, n in zip(offset, local_shape)]
    exact = _strided_indices(shape, mesh, placements)
    sizes = tuple(len(ix) for ix in exact)
    firsts = tuple(int(ix[0]) if len(ix) else o for ix, o in zip(exact, offset))
    if sizes != tuple(local_shape) or firsts != tuple(offset):
        raise ValueError(f"torch's offsets of {placements} on {shape}: box {local_shape} at {offset}, indices "
                         f"{sizes} from {firsts}: its two views of one computation disagree")
    return [range(o, o + n) if torch.equal(ix, torch.arange(o, o + n)) else ix
            for ix, o, n in zip(exact, offset, local_shape)]


def _strided(placements) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in placements)


def _strided_indices(shape, mesh, placements) -> list[torch.Tensor]:
    """Per dimension, every global index (not only the first, which is all `compute_local_shape_and_global_offset`
    returns): a `_StridedShard` after another shard of the same dimension leaves the local entries apart. The same
    left-to-right walk as torch's `_compute_local_shape_and_global_offset`, through its own per-dimension step."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    coord = mesh.get_coordinate()
    index = [torch.arange(n, dtype=torch.int64) for n in shape]
    sharded: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if not (p.is_shard() or isinstance(p, _StridedShard)):
            continue
        d = p.dim
        size, offsets = _get_shard_size_and_offsets(
            len(index[d]), mesh.size(mesh_dim), coord[mesh_dim], p, index[d] if d in sharded else None, shape[d],
            False)
        index[d] = offsets[:size].to(torch.int64) if size else index[d][:0]
        sharded.add(d)
    return index



def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor it wraps, by the wrapper-subclass protocol: ``to_local`` is an
    autograd function, 20 times slower, for a value the check only reads); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    inner, _ = t.__tensor_flatten__()
    return getattr(t, inner[0])
