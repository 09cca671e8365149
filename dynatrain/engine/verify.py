"""Bitwise check of a switch: one checksum per state, invariant to how the state is partitioned.

Every element contributes a hash of (its bits, its global flat index); the sum over ranks of their boxes is
the same for any layout, up to the replication factor (dp_replicate copies, TP-replicated norms), which the
layout knows. Old and new sums are compared after one all-reduce; int64 arithmetic wraps, so the comparison
is exact modulo 2**64.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from dynatrain.vps.layout import Layout

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64


class SwitchVerificationError(RuntimeError):
    """The state after a switch differs from the state before it."""


def _box_checksum(local: torch.Tensor, lo: tuple[int, ...], hi: tuple[int, ...], shape: tuple[int, ...]) -> int:
    if local.numel() == 0:
        return 0
    bits = local.contiguous().view(_BITS[local.element_size()]).to(torch.int64).flatten()
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = torch.arange(lo[d], hi[d], dtype=torch.int64, device=local.device) * stride
        index = axis.view(-1, *([1] * (len(shape) - 1 - d))) + index
        stride *= shape[d]
    index = index.flatten()
    # Multiply by an odd, index-dependent factor: a value moved to another index changes the sum.
    h = (bits + _MIX) * (index * 2 + 1)
    h = h ^ (h >> 29)
    return int(h.sum().item())


def local_checksums(layout: Layout, process: int, tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """This process's contribution to every state's checksum (0 for what it does not hold)."""
    out = []
    for spec in layout.states:
        shards = layout.shards(spec.name, process)
        total = 0
        if shards is not None and shards.boxes:  # another pipeline stage's state: nothing here
            t = tensors[spec.name]
            for box, off in zip(shards.boxes, shards.offsets):
                view = t[tuple(slice(o, o + n) for o, n in zip(off, box.shape))]
                total += _box_checksum(view, box.lo, box.hi, spec.shape)
        out.append(_wrap(total))
    return out


def replication(layout: Layout) -> list[int]:
    """How many positions hold each element of each state."""
    reps = []
    for i, spec in enumerate(layout.states):
        held = sum(sh.numel for q, sh in enumerate(layout.classes[layout.state_class[i]])
                   if layout.rank_map[q] is not None)
        reps.append(held // spec.numel if spec.numel else 1)
    return reps


def _wrap(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def reduce_sums(sums: list[int], device: torch.device | str = "cpu", group=None) -> list[int]:
    """Sum per-state checksums over the ranks of ``group`` (the whole state's checksums on every rank)."""
    t = torch.tensor([_wrap(x) for x in sums], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def differing(old: Layout, old_totals: list[int], new: Layout, new_totals: list[int]) -> list[str]:
    """Names of the states whose whole-state checksums differ, replication factors taken out."""
    ra, rb = replication(old), replication(new)
    return [
        spec.name
        for spec, x, y, p, q in zip(old.states, old_totals, new_totals, ra, rb)
        if _wrap(x * q) != _wrap(y * p)
    ]


def compare(
    old: Layout, old_sums: list[int], new: Layout, new_sums: list[int], device: torch.device | str = "cpu",
    group=None,
) -> list[str]:
    """All-reduce both checksum vectors and return the names of the states that differ (empty: bitwise equal)."""
    both = reduce_sums([*old_sums, *new_sums], device, group)
    n = len(old_sums)
    return differing(old, both[:n], new, both[n:])
