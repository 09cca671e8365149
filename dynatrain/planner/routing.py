"""Routing: intersect an old and a new layout into transfers.

Works in two stages so that one rank can plan a 1,024-rank switch quickly:

1. `overlaps` intersects the boxes of each *route class* (states that share their old and their new split)
   in mesh-position space, once per class, not once per state. The assignment reads the same overlaps.
2. `RouteTable` binds positions to processes. Each region of a destination shard is either local (the
   destination process already holds it: a copy, never on the wire) or has a list of replica holders;
   the holder for a given state is picked by rotation, so the states of a class spread evenly over the
   replicas. `RouteTable.transfers(process)` expands only one process's regions into per-state transfers.

Exactness rests on one property checked here: the distinct old boxes of a class are pairwise disjoint
(every DTensor Shard/Replicate layout has it), so a destination box is covered exactly once iff the
volumes of its intersections add up to its own volume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse, minlength=len(uniq))
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
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
    lo = np.maximum(nlo[m], olo[k])
    hi = np.minimum(nhi[m], ohi[k])
    vol = np.prod(np.clip(hi - lo, 0, None), axis=1)
    keep = vol > 0
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


@dataclass(frozen=True, eq=False)
class Region:
    """A box (global coordinates) of destination shard ``dst_shard`` of ``dst`` that one route class needs.

    ``sources`` are (process, shard index, shard origin) of the holders, ascending by process; a local
    region has the destination itself as its only source.
    """

    route: int
    dst: int
    dst_shard: int
    dst_origin: tuple[int, ...]
    box: Box
    sources: tuple[tuple[int, int, tuple[int, ...]], ...]
    rotation: int
    local: bool

    def source_for(self, rotation_index: int) -> tuple[int, int, tuple[int, ...]]:
        return self.sources[(rotation_index + self.rotation) % len(self.sources)]


@dataclass(frozen=True, eq=False)
class RouteTable:
    """Every region of a switch, indexed by the processes involved, plus bytes per ordered pair."""

    old: Layout
    new: Layout
    classes: tuple[RouteClass, ...]
    regions: tuple[Region, ...]
    by_process: dict = field(repr=False)
    pair_bytes: dict = field(repr=False)  # (src, dst) -> ((itemsize, bytes), ...) itemsize descending
    local_bytes: dict = field(repr=False)  # process -> bytes it copies locally
    # Per route class: (src, dst) -> {replica count n: element volumes by residue}. A state of the class with
    # rotation index r sends acc[n][r % n] elements over the pair from regions with n holders.
    class_pairs: tuple = field(default=(), repr=False)
    _arrays: dict = field(default_factory=dict, repr=False)

    def group_pair_bytes(self, states: Iterable[int]) -> dict:
        """`pair_bytes` restricted to the given state indices: (src, dst) -> ((itemsize, bytes), ...)."""
        wanted = set(states)
        pairs, blocks = self._residue_arrays()
        acc: dict[int, np.ndarray] = {}  # itemsize -> bytes per pair (index into `pairs`)
        for rc, by_n in zip(self.classes, blocks):
            members = [(self.old.states[si].itemsize, rot) for si, rot in zip(rc.states, rc.rotation_index)
                       if si in wanted]
            if not members:
                continue
            for n, (index, volume) in by_n.items():
                counts: dict[int, np.ndarray] = {}  # itemsize -> states per residue
                for size, rot in members:
                    counts.setdefault(size, np.zeros(n, dtype=np.int64))[rot % n] += 1
                for size, c in counts.items():
                    total = acc.setdefault(size, np.zeros(len(pairs), dtype=np.int64))
                    total[index] += (volume @ c) * size  # a class lists each pair once per replica count
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for size in sorted(acc, reverse=True):
            for i in np.flatnonzero(acc[size]).tolist():
                out.setdefault(pairs[i], []).append((size, int(acc[size][i])))
        return {pair: tuple(out[pair]) for pair in sorted(out)}

    def _residue_arrays(self):
        """`class_pairs` as arrays, built once: (pairs, per class {n: (pair indices, volumes [pairs x n])})."""
        if "residues" not in self._arrays:
            pairs = sorted({pair for by_pair in self.class_pairs for pair in by_pair})
            where = {pair: i for i, pair in enumerate(pairs)}
            blocks = []
            for by_pair in self.class_pairs:
                rows: dict[int, tuple[list[int], list[list[int]]]] = {}
                for pair, by_n in by_pair.items():
                    for n, vols in by_n.items():
                        index, volume = rows.setdefault(n, ([], []))
                        index.append(where[pair])
                        volume.append(vols)
                blocks.append({n: (np.array(i, dtype=np.int64), np.array(v, dtype=np.int64).reshape(len(i), n))
                               for n, (i, v) in rows.items()})
            self._arrays["residues"] = (pairs, blocks)
        return self._arrays["residues"]

    @property
    def bytes_moved(self) -> int:
        return sum(b for segs in self.pair_bytes.values() for _, b in segs)

    def transfers(self, process: int) -> tuple[list[Transfer], list[Transfer], list[Transfer]]:
        """(sends, receives, local copies) of one process, every state expanded."""
        sends, recvs, local = [], [], []
        states = self.old.states
        for ri in self.by_process.get(process, ()):
            reg = self.regions[ri]
            rc = self.classes[reg.route]
            box = reg.box
            for si, rot in zip(rc.states, rc.rotation_index):
                spec = states[si]
                src, src_shard, src_origin = reg.source_for(rot)
                if process != src and process != reg.dst:
                    continue
                t = Transfer(
                    src, reg.dst, spec.name, src_shard, box.shift(src_origin),
                    reg.dst_shard, box.shift(reg.dst_origin), box.numel * spec.itemsize,
                )
                if reg.local:
                    local.append(t)
                elif process == src:
                    sends.append(t)
                else:
                    recvs.append(t)
        return sends, recvs, local


def route_table(
    old: Layout, new: Layout, ovs: tuple[ClassOverlap, ...] | None = None,
    node_of: Callable[[int], int] | None = None,
) -> RouteTable:
    """Bind the overlaps to processes. With ``node_of``, a replica on the destination's node is preferred."""
    ovs = overlaps(old, new) if ovs is None else ovs
    classes = tuple(ov.route for ov in ovs)
    regions: list[Region] = []
    by_process: dict[int, list[int]] = {}
    pair_bytes: dict[tuple[int, int], dict[int, int]] = {}
    local_bytes: dict[int, int] = {}
    class_pairs: list[dict] = []
    for ci, ov in enumerate(ovs):
        residues: dict[tuple[int, int], dict[int, list[int]]] = {}
        class_pairs.append(residues)
        rc = ov.route
        ob, nb = old.class_boxes(rc.old_class), new.class_boxes(rc.new_class)
        ob_pos, ob_shard, ob_lo = ob.position.tolist(), ob.shard.tolist(), ob.lo.tolist()
        nb_pos, nb_shard, nb_lo = nb.position.tolist(), nb.shard.tolist(), nb.lo.tolist()
        old_ptr, old_ind = ov.old_ptr.tolist(), ov.old_ind.tolist()
        new_ptr, new_ind = ov.new_ptr.tolist(), ov.new_ind.tolist()
        region_lo, region_hi, volume = ov.lo.tolist(), ov.hi.tolist(), ov.volume.tolist()
        per_element = rc.bytes_per_element
        holders_cache: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
        for x, (k, m) in enumerate(zip(ov.old_of.tolist(), ov.new_of.tolist())):
            holders = holders_cache.get(k)
            if holders is None:
                holders = []
                for b in old_ind[old_ptr[k]:old_ptr[k + 1]]:
                    p = old.rank_map[ob_pos[b]]
                    if p is not None:
                        holders.append((p, ob_shard[b], tuple(ob_lo[b])))
                holders.sort()
                holders_cache[k] = holders
            box = Box._trusted(tuple(region_lo[x]), tuple(region_hi[x]))
            vol = volume[x]
            for b in new_ind[new_ptr[m]:new_ptr[m + 1]]:
                q = nb_pos[b]
                dst = new.rank_map[q]
                if dst is None:
                    raise ValueError(f"new layout position {q} has no process: give every new position a process")
                origin = tuple(nb_lo[b])
                own = [h for h in holders if h[0] == dst]
                if own:
                    regions.append(Region(ci, dst, nb_shard[b], origin, box, (own[0],), 0, True))
                    local_bytes[dst] = local_bytes.get(dst, 0) + vol * per_element
                    by_process.setdefault(dst, []).append(len(regions) - 1)
                    continue
                if not holders:
                    name = old.states[rc.states[0]].name
                    raise ValueError(
                        f"state {name!r}: box {box} was held only by lost processes; "
                        "restore it from a snapshot, the switch cannot rebuild it"
                    )
                srcs = holders
                if node_of is not None and len(holders) > 1:
                    near = [h for h in holders if node_of(h[0]) == node_of(dst)]
                    srcs = near or holders
                regions.append(Region(ci, dst, nb_shard[b], origin, box, tuple(srcs), q, False))
                ri = len(regions) - 1
                by_process.setdefault(dst, []).append(ri)
                n = len(srcs)
                for h, (src, _, _) in enumerate(srcs):
                    acc = residues.setdefault((src, dst), {}).setdefault(n, [0] * n)
                    acc[(h - q) % n] += vol
                    sent = 0
                    for size, count in rc.itemsize_counts:
                        mine = count // n + (1 if (h - q) % n < count % n else 0)
                        if mine:
                            seg = pair_bytes.setdefault((src, dst), {})
                            seg[size] = seg.get(size, 0) + mine * size * vol
                            sent += mine
                    if sent:
                        by_process.setdefault(src, []).append(ri)
    frozen_pairs = {
        pair: tuple(sorted(segs.items(), reverse=True)) for pair, segs in sorted(pair_bytes.items())
    }
    return RouteTable(old, new, classes, tuple(regions), by_process, frozen_pairs, local_bytes, tuple(class_pairs))


def route(old: Layout, new: Layout, processes: Iterable[int] | None = None) -> Routing:
    """Every transfer from ``old`` to ``new`` (or only those that touch ``processes``), in a fixed order."""
    table = route_table(old, new)
    procs = sorted(set(old.processes) | set(new.processes)) if processes is None else sorted(set(processes))
    wire, local = [], []
    seen = set()
    for p in procs:
        s, r, l = table.transfers(p)
        for t in s + r:
            key = (t.src, t.dst, t.state, t.dst_shard, t.dst_box.lo)
            if key not in seen:
                seen.add(key)
                wire.append(t)
        local += l
    order = lambda t: (t.src, t.dst, table.old.state_index(t.state), t.dst_shard, t.dst_box.lo)
    return Routing(tuple(sorted(wire, key=order)), tuple(sorted(local, key=order)))
