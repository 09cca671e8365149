"""The array form of a class's shards equals the position-by-position computation it replaces."""

import random

from dynatrain.vps.class_shards import ClassShards
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.rules import ShardRule, _shards_from_ranges, _tp_ranges, layout_shards


def _reference(rule: ShardRule, pcfg: ParallelConfig) -> tuple:
    per_t = [_tp_ranges(rule, pcfg.tp, t) for t in range(pcfg.tp)]
    per_st = [_shards_from_ranges(per_t[t], pcfg.dp_shard, s) for s in range(pcfg.dp_shard) for t in range(pcfg.tp)]
    return tuple(per_st) * pcfg.dp_replicate


def test_layout_shards_equal_the_per_position_rule_on_random_cases():
    rng = random.Random(7)
    for _ in range(300):
        nd = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 9) for _ in range(nd))
        tp_dim = rng.choice([None, *range(nd)])
        fused = None
        if tp_dim is not None and shape[tp_dim] >= 2 and rng.random() < 0.3:
            k = rng.randint(0, shape[tp_dim])
            fused = (k, shape[tp_dim] - k)
        rule = ShardRule(shape, tp_dim, fused)
        pcfg = ParallelConfig.parse(
            f"dp_replicate={rng.randint(1, 2)},dp_shard={rng.randint(1, 5)},tp={rng.randint(1, 3)}")
        fast, slow = layout_shards(rule, pcfg), _reference(rule, pcfg)
        assert isinstance(fast, ClassShards)
        assert tuple(fast) == slow and fast == slow, (rule, pcfg.short())
        assert ClassShards.of(slow) == fast
        assert fast.numel == sum(s.numel for s in slow)


def test_concatenation_with_tuples_keeps_positions():
    rule, pcfg = ShardRule((6, 4), 0), ParallelConfig.parse("dp_shard=2,tp=2")
    held = layout_shards(rule, pcfg)
    empty = (held[0].__class__((), (), (0, 0)),)
    joined = empty * 3 + held + empty * 2
    assert isinstance(joined, ClassShards) and len(joined) == 3 + len(held) + 2
    assert tuple(joined) == empty * 3 + tuple(held) + empty * 2
