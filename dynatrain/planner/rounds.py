"""Rounds: the byte count of every ordered pair, scheduled under a staging budget.

Only byte counts are scheduled here (global, integers only, so every rank computes the same rounds). Each pair's
bytes form one *stream*; a round gives a pair one contiguous slice of it (`Slices`: a round's messages as arrays).

Pass 1 gives every pair the same fraction of what it has left: budget / (the busiest rank's sent + received bytes
left), rounded down to whole elements. A rank's shares then add up to at most the budget, the busiest rank fills
it, and every rank sends and receives in the same proportion in every round. A round lasts as long as its most
loaded link, so the rounds together take what the busiest link carries in all, the least any schedule can, in
ceil(busiest / budget) rounds or one more. Handing the room left over to whichever pair comes first would let one
rank fill a round with sends and the next with receives, and the rounds would add up to twice that.

Pass 2 walks pairs one by one, busiest rank first, then the pair furthest behind in its stream (in 1/1024ths), then
by ids, and gives back what rounding down took where that is a noticeable part of a share (one under 64 of the
widest elements), at most a sixteenth more than the share. When pass 1 moved nothing (a budget of a few elements)
it walks every pair and hands out the whole room, so every round moves at least one element. Pass 1 is computed
for all pairs at once and pass 2 visits only small shares, which is what keeps millions of pairs cheap.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from dynatrain.planner.pair_bytes import PairBytes, dense_ids, sum_by

Slice = tuple[int, int, int, int]  # (src, dst, stream offset, bytes)
MAX_ROUNDS = 100_000  # beyond this a budget is a typo (bytes for MiB), not a plan anyone wants to run
_EXACT_PRODUCT = 2 ** 63  # bytes x budget below this is exact in int64
_FINE = 64  # a share under this many of the widest elements loses a noticeable part of itself to rounding down


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
    whole = pb.sizes - 1  # with power-of-two itemsizes, a count of whole elements has none of these bits set
    if (pb.sizes > 0).all() and not (pb.sizes & whole).any() and not (pb.nbytes & whole).any():
        return
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
    """Give the pairs of ``order`` in turn what both ends still have room for (at most ``cap[c]`` more for the c-th
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


def _rank_load(pb: PairBytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each pair's sender and receiver as ids below n (`dense_ids`), each such id's bytes sent plus received)."""
    n, (si, di) = dense_ids(pb.src, pb.dst)
    total = pb.total
    return si, di, sum_by(si, total, n) + sum_by(di, total, n)


def schedule_arrays(pb: PairBytes, budget: int, rank_load=None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rounds as (pair rows of ``pb`` ascending, stream offsets, bytes) such that no rank's sent + received bytes
    in a round exceed ``budget``; ``rank_load``: `_rank_load(pb)` when the caller has it (this consumes it)."""
    need = min_budget(pb)
    if budget < need:
        raise ValueError(
            f"a staging budget of {budget} bytes is smaller than the largest indivisible piece "
            f"(one element of {need} bytes): give a budget of at least {need} bytes"
        )
    _check(pb)
    total = pb.total
    si, di, load = rank_load or _rank_load(pb)
    n_ranks = len(load)
    busiest = int(load.max(initial=0))
    if -(-busiest // budget) > MAX_ROUNDS:
        raise ValueError(
            f"a staging budget of {budget} bytes needs at least {-(-busiest // budget)} rounds for a rank that "
            f"moves {busiest} bytes; give a budget of at least {-(-busiest // MAX_ROUNDS)} bytes"
        )
    if busiest <= budget:
        # One round carries everything: what the passes below would give every pair (all it has) without them.
        active = np.flatnonzero(total > 0)
        return [(active, np.zeros(len(active), dtype=np.int64), total[active])] if len(active) else []
    ends = np.cumsum(pb.nbytes, axis=1)
    offset = np.zeros(len(pb), dtype=np.int64)
    active = np.flatnonzero(total > 0)
    rounds = []
    while len(active):
        # Busiest rank first; among equals the pair furthest behind in its stream (in 1/1024ths), then ids
        # (``active`` is ascending and the sort stable): the order in which pass 2 hands out what is left.
        busy = np.maximum(load[si[active]], load[di[active]])
        act = active[np.lexsort(((offset[active] << 10) // total[active], -busy))]
        s_act, d_act = si[act], di[act]
        start = offset[act].copy()
        share = _shares(total[act] - start, budget, int(load.max()))
        offset[act] = np.maximum(_snap(ends[act], pb.sizes, start + share), start)
        taken = offset[act] - start
        room = (budget - sum_by(s_act, taken, n_ranks) - sum_by(d_act, taken, n_ranks)).tolist()
        left = np.flatnonzero(offset[act] < total[act])
        if taken.any():
            # Only where rounding down to whole elements took a noticeable part of the share (it is under 64 of
            # the widest elements): at 16,384 ranks the walk would otherwise visit every pair of every round.
            left = left[share[left] < _FINE * need]
        room_a = np.array(room, dtype=np.int64)
        left = left[(room_a[s_act[left]] > 0) & (room_a[d_act[left]] > 0)]
        if len(left):
            idx = act[left]
            # Give back what rounding down took, at most a sixteenth more than the share: enough to fill a budget of a
            # few elements, too little to unbalance a round. Anything when pass 1 moved nothing.
            cap = None if not taken.any() else np.maximum(2 * need, share[left] // 16).tolist()
            off_l = dict(zip(idx.tolist(), offset[idx].tolist()))
            _walk(idx, si.tolist(), di.tolist(), ends, pb.sizes, off_l, dict(zip(idx.tolist(), total[idx].tolist())),
                  room, cap)
            offset[idx] = np.fromiter((off_l[i] for i in idx.tolist()), dtype=np.int64, count=len(idx))
        taken = offset[act] - start
        load -= sum_by(s_act, taken, n_ranks) + sum_by(d_act, taken, n_ranks)
        moved = np.flatnonzero(taken > 0)
        order = np.argsort(act[moved], kind="stable")
        rows = act[moved][order]
        rounds.append((rows, start[moved][order], taken[moved][order]))
        active = np.sort(act[offset[act] < total[act]])
    return rounds


def _shares(left: np.ndarray, budget: int, top: int) -> np.ndarray:
    """Each pair's bytes for this round, before snapping: its bytes left times budget / ``top`` (the busiest rank's
    load left), rounded down, so every rank's shares add up to at most the budget and every rank moves the same
    fraction of what it has left in each direction. All of it once the busiest rank's load fits."""
    if top <= budget:
        return left
    if int(left.max(initial=0)) < _EXACT_PRODUCT // budget:
        return left * budget // top
    # Past int64: float64, scaled down by far more than its rounding error, so no share is ever rounded up.
    return np.floor(left * (budget / top * (1.0 - 2.0 ** -30))).astype(np.int64)


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
    load = _rank_load(everything)
    busiest = int(load[2].max(initial=0))
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
            for rows, off, n in schedule_arrays(pb, staging, load if pb is everything else None):
                if len(rows) == len(pb):  # every pair (rows ascend): its arrays as they are, not a copy of each
                    rows = slice(None)
                traffic.append(Slices(pb.src[rows], pb.dst[rows], base[pb.pair_id[rows]] + off, n))
            base[pb.pair_id] += pb.total
        if len(traffic) == start:
            traffic.append(Slices.empty())
        spans.append((start, len(traffic)))
    return tuple(traffic), tuple(spans)
