"""Rounds: the byte count of every ordered pair, scheduled under a staging budget.

Only byte counts are scheduled here (global, integers only, so every rank computes the same rounds). Each pair's
bytes form one *stream*; a round gives a pair one contiguous slice of it (`Slices`: a round's messages as arrays).

Per round, pairs are taken busiest rank first; among equals the pair furthest behind in its stream (fraction done,
in 1/1024ths), then by ids. Pass 1 gives each pair at most a fair share of its busier end's budget (the budget over
that end's active pairs), so a rank sends and receives in the same round; pass 2 hands out the room that is left.
A rank's fair shares add up to at most the budget, so pass 1 never runs out of room unless one element is bigger
than a fair share: then, and for pass 2, the pairs are walked one by one in order, since the room each gets depends
on those before it. Pass 1 is computed for all pairs at once otherwise, which is what keeps millions of pairs cheap.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from dynatrain.planner.pair_bytes import PairBytes, sum_by

Slice = tuple[int, int, int, int]  # (src, dst, stream offset, bytes)
MAX_ROUNDS = 100_000  # beyond this a budget is a typo (bytes for MiB), not a plan anyone wants to run


class Slices(Sequence):
    """One round's messages as (src, dst, stream offset, bytes), ascending by pair; it compares, hashes and prints
    like the tuple of those 4-tuples."""

    __slots__ = ("src", "dst", "offset", "nbytes")

    def __init__(self, src, dst, offset, nbytes) -> None:
        self.src = np.asarray(src, dtype=np.int64)
        self.dst = np.asarray(dst, dtype=np.int64)
        self.offset = np.asarray(offset, dtype=np.int64)
        self.nbytes = np.asarray(nbytes, dtype=np.int64)

    @classmethod
    def empty(cls) -> "Slices":
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        return (int(self.src[i]), int(self.dst[i]), int(self.offset[i]), int(self.nbytes[i]))

    def __iter__(self) -> Iterator[Slice]:
        return zip(self.src.tolist(), self.dst.tolist(), self.offset.tolist(), self.nbytes.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, Slices):
            return all(np.array_equal(a, b) for a, b in ((self.src, other.src), (self.dst, other.dst),
                                                          (self.offset, other.offset), (self.nbytes, other.nbytes)))
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def min_budget(pair_bytes: Mapping) -> int:
    """The smallest budget that works: one element of the widest dtype that moves (1 when nothing moves)."""
    if isinstance(pair_bytes, PairBytes):
        moving = pair_bytes.sizes[(pair_bytes.nbytes > 0).any(axis=0)] if len(pair_bytes) else pair_bytes.sizes[:0]
        return int(moving.max(initial=1))
    return max((size for segs in pair_bytes.values() for size, b in segs if b), default=1)


def _check(pb: PairBytes) -> None:
    sizes = pb.sizes[None, :]
    bad_mod = pb.nbytes % np.maximum(sizes, 1) != 0
    bad_pow = ((sizes & (sizes - 1)) != 0) & (pb.nbytes > 0)
    bad = bad_mod | bad_pow
    if bad.any():
        i, j = (int(x[0]) for x in np.nonzero(bad))
        pair, size, b = (int(pb.src[i]), int(pb.dst[i])), int(pb.sizes[j]), int(pb.nbytes[i, j])
        if bad_mod[i, j]:
            raise ValueError(f"pair {pair}: {b} bytes of itemsize {size} is not a whole number of elements")
        raise ValueError(f"itemsize {size} is not a power of two")


def _snap(ends: np.ndarray, sizes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per row, the largest element boundary <= x in a stream whose itemsize segments end at ``ends`` (rows of
    non-decreasing offsets, itemsizes ``sizes`` descending)."""
    j = (ends <= x[:, None]).sum(axis=1)
    full = j == ends.shape[1]
    jj = np.minimum(j, ends.shape[1] - 1)
    rows = np.arange(len(x))
    start = np.where(j > 0, ends[rows, np.maximum(j - 1, 0)], 0)
    size = sizes[jj]
    return np.where(full, ends[:, -1], start + (x - start) // size * size)


def _snap_one(ends: list[int], sizes: list[int], x: int) -> int:
    start = 0
    for end, size in zip(ends, sizes):
        if x < end:
            return start + (x - start) // size * size
        start = end
    return start


def _walk(order, si, di, ends, sizes, offset, total, room, cap) -> None:
    """Give the pairs of ``order`` in turn what both ends still have room for (at most ``cap[c]`` for the c-th
    when given), updating ``offset`` and ``room`` in place."""
    size_l = sizes.tolist()
    for c, i in enumerate(order.tolist()):
        s, d = si[i], di[i]
        want = min(room[s], room[d], total[i] - offset[i])
        if cap is not None:
            want = min(want, cap[c])
        if want <= 0:
            continue
        n = _snap_one(ends[i].tolist(), size_l, offset[i] + want) - offset[i]
        if n <= 0:
            continue
        offset[i] += n
        room[s] -= n
        room[d] -= n


def schedule_arrays(pb: PairBytes, budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rounds as (pair rows of ``pb`` ascending, stream offsets, bytes) such that no rank's sent + received bytes
    in a round exceed ``budget``."""
    need = min_budget(pb)
    if budget < need:
        raise ValueError(
            f"a staging budget of {budget} bytes is smaller than the largest indivisible piece "
            f"(one element of {need} bytes): give a budget of at least {need} bytes"
        )
    _check(pb)
    total = pb.total
    ranks, inverse = np.unique(np.concatenate([pb.src, pb.dst]), return_inverse=True)
    inverse = inverse.reshape(-1)
    si, di = inverse[:len(pb)], inverse[len(pb):]
    load = sum_by(si, total, len(ranks)) + sum_by(di, total, len(ranks))
    busiest = int(load.max(initial=0))
    if -(-busiest // budget) > MAX_ROUNDS:
        raise ValueError(
            f"a staging budget of {budget} bytes needs at least {-(-busiest // budget)} rounds for a rank that "
            f"moves {busiest} bytes; give a budget of at least {-(-busiest // MAX_ROUNDS)} bytes"
        )
    ends = np.cumsum(pb.nbytes, axis=1)
    offset = np.zeros(len(pb), dtype=np.int64)
    active = np.flatnonzero(total > 0)
    rounds = []
    while len(active):
        # Busiest rank first; among equals the pair furthest behind in its stream (in 1/1024ths), then ids
        # (``active`` is ascending and the sort stable), so a rank's streams walk through the states together.
        busy = np.maximum(load[si[active]], load[di[active]])
        act = active[np.lexsort(((offset[active] << 10) // total[active], -busy))]
        s_act, d_act = si[act], di[act]
        degree = np.bincount(s_act, minlength=len(ranks)) + np.bincount(d_act, minlength=len(ranks))
        start = offset[act].copy()
        fair = np.maximum(need, budget // np.maximum(degree[s_act], degree[d_act]))
        if need <= budget // int(degree.max()):
            # Every fair share at a rank is at most budget // its degree: the room never runs out in this pass.
            want = np.minimum(fair, total[act] - start)
            offset[act] = np.maximum(_snap(ends[act], pb.sizes, start + want), start)
            taken = offset[act] - start
            room = (budget - np.bincount(s_act, weights=taken, minlength=len(ranks))
                    - np.bincount(d_act, weights=taken, minlength=len(ranks))).astype(np.int64).tolist()
        else:
            room = [budget] * len(ranks)
            off_l = offset.tolist()
            _walk(act, si.tolist(), di.tolist(), ends, pb.sizes, off_l, total.tolist(), room, fair.tolist())
            offset = np.array(off_l, dtype=np.int64)
        left = np.flatnonzero(offset[act] < total[act])
        room_a = np.array(room, dtype=np.int64)
        left = left[(room_a[s_act[left]] > 0) & (room_a[d_act[left]] > 0)]
        if len(left):
            idx = act[left]
            off_l = dict(zip(idx.tolist(), offset[idx].tolist()))
            _walk(idx, si.tolist(), di.tolist(), ends, pb.sizes, off_l, dict(zip(idx.tolist(), total[idx].tolist())),
                  room, None)
            offset[idx] = np.fromiter((off_l[i] for i in idx.tolist()), dtype=np.int64, count=len(idx))
        taken = offset[act] - start
        load -= sum_by(s_act, taken, len(ranks)) + sum_by(d_act, taken, len(ranks))
        moved = np.flatnonzero(taken > 0)
        order = np.argsort(act[moved], kind="stable")
        rows = act[moved][order]
        rounds.append((rows, start[moved][order], taken[moved][order]))
        active = np.sort(act[offset[act] < total[act]])
    return rounds


def schedule_pairs(pair_bytes: Mapping, budget: int) -> tuple[tuple[Slice, ...], ...]:
    """Rounds of (src, dst, stream offset, bytes) slices such that no rank's sent + received bytes in a round
    exceed ``budget``; ``pair_bytes``: (src, dst) -> ((itemsize, bytes), ...), itemsize descending."""
    pb = PairBytes.from_dict(pair_bytes)
    return tuple(tuple(zip(pb.src[rows].tolist(), pb.dst[rows].tolist(), off.tolist(), n.tolist()))
                 for rows, off, n in schedule_arrays(pb, budget))


def staging_share(budget_bytes: int) -> int:
    """Half the budget stages a round's messages; the other half holds the phase in flight."""
    return (budget_bytes + 1) // 2


def schedule_groups(table, groups: tuple[tuple[int, ...], ...], budget_bytes: int):
    """Rounds for the phases one after another: (traffic as `Slices` per round, rounds [start, end) of each phase).

    A phase with nothing on the wire still gets one round, where its local copies run. Stream offsets run on
    across phases, so a pair's stream is its phases' streams back to back (the rank plan sorts by phase).
    """
    staging = staging_share(budget_bytes)
    everything = table.pair_bytes
    need = min_budget(everything)
    if staging < need:
        raise ValueError(
            f"a switch budget of {budget_bytes} bytes leaves {staging} bytes to stage a round, less than the "
            f"largest indivisible piece (one element of {need} bytes): give a budget of at least {2 * need - 1} bytes"
        )
    total = everything.total
    ranks, inverse = np.unique(np.concatenate([everything.src, everything.dst]), return_inverse=True)
    inverse = inverse.reshape(-1)
    load = sum_by(inverse[:len(total)], total, len(ranks)) + sum_by(inverse[len(total):], total, len(ranks))
    busiest = int(load.max(initial=0))
    if -(-busiest // staging) + len(groups) > MAX_ROUNDS:
        raise ValueError(
            f"a switch budget of {budget_bytes} bytes needs more than {MAX_ROUNDS} rounds for a rank that moves "
            f"{busiest} bytes; give a budget of at least {2 * -(-busiest // (MAX_ROUNDS - len(groups)))} bytes"
        )
    traffic: list[Slices] = []
    spans = []
    base = np.zeros(len(table.pair_src), dtype=np.int64)
    for members in groups:
        pb = everything if len(groups) == 1 else table.group_pair_bytes(members)
        start = len(traffic)
        if len(pb):
            for rows, off, n in schedule_arrays(pb, staging):
                traffic.append(Slices(pb.src[rows], pb.dst[rows], base[pb.pair_id[rows]] + off, n))
            base[pb.pair_id] += pb.total
        if len(traffic) == start:
            traffic.append(Slices.empty())
        spans.append((start, len(traffic)))
    return tuple(traffic), tuple(spans)
