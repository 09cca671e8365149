"""Hand-checked switches: the exact transfers are worked out by hand in each docstring."""

from __future__ import annotations

import pytest

from _planner_check import execute
from dynatrain.models.specs import layout_for_model
from dynatrain.planner import Transfer, plan_switch, route
from dynatrain.vps import Box, Layout, ParallelConfig, StateSpec


def _layout(shape, cfg, tp_dim=None, rank_map=None, dtype="float32"):
    return Layout.from_config((StateSpec("w", shape, dtype, tp_dim),), ParallelConfig.parse(cfg), rank_map)


def _wire(plan):
    return sorted((t.src, t.dst, t.src_box, t.dst_box) for p in plan.processes
                  for k in range(plan.num_rounds) for m in plan.sends(p, k) for t in m.pieces)


def _copies(plan):
    return sorted((t.src, t.src_box, t.dst_box) for p in plan.processes for t in plan.local_copies(p))


def test_pure_dp_shard_change_scale_out():
    """(8, 2) rows: dp_shard=2 -> 4. Old: 0 holds rows [0,4), 1 holds [4,8). Joiners 2 and 3 take
    positions 1 and 3; each old process keeps the first half of its rows."""
    old = _layout((8, 2), "dp_shard=2")
    plan = plan_switch(old, "dp_shard=4", rank_map=[0, 2, 1, 3])
    assert plan.assignment.joiners == (2, 3)
    assert _wire(plan) == [
        (0, 2, Box((2, 0), (4, 2)), Box((0, 0), (2, 2))),
        (1, 3, Box((2, 0), (4, 2)), Box((0, 0), (2, 2))),
    ]
    assert _copies(plan) == [(0, Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),
                             (1, Box((0, 0), (2, 2)), Box((0, 0), (2, 2)))]
    assert plan.bytes_moved == 2 * 4 * 4
    optimal = plan_switch(old, "dp_shard=4")
    assert optimal.bytes_moved == plan.bytes_moved
    assert optimal.assignment.rank_map.index(0) in (0, 1) and optimal.assignment.rank_map.index(1) in (2, 3)
    execute(optimal)


def test_tp_change_rowwise_to_dp_shard():
    """(4, 4) rowwise: tp=2 (process t holds columns [2t, 2t+2)) -> dp_shard=2 (process s holds rows
    [2s, 2s+2)). Each keeps the quarter it shares and swaps one quarter with the other."""
    plan = plan_switch(_layout((4, 4), "tp=2", tp_dim=1), "dp_shard=2")
    assert plan.assignment.rank_map == (0, 1)
    assert _wire(plan) == [
        (0, 1, Box((2, 0), (4, 2)), Box((0, 0), (2, 2))),
        (1, 0, Box((0, 0), (2, 2)), Box((0, 2), (2, 4))),
    ]
    assert plan.bytes_moved == 2 * 4 * 4 and plan.num_rounds == 1
    execute(plan)


def test_dp_replicate_to_dp_shard_moves_nothing_and_back_moves_halves():
    old = _layout((4, 3), "dp_replicate=2")
    shard = plan_switch(old, "dp_shard=2")
    assert shard.bytes_moved == 0 and _wire(shard) == [] and shard.num_rounds == 1
    assert _copies(shard) == [(0, Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),
                              (1, Box((2, 0), (4, 3)), Box((0, 0), (2, 3)))]
    execute(shard)
    back = plan_switch(_layout((4, 3), "dp_shard=2"), "dp_replicate=2")
    assert _wire(back) == [(0, 1, Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),
                           (1, 0, Box((0, 0), (2, 3)), Box((2, 0), (4, 3)))]
    execute(back)


def test_scale_in_4_to_3():
    """(12,): chunks of 3 -> chunks of 4. With process 3 forced out: 1 -> 0 sends [3,4), 2 -> 1 sends [6,8),
    3 -> 2 sends [9,12): 6 elements. Free to choose, the planner drops process 1 or 2 instead: 4 elements."""
    old = _layout((12,), "dp_shard=4")
    forced = plan_switch(old, "dp_shard=3", leave=[3])
    assert forced.assignment.rank_map == (0, 1, 2) and forced.assignment.idle == ()
    assert _wire(forced) == [(1, 0, Box((0,), (1,)), Box((3,), (4,))),
                             (2, 1, Box((0,), (2,)), Box((2,), (4,))),
                             (3, 2, Box((0,), (3,)), Box((1,), (4,)))]
    execute(forced)
    free = plan_switch(old, "dp_shard=3")
    assert free.bytes_moved == 4 * 4 and free.bytes_moved_identity == 6 * 4
    assert free.assignment.rank_map[0] == 0 and free.assignment.rank_map[2] == 3
    execute(free)


def test_scale_out_3_to_5():
    """(15,): chunks of 5 -> chunks of 3. Old processes take positions 0, 2, 4 and keep 3 elements each;
    joiners 3 and 4 fetch [3,6) and [9,12) from two holders each: 6 elements on the wire."""
    plan = plan_switch(_layout((15,), "dp_shard=3"), "dp_shard=5")
    rm = plan.assignment.rank_map
    assert (rm[0], rm[2], rm[4]) == (0, 1, 2) and {rm[1], rm[3]} == {3, 4}
    assert plan.bytes_moved == 6 * 4
    assert plan.bytes_moved_identity == 11 * 4
    execute(plan)


def test_dim0_smaller_than_dp_shard():
    """(2, 3) on dp_shard=4: positions 2 and 3 hold empty (0, 3) shards, and a switch to dp_shard=2 keeps
    both rows where they are."""
    old = _layout((2, 3), "dp_shard=4")
    assert old.boxes("w", 2) == () and old.shards("w", 3).local_shape == (0, 3)
    plan = plan_switch(old, "dp_shard=2")
    assert plan.bytes_moved == 0 and set(plan.assignment.idle) == {2, 3}
    assert plan.release_round(2) == {}  # nothing held, nothing to free
    execute(plan)
    out = plan_switch(_layout((2, 3), "dp_shard=1"), "dp_shard=4")
    assert out.bytes_moved == 3 * 4
    execute(out)


def test_uneven_and_rank_map_with_gaps():
    old = _layout((7, 5), "dp_shard=3", tp_dim=None, rank_map=[40, 7, 19])
    plan = plan_switch(old, "dp_shard=2,tp=2", leave=[7], joiners=[50, 60], budget_bytes=16)
    assert 7 not in plan.new.processes and set(plan.new.processes) == {40, 19, 50, 60}
    execute(plan)


def test_llama3_70b_128_to_64_identity_vs_optimal():
    """Identity keeps only rank 0's first 1/128; the optimal map keeps one of two old chunks per new shard."""
    old = layout_for_model("llama3-70b", ParallelConfig(dp_shard=128))
    plan = plan_switch(old, "dp_shard=64")
    total = plan.bytes_total
    assert plan.bytes_moved_identity * 128 == total * 127  # 99.2%
    assert plan.bytes_moved * 2 == total  # 50.0%
    assert f"{plan.bytes_moved_identity / total:.1%}" == "99.2%" and f"{plan.bytes_moved / total:.1%}" == "50.0%"
    ident = plan_switch(old, "dp_shard=64", rank_map="identity")
    assert ident.bytes_moved == plan.bytes_moved_identity


def test_lost_process_is_replaced_by_its_replica():
    old = _layout((4, 2), "dp_replicate=2,dp_shard=2")
    plan = plan_switch(old, "dp_shard=2", lost=[0])
    assert 0 not in plan.processes
    assert all(t.src != 0 for p in plan.processes for k in range(plan.num_rounds) for m in plan.sends(p, k)
               for t in m.pieces)
    execute(plan)
    with pytest.raises(ValueError, match="held only by lost processes"):
        plan_switch(_layout((4, 2), "dp_shard=2"), "dp_shard=1", lost=[1])


def test_routing_lists_every_transfer_once():
    """(6, 4) colwise rows: dp_shard=3 (rows [0,2), [2,4), [4,6)) -> dp_shard=2,tp=2 with the layouts' own
    rank maps: positions hold rows [0,2), [3,5), [2,3), [5,6); process 3 joins."""
    old = _layout((6, 4), "dp_shard=3", tp_dim=0)
    new = _layout((6, 4), "dp_shard=2,tp=2", tp_dim=0)
    r = route(old, new)
    assert r.transfers == (
        Transfer(1, 2, "w", 0, Box((0, 0), (1, 4)), 0, Box((0, 0), (1, 4)), 16),
        Transfer(2, 1, "w", 0, Box((0, 0), (1, 4)), 0, Box((1, 0), (2, 4)), 16),
        Transfer(2, 3, "w", 0, Box((1, 0), (2, 4)), 0, Box((0, 0), (1, 4)), 16),
    )
    assert r.local_copies == (
        Transfer(0, 0, "w", 0, Box((0, 0), (2, 4)), 0, Box((0, 0), (2, 4)), 32),
        Transfer(1, 1, "w", 0, Box((1, 0), (2, 4)), 0, Box((0, 0), (1, 4)), 16),
    )
    assert r.bytes_moved + sum(t.nbytes for t in r.local_copies) == new.needed_bytes
    assert route(old, new, processes=[3]).transfers == r.transfers[2:]


def test_bad_requests_name_the_fix():
    old = _layout((8,), "dp_shard=2")
    # Half the budget stages a round: one 4-byte element needs a budget of 7 bytes.
    with pytest.raises(ValueError, match="at least 7 bytes"):
        plan_switch(old, "dp_shard=4", budget_bytes=6)
    plan_switch(old, "dp_shard=4", budget_bytes=7)
    with pytest.raises(ValueError, match="hold no position"):
        plan_switch(old, "dp_shard=1", leave=[5])
    with pytest.raises(ValueError, match="only 2 are available"):
        plan_switch(old, "dp_shard=4", joiners=[])
    with pytest.raises(ValueError, match="names a process twice"):
        plan_switch(old, "dp_shard=2", rank_map=[0, 0])
    with pytest.raises(ValueError, match="not available"):
        plan_switch(old, "dp_shard=2", rank_map=[0, 1], leave=[1], joiners=[2])
    with pytest.raises(ValueError, match="unknown rank map"):
        plan_switch(old, "dp_shard=2", rank_map="random")
    with pytest.raises(ValueError, match="positive integer"):
        plan_switch(old, "dp_shard=2", budget_bytes=0)
