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
    """Per class of ``layout``: the local element count of each process (0 where it holds no position)."""
    pos = np.array([-1 if layout.position_of(p) is None else layout.position_of(p) for p in processes])
    held = pos >= 0
    out = []
    for shards in layout.classes:
        per_pos = np.array([h.numel for h in shards], dtype=np.int64)
        out.append(np.where(held, per_pos[np.where(held, pos, 0)], 0))
    return out


def state_groups(old: Layout, new: Layout, limit: int) -> tuple[tuple[int, ...], ...]:
    """State indices in phases. Every rank derives the same groups from the same layouts."""
    old.same_states(new)
    processes = sorted(set(old.processes) | set(new.processes))
    old_n, new_n = _local_numel(old, processes), _local_numel(new, processes)
    size = [s.itemsize for s in old.states]
    src = [old_n[c] * size[i] for i, c in enumerate(old.state_class)]
    dst = [new_n[c] * size[i] for i, c in enumerate(new.state_class)]
    order = sorted(range(len(size)), key=lambda i: (int(dst[i].sum() > src[i].sum()), i))
    groups: list[tuple[int, ...]] = []
    members: list[int] = []
    in_src = np.zeros(len(processes), dtype=np.int64)
    in_dst = np.zeros(len(processes), dtype=np.int64)
    for i in order:
        grown_src, grown_dst = in_src + src[i], in_dst + dst[i]
        if members and np.minimum(grown_src, grown_dst).max(initial=0) > limit:
            groups.append(tuple(members))
            members, grown_src, grown_dst = [], src[i].copy(), dst[i].copy()
        members.append(i)
        in_src, in_dst = grown_src, grown_dst
    if members:
        groups.append(tuple(members))
    return tuple(groups)
