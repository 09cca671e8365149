"""Rounds under the staging budget, element-aligned cuts, early free / late allocation, determinism."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _planner_check import execute
from dynatrain.models.specs import layout_for_model
from dynatrain.planner import plan_switch
from dynatrain.planner.groups import kept_in_place, positions
from dynatrain.planner.schedule import min_budget, schedule_pairs
from dynatrain.vps import Layout, ParallelConfig, StateSpec

REPO = Path(__file__).resolve().parent.parent


def _per_round_use(rounds):
    out = []
    for rnd in rounds:
        use: dict[int, int] = {}
        for s, d, _, n in rnd:
            use[s] = use.get(s, 0) + n
            use[d] = use.get(d, 0) + n
        out.append(use)
    return out


def test_cuts_fall_on_element_boundaries_of_mixed_dtypes():
    # 12 bytes of fp32 then 6 bytes of bf16; a 6-byte budget fits one fp32 element plus nothing else.
    rounds = schedule_pairs({(0, 1): ((4, 12), (2, 6))}, 6)
    assert rounds == (((0, 1, 0, 4),), ((0, 1, 4, 4),), ((0, 1, 8, 6),), ((0, 1, 14, 4),))


def test_budget_below_one_element_names_the_minimum():
    assert min_budget({(0, 1): ((8, 16), (2, 4))}) == 8
    with pytest.raises(ValueError, match="at least 8 bytes"):
        schedule_pairs({(0, 1): ((8, 16), (2, 4))}, 7)
    with pytest.raises(ValueError, match="at least 2000 bytes"):
        schedule_pairs({(0, 1): ((4, 200_000_000),)}, 4)


def test_star_meets_the_lower_bound():
    pairs = {(0, d): ((4, 12),) for d in range(1, 5)}
    rounds = schedule_pairs(pairs, 24)
    assert len(rounds) == 2  # rank 0 moves 48 bytes at 24 per round
    assert all(use[0] <= 24 for use in _per_round_use(rounds))


def test_every_round_moves_the_same_fraction_each_way():
    # Rank 0 sends 8,000 bytes to 1 and receives 4,000 from 2: at 3,000 bytes a round it needs four rounds, and in
    # each it sends twice what it receives, as over the whole switch. Half the budget to each pair would finish the
    # receive early and leave the last rounds to the send alone, with the receiving link idle.
    pairs = {(0, 1): ((4, 8000),), (2, 0): ((4, 4000),)}
    rounds = schedule_pairs(pairs, 3000)
    assert len(rounds) == 4
    for rnd in rounds:
        sent = sum(n for s, _, _, n in rnd if s == 0)
        received = sum(n for _, d, _, n in rnd if d == 0)
        assert sent + received <= 3000 and abs(sent - 2 * received) <= 8, rnd


def test_random_pair_sets_respect_budget_and_cover_each_stream_once():
    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.integers(2, 9))
        pairs = {}
        for s in range(n):
            for d in range(n):
                if s != d and rng.random() < 0.4:
                    pairs[(s, d)] = tuple((size, int(rng.integers(1, 40)) * size) for size in (8, 4, 2)
                                          if rng.random() < 0.7) or ((4, 4),)
        budget = int(rng.integers(8, 200))
        rounds = schedule_pairs(pairs, budget)
        assert all(max(use.values()) <= budget for use in _per_round_use(rounds))
        seen: dict[tuple[int, int], int] = {}
        for rnd in rounds:
            assert len({(s, d) for s, d, _, _ in rnd}) == len(rnd)  # one message per ordered pair
            for s, d, off, size in rnd:
                assert off == seen.get((s, d), 0) and size > 0  # contiguous, in stream order
                seen[(s, d)] = off + size
        assert seen == {p: sum(b for _, b in segs) for p, segs in pairs.items()}
        busiest = max(sum(sum(b for _, b in segs) for (s, d), segs in pairs.items() if r in (s, d))
                      for r in range(n))
        assert len(rounds) <= 2 * -(-busiest // budget) + 1


def test_sources_are_freed_early_and_destinations_allocated_late():
    states = tuple(StateSpec(f"s{i}", (4, 4)) for i in range(4))
    old = Layout.from_config(states, ParallelConfig(dp_shard=2))
    # Swapping the two processes moves every byte: 32 bytes per state shard. A budget of 128 bytes is 64 to
    # stage a round and 64 in flight, so the states move in two phases of two.
    plan = plan_switch(old, "dp_shard=2", rank_map=[1, 0], budget_bytes=128)
    assert plan.groups == ((0, 1), (2, 3))
    assert plan.num_rounds == 4
    for p in (0, 1):
        rp = plan.rank_plan(p)
        # Full duplex: every round both sends and receives, half the staging each way.
        assert all(rp.sends[k] and rp.recvs[k] for k in range(4))
        assert all(rp.staging_bytes(k) == 64 for k in range(4))
        # Each state's source goes in the round it is sent, its destination comes in the round it arrives.
        assert rp.release_round == {(f"s{i}", 0): i for i in range(4)}
        assert rp.alloc_round == {(f"s{i}", 0): i for i in range(4)}
    execute(plan)


def test_phases_keep_the_doubled_state_under_the_budget():
    # dp_shard=4 -> dp_shard=2: the survivors' states double, the leavers' vanish. Without phases every
    # survivor would allocate all of its destinations while still holding its sources.
    old = layout_for_model("debug", ParallelConfig(dp_shard=4))
    budget = 1 << 20
    plan = plan_switch(old, "dp_shard=2", leave=[2, 3], budget_bytes=budget)
    assert len(plan.groups) > 1
    assert sorted(si for g in plan.groups for si in g) == list(range(len(old.states)))
    assert sum(b for g in plan.groups for segs in plan.table.group_pair_bytes(g).values() for _, b in segs) \
        == plan.bytes_moved
    largest = max(s.nbytes for s in old.states)
    for p in plan.processes:
        rp = plan.rank_plan(p)
        src = {s.name: _held(plan.old, s.name, p) for s in old.states}
        dst = {s.name: _held(plan.new, s.name, p) for s in old.states}
        live = sum(src.values())
        peak = live + max(rp.staging_bytes(k) for k in range(rp.num_rounds))
        for k in range(rp.num_rounds):
            live += sum(dst[name] for (name, _), a in rp.alloc_round.items() if a == k)
            peak = max(peak, live + rp.staging_bytes(k))
            live -= sum(src[name] for (name, _), r in rp.release_round.items() if r == k)
        assert peak <= max(sum(src.values()), sum(dst.values())) + budget + largest // 2, p
    execute(plan)


def test_a_state_kept_in_place_does_not_count_against_its_phase():
    # dp_shard=2 -> tp=2: the column-parallel weights' TP shards are the FSDP rows each process already holds, so
    # the engine adopts them in place; only the rest doubles while it moves.
    old = layout_for_model("debug", ParallelConfig(dp_shard=2))
    new = plan_switch(old, "tp=2", budget_bytes=1 << 30).new
    procs = [0, 1]
    q_old, q_new = positions(old, procs), positions(new, procs)
    doubled, moving = [0, 0], [0, 0]
    for i, s in enumerate(old.states):
        kept = kept_in_place(old.class_arrays(old.state_class[i]), new.class_arrays(new.state_class[i]), q_old, q_new)
        for p in procs:
            b = min(_held(old, s.name, p), _held(new, s.name, p))
            doubled[p] += b
            moving[p] += 0 if kept[p] else b
    assert 0 < max(moving) < max(doubled) // 2
    # Half the budget holds what moves: one phase, though counting every state would take several.
    plan = plan_switch(old, "tp=2", budget_bytes=2 * max(moving))
    assert len(plan.groups) == 1 and sorted(plan.groups[0]) == list(range(len(old.states)))
    assert len(plan_switch(old, "tp=2", budget_bytes=2 * max(moving) - 64).groups) == 2
    execute(plan)


def _held(layout, name, p):
    held = layout.shards(name, p)
    return 0 if held is None else held.numel * layout.state(name).itemsize


def test_streams_put_wide_dtypes_first_so_pieces_stay_aligned():
    old = layout_for_model("debug", ParallelConfig(dp_shard=2), kind="bf16-adam")
    plan = plan_switch(old, "dp_shard=3", budget_bytes=300_000)
    size = {s.name: s.itemsize for s in old.states}
    for p in plan.processes:
        for k in range(plan.num_rounds):
            for m in plan.sends(p, k):
                offset, last = 0, 99
                for t in m.pieces:
                    assert size[t.state] <= last and offset % size[t.state] == 0
                    last = size[t.state]
                    offset += t.nbytes
    execute(plan)


def test_messages_match_in_posting_order_per_channel():
    """Each rank posts its rounds in order; messages of one (src, dst) channel pair up FIFO. The k-th send
    on a channel must meet the k-th receive in the same round with the same pieces."""
    old = layout_for_model("debug", ParallelConfig(dp_replicate=2, dp_shard=2, tp=2))
    plan = plan_switch(old, "dp_shard=3,tp=2", leave=[5], budget_bytes=100_000, gpus_per_node=4)
    assert plan.num_rounds > 3
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for p in plan.processes:
        for k in range(plan.num_rounds):
            for m in plan.sends(p, k):
                sent.setdefault((m.src, m.dst), []).append(m)
            for m in plan.recvs(p, k):
                got.setdefault((m.src, m.dst), []).append(m)
    assert sent == got


# The package's __init__ imports Lightning to register the strategy (seconds per process); the planner is
# pure, so the subprocesses load the dynatrain package without running that __init__.
_PURE_IMPORT = """
import sys, types
pkg = types.ModuleType("dynatrain")
pkg.__path__ = [{path!r}]
sys.modules["dynatrain"] = pkg
"""

_FINGERPRINT = """
from dynatrain.models.specs import layout_for_model
from dynatrain.planner import plan_switch
from dynatrain.vps import Layout, ParallelConfig
old = layout_for_model("debug", ParallelConfig(dp_replicate=2, dp_shard=2, tp=2), kind="bf16-adam",
                       rank_map=[3, 9, 1, 4, 12, 0, 7, 2])
plan = plan_switch(old, "dp_shard=3,tp=2", leave=[9], budget_bytes=200_000, gpus_per_node=4)
print(plan.fingerprint())
"""


@pytest.mark.timeout(240)
def test_plans_built_in_separate_processes_are_equal():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, "-c", _PURE_IMPORT.format(path=str(REPO / "dynatrain")) + _FINGERPRINT],
                         env=dict(env, PYTHONHASHSEED=seed),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed in ("1", "4242")
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err
        outs.append(out.strip())
    here = {}
    exec(_FINGERPRINT.replace("print(plan.fingerprint())", "here['fp'] = plan.fingerprint()"), {"here": here})
    assert outs[0] == outs[1] == here["fp"] and len(here["fp"]) == 64


def _reference_rounds(pair_bytes: dict, budget: int) -> tuple:
    """The rounds of `schedule_pairs` written pair by pair in plain integers."""
    need = max((size for segs in pair_bytes.values() for size, b in segs if b), default=1)
    pairs = [p for p in sorted(pair_bytes) if sum(b for _, b in pair_bytes[p])]
    ends = []
    for p in pairs:
        pos, segs = 0, []
        for size, b in pair_bytes[p]:
            pos += b
            segs.append((pos, size))
        ends.append(segs)

    def snap(segs, x):
        start = 0
        for end, size in segs:
            if x < end:
                return start + (x - start) // size * size
            start = end
        return start

    total = [segs[-1][0] for segs in ends]
    load: dict[int, int] = {}
    for (s, d), t in zip(pairs, total):
        load[s] = load.get(s, 0) + t
        load[d] = load.get(d, 0) + t
    offset, active, rounds = [0] * len(pairs), list(range(len(pairs))), []
    while active:
        active.sort(key=lambda i: (-max(load[pairs[i][0]], load[pairs[i][1]]), (offset[i] << 10) // total[i], pairs[i]))
        top = max(load.values())
        start = {i: offset[i] for i in active}
        # Pass 1: every pair the same fraction, budget / top, of what it has left.
        share = {i: total[i] - offset[i] if top <= budget else (total[i] - offset[i]) * budget // top for i in active}
        room = {r: budget for r in load}
        for i in active:
            offset[i] = max(snap(ends[i], offset[i] + share[i]), offset[i])
            for r in pairs[i]:
                room[r] -= offset[i] - start[i]
        # Pass 2: in order, what rounding down took from fine shares, capped; anything if pass 1 moved nothing.
        moved = any(offset[i] > start[i] for i in active)
        for i in active:
            s, d = pairs[i]
            if offset[i] >= total[i] or (moved and share[i] >= 64 * need):
                continue
            want = min(room[s], room[d], total[i] - offset[i])
            if moved:
                want = min(want, max(2 * need, share[i] // 16))
            if want <= 0:
                continue
            n = snap(ends[i], offset[i] + want) - offset[i]
            if n <= 0:
                continue
            offset[i] += n
            room[s] -= n
            room[d] -= n
        for i in active:
            for r in pairs[i]:
                load[r] -= offset[i] - start[i]
        rounds.append(tuple(sorted((*pairs[i], start[i], offset[i] - start[i])
                                   for i in active if offset[i] > start[i])))
        active = [i for i in active if offset[i] < total[i]]
    return tuple(rounds)


def test_schedule_pairs_equals_the_pair_by_pair_greedy_on_random_cases():
    rng = random.Random(11)
    for case in range(300):
        ranks = rng.randint(2, 9)
        pair_bytes = {}
        for _ in range(rng.randint(1, 25)):
            s, d = rng.sample(range(ranks), 2)
            sizes = sorted(rng.sample([8, 4, 2, 1], rng.randint(1, 3)), reverse=True)
            pair_bytes[(s, d)] = tuple((size, size * rng.randint(0, 40)) for size in sizes)
        if not any(b for segs in pair_bytes.values() for _, b in segs):
            continue
        budget = rng.choice([8, 9, 13, 32, 64, 100, 1000]) * rng.randint(1, 3)
        assert schedule_pairs(pair_bytes, budget) == _reference_rounds(pair_bytes, budget), case


@pytest.mark.parametrize("top", [40, 1 << 40])
def test_process_ids_index_and_sum_as_unique_would(top):
    # Small ids take a presence mask, ids far above the count the sort: both must give np.unique's answer.
    from dynatrain.planner.pair_bytes import index_ids, sum_by_id

    rng = np.random.default_rng(top % 97)
    src, dst = rng.integers(0, top, 300), rng.integers(0, top, 200)
    ids, inverse = np.unique(np.concatenate([src, dst]), return_inverse=True)
    held, (si, di) = index_ids(src, dst)
    assert np.array_equal(held, ids)
    assert np.array_equal(si, inverse[:300]) and np.array_equal(di, inverse[300:])
    values = rng.integers(0, 1 << 40, 300)
    held, sums = sum_by_id(src, values)
    assert np.array_equal(held, np.unique(src))
    assert sums.tolist() == [int(values[src == i].sum()) for i in held.tolist()]


@pytest.mark.parametrize("values", [
    [2**53 + 1, 1, 5],  # past what a double holds: int64 sums
    [2**52, 0, 0],  # the magnitude bound fails, the exact sum does not: float sums, still exact
    [-(2**60), 2**60 + 3, 7],  # negative values count by magnitude
    [],
])
def test_sums_by_index_stay_exact(values):
    from dynatrain.planner.pair_bytes import sum_by

    index = np.array([0, 0, 2][:len(values)], dtype=np.int64)
    out = sum_by(index, np.array(values, dtype=np.int64), 3)
    assert out.dtype == np.int64
    assert out.tolist() == [sum(v for i, v in zip(index.tolist(), values) if i == j) for j in range(3)]


def test_identical_boxes_merge_in_the_order_unique_gives():
    from dynatrain.planner.routing import _distinct

    rng = np.random.default_rng(2)
    lo = rng.integers(0, 4, (500, 3))
    hi = lo + rng.integers(1, 3, (500, 3))
    keys, inverse = np.unique(np.concatenate([lo, hi], axis=1), axis=0, return_inverse=True)
    dlo, dhi, ptr, ind = _distinct(lo, hi)
    assert np.array_equal(np.concatenate([dlo, dhi], axis=1), keys)
    assert np.array_equal(ind, np.argsort(inverse.reshape(-1), kind="stable"))
    assert np.array_equal(np.diff(ptr), np.bincount(inverse.reshape(-1)))


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_box_pairs_meet_as_a_plain_double_loop_finds(nd):
    from dynatrain.planner.routing import _intersect_all

    rng = np.random.default_rng(nd)
    olo = rng.integers(0, 12, (80, nd))
    ohi = olo + rng.integers(0, 5, (80, nd))  # some old boxes are empty
    nlo = rng.integers(0, 12, (60, nd))
    nhi = nlo + rng.integers(0, 6, (60, nd))
    expected = []
    for m in range(len(nlo)):
        for k in range(len(olo)):
            lo, hi = np.maximum(nlo[m], olo[k]), np.minimum(nhi[m], ohi[k])
            if (hi > lo).all():
                expected.append((m, k, *lo, *hi, int(np.prod(hi - lo))))
    m, k, lo, hi, vol = _intersect_all(nlo, nhi, olo, ohi)
    got = [(int(a), int(b), *map(int, c), *map(int, d), int(v)) for a, b, c, d, v in zip(m, k, lo, hi, vol)]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got))


@pytest.mark.parametrize("top", [300, 1 << 17, 1 << 31])
def test_pairs_index_as_unique_would(top):
    # Keys that fit an int64 beside the row number are sorted packed with it, larger ones by a stable argsort:
    # both give np.unique's answer.
    from dynatrain.planner.pair_bytes import pair_index

    rng = np.random.default_rng(top % 89)
    src, dst = rng.integers(0, top, 5000), rng.integers(0, 40, 5000)
    keys, inverse = np.unique(src * top + dst, return_inverse=True)
    pair_src, pair_dst, ours = pair_index(src, dst)
    assert np.array_equal(pair_src, keys // top) and np.array_equal(pair_dst, keys % top)
    assert np.array_equal(ours, inverse.reshape(-1))


def test_route_table_indices_narrow_only_when_they_fit():
    from dynatrain.planner.route_table import _narrow

    fits = _narrow(np.array([5, -3, 2**31 - 1], dtype=np.int64))
    assert fits.dtype == np.int32 and fits.tolist() == [5, -3, 2**31 - 1]
    for wide in ([2**31], [-(2**31) - 1]):
        kept = _narrow(np.array(wide, dtype=np.int64))
        assert kept.dtype == np.int64 and kept.tolist() == wide
    assert _narrow(np.zeros(0, dtype=np.int64)).dtype == np.int32
