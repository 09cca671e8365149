"""Phases of a switch: the order in which it walks the states, and where it cuts that walk.

A state is one tensor per rank, allocated whole at its first piece and freed whole after its last, so while
a state is half-moved a rank holds both its old and its new tensor. If every pair streamed through all
states at once, a rank could allocate many destinations before any source is freed and overshoot
max(sources, destinations) by far more than one state. So a switch runs in phases: a phase moves one group
of states completely (its own rounds) before the next begins, and a group doubles at most ``limit`` bytes on
any rank, min(old, new) of its states; a state bigger than that is a group alone.

Order: states that shrink in total first, then the others, model order within each. On a rank whose
states shrink and grow in that order, the live bytes between phases never exceed max(sources, destinations)
(the prefix sums of new - old fall, then rise), so the peak is that plus the group in flight plus staging.
"""

from __future__ import annotations

import numpy as np

from dynatrain.vps.layout import Layout


def _local_numel(layout: Layout, processes: list[int]) -> list[np.ndarray]:
    """Per class of ``layout``: the local element count of each process (0 where it holds no position), from the
    class's box arrays (which routing builds anyway), not from one Python call per position and class."""
    pos = np.array([-1 if layout.position_of(p) is None else layout.position_of(p) for p in processes],
                   dtype=np.int64)
    held = pos >= 0
    at = np.where(held, pos, 0)
    out = []
    for c in range(len(layout.classes)):
        boxes = layout.class_boxes(c)
        per_pos = np.zeros(layout.world_size, dtype=np.int64)
        np.add.at(per_pos, boxes.position, np.prod(boxes.hi - boxes.lo, axis=1))
        out.append(np.where(held, per_pos[at], 0))
    return out


def state_groups(old: Layout, new: Layout, limit: int) -> tuple[tuple[int, ...], ...]:
    """State indices in phases. Every rank derives the same groups from the same layouts."""
    old.same_states(new)
    processes = sorted(set(old.processes) | set(new.processes))
    old_n, new_n = _local_numel(old, processes), _local_numel(new, processes)
    size = [s.itemsize for s in old.states]
    old_c, new_c = old.state_class, new.state_class
    # A state shrinks when its class's elements do: the itemsize scales both sides alike.
    old_total, new_total = [int(n.sum()) for n in old_n], [int(n.sum()) for n in new_n]
    order = sorted(range(len(size)), key=lambda i: (int(new_total[new_c[i]] > old_total[old_c[i]]), i))
    groups: list[tuple[int, ...]] = []
    members: list[int] = []
    in_src = np.zeros(len(processes), dtype=np.int64)
    in_dst = np.zeros(len(processes), dtype=np.int64)
    for i in order:
        # Per-state byte vectors are made on the fly: at 16,384 processes keeping them all would take a GiB.
        src, dst = old_n[old_c[i]] * size[i], new_n[new_c[i]] * size[i]
        grown_src, grown_dst = in_src + src, in_dst + dst
        if members and np.minimum(grown_src, grown_dst).max(initial=0) > limit:
            groups.append(tuple(members))
            members, grown_src, grown_dst = [], src, dst
        members.append(i)
        in_src, in_dst = grown_src, grown_dst
    if members:
        groups.append(tuple(members))
    return tuple(groups)
