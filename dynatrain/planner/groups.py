"""Phases of a switch: the order in which it walks the states, and where it cuts that walk.

A state is one tensor per rank, allocated whole at its first piece and freed whole after its last, so while
a state is half-moved a rank holds both its old and its new tensor. If every pair streamed through all
states at once, a rank could allocate many destinations before any source is freed and overshoot
max(sources, destinations) by far more than one state. So a switch runs in phases: a phase moves one group
of states completely (its own rounds) before the next begins, and a group doubles at most ``limit`` bytes on
any rank, min(old, new) of its states; a state bigger than that is a group alone.

A state a rank *keeps in place* doubles nothing there: the rank holds the same boxes at the same offsets of a
local tensor of the same shape, which they fill, so the engine adopts the old tensor as the new one before the
first round (`run_transition`'s ``keep_in_place``, on by default) and never allocates a second. Counting it would
cut a switch that changes a fifth of the bytes into as many phases as one that changes them all (FSDP's and
column-parallel TP's shards of a weight are the same rows), each phase a round of its own, the wire idle between.

Order: states that shrink in total first, then the others, model order within each. On a rank whose
states shrink and grow in that order, the live bytes between phases never exceed max(sources, destinations)
(the prefix sums of new - old fall, then rise), so the peak is that plus the group in flight plus staging.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dynatrain.planner.pair_bytes import sum_by
from dynatrain.vps.class_shards import ClassShards
from dynatrain.vps.layout import Layout


def positions(layout: Layout, processes: list[int]) -> np.ndarray:
    """Each process's position in ``layout``; -1 where it holds none."""
    at = layout.position_of
    return np.array([-1 if (q := at(p)) is None else q for p in processes], dtype=np.int64)


def _local_numel(layout: Layout, pos: np.ndarray) -> list[np.ndarray]:
    """Per class of ``layout``: the local element count of each process (at position ``pos``; -1: none, 0
    elements), from the class's box arrays (which routing builds anyway), not from one Python call per position and
    class."""
    held = pos >= 0
    at = np.where(held, pos, 0)
    out = []
    for c in range(len(layout.classes)):
        boxes = layout.class_boxes(c)
        per_pos = np.zeros(layout.world_size, dtype=np.int64)
        np.add.at(per_pos, boxes.position, np.prod(boxes.hi - boxes.lo, axis=1))
        out.append(np.where(held, per_pos[at], 0))
    return out


def kept_in_place(old: ClassShards, new: ClassShards, q_old: np.ndarray, q_new: np.ndarray) -> np.ndarray:
    """Per process (at old position ``q_old``, new position ``q_new``; -1: none): whether it keeps a state of these
    classes in place, holding the same boxes in the same order at the same offsets of a same-shaped local tensor
    that they fill. Every element it needs is then its own (a local region), so no byte of it moves."""
    held = (q_old >= 0) & (q_new >= 0)
    a, b = np.where(held, q_old, 0), np.where(held, q_new, 0)
    count = np.diff(old.ptr)[a]
    # A process with no box of the state keeps nothing (it moves nothing either): under pp most hold none of a layer.
    cand = np.flatnonzero(held & (count > 0) & (count == np.diff(new.ptr)[b]))
    cand = cand[(old.local_shape[a[cand]] == new.local_shape[b[cand]]).all(axis=1)]
    same = np.zeros(len(q_old), dtype=bool)
    if not len(cand):
        return same
    counts = count[cand]
    owner = np.repeat(np.arange(len(cand)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    i_old, i_new = old.ptr[a[cand]][owner] + within, new.ptr[b[cand]][owner] + within
    differ = ~((old.lo[i_old] == new.lo[i_new]).all(axis=1) & (old.hi[i_old] == new.hi[i_new]).all(axis=1)
               & (old.offsets[i_old] == new.offsets[i_new]).all(axis=1))
    volume = sum_by(owner, np.prod(old.hi[i_old] - old.lo[i_old], axis=1), len(cand))
    fills = volume == np.prod(old.local_shape[a[cand]], axis=1)
    same[cand] = (sum_by(owner, differ.astype(np.int64), len(cand)) == 0) & fills
    return same


def state_groups(old: Layout, new: Layout, limit: int) -> tuple[tuple[int, ...], ...]:
    """State indices in phases. Every rank derives the same groups from the same layouts."""
    old.same_states(new)
    processes = sorted(set(old.processes) | set(new.processes))
    q_old, q_new = positions(old, processes), positions(new, processes)
    old_n, new_n = _local_numel(old, q_old), _local_numel(new, q_new)
    size = [s.itemsize for s in old.states]
    old_c, new_c = old.state_class, new.state_class
    # A state shrinks when its class's elements do: the itemsize scales both sides alike.
    old_total, new_total = [int(n.sum()) for n in old_n], [int(n.sum()) for n in new_n]
    order = sorted(range(len(size)), key=lambda i: (int(new_total[new_c[i]] > old_total[old_c[i]]), i))
    # (old class, new class, itemsize) -> the bytes each process doubles while such a state moves: none where it
    # keeps the state in place. Made once per key: at 16,384 processes a 405B model has 3,400 states but a handful
    # of keys, and one vector per state would take a GiB.
    doubles: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    moves: dict[tuple[int, int], np.ndarray] = {}  # (old class, new class) -> per process: False where kept

    def doubled(key: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        if key not in doubles:
            pair = key[:2]
            if pair not in moves:
                moves[pair] = ~kept_in_place(old.class_arrays(pair[0]), new.class_arrays(pair[1]), q_old, q_new)
            doubles[key] = (old_n[key[0]] * key[2] * moves[pair], new_n[key[1]] * key[2] * moves[pair])
        return doubles[key]

    keys = [(old_c[i], new_c[i], size[i]) for i in order]
    count = Counter(keys)
    all_src = sum(doubled(key)[0] * n for key, n in count.items())
    all_dst = sum(doubled(key)[1] * n for key, n in count.items())
    if np.minimum(all_src, all_dst).max(initial=0) <= limit:
        # The sums below only grow, so no prefix exceeds the limit when the whole does: one phase.
        return (tuple(order),) if order else ()
    groups: list[tuple[int, ...]] = []
    members: list[int] = []
    in_src = np.zeros(len(processes), dtype=np.int64)
    in_dst = np.zeros(len(processes), dtype=np.int64)
    for i, key in zip(order, keys):
        src, dst = doubled(key)
        grown_src, grown_dst = in_src + src, in_dst + dst
        if members and np.minimum(grown_src, grown_dst).max(initial=0) > limit:
            groups.append(tuple(members))
            members, grown_src, grown_dst = [], src, dst
        members.append(i)
        in_src, in_dst = grown_src, grown_dst
    if members:
        groups.append(tuple(members))
    return tuple(groups)
