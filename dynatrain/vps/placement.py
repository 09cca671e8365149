"""Boxes from DTensor placements: which part of a state every position of a device mesh holds.

A state's sharding is what DTensor records for it: the mesh and one placement per mesh dimension. Here the mesh
is always the job's *root* mesh (``mesh_shape``, positions numbered row-major), and each placement covers a run of
consecutive root dimensions (``dims``): a DTensor on a flattened dimension (Lightning's ``data_parallel`` is
``dp_replicate`` x ``dp_shard`` flattened) shards over the run as one dimension of their product's size; a root
dimension no placement covers holds whole copies.

Splits follow ``torch.chunk``: chunks of ``ceil(n / parts)``, the last ones short or empty. A ``Shard(d)`` splits
the position's current local extent of ``d``. A ``StridedShard(d, split_factor)`` is a split applied *after* the
later mesh dimensions that shard ``d`` (whose sizes multiply to ``split_factor``): FSDP2 chunking the TP-local
tensor records ``_StridedShard(0, sf=tp)`` on its data-parallel dimension. So non-strided placements apply in
mesh order, then strided ones from the last mesh dimension back. A local extent may then be a stack of
non-adjacent global ranges, and one position holds several boxes.

A state of one pipeline stage is ``held`` only where one root dimension (``pp``) has given coordinates: the
positions of other stages hold nothing of it (an empty local shape), the stage's positions split it by its
placements as above.

Pure Python: no torch, no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from dynatrain.vps.box import Box


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


Placement = Replicate | Shard | StridedShard


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of chunk ``index`` when ``torch.chunk`` splits ``n`` items into ``parts`` (padded to
    ``parts`` with empty chunks, as DTensor and FSDP2 do)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk {index} of {parts} does not exist")
    size = -(-n // parts)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


@dataclass(frozen=True)
class LocalShards:
    """What one mesh position holds of one state.

    ``boxes[i]`` (global coordinates) sits in the position's local tensor at ``offsets[i]``; the local tensor
    has ``local_shape`` (possibly with a zero dimension: an empty FSDP chunk still exists as a tensor).
    Empty boxes are left out, so ``boxes`` is empty when the position holds no element.
    """

    boxes: tuple[Box, ...]
    offsets: tuple[tuple[int, ...], ...]
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)


@dataclass(frozen=True)
class Sharding:
    """How a state lies on the root mesh: ``placements[k]`` over the root dimensions ``dims[k]``; with ``held =
    (dim, coordinates)`` only the positions whose coordinate along root dimension ``dim`` is one of ``coordinates``
    hold it (a pipeline stage's states), None: every position."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...] = ()
    dims: tuple[tuple[int, ...], ...] = ()
    held: tuple[int, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        mesh = tuple(int(n) for n in self.mesh_shape)
        dims = tuple(tuple(int(d) for d in run) for run in self.dims)
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "placements", tuple(self.placements))
        if any(n < 1 for n in mesh):
            raise ValueError(f"mesh shape {mesh} has a dimension below 1")
        if len(dims) != len(self.placements):
            raise ValueError(f"{len(self.placements)} placements need as many runs of mesh dimensions, got {dims}")
        seen: list[int] = []
        for run in dims:
            if not run or list(run) != list(range(run[0], run[0] + len(run))) or not 0 <= run[0] <= run[-1] < len(mesh):
                raise ValueError(f"mesh dimensions {run} are not a run of consecutive dimensions of mesh {mesh}")
            seen += run
        if len(set(seen)) != len(seen):
            raise ValueError(f"a mesh dimension appears twice in {dims}")
        for p in self.placements:
            if not isinstance(p, (Replicate, Shard, StridedShard)):
                raise ValueError(f"unknown placement {p!r}: use Replicate, Shard(d) or StridedShard(d, split_factor)")
        if self.held is not None:
            dim, where = int(self.held[0]), tuple(sorted({int(c) for c in self.held[1]}))
            if not 0 <= dim < len(mesh) or dim in seen:
                raise ValueError(f"held along mesh dimension {dim}: it must be a dimension of mesh {mesh} that no "
                                 "placement splits")
            if not where or not all(0 <= c < mesh[dim] for c in where):
                raise ValueError(f"held at coordinates {list(where)} of mesh dimension {dim} of size {mesh[dim]}")
            # Held everywhere is not held at all: one spelling per sharding, so equal shardings compare equal.
            object.__setattr__(self, "held", None if len(where) == mesh[dim] else (dim, where))

    @classmethod
    def replicated(cls, mesh_shape: tuple[int, ...], held: tuple[int, tuple[int, ...]] | None = None) -> "Sharding":
        return cls(tuple(mesh_shape), held=held)

    def holds(self, position: int) -> bool:
        """Whether root ``position`` holds any of the state (False on another pipeline stage's positions)."""
        if self.held is None:
            return True
        dim, where = self.held
        after = 1
        for n in self.mesh_shape[dim + 1:]:
            after *= n
        return (position // after) % self.mesh_shape[dim] in where

    def union(self, other: "Sharding") -> "Sharding":
        """The state as two pipeline stages each hold it (a buffer every stage keeps): same placements, held where
        either holds it."""
        if (self.mesh_shape, self.placements, self.dims) != (other.mesh_shape, other.placements, other.dims):
            raise ValueError(f"one state placed {self} on one pipeline stage and {other} on another")
        if self.held is None or other.held is None:
            return Sharding(self.mesh_shape, self.placements, self.dims)
        if self.held[0] != other.held[0]:
            raise ValueError(f"one state held along mesh dimensions {self.held[0]} and {other.held[0]}")
        return self.held_along(self.held[0], self.held[1] + other.held[1])

    def held_along(self, dim: int, coordinates) -> "Sharding":
        """The same placements, held only at ``coordinates`` of root dimension ``dim``."""
        return Sharding(self.mesh_shape, self.placements, self.dims, (dim, tuple(coordinates)))

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.mesh_shape:
            n *= d
        return n

    def sizes(self) -> tuple[int, ...]:
        """The size of each placement's (flattened) mesh dimension."""
        out = []
        for run in self.dims:
            n = 1
            for d in run:
                n *= self.mesh_shape[d]
            out.append(n)
        return tuple(out)

    def order(self, ndim: int) -> tuple[int, ...]:
        """Indices of the placements in the order their splits apply; raises ValueError when a strided split's
        factor is not the product of the later splits of its dimension."""
        sizes = self.sizes()
        for k, p in enumerate(self.placements):
            if isinstance(p, (Shard, StridedShard)) and not 0 <= p.dim < ndim:
                raise ValueError(f"placement {p} shards dimension {p.dim} of a {ndim}-d state")
            if isinstance(p, StridedShard):
                later = 1
                for j in range(k + 1, len(self.placements)):
                    q = self.placements[j]
                    if isinstance(q, (Shard, StridedShard)) and q.dim == p.dim:
                        later *= sizes[j]
                if later != p.split_factor:
                    raise ValueError(
                        f"placement {p} on mesh dimensions {self.dims[k]}: the later mesh dimensions shard dim "
                        f"{p.dim} {later} ways, not {p.split_factor}; this sharding cannot be described"
                    )
        plain = [k for k, p in enumerate(self.placements) if isinstance(p, Shard)]
        strided = [k for k, p in enumerate(self.placements) if isinstance(p, StridedShard)]
        return tuple(plain + strided[::-1])

    def coordinates(self, position: int) -> tuple[int, ...]:
        """Per placement, the coordinate of root ``position`` along its (flattened) mesh dimension."""
        coords, rest = [], position
        full = []
        for n in reversed(self.mesh_shape):
            full.append(rest % n)
            rest //= n
        full.reverse()
        for run in self.dims:
            c = 0
            for d in run:
                c = c * self.mesh_shape[d] + full[d]
            coords.append(c)
        return tuple(coords)

    def __str__(self) -> str:
        text = "(" + ", ".join(f"{p}@{run}" for p, run in zip(self.placements, self.dims)) + ")"
        return text if self.held is None else f"{text}@{self.held[0]}={list(self.held[1])}"


def _split(ranges: list[tuple[int, int]], parts: int, index: int) -> list[tuple[int, int]]:
    """Chunk ``index`` of ``parts`` of the stack of global ``ranges``, as global ranges (empty ones kept out)."""
    total = sum(hi - lo for lo, hi in ranges)
    a, b = chunk_bounds(total, parts, index)
    out, pos = [], 0
    for lo, hi in ranges:
        n = hi - lo
        x, y = max(a, pos), min(b, pos + n)
        if x < y:
            out.append((lo + x - pos, lo + y - pos))
        pos += n
    return out


def position_shards(shape: tuple[int, ...], sharding: Sharding, position: int) -> LocalShards:
    """What root ``position`` holds of a state of ``shape``."""
    if not shape:
        raise ValueError("a 0-d state (such as Adam's step) has no boxes: keep or broadcast it instead of routing it")
    if not sharding.holds(position):
        return LocalShards((), (), (0,) * len(shape))
    ranges: list[list[tuple[int, int]]] = [[(0, n)] for n in shape]
    sizes, coords = sharding.sizes(), sharding.coordinates(position)
    for k in sharding.order(len(shape)):
        p = sharding.placements[k]
        # A strided split is an ordinary split of the extent the later splits left: only its turn differs.
        ranges[p.dim] = _split(ranges[p.dim], sizes[k], coords[k])
    local_shape = tuple(sum(hi - lo for lo, hi in r) for r in ranges)
    per_dim = []
    for r in ranges:
        entries, off = [], 0
        for lo, hi in r:
            entries.append((lo, hi, off))
            off += hi - lo
        per_dim.append(entries)
    boxes, offsets = [], []
    for combo in product(*per_dim):
        boxes.append(Box._trusted(tuple(c[0] for c in combo), tuple(c[1] for c in combo)))
        offsets.append(tuple(c[2] for c in combo))
    return LocalShards(tuple(boxes), tuple(offsets), local_shape)


def sharding_shards(shape: tuple[int, ...], sharding: Sharding) -> tuple[LocalShards, ...]:
    """`position_shards` for every root position; positions with the same coordinates share one computation."""
    memo: dict[tuple[int, ...], LocalShards] = {}
    out = []
    for q in range(sharding.world_size):
        key = (sharding.holds(q),) + sharding.coordinates(q)
        held = memo.get(key)
        if held is None:
            held = memo[key] = position_shards(shape, sharding, q)
        out.append(held)
    return tuple(out)
