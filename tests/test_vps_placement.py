"""Boxes from placements: the same boxes as the TP-then-FSDP rules, flattened mesh dimensions, bad shardings."""

from __future__ import annotations

import itertools

import pytest

from dynatrain.vps import Layout, ParallelConfig, Replicate, Shard, Sharding, StateSpec, StridedShard
from dynatrain.vps.placement import position_shards, sharding_shards
from dynatrain.vps.rules import rule_sharding


def _as_placements(tp_dim: int | None, pcfg: ParallelConfig) -> Sharding:
    """What DTensor records for a parameter after `apply_tp` then `fully_shard` on (dp_replicate, dp_shard, tp)."""
    dp = StridedShard(0, pcfg.tp) if tp_dim == 0 and pcfg.tp > 1 else Shard(0)
    tp = Replicate() if tp_dim is None else Shard(tp_dim)
    return Sharding(pcfg.mesh_shape, (Replicate(), dp, tp), ((0,), (1,), (2,)))


@pytest.mark.parametrize("shape,tp_dim", [((10, 6), 0), ((7, 5), 1), ((9,), None), ((3, 4), 0), ((16, 8), None)])
@pytest.mark.parametrize("mesh", [(1, 4, 1), (1, 2, 2), (2, 2, 2), (1, 3, 2), (1, 1, 4), (2, 3, 1), (1, 5, 3)])
def test_placements_give_the_boxes_of_the_tp_then_fsdp_rules(shape, tp_dim, mesh):
    pcfg = ParallelConfig(*mesh)
    spec = StateSpec("w", shape, "float32", tp_dim)
    by_rule = Layout.from_config([spec], pcfg)
    by_placement = Layout.from_shardings([StateSpec("w", shape, "float32")], [_as_placements(tp_dim, pcfg)], pcfg)
    assert by_rule.classes == by_placement.classes
    by_rule_sharding = Layout.from_shardings([spec], [rule_sharding(spec.rule, pcfg)], pcfg)
    assert by_rule_sharding.classes == by_rule.classes


def test_a_flattened_data_parallel_dimension_chunks_over_the_product():
    # Lightning's `data_parallel` is dp_replicate x dp_shard flattened: one chunk per data-parallel rank.
    mesh = (2, 2, 1)
    flat = Sharding(mesh, (Shard(0),), ((0, 1),))
    shards = sharding_shards((10,), flat)
    assert [s.boxes[0].lo[0] if s.boxes else None for s in shards] == [0, 3, 6, 9]
    assert [s.local_shape for s in shards] == [(3,), (3,), (3,), (1,)]
    # Nested splits of an uneven extent differ from one flat split: the run is not two placements.
    nested = Sharding(mesh, (Shard(0), Shard(0)), ((0,), (1,)))
    assert [s.local_shape for s in sharding_shards((10,), nested)] == [(3,), (2,), (3,), (2,)]


def test_uncovered_mesh_dimensions_hold_copies_and_empty_chunks_exist():
    sh = Sharding((1, 4, 2), (Shard(1),), ((1,),))
    shards = sharding_shards((3, 2), sh)
    assert shards[0] == shards[1]  # tp (not covered) replicates
    assert [s.local_shape for s in shards[::2]] == [(3, 1), (3, 1), (3, 0), (3, 0)]
    assert shards[4].boxes == ()


def test_every_element_is_held_exactly_once_per_replica():
    for mesh, placements, dims, copies in [
        ((1, 3, 2), (StridedShard(0, 2), Shard(0)), ((1,), (2,)), 1),
        ((2, 3, 2), (Replicate(), Shard(0), Shard(1)), ((0,), (1,), (2,)), 2),
        ((2, 3, 2), (StridedShard(1, 2), Shard(1)), ((0, 1), (2,)), 1),
        ((1, 2, 3), (Shard(1), Shard(0)), ((1,), (2,)), 1),
    ]:
        per = sharding_shards((7, 5), Sharding(mesh, placements, dims))
        count: dict = {}
        for held in per:
            assert all(h - l for b in held.boxes for l, h in zip(b.lo, b.hi))
            for box in held.boxes:
                for idx in itertools.product(*[range(l, h) for l, h in zip(box.lo, box.hi)]):
                    count[idx] = count.get(idx, 0) + 1
        assert set(count.values()) == {copies} and len(count) == 35


def test_a_strided_split_whose_factor_is_not_the_later_splits_is_refused():
    with pytest.raises(ValueError, match="cannot be described"):
        position_shards((8, 4), Sharding((2, 2), (StridedShard(0, 4), Shard(0)), ((0,), (1,))), 0)
    with pytest.raises(ValueError, match="run of consecutive"):
        Sharding((2, 2, 2), (Shard(0),), ((0, 2),))
    with pytest.raises(ValueError, match="0-d"):
        position_shards((), Sharding((2,)), 0)
    with pytest.raises(ValueError, match="mesh of shape"):
        Layout.from_shardings([StateSpec("w", (4,))], [Sharding((2, 1, 1))], ParallelConfig(dp_shard=2))
