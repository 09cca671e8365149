"""`Box`: one half-open index range per dimension of a tensor.

Every shard of every training state is a box (or a few boxes) of the state's global index space, so
resharding reduces to intersecting boxes. Boxes are plain integers: no torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    """``[lo[d], hi[d])`` in every dimension ``d``. An empty box has ``hi[d] == lo[d]`` somewhere.

    Boxes are normalised on construction (``hi`` is clamped to at least ``lo``), so two empty boxes of the
    same corner compare equal and ``numel`` never goes negative.
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def __post_init__(self) -> None:
        lo, hi = tuple(map(int, self.lo)), tuple(map(int, self.hi))
        if len(lo) != len(hi):
            raise ValueError(f"a box needs as many lower as upper bounds, got lo={lo} and hi={hi}")
        if lo and min(lo) < 0:
            raise ValueError(f"box bounds must be non-negative, got lo={lo}")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi if all(map(int.__le__, lo, hi)) else tuple(map(max, lo, hi)))

    @classmethod
    def _trusted(cls, lo: tuple[int, ...], hi: tuple[int, ...]) -> "Box":
        """Skip validation: for callers that already hold tuples of ints with lo <= hi (hot loops)."""
        box = object.__new__(cls)
        object.__setattr__(box, "lo", lo)
        object.__setattr__(box, "hi", hi)
        return box

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> "Box":
        """The whole index space of a tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def from_offset(cls, offset: tuple[int, ...], shape: tuple[int, ...]) -> "Box":
        """The box that starts at ``offset`` and has ``shape`` (DTensor's local shape + global offset)."""
        return cls(tuple(offset), tuple(o + n for o, n in zip(offset, shape)))

    @property
    def ndim(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        n = 1
        for l, h in zip(self.lo, self.hi):
            n *= h - l
        return n

    @property
    def is_empty(self) -> bool:
        return any(h == l for l, h in zip(self.lo, self.hi))

    def intersect(self, other: "Box") -> "Box":
        """The common part; empty (not None) when they do not meet, so callers test ``is_empty``."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi))
        return Box(lo, hi)

    def contains(self, other: "Box") -> bool:
        """True when every element of ``other`` lies in this box (an empty ``other`` always does)."""
        if other.is_empty:
            return True
        return all(a <= b and d <= c for a, b, c, d in zip(self.lo, other.lo, self.hi, other.hi))

    def shift(self, origin: tuple[int, ...]) -> "Box":
        """This box in the coordinates of a tensor whose element 0 sits at ``origin`` (global -> local)."""
        lo = tuple(l - o for l, o in zip(self.lo, origin))
        if min(lo, default=0) < 0:
            if not self.is_empty:
                raise ValueError(f"box {self} starts before origin {origin}: it is not inside that tensor")
            lo = tuple(max(0, x) for x in lo)
        hi = tuple(max(h - o, l) for h, o, l in zip(self.hi, origin, lo))
        return Box._trusted(lo, hi)

    def offset(self, origin: tuple[int, ...]) -> "Box":
        """The inverse of `shift`: local coordinates under ``origin`` -> global coordinates."""
        if origin and min(origin) < 0:
            raise ValueError(f"origin {origin} has a negative coordinate")
        return Box._trusted(tuple(map(int.__add__, self.lo, origin)), tuple(map(int.__add__, self.hi, origin)))

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor or array with ``t[box.slices()]``."""
        return tuple(slice(l, h) for l, h in zip(self.lo, self.hi))

    def element_range(self, start: int, stop: int) -> list["Box"]:
        """Elements ``[start, stop)`` of this box in row-major order, as at most ``2*ndim - 1`` boxes.

        The boxes come back in row-major order, so packing each one row-major and concatenating gives the
        same byte stream as packing the whole range: a chunk boundary may fall anywhere, even mid-row.
        """
        n = self.numel
        if not 0 <= start <= stop <= n:
            raise ValueError(f"element range [{start}, {stop}) is outside a box of {n} elements")
        base = self.lo
        return [
            Box._trusted(tuple(map(int.__add__, lo, base)), tuple(map(int.__add__, hi, base)))
            for lo, hi in _range_boxes(self.shape, start, stop)
        ]

    def __repr__(self) -> str:
        return "Box[" + ", ".join(f"{l}:{h}" for l, h in zip(self.lo, self.hi)) + "]"


def _range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(lo, hi) of the boxes covering elements [start, stop) of a tensor of ``shape``, row-major."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop,))]
    inner = 1
    for d in shape[1:]:
        inner *= d
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        return [((r0,) + lo, (r0 + 1,) + hi) for lo, hi in _range_boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0,) + lo, (r0 + 1,) + hi) for lo, hi in _range_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1,) + tuple(shape[1:])))
    if c1:
        out += [((r1,) + lo, (r1 + 1,) + hi) for lo, hi in _range_boxes(shape[1:], 0, c1)]
    return out
