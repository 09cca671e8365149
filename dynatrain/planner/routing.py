"""Routing in position space: intersect an old and a new layout per route class.

Works in two stages so that one rank can plan a 16,384-rank switch quickly:

1. `overlaps` (here) intersects the boxes of each *route class* (states that share their old and their new
   split) in mesh-position space, once per class, not once per state. The assignment reads the same overlaps
   (`saved_matrix`).
2. `planner.route_table` binds positions to processes: local regions, replica holders, bytes per pair.

Exactness rests on one property checked here: the distinct old boxes of a class are pairwise disjoint
(every DTensor Shard/Replicate layout has it), so a destination box is covered exactly once iff the
volumes of its intersections add up to its own volume.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix

from dynatrain.vps.box import Box
from dynatrain.vps.layout import Layout


@dataclass(frozen=True)
class Transfer:
    """Elements of one state that move from ``src`` to ``dst`` (or are copied locally when src == dst).

    ``src_box`` is in the coordinates of the source's shard ``src_shard`` (subtract nothing more: index the
    shard with ``src_box.slices()``); ``dst_box`` likewise in the destination's shard ``dst_shard``.
    """

    src: int
    dst: int
    state: str
    src_shard: int
    src_box: Box
    dst_shard: int
    dst_box: Box
    nbytes: int


@dataclass(frozen=True)
class Routing:
    """All transfers of a switch (or of the processes asked for). Local copies never go on the wire."""

    transfers: tuple[Transfer, ...]
    local_copies: tuple[Transfer, ...]

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True)
class RouteClass:
    """States with the same old class and the same new class; they route identically."""

    old_class: int
    new_class: int
    states: tuple[int, ...]
    # For each state in `states`: its index among this route class's states of the same itemsize. The
    # replica holder of a region for that state is sources[(rotation_index + region.rotation) % len].
    rotation_index: tuple[int, ...]
    itemsize_counts: tuple[tuple[int, int], ...]  # (itemsize, number of states), itemsize descending

    @property
    def bytes_per_element(self) -> int:
        return sum(i * n for i, n in self.itemsize_counts)


@dataclass(frozen=True, eq=False)
class ClassOverlap:
    """Intersections of one route class in position space.

    Distinct old boxes ``k`` and distinct new boxes ``m`` (identical boxes of replicas merged); pair ``x``
    is the region ``[lo[x], hi[x])`` where new box ``new_of[x]`` meets old box ``old_of[x]``. Holders of old
    box k are the class-box indices ``old_ind[old_ptr[k]:old_ptr[k+1]]`` (likewise ``new_ptr/new_ind`` for
    the positions that need new box m).
    """

    route: RouteClass
    old_ptr: np.ndarray
    old_ind: np.ndarray
    new_ptr: np.ndarray
    new_ind: np.ndarray
    new_of: np.ndarray
    old_of: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    volume: np.ndarray


def route_classes(old: Layout, new: Layout) -> tuple[RouteClass, ...]:
    old.same_states(new)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (a, b) in enumerate(zip(old.state_class, new.state_class)):
        groups.setdefault((a, b), []).append(i)
    out = []
    for (a, b), members in groups.items():
        seen: dict[int, int] = {}
        rot = []
        for i in members:
            size = old.states[i].itemsize
            rot.append(seen.get(size, 0))
            seen[size] = seen.get(size, 0) + 1
        out.append(RouteClass(a, b, tuple(members), tuple(rot), tuple(sorted(seen.items(), reverse=True))))
    return tuple(out)


def _distinct(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge identical boxes: (distinct lo, distinct hi, CSR pointer, box indices grouped by distinct box)."""
    if len(lo) == 0:
        nd = lo.shape[1]
        return lo.reshape(0, nd), hi.reshape(0, nd), np.zeros(1, np.int64), np.zeros(0, np.int64)
    keys = np.concatenate([lo, hi], axis=1)
    # Sorted on the columns in order, stably, as np.unique(axis=0) would give them, on integer keys instead of
    # its row records (several times faster at 16,384 ranks).
    order = np.lexsort(keys.T[::-1])
    ranked = keys[order]
    first = np.ones(len(ranked), dtype=bool)
    first[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    uniq = ranked[first]
    ptr = np.append(np.flatnonzero(first), len(ranked)).astype(np.int64)
    nd = lo.shape[1]
    return uniq[:, :nd], uniq[:, nd:], ptr, order.astype(np.int64)


def _intersect_all(nlo, nhi, olo, ohi):
    """Every (new box m, old box k) pair that meets, with the region and its volume.

    Only old boxes whose dim-0 start lies within the widest old dim-0 extent of the new box can meet it, so
    a sorted search on dim 0 gives a few candidates per new box instead of all of them.
    """
    nd = nlo.shape[1]
    if len(nlo) == 0 or len(olo) == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, nd), np.int64), np.zeros((0, nd), np.int64), z
    order = np.argsort(olo[:, 0], kind="stable")
    starts0 = olo[order, 0]
    widest = int((ohi[:, 0] - olo[:, 0]).max())
    first = np.searchsorted(starts0, nlo[:, 0] - widest, side="right")
    last = np.searchsorted(starts0, nhi[:, 0], side="left")
    counts = np.maximum(last - first, 0)
    m = np.repeat(np.arange(len(nlo)), counts)
    base = np.repeat(first - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    k = order[base + np.arange(int(counts.sum()))]
    # Keep the pairs that meet in every dimension, one column at a time, before forming their regions: with TP,
    # most candidates share the new box's dim-0 range but hold another TP slice.
    meet = ohi[k, 0] > nlo[m, 0]
    for d in range(1, nd):
        meet &= (olo[k, d] < nhi[m, d]) & (ohi[k, d] > nlo[m, d])
    m, k = m[meet], k[meet]
    lo = np.maximum(nlo[m], olo[k])
    hi = np.minimum(nhi[m], ohi[k])
    vol = np.prod(hi - lo, axis=1)
    keep = vol > 0  # an empty box meets nothing
    return m[keep], k[keep], lo[keep], hi[keep], vol[keep]


def overlaps(old: Layout, new: Layout, classes: tuple[RouteClass, ...] | None = None) -> tuple[ClassOverlap, ...]:
    """Intersect every route class's old and new boxes; raise ValueError when a new box is not covered
    exactly once by the old layout (a hole, or replicas that hold different overlapping boxes)."""
    classes = route_classes(old, new) if classes is None else classes
    out = []
    for rc in classes:
        ob, nb = old.class_boxes(rc.old_class), new.class_boxes(rc.new_class)
        olo, ohi, optr, oind = _distinct(ob.lo, ob.hi)
        nlo, nhi, nptr, nind = _distinct(nb.lo, nb.hi)
        m, k, lo, hi, vol = _intersect_all(nlo, nhi, olo, ohi)
        ov = ClassOverlap(rc, optr, oind, nptr, nind, m, k, lo, hi, vol)
        covered = np.bincount(ov.new_of, weights=ov.volume, minlength=len(nlo))
        need = np.prod(nhi - nlo, axis=1)
        bad = np.nonzero(covered != need)[0]
        if len(bad):
            m = int(bad[0])
            name = old.states[rc.states[0]].name
            what = "not held by any position" if covered[m] < need[m] else "held twice by overlapping old boxes"
            raise ValueError(
                f"state {name!r}: part of box {Box(tuple(nlo[m]), tuple(nhi[m]))} of the new layout is {what} "
                "of the old layout; the old layout must hold every element once per replica"
            )
        out.append(ov)
    return tuple(out)


def _expand(ptr: np.ndarray, ind: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each entry of ``which`` (a CSR row), repeat it per member: (entry index, member)."""
    counts = ptr[which + 1] - ptr[which]
    rep = np.repeat(np.arange(len(which)), counts)
    starts = np.repeat(ptr[which] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return rep, ind[starts + np.arange(counts.sum())]


def saved_matrix(ovs: tuple[ClassOverlap, ...], old: Layout, new: Layout, candidates: list[int]) -> csr_matrix:
    """``W[c, q]``: bytes new position ``q`` needs that candidate process ``candidates[c]`` already holds.

    Putting candidate c at position q saves W[c, q] bytes of wire traffic; the assignment maximises the sum.
    Sparse: a process holds a little of what a few positions need, and at 16,384 processes the dense matrix
    alone would take 2 GiB.
    """
    row = np.full(len(old.rank_map), -1, dtype=np.int64)
    where = {p: i for i, p in enumerate(candidates)}
    for q, p in enumerate(old.rank_map):
        if p is not None and p in where:
            row[q] = where[p]
    rows_all, cols_all, vals_all = [], [], []
    for ov in ovs:
        if not len(ov.volume):
            continue
        ob, nb = old.class_boxes(ov.route.old_class), new.class_boxes(ov.route.new_class)
        pair, oidx = _expand(ov.old_ptr, ov.old_ind, ov.old_of)
        rows = row[ob.position[oidx]]
        keep = rows >= 0
        pair, rows = pair[keep], rows[keep]
        pair2, nidx = _expand(ov.new_ptr, ov.new_ind, ov.new_of[pair])
        rows_all.append(rows[pair2])
        cols_all.append(nb.position[nidx])
        vals_all.append(ov.volume[pair][pair2] * ov.route.bytes_per_element)
    shape = (len(candidates), new.world_size)
    if not rows_all:
        return csr_matrix(shape, dtype=np.int64)
    w = coo_matrix((np.concatenate(vals_all).astype(np.int64),
                    (np.concatenate(rows_all), np.concatenate(cols_all))), shape=shape).tocsr()
    w.sum_duplicates()
    return w
