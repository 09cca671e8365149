"""The route table: the overlaps of every route class bound to processes, as arrays.

A *region* is the box where one new box of a route class meets one old box, for one destination shard that needs
it. Each region is either local (the destination process already holds the old box: a copy, never on the wire) or
has a list of replica holders, ascending by process (with a node model, those on the destination's node when there
are any). A state with rotation index ``i`` (its index among its route class's states of its itemsize) comes from
holder ``(i + rotation) % n`` of a region with ``n`` holders, where ``rotation`` is the destination's position: a
class's states spread evenly over the replicas, and different destinations start at different replicas.

Every route class is expanded with numpy: regions in a fixed order (overlap, then destination box in layout
order), their sources as a CSR, and per (region, source) the rotation residue ``i % n`` of the states it sends. At
16,384 ranks there are millions of (region, holder) rows; nothing here walks them in Python, and nothing depends on
hashing, so every rank builds the same arrays. Only `RouteTable.transfers` makes Python objects, for one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from dynatrain.planner.pair_bytes import PairBytes, pair_index, sum_by, sum_by_id
from dynatrain.planner.routing import ClassOverlap, RouteClass, Routing, Transfer, overlaps
from dynatrain.vps.box import Box
from dynatrain.vps.layout import ClassBoxes, Layout


def expand_csr(ptr: np.ndarray, ind: np.ndarray | None, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each entry of ``which`` (a CSR row), repeat it per member: (entry index, member); ``ind`` None: the
    members are the positions in the CSR themselves."""
    counts = ptr[which + 1] - ptr[which]
    total = int(counts.sum())
    rep = np.repeat(np.arange(len(which)), counts)
    at = np.repeat(ptr[which] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts).astype(np.int64, copy=False)
    at += np.arange(total)
    return rep, at if ind is None else ind[at]


@dataclass(frozen=True, eq=False)
class ClassRegions:
    """One route class's regions. Region ``r`` is the box of overlap ``overlap[r]`` for new class box
    ``new_box[r]``, needed by process ``dst[r]``; a local region's only source is ``dst[r]`` itself. Its sources
    are rows ``src_ptr[r]:src_ptr[r+1]``, ascending by process: process ``src``, old class box ``src_box``. A source
    row of a non-local region with ``n`` sources sends the states whose rotation index ``i`` has
    ``i % n == residue``; ``sends`` marks the rows for which such a state exists."""

    overlap: np.ndarray
    new_box: np.ndarray
    dst: np.ndarray
    rotation: np.ndarray  # the destination's position; 0 for a local region
    local: np.ndarray
    src_ptr: np.ndarray
    src: np.ndarray
    src_box: np.ndarray
    residue: np.ndarray
    n: np.ndarray
    sends: np.ndarray

    @property
    def src_region(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.dst)), np.diff(self.src_ptr))


def class_regions(
    ov: ClassOverlap, ob: ClassBoxes, nb: ClassBoxes, old_proc: np.ndarray, new_proc: np.ndarray,
    node: Callable[[np.ndarray], np.ndarray] | None, max_count: int, name: str,
) -> ClassRegions:
    """Bind one class's overlaps ``ov`` to processes (``old_proc``/``new_proc``: process per position, -1 where
    vacant); ``node`` maps process arrays to nodes (replicas on the destination's node are preferred);
    ``max_count``: most states of one itemsize in the class; ``name``: a state of the class, for errors. Raises
    the error met first in region order."""
    k_all = np.arange(len(ov.old_ptr) - 1)
    hk, hbox = expand_csr(ov.old_ptr, ov.old_ind, k_all)
    hproc = old_proc[ob.position[hbox]]
    alive = hproc >= 0
    hk, hbox, hproc = hk[alive], hbox[alive], hproc[alive]
    order = np.lexsort((ob.shard[hbox], hproc, hk))  # holders of each old box ascending by process
    hk, hbox, hproc = hk[order], hbox[order], hproc[order]
    hptr = np.searchsorted(hk, np.arange(len(k_all) + 1))

    rx, rb = expand_csr(ov.new_ptr, ov.new_ind, ov.new_of)
    q = nb.position[rb]
    dst = new_proc[q]
    k = ov.old_of[rx]
    nh = hptr[k + 1] - hptr[k]
    # The destination holds the old box itself: its first holder row (k, dst), if any.
    top = int(max(hproc.max(initial=0), dst.max(initial=0))) + 1
    hkey = hk * top + hproc
    at = np.searchsorted(hkey, k * top + dst)
    if len(hkey):
        local = (dst >= 0) & (at < len(hkey)) & (hkey[np.minimum(at, len(hkey) - 1)] == k * top + dst)
    else:
        local = np.zeros(len(dst), dtype=bool)

    vacant = np.flatnonzero(dst < 0)
    orphan = np.flatnonzero(~local & (nh == 0) & (dst >= 0))
    if len(vacant) or len(orphan):
        first_v = int(vacant[0]) if len(vacant) else len(dst)
        first_o = int(orphan[0]) if len(orphan) else len(dst)
        if first_v <= first_o:
            raise ValueError(f"new layout position {int(q[first_v])} has no process: give every new position "
                             "a process")
        x = int(rx[first_o])
        box = Box._trusted(tuple(ov.lo[x].tolist()), tuple(ov.hi[x].tolist()))
        raise ValueError(f"state {name!r}: box {box} was held only by lost processes; restore it from a "
                         "snapshot, the switch cannot rebuild it")

    remote = np.flatnonzero(~local)
    rep, hrow = expand_csr(hptr, None, k[remote])
    if node is not None and len(rep):
        same = node(hproc[hrow]) == node(dst[remote][rep])
        near = np.bincount(rep, weights=same, minlength=len(remote))
        use_near = (nh[remote] > 1) & (near > 0)
        keep = ~use_near[rep] | same
        rep, hrow = rep[keep], hrow[keep]
    n_remote = np.bincount(rep, minlength=len(remote))
    counts = np.ones(len(dst), dtype=np.int64)
    counts[remote] = n_remote
    src_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(src_ptr[-1])
    row_of = np.empty(total, dtype=np.int64)
    where_local = np.flatnonzero(local)
    row_of[src_ptr[where_local]] = at[where_local]
    first = np.concatenate([[0], np.cumsum(n_remote)[:-1]]).astype(np.int64)
    h = np.arange(len(rep)) - first[rep]
    at_row = src_ptr[remote][rep] + h
    row_of[at_row] = hrow
    residue = np.zeros(total, dtype=np.int64)
    n = np.ones(total, dtype=np.int64)
    residue[at_row] = (h - q[remote][rep]) % np.maximum(n_remote[rep], 1)
    n[at_row] = n_remote[rep]
    sends = np.zeros(total, dtype=bool)
    sends[at_row] = residue[at_row] < max_count
    rotation = np.where(local, 0, q)
    return ClassRegions(_narrow(rx), _narrow(rb), _narrow(dst), _narrow(rotation), local, _narrow(src_ptr),
                        _narrow(hproc[row_of]), _narrow(hbox[row_of]), _narrow(residue), _narrow(n), sends)


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` as int32 when every value fits: the table keeps millions of indices per class at 16,384 ranks, and
    half the bytes is half the fresh pages to map."""
    if len(a) and (int(a.max()) > np.iinfo(np.int32).max or int(a.min()) < np.iinfo(np.int32).min):
        return a
    return a.astype(np.int32, copy=False)


def _process_array(rank_map) -> np.ndarray:
    return np.array([-1 if p is None else p for p in rank_map], dtype=np.int64)


def _vector_node(node_of: Callable[[int], int] | None):
    if node_of is None:
        return None

    def node(procs: np.ndarray) -> np.ndarray:
        try:
            out = np.asarray(node_of(procs))
            if out.shape == procs.shape:
                return out
        except TypeError:
            pass
        return np.array([node_of(int(p)) for p in procs.tolist()], dtype=np.int64)

    return node


@dataclass(frozen=True, eq=False)
class RouteTable:
    """Every region of a switch, per route class, and the remote source rows of all classes as one array set
    (``rows_*``; rows that send nothing left out) with the global pair index of each row."""

    old: Layout
    new: Layout
    classes: tuple[RouteClass, ...]
    overlaps: tuple[ClassOverlap, ...] = field(repr=False)
    blocks: tuple[ClassRegions, ...] = field(repr=False)
    pair_src: np.ndarray = field(repr=False)  # global pairs (src, dst), ascending
    pair_dst: np.ndarray = field(repr=False)
    rows_pair: np.ndarray = field(repr=False)
    rows_n: np.ndarray = field(repr=False)
    rows_residue: np.ndarray = field(repr=False)
    rows_volume: np.ndarray = field(repr=False)
    class_span: np.ndarray = field(repr=False)  # rows of class c: [class_span[c], class_span[c + 1])
    _cache: dict = field(default_factory=dict, repr=False)

    def group_pair_bytes(self, states: Iterable[int] | None = None) -> PairBytes:
        """Bytes per pair and itemsize that the given state indices (default: all) put on the wire."""
        wanted = np.zeros(len(self.old.states), dtype=bool)
        if states is None:
            wanted[:] = True
        else:
            wanted[np.fromiter(states, dtype=np.int64)] = True
        itemsize = np.array([s.itemsize for s in self.old.states], dtype=np.int64)
        sizes = np.array(sorted(set(itemsize[wanted].tolist()), reverse=True), dtype=np.int64)
        per_row = np.zeros((len(sizes), len(self.rows_pair)), dtype=np.int64)  # elements per row and itemsize
        for c, rc in enumerate(self.classes):
            a, b = int(self.class_span[c]), int(self.class_span[c + 1])
            members = np.array(rc.states, dtype=np.int64)
            keep = wanted[members]
            if a == b or not keep.any():
                continue
            rot = np.array(rc.rotation_index, dtype=np.int64)[keep]
            size = itemsize[members[keep]]
            n, res = self.rows_n[a:b], self.rows_residue[a:b]
            for n_val in np.unique(n).tolist():
                sel = np.flatnonzero(n == n_val)
                for j, s in enumerate(sizes.tolist()):
                    counts = np.bincount(rot[size == s] % n_val, minlength=n_val)
                    per_row[j, a + sel] = counts[res[sel]]
        nbytes = np.stack([sum_by(self.rows_pair, per_row[j] * self.rows_volume * s, len(self.pair_src))
                           for j, s in enumerate(sizes.tolist())], axis=1) if len(sizes) else \
            np.zeros((len(self.pair_src), 0), dtype=np.int64)
        used = np.flatnonzero(nbytes.sum(axis=1) > 0)
        if len(used) == len(nbytes):  # every pair: the arrays as they are, not a copy of each
            return PairBytes(self.pair_src, self.pair_dst, sizes, nbytes, used)
        return PairBytes(self.pair_src[used], self.pair_dst[used], sizes, nbytes[used], used)

    @property
    def pair_bytes(self) -> PairBytes:
        """Bytes per ordered pair and itemsize over the whole switch."""
        if "all" not in self._cache:
            self._cache["all"] = self.group_pair_bytes()
        return self._cache["all"]

    @property
    def local_bytes(self) -> dict[int, int]:
        """Bytes each process copies locally."""
        if "local" not in self._cache:
            procs, vals = [], []
            for rc, ov, blk in zip(self.classes, self.overlaps, self.blocks):
                procs.append(blk.dst[blk.local])
                vals.append(ov.volume[blk.overlap[blk.local]] * rc.bytes_per_element)
            p = np.concatenate(procs) if procs else np.zeros(0, np.int64)
            v = np.concatenate(vals) if vals else np.zeros(0, np.int64)
            held, total = sum_by_id(p, v)
            self._cache["local"] = dict(zip(held.tolist(), total.tolist()))
        return self._cache["local"]

    @property
    def bytes_moved(self) -> int:
        return int(self.pair_bytes.nbytes.sum())

    def transfers(self, process: int) -> tuple[list[Transfer], list[Transfer], list[Transfer]]:
        """(sends, receives, local copies) of one process, every state expanded, in region order."""
        sends, recvs, local = [], [], []
        states = self.old.states
        for rc, ov, blk in zip(self.classes, self.overlaps, self.blocks):
            as_dst = blk.dst == process
            rows = np.flatnonzero((blk.src == process) & blk.sends)
            if not len(rows) and not as_dst.any():
                continue
            regs = np.union1d(np.flatnonzero(as_dst), np.searchsorted(blk.src_ptr, rows, side="right") - 1)
            ob = self.old.class_boxes(rc.old_class)
            nb = self.new.class_boxes(rc.new_class)
            members = [(states[si].name, states[si].itemsize, rot) for si, rot in zip(rc.states, rc.rotation_index)]
            for r in regs.tolist():
                x, b = int(blk.overlap[r]), int(blk.new_box[r])
                box = Box._trusted(tuple(ov.lo[x].tolist()), tuple(ov.hi[x].tolist()))
                dst = int(blk.dst[r])
                dst_shard, dst_box = int(nb.shard[b]), box.shift(tuple(nb.lo[b].tolist()))
                p0, p1 = int(blk.src_ptr[r]), int(blk.src_ptr[r + 1])
                srcs = [(int(blk.src[i]), int(ob.shard[blk.src_box[i]]), tuple(ob.lo[blk.src_box[i]].tolist()))
                        for i in range(p0, p1)]
                n, rotation, is_local = p1 - p0, int(blk.rotation[r]), bool(blk.local[r])
                shifted: dict[int, Box] = {}
                for name, size, rot in members:
                    h = (rot + rotation) % n
                    src, src_shard, src_origin = srcs[h]
                    if process != src and process != dst:
                        continue
                    src_box = shifted.get(h)
                    if src_box is None:
                        src_box = shifted[h] = box.shift(src_origin)
                    t = Transfer(src, dst, name, src_shard, src_box, dst_shard, dst_box, box.numel * size)
                    if is_local:
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
    old_proc, new_proc = _process_array(old.rank_map), _process_array(new.rank_map)
    node = _vector_node(node_of)
    blocks = []
    rows_src, rows_dst, rows_n, rows_res, rows_vol = [], [], [], [], []
    for ov in ovs:
        rc = ov.route
        ob, nb = old.class_boxes(rc.old_class), new.class_boxes(rc.new_class)
        max_count = max((count for _, count in rc.itemsize_counts), default=0)
        blk = class_regions(ov, ob, nb, old_proc, new_proc, node, max_count, old.states[rc.states[0]].name)
        blocks.append(blk)
        sel = np.flatnonzero(blk.sends)
        region = blk.src_region[sel]
        rows_src.append(blk.src[sel])
        rows_dst.append(blk.dst[region])
        rows_n.append(blk.n[sel])
        rows_res.append(blk.residue[sel])
        rows_vol.append(ov.volume[blk.overlap[region]])
    cat = (lambda xs: np.concatenate(xs)) if ovs else (lambda xs: np.zeros(0, np.int64))
    wide = lambda xs: cat(xs).astype(np.int64, copy=False)  # process ids: pair_index multiplies them
    pair_src, pair_dst, inverse = pair_index(wide(rows_src), wide(rows_dst))
    span = np.concatenate([[0], np.cumsum([len(x) for x in rows_src])]).astype(np.int64)
    return RouteTable(old, new, classes, tuple(ovs), tuple(blocks), pair_src, pair_dst, inverse,
                      _narrow(cat(rows_n)), _narrow(cat(rows_res)), wide(rows_vol), span)


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
