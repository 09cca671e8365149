"""`ClassShards`: what every mesh position holds of one class of states, as arrays.

A 405B layout at 16,384 positions has some 200,000 (class, position) entries; one `LocalShards` object each would
cost seconds to build, and the planner only reads the boxes as arrays. So a class's shards are held as arrays and
behave as the tuple of `LocalShards` they stand for: ``shards[q]`` builds position ``q``'s entry when asked (once:
the engine asks for the same few positions hundreds of times inside the stall), and they compare equal to that
tuple. The arrays are never written after construction, which is what makes the entries safe to keep.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from dynatrain.vps.box import Box
from dynatrain.vps.placement import LocalShards


class ClassShards(Sequence):
    """Position ``q`` holds boxes ``ptr[q]:ptr[q+1]``: ``[lo[i], hi[i])`` at ``offsets[i]`` of its local tensor
    of shape ``local_shape[q]``."""

    def __init__(self, ptr: np.ndarray, lo: np.ndarray, hi: np.ndarray, offsets: np.ndarray,
                 local_shape: np.ndarray) -> None:
        self.ptr = np.asarray(ptr, dtype=np.int64)
        ndim = local_shape.shape[1]
        self.lo = np.asarray(lo, dtype=np.int64).reshape(-1, ndim)
        self.hi = np.asarray(hi, dtype=np.int64).reshape(-1, ndim)
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, ndim)
        self.local_shape = np.asarray(local_shape, dtype=np.int64)
        self._built: dict[int, LocalShards] = {}

    @classmethod
    def of(cls, shards: Sequence[LocalShards]) -> "ClassShards":
        """The arrays of a sequence of `LocalShards` (one object repeated is converted once)."""
        if isinstance(shards, ClassShards):
            return shards
        shards = tuple(shards)
        if shards and shards.count(shards[0]) == len(shards):
            one = cls._convert((shards[0],))
            return one.tile(len(shards))
        return cls._convert(shards)

    @classmethod
    def _convert(cls, shards: tuple[LocalShards, ...]) -> "ClassShards":
        ndim = len(shards[0].local_shape) if shards else 1
        counts = [len(s.boxes) for s in shards]
        lo = [b.lo for s in shards for b in s.boxes]
        hi = [b.hi for s in shards for b in s.boxes]
        off = [o for s in shards for o in s.offsets]
        ptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        shape = np.array([s.local_shape for s in shards], dtype=np.int64).reshape(-1, ndim)
        return cls(ptr, np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64), np.array(off, dtype=np.int64),
                   shape)

    def tile(self, times: int) -> "ClassShards":
        """These positions ``times`` over, one block after another."""
        n_box = len(self.lo)
        ptr = (self.ptr[:-1][None, :] + n_box * np.arange(times)[:, None]).reshape(-1)
        return ClassShards(np.concatenate([ptr, [n_box * times]]), np.tile(self.lo, (times, 1)),
                           np.tile(self.hi, (times, 1)), np.tile(self.offsets, (times, 1)),
                           np.tile(self.local_shape, (times, 1)))

    def concat(self, other: "ClassShards") -> "ClassShards":
        return ClassShards(np.concatenate([self.ptr[:-1], other.ptr + self.ptr[-1]]),
                           np.concatenate([self.lo, other.lo]), np.concatenate([self.hi, other.hi]),
                           np.concatenate([self.offsets, other.offsets]),
                           np.concatenate([self.local_shape, other.local_shape]))

    @property
    def position(self) -> np.ndarray:
        """The position of every box."""
        return np.repeat(np.arange(len(self)), np.diff(self.ptr))

    @property
    def shard(self) -> np.ndarray:
        """Each box's index among its position's boxes."""
        return np.arange(len(self.lo)) - np.repeat(self.ptr[:-1], np.diff(self.ptr))

    @property
    def numel(self) -> int:
        """Elements over all positions (replicas counted every time)."""
        return int(np.prod(self.hi - self.lo, axis=1).sum())

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def __getitem__(self, q):
        if isinstance(q, slice):
            return tuple(self[i] for i in range(*q.indices(len(self))))
        q = int(q)
        if q < 0:
            q += len(self)
        if not 0 <= q < len(self):
            raise IndexError(f"position {q} of {len(self)}")
        built = self._built.get(q)
        if built is None:
            built = self._built[q] = self._build(q)
        return built

    def _build(self, q: int) -> LocalShards:
        a, b = int(self.ptr[q]), int(self.ptr[q + 1])
        lo, hi, off = self.lo[a:b].tolist(), self.hi[a:b].tolist(), self.offsets[a:b].tolist()
        return LocalShards(tuple(Box._trusted(tuple(x), tuple(y)) for x, y in zip(lo, hi)),
                           tuple(tuple(o) for o in off), tuple(self.local_shape[q].tolist()))

    def __iter__(self) -> Iterator[LocalShards]:
        # Not kept: a walk over every position (a comparison, a 16,384-rank check) would keep them all.
        return (self._built[q] if q in self._built else self._build(q) for q in range(len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, ClassShards):
            return all(np.array_equal(a, b) for a, b in (
                (self.ptr, other.ptr), (self.lo, other.lo), (self.hi, other.hi), (self.offsets, other.offsets),
                (self.local_shape, other.local_shape)))
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        if isinstance(other, (tuple, ClassShards)):
            return self.concat(ClassShards.of(other)) if len(other) else self
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, tuple):
            return ClassShards.of(other).concat(self) if other else self
        return NotImplemented

    def __repr__(self) -> str:
        return f"ClassShards({len(self)} positions, {len(self.lo)} boxes)"
