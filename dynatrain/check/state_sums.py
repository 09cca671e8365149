"""Per-state checksums of a whole state, every element indexed by its tensor's own placements
(`dynatrain.check.placement`), so the totals over the ranks are the same in any layout that holds the same values.

Per state, every rank contributes (all int64, wrapping, so exact modulo 2**64):

- ``sum``: the sum over its elements of ``a(row) * b(column) * value`` (`hashing.indexed_checksum`: a separable
  hash of the element's bits and global flat index), or for a scalar or object the 64-bit hash of (name, canonical
  bytes of the value) (`scalars.scalar_hash`);
- ``held``: the elements it holds (a scalar: 1 holder);
- ``size``, ``knowers``: the state's element count, and 1, from every rank that has the state at all (a rank off
  a DTensor's mesh still knows its shape; one without it, another pipeline stage, does not);
- ``square``: a scalar's hash squared (0 for tensors): with ``k`` holders, ``sum**2 == k * square`` exactly when
  every holder hashed the same value (``sum**2 - k*square = -sum over pairs (h_i - h_j)**2``);
- ``bad``: 1 where the local tensor contradicts its own placements (its shape is not the one they give, a pending
  reduction, a dtype whose bits cannot be read).

The replication factor comes from the tensors too: the elements the ranks hold, summed, over the elements the state
has. `reduce` sums all of it over the ranks in one all-reduce; `differing` / `explain` compare the totals of before
and after: replication ``rep = held / size`` must be a positive integer (or nothing held of an empty state), the
size the same, the scalars' holders in agreement, and ``old_sum * new_rep == new_sum * old_rep`` modulo 2**64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dynatrain.check.hashing import PieceSums
from dynatrain.check.int64 import wrap64
from dynatrain.check.placement import local_part, placed_indices
from dynatrain.check.scalars import scalar_hash
from dynatrain.runtime import control_group

_FIELDS = ("sums", "held", "sizes", "knowers", "squares", "bad")


@dataclass
class StateSums:
    """Per state of ``names`` (one agreed order on every rank): this rank's contributions, or after `reduce` the
    totals over the ranks. ``problems``: why this rank marked a state bad (this rank's own, not reduced)."""

    names: tuple[str, ...]
    sums: list[int]
    held: list[int]  # elements held (a scalar: holders)
    sizes: list[int]  # sum of the state's element count over the ranks that have it (a scalar: 1 each)
    knowers: list[int]  # ranks that have it
    squares: list[int]  # a scalar: its hash squared; a tensor: 0
    bad: list[int]  # ranks whose local tensor contradicts its placements
    problems: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, names: Sequence[str]) -> StateSums:
        n = len(names)
        return cls(tuple(names), *([0] * n for _ in _FIELDS))

    def vector(self) -> list[int]:
        return [wrap64(x) for f in _FIELDS for x in getattr(self, f)]

    @classmethod
    def from_vector(cls, names: tuple[str, ...], values: Sequence[int], problems=None) -> StateSums:
        n = len(names)
        parts = [list(values[i * n:(i + 1) * n]) for i in range(len(_FIELDS))]
        return cls(names, *parts, problems=dict(problems or {}))


def local_sums(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], names: Sequence[str]) -> StateSums:
    """This rank's contributions to every state of ``names``: a tensor (DTensor or plain) of ``tensors`` by the
    elements it holds where its own metadata places them, a value of ``scalars`` (a 0-d tensor, a number, a
    scheduler's ``state_dict()``, any JSON-like object) by one holder's hash; 0 for a name this rank has not.
    A local tensor that contradicts its placements is counted ``bad`` (reported by `explain` on every rank, after
    `reduce`) rather than raised, so no rank leaves the others waiting in the all-reduce."""
    both = set(tensors) & set(scalars)
    if both:
        raise ValueError(f"states given both as tensors and as scalars: {sorted(both)[:5]}")
    out = StateSums.empty(names)
    _hash_states(out, tensors, scalars)
    return out


def _hash_states(out: StateSums, tensors, scalars) -> None:
    with PieceSums(len(out.names)) as pieces:  # one host transfer for every tensor's sum, at the end
        for i, name in enumerate(out.names):
            if name in scalars:
                h = scalar_hash(name, scalars[name])
                out.sums[i], out.held[i], out.sizes[i], out.knowers[i], out.squares[i] = h, 1, 1, 1, wrap64(h * h)
                continue
            t = tensors.get(name)
            if t is None:
                continue
            out.sizes[i], out.knowers[i] = t.numel(), 1
            try:
                indices = placed_indices(t)
                if indices is None:  # off the DTensor's mesh: holds nothing
                    continue
                local = local_part(t)
                want = tuple(len(ix) for ix in indices)
                if tuple(local.shape) != want:
                    raise ValueError(f"local shape {tuple(local.shape)}, its placements give {want}")
                pieces.add(i, local, indices, tuple(t.shape))
                out.held[i] = local.numel()
            except ValueError as e:
                out.bad[i] = 1
                out.problems[name] = str(e)
        tensor_sums = pieces.totals()
    out.sums = [wrap64(s + t) for s, t in zip(out.sums, tensor_sums)]  # each is 0 where the other is set


def reduce(sums: StateSums, group=None) -> StateSums:
    """``sums`` summed over the ranks of the control group ``group`` (one all-reduce of ``6 * len(names)`` int64s,
    `dynatrain.runtime.control_group`); as it is without an initialised process group."""
    return StateSums.from_vector(sums.names, control_group.all_reduce_ints(sums.vector(), group), sums.problems)


def reduce_pair(old: StateSums, new: StateSums, group=None) -> tuple[StateSums, StateSums]:
    """`reduce` of both sides in one all-reduce (the switch can keep its local sums of before until after)."""
    v, n = control_group.all_reduce_ints(old.vector() + new.vector(), group), len(_FIELDS) * len(old.names)
    return StateSums.from_vector(old.names, v[:n], old.problems), StateSums.from_vector(new.names, v[n:],
                                                                                       new.problems)


def _side(s: StateSums, i: int) -> tuple[int, int, str | None]:
    """(element count, replication, what is wrong or None) of state ``i`` of a reduced side."""
    held, size, knowers, square, bad = s.held[i], s.sizes[i], s.knowers[i], s.squares[i], s.bad[i]
    if bad:
        why = s.problems.get(s.names[i])
        return 0, 0, f"{bad} rank(s) hold a local tensor that contradicts its own placements" + (
            f" (here: {why})" if why else "")
    if size < 0 or size % knowers:
        return 0, 0, f"the ranks that have it disagree on its size ({size} over {knowers})"
    numel = size // knowers
    if numel == 0:
        return 0, 1, None if held == 0 else f"{held} elements held of an empty state"
    if held <= 0 or held % numel:
        return numel, 0, f"{held} elements held of {numel}: not a whole number of copies"
    if square and wrap64(s.sums[i] * s.sums[i] - held * square):
        return numel, 0, f"its {held} holders do not all hold the same value"
    return numel, held // numel, None


def explain(old: StateSums, new: StateSums) -> dict[str, str]:
    """Per state that differs between the reduced sums of before (``old``) and after (``new``), why; empty when
    every state is the same bit for bit (up to the hash) and consistently held on both sides."""
    if old.names != new.names:
        raise ValueError("old and new sums are over different state names: take both over one agreed list")
    out: dict[str, str] = {}
    for i, name in enumerate(old.names):
        known = old.knowers[i] > 0, new.knowers[i] > 0
        if known != (True, True):
            if known != (False, False):
                out[name] = "held by nobody " + ("before" if known[1] else "after") + " the switch"
            continue
        (a, p, why_a), (b, q, why_b) = _side(old, i), _side(new, i)
        if why_a or why_b:
            out[name] = "; ".join(f"{when}: {why}" for when, why in (("before", why_a), ("after", why_b)) if why)
        elif a != b:
            out[name] = f"{a} elements before, {b} after"
        elif wrap64(old.sums[i] * q) != wrap64(new.sums[i] * p):
            out[name] = "values differ"
    return out


def differing(old: StateSums, new: StateSums) -> list[str]:
    """Names of the states `explain` reports, in ``names`` order."""
    return list(explain(old, new))


def compare(old: StateSums, new: StateSums, group=None) -> dict[str, str]:
    """Local sums of before and after, reduced over the control group ``group`` in one all-reduce and explained
    (empty: bitwise equal)."""
    return explain(*reduce_pair(old, new, group))


def all_names(tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, object], group=None) -> tuple[str, ...]:
    """The sorted union of every rank's state names over the control group ``group``: the agreed order where ranks
    have different states (pipeline stages)."""
    every = control_group.all_gather_object(sorted({*tensors, *scalars}), group)
    return tuple(sorted({n for names in every for n in names}))

