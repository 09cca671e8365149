"""A rank's local copies: which states it keeps in place (its old local tensor is its new one, no copy), and the
order a round's copies run in, so that memory is handed back before more is taken."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dynatrain.engine.checks import tensor_bytes
from dynatrain.engine.wire import local_box
from dynatrain.planner.routing import Transfer
from dynatrain.planner.schedule import SwitchPlan


def states_kept_in_place(plan: SwitchPlan, rank: int) -> set[str]:
    """The states whose new local tensor on process ``rank`` is its old one: the same shape, and every element it
    holds a local copy onto the same local coordinates (nothing received). The engine adopts those sources as
    their destinations instead of copying them."""
    rp = plan.rank_plan(rank)
    received = {t.state for ms in rp.recvs for m in ms for t in m.pieces}
    copies: dict[str, list[Transfer]] = {}
    for ts in rp.local_copies:
        for t in ts:
            copies.setdefault(t.state, []).append(t)
    out = set()
    for name, ts in copies.items():
        if name in received:
            continue
        s_sh, d_sh = plan.old.shards(name, rank), plan.new.shards(name, rank)
        if tuple(s_sh.local_shape) != tuple(d_sh.local_shape):
            continue
        if all(local_box(s_sh.offsets[t.src_shard], t.src_box) == local_box(d_sh.offsets[t.dst_shard], t.dst_box)
               for t in ts) and sum(t.dst_box.numel for t in ts) == math.prod(s_sh.local_shape):
            out.add(name)
    return out


def copy_order(copies: list[Transfer], kept: set[str], uses: Mapping[str, int], src: Mapping[str, torch.Tensor],
               dst: Mapping[str, torch.Tensor], dst_spec: Mapping) -> list[Transfer]:
    """The round's local copies grouped by state, states that free more than they allocate first, so a
    shrinking state never waits behind a growing one (the peak of a local-only switch is then at most the
    sources plus one destination tensor)."""
    groups: dict[str, list[Transfer]] = {}
    for t in copies:
        if t.state not in kept:  # kept states were adopted in place before round 0
            groups.setdefault(t.state, []).append(t)

    def net(name: str) -> int:
        grow = 0 if name in dst else tensor_bytes(*dst_spec[name])
        s = src.get(name)
        free = s.numel() * s.element_size() if s is not None and uses[name] == len(groups[name]) else 0
        return grow - free

    order = sorted(groups, key=net)
    return [t for name in order for t in groups[name]]
