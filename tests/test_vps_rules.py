from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.vps.box import Box
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.models.specs import rule_for_param
from dynatrain.vps.rules import ShardRule, chunk_bounds, layout_shards, local_shards


def test_chunk_bounds_is_torch_chunk_padded():
    for n in range(0, 13):
        for parts in range(1, 7):
            chunks = torch.arange(n).chunk(parts) if n else ()
            sizes = [len(c) for c in chunks] + [0] * (parts - len(chunks))
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
            assert [chunk_bounds(n, parts, i) for i in range(parts)] == [
                (s, s + z) for s, z in zip(starts, sizes)
            ], (n, parts)
    with pytest.raises(ValueError):
        chunk_bounds(4, 2, 2)


def test_rules_follow_the_tp_table():
    assert rule_for_param("layers.0.attention.wq.weight", (8, 8)).tp_dim == 0
    assert rule_for_param("layers.3.attention.wo.weight", (8, 8)).tp_dim == 1
    assert rule_for_param("layers.1.feed_forward.w2.weight", (8, 16)).tp_dim == 1
    assert rule_for_param("layers.0.ffn_norm.weight", (8,)).tp_dim is None
    assert rule_for_param("tok_embeddings.weight", (32, 8)).tp_dim == 0
    assert rule_for_param("output.weight", (32, 8)).tp_dim == 0
    with pytest.raises(ValueError, match="tp_styles.py"):
        rule_for_param("layers.0.attention.bogus.weight", (8, 8))


def test_colwise_then_fsdp_chunks_the_tp_local_rows():
    cfg = ParallelConfig(dp_shard=2, tp=2)
    # rows 0..9: tp=2 -> [0,5) and [5,10); fsdp=2 on 5 local rows -> 3 + 2.
    got = [local_shards(ShardRule((10, 4), 0), cfg, s, t).boxes for s in range(2) for t in range(2)]
    assert got == [
        (Box((0, 0), (3, 4)),), (Box((5, 0), (8, 4)),), (Box((3, 0), (5, 4)),), (Box((8, 0), (10, 4)),)
    ]


def test_rowwise_shards_columns_then_rows():
    cfg = ParallelConfig(dp_shard=2, tp=2)
    held = local_shards(ShardRule((4, 6), 1), cfg, 1, 1)
    assert held.boxes == (Box((2, 3), (4, 6)),) and held.local_shape == (2, 3)


def test_replicated_norm_and_empty_chunks():
    cfg = ParallelConfig(dp_replicate=2, dp_shard=4, tp=2)
    shards = layout_shards(ShardRule((2,)), cfg)
    assert len(shards) == 16
    # dim 0 = 2 < dp_shard = 4: chunks of 1, the last two positions hold an empty (0,) tensor.
    assert [s.boxes for s in shards[:8]] == [(Box((0,), (1,)),)] * 2 + [(Box((1,), (2,)),)] * 2 + [()] * 4
    assert shards[7].local_shape == (0,)
    assert shards[8:] == shards[:8]  # dp_replicate copies


def test_fused_projection_holds_several_boxes():
    # Parts of 4 and 2 rows, each split by tp=2: rank t=0 holds rows [0,2) and [4,5) stacked as 3 local rows.
    rule = ShardRule((6, 3), 0, (4, 2))
    cfg = ParallelConfig(dp_shard=2, tp=2)
    first = local_shards(rule, cfg, 0, 0)
    second = local_shards(rule, cfg, 1, 0)
    assert first.boxes == (Box((0, 0), (2, 3)),) and first.offsets == ((0, 0),)
    assert second.boxes == (Box((4, 0), (5, 3)),)
    whole = local_shards(rule, ParallelConfig(tp=2), 0, 1)
    assert whole.boxes == (Box((2, 0), (4, 3)), Box((5, 0), (6, 3)))
    assert whole.offsets == ((0, 0), (2, 0)) and whole.local_shape == (3, 3)


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="scalar"):
        ShardRule(())
    with pytest.raises(ValueError, match="tp_dim=2"):
        ShardRule((3, 3), 2)
    with pytest.raises(ValueError, match="add up"):
        ShardRule((6, 3), 0, (4, 1))
    with pytest.raises(ValueError, match="give tp_dim"):
        ShardRule((6, 3), None, (4, 2))


@st.composite
def rules_and_configs(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    tp_dim = draw(st.sampled_from([None, *range(ndim)]))
    fused = None
    if tp_dim is not None and shape[tp_dim] >= 2 and draw(st.booleans()):
        cut = draw(st.integers(1, shape[tp_dim] - 1))
        fused = (cut, shape[tp_dim] - cut)
    cfg = ParallelConfig(draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    return ShardRule(shape, tp_dim, fused), cfg


@settings(max_examples=300, deadline=None, derandomize=True)
@given(rules_and_configs())
def test_every_element_is_held_once_per_replica(case):
    rule, cfg = case
    shards = layout_shards(rule, cfg)
    count = np.zeros(rule.shape, np.int64)
    for held in shards:
        local = np.zeros(held.local_shape, np.int64)
        for box, off in zip(held.boxes, held.offsets):
            count[box.slices()] += 1
            local[box.shift(box.lo).offset(off).slices()] += 1
        # The boxes tile the local tensor exactly: its shape is what the rank really allocates.
        assert (local == 1).all()
    replicas = cfg.dp_replicate * (cfg.tp if rule.tp_dim is None else 1)
    assert (count == replicas).all()
