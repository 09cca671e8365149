"""Which boxes of a state each mesh position holds, as `apply_tp` then `apply_fsdp` place them.

TP shards first: colwise/embedding weights on dim 0, rowwise on dim 1, norms stay whole. FSDP2 then splits
dim 0 of the *TP-local* tensor over dp_shard (dp_shard x cp with context parallelism, whose ranks shard states
as dp_shard ranks do); dp_replicate copies the result. Both splits follow
``torch.chunk``: chunks of ``ceil(n / parts)``, so the last chunks are short or empty when ``parts`` does not
divide ``n`` (DTensor's ``Shard`` and FSDP2 pad the same way and never move data between chunks).

A fused projection concatenates parts that TP splits one by one, so its TP-local tensor is a stack of
non-adjacent global ranges and one FSDP chunk can span several of them: that position holds several boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynatrain.vps.box import Box
from dynatrain.vps.class_shards import ClassShards
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.placement import LocalShards, Shard, Sharding, StridedShard, chunk_bounds


@dataclass(frozen=True)
class ShardRule:
    """How a state of ``shape`` is split. ``tp_dim`` is the dimension TP shards (None: every TP rank holds
    it whole); ``fused`` lists the sizes, along ``tp_dim``, of the parts TP shards separately."""

    shape: tuple[int, ...]
    tp_dim: int | None = None
    fused: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape:
            raise ValueError("a scalar state (such as Adam's step) has no boxes: broadcast it instead of routing it")
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(shape):
            raise ValueError(f"tp_dim={self.tp_dim} is not a dimension of shape {shape}")
        if self.fused is not None:
            fused = tuple(int(p) for p in self.fused)
            object.__setattr__(self, "fused", fused)
            if self.tp_dim is None:
                raise ValueError("fused parts only make sense for a TP-sharded state: give tp_dim")
            if sum(fused) != shape[self.tp_dim] or any(p < 0 for p in fused):
                raise ValueError(
                    f"fused parts {fused} must be non-negative and add up to dim {self.tp_dim} of shape {shape}"
                )


def _tp_ranges(rule: ShardRule, tp: int, t: int) -> list[list[tuple[int, int]]]:
    """Per dimension, the global ranges the TP-local tensor concatenates (in local order)."""
    ranges = [[(0, n)] for n in rule.shape]
    if rule.tp_dim is not None:
        parts = rule.fused or (rule.shape[rule.tp_dim],)
        out, base = [], 0
        for size in parts:
            lo, hi = chunk_bounds(size, tp, t)
            out.append((base + lo, base + hi))
            base += size
        ranges[rule.tp_dim] = out
    return ranges


def _shards_from_ranges(ranges: list[list[tuple[int, int]]], dp_shard: int, s: int) -> LocalShards:
    rows = ranges[0]
    local_rows = sum(hi - lo for lo, hi in rows)
    a, b = chunk_bounds(local_rows, dp_shard, s)
    # Map the FSDP chunk [a, b) of the stacked TP-local rows back to global row ranges.
    picked: list[tuple[int, int, int]] = []  # (global lo, global hi, local row offset)
    pos = 0
    for lo, hi in rows:
        n = hi - lo
        x, y = max(a, pos), min(b, pos + n)
        if x < y:
            picked.append((lo + x - pos, lo + y - pos, x - a))
        pos += n
    local_shape = (b - a,) + tuple(sum(hi - lo for lo, hi in r) for r in ranges[1:])
    others = _other_dims(ranges)
    boxes, offsets = [], []
    for row_lo, row_hi, row_off in picked:
        for l, h, o in others:
            boxes.append(Box._trusted((row_lo,) + l, (row_hi,) + h))
            offsets.append((row_off,) + o)
    return LocalShards(tuple(boxes), tuple(offsets), local_shape)


def _other_dims(ranges: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, ...], ...]]:
    """The dimensions after the first: every combination of their non-empty global ranges, as (lo, hi, offset in
    the local tensor) per dimension."""
    others: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [((), (), ())]
    for dim_ranges in ranges[1:]:
        nxt = []
        col_off = 0
        for lo, hi in dim_ranges:
            if hi > lo:
                nxt += [(l + (lo,), h + (hi,), o + (col_off,)) for l, h, o in others]
            col_off += hi - lo
        others = nxt
    return others


def local_shards(rule: ShardRule, pcfg: ParallelConfig, s: int, t: int) -> LocalShards:
    """The shards at FSDP index ``s`` (over dp_shard x cp) and tp index ``t`` (every dp_replicate index holds the
    same)."""
    return _shards_from_ranges(_tp_ranges(rule, pcfg.tp, t), pcfg.fsdp_shard, s)


def _st_arrays(ranges: list[list[tuple[int, int]]], dp_shard: int):
    """`_shards_from_ranges` for every dp_shard index at once: (boxes per s, lo, hi, offsets, local shapes), boxes
    ordered by s, then row range, then the ranges of the other dimensions."""
    rows = ranges[0]
    local_rows = sum(hi - lo for lo, hi in rows)
    size = -(-local_rows // dp_shard)
    a = np.minimum(np.arange(dp_shard, dtype=np.int64) * size, local_rows)
    b = np.minimum(a + size, local_rows)
    row_lo = np.array([lo for lo, _ in rows], dtype=np.int64)
    row_n = np.array([hi - lo for lo, hi in rows], dtype=np.int64)
    row_pos = np.concatenate([[0], np.cumsum(row_n)[:-1]]).astype(np.int64)
    x = np.maximum(a[:, None], row_pos[None, :])
    y = np.minimum(b[:, None], (row_pos + row_n)[None, :])
    s_idx, j_idx = np.nonzero(x < y)  # row-major: by s, then row range
    others = _other_dims(ranges)
    n_o, ndim = len(others), len(ranges)
    o_lo = np.array([l for l, _, _ in others], dtype=np.int64).reshape(n_o, ndim - 1)
    o_hi = np.array([h for _, h, _ in others], dtype=np.int64).reshape(n_o, ndim - 1)
    o_off = np.array([o for _, _, o in others], dtype=np.int64).reshape(n_o, ndim - 1)
    xs, ys = x[s_idx, j_idx], y[s_idx, j_idx]
    first = np.repeat(np.stack([row_lo[j_idx] + xs - row_pos[j_idx], row_lo[j_idx] + ys - row_pos[j_idx],
                                xs - a[s_idx]], axis=1), n_o, axis=0)
    tile = lambda m: np.tile(m, (len(s_idx), 1))
    lo = np.concatenate([first[:, :1], tile(o_lo)], axis=1)
    hi = np.concatenate([first[:, 1:2], tile(o_hi)], axis=1)
    off = np.concatenate([first[:, 2:3], tile(o_off)], axis=1)
    counts = np.bincount(s_idx, minlength=dp_shard) * n_o
    rest = [sum(hi - lo for lo, hi in r) for r in ranges[1:]]
    shape = np.concatenate([(b - a)[:, None], np.tile(np.array(rest, dtype=np.int64), (dp_shard, 1))], axis=1)
    return counts, lo, hi, off, shape


def layout_shards(rule: ShardRule, pcfg: ParallelConfig) -> ClassShards:
    """`local_shards` for every mesh position in the default order, position = (r*S + s)*T + t (S: dp_shard * cp),
    as arrays."""
    tp, S = pcfg.tp, pcfg.fsdp_shard
    per_t = [_st_arrays(_tp_ranges(rule, tp, t), S) for t in range(tp if rule.tp_dim is not None else 1)]
    if rule.tp_dim is None:
        # Replicated over TP: one computation per dp_shard index serves every t.
        per_t = per_t * tp
    # Interleave: position s*T + t takes (s, t)'s boxes.
    counts = np.stack([c for c, *_ in per_t], axis=1).reshape(-1)  # [S*T], s-major
    box_t = np.concatenate([np.full(len(lo), t, dtype=np.int64) for t, (_, lo, *_r) in enumerate(per_t)])
    box_s = np.concatenate([np.repeat(np.arange(S), c) for c, *_ in per_t])
    order = np.lexsort((box_t, box_s))  # stable: within (s, t) the boxes keep their order
    lo = np.concatenate([x[1] for x in per_t])[order]
    hi = np.concatenate([x[2] for x in per_t])[order]
    off = np.concatenate([x[3] for x in per_t])[order]
    shape = np.stack([x[4] for x in per_t], axis=1).reshape(S * tp, -1)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return ClassShards(ptr, lo, hi, off, shape).tile(pcfg.dp_replicate)


def rule_sharding(rule: ShardRule, pcfg: ParallelConfig) -> Sharding:
    """The placements `apply_tp` then `fully_shard` give a state of this rule on the (dp_replicate, dp_shard, tp)
    mesh (with cp, FSDP2 shards over dp_shard x cp): FSDP2 chunks dim 0 of the TP-local tensor, which DTensor records
    as a strided shard when TP split dim 0."""
    if rule.fused is not None:
        raise ValueError("a fused projection's parts are split one by one: no single placement describes it")
    placements, dims = [], []
    if pcfg.fsdp_shard > 1:
        strided = rule.tp_dim == 0 and pcfg.tp > 1
        placements.append(StridedShard(0, pcfg.tp) if strided else Shard(0))
        dims.append(pcfg.root_dims("dp_shard_cp"))
    if rule.tp_dim is not None and pcfg.tp > 1:
        placements.append(Shard(rule.tp_dim))
        dims.append(pcfg.root_dims("tp"))
    return Sharding(pcfg.mesh_shape, tuple(placements), tuple(dims))
