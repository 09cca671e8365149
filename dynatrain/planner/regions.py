"""The regions of a route table as arrays, one block per route class.

A region is the box where one new box of a route class meets one old box, for one destination shard that needs
it. `route_table` used to walk every (region, replica holder) in Python; at 16,384 ranks that is millions of
iterations. Here each route class is expanded with numpy: regions in the order the walk visited them (overlap,
then destination box in layout order), their sources as a CSR, and per (region, source) the rotation residue that
decides which of the class's states that source sends. Nothing here depends on hashing, so every rank builds the
same arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynatrain.vps.box import Box
from dynatrain.vps.layout import ClassBoxes


@dataclass(frozen=True, eq=False)
class ClassRegions:
    """One route class's regions. Region ``r`` is the box of overlap ``overlap[r]`` for new box ``new_box[r]``
    (destination shard and origin), needed by process ``dst[r]``; a local region's only source is ``dst[r]``
    itself. Its sources are rows ``src_ptr[r]:src_ptr[r+1]``, ascending by process: process ``src``, old box
    ``src_box`` (shard and origin). A non-local region with ``n`` sources sends a state of rotation index ``i``
    from its source ``h`` where ``(i + rotation) % n == h``, i.e. ``i % n == residue`` of that source row."""

    overlap: np.ndarray
    new_box: np.ndarray
    dst: np.ndarray
    rotation: np.ndarray  # the destination's position; 0 for a local region
    local: np.ndarray
    src_ptr: np.ndarray
    src: np.ndarray
    src_box: np.ndarray
    residue: np.ndarray
    n: np.ndarray  # per source row: sources of its region
    sends: np.ndarray  # per source row: it sends at least one state (never for a local region)

    @property
    def src_region(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.dst)), np.diff(self.src_ptr))


def expand_csr(ptr: np.ndarray, ind: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each entry of ``which`` (a CSR row), repeat it per member: (entry index, member)."""
    counts = ptr[which + 1] - ptr[which]
    total = int(counts.sum())
    rep = np.repeat(np.arange(len(which)), counts)
    starts = np.repeat(ptr[which] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return rep, ind[starts + np.arange(total)]


def class_regions(
    ov, ob: ClassBoxes, nb: ClassBoxes, old_proc: np.ndarray, new_proc: np.ndarray,
    node: Callable[[np.ndarray], np.ndarray] | None, max_count: int, name: str,
) -> ClassRegions:
    """Bind one class's overlaps ``ov`` to processes (``old_proc``/``new_proc``: process per position, -1 where
    vacant); ``node`` maps process arrays to nodes (replicas on the destination's node are preferred);
    ``max_count``: most states of one itemsize in the class; ``name``: a state of the class, for errors. Raises
    the error the walk in region order would meet first."""
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
    # The destination holds the old box itself: one holder row (k, dst) at most.
    top = int(max(hproc.max(initial=0), dst.max(initial=0))) + 1
    hkey = hk * top + hproc
    at = np.searchsorted(hkey, k * top + dst)
    at_c = np.minimum(at, max(len(hkey) - 1, 0))
    local = (dst >= 0) & (at < len(hkey)) & (hkey[at_c] == k * top + dst) if len(hkey) else np.zeros(len(dst), bool)

    vacant = np.flatnonzero(dst < 0)
    orphan = np.flatnonzero(~local & (nh == 0) & (dst >= 0))
    if len(vacant) or len(orphan):
        first_v = int(vacant[0]) if len(vacant) else len(dst)
        first_o = int(orphan[0]) if len(orphan) else len(dst)
        if first_v <= first_o:
            raise ValueError(f"new layout position {int(q[first_v])} has no process: give every new position "
                             "a process")
        else:
            x = int(rx[first_o])
            box = Box._trusted(tuple(ov.lo[x].tolist()), tuple(ov.hi[x].tolist()))
            raise ValueError(f"state {name!r}: box {box} was held only by lost processes; restore it from a "
                             "snapshot, the switch cannot rebuild it")

    remote = np.flatnonzero(~local)
    rep, hrow = expand_csr(hptr, np.arange(len(hk)), k[remote])
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
    first = np.concatenate([[0], np.cumsum(n_remote)[:-1]])
    h = np.arange(len(rep)) - first[rep]
    row_of[src_ptr[remote][rep] + h] = hrow
    residue = np.zeros(total, dtype=np.int64)
    n = np.ones(total, dtype=np.int64)
    n_of = n_remote[rep]
    residue[src_ptr[remote][rep] + h] = (h - q[remote][rep]) % np.maximum(n_of, 1)
    n[src_ptr[remote][rep] + h] = n_of
    sends = np.zeros(total, dtype=bool)
    sends[src_ptr[remote][rep] + h] = residue[src_ptr[remote][rep] + h] < max_count
    rotation = np.where(local, 0, q)
    return ClassRegions(rx, rb, dst, rotation, local, src_ptr, hproc[row_of], hbox[row_of], residue, n, sends)
