"""The transition engine: exact results and the memory bound, in-process (local-only plans, errors) and on
2, 3 and 4 gloo ranks with random layouts, scale-in/out and budgets that force several rounds."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from _launch import launch
from dynatrain.engine import TransitionError, allocate_destinations, run_transition, validate_sources
from dynatrain.engine.copy_threads import COPY_THREADS_MAX, default_copy_threads
from dynatrain.engine.transition import _RankTransition
from dynatrain.models.specs import layout_for_model
from dynatrain.planner.groups import kept_in_place, positions
from dynatrain.planner.schedule import plan_switch
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from engine_worker import fill_local  # noqa: E402

ALIGN = 16  # the engine pads each message slot of the staging buffer to this many bytes


def _states():
    return [StateSpec("w", (7, 5), "float32", 0), StateSpec("w.m", (7, 5), "bfloat16", 0),
            StateSpec("b", (6, 9), "float64", 1), StateSpec("n", (5,), "int8", None),
            StateSpec("f", (12, 3), "float32", 0, (4, 4, 4))]


def _one_process_plan(pid: int = 0, budget: int = 64):
    old = Layout.from_config(_states(), ParallelConfig(), [pid])
    return plan_switch(old, ParallelConfig(), budget_bytes=budget, rank_map=[pid])


def test_local_only_plan_keeps_tensors_in_place():
    plan = _one_process_plan(pid=7)
    src = {s.name: fill_local(plan.old, s.name, 7, seed=3) for s in plan.old.states}
    ids = {name: id(t) for name, t in src.items()}
    want = {name: t.clone() for name, t in src.items()}
    dst, stats = run_transition(plan, 7, src)  # no send or receive: no process group needed
    assert not src
    for name, t in want.items():
        assert torch.equal(dst[name], t) and dst[name].dtype == t.dtype
        assert id(dst[name]) == ids[name]  # adopted, not copied
    assert stats.bytes_sent == stats.bytes_received == stats.bytes_local == 0
    assert stats.bytes_kept == plan.old.total_bytes
    assert stats.peak_bytes == stats.src_bytes == stats.dst_bytes


def test_local_only_plan_copies_without_keep_in_place():
    plan = _one_process_plan()
    src = {s.name: fill_local(plan.old, s.name, 0, seed=4) for s in plan.old.states}
    want = {name: t.clone() for name, t in src.items()}
    dst, stats = run_transition(plan, 0, src, keep_in_place=False)
    for name, t in want.items():
        assert torch.equal(dst[name], t)
    assert stats.bytes_local == plan.old.total_bytes
    # Each source is freed right after its copy: the peak is far below src + dst.
    largest = max(t.numel() * t.element_size() for t in want.values())
    assert stats.peak_bytes <= stats.src_bytes + largest


def test_preallocated_destinations_receive_the_bytes_and_count_from_the_start():
    plan = _one_process_plan()
    src = {s.name: fill_local(plan.old, s.name, 0, seed=6) for s in plan.old.states}
    want = {name: t.clone() for name, t in src.items()}
    ready = allocate_destinations(plan, 0)
    assert {n: (tuple(t.shape), t.dtype) for n, t in ready.items()} == {n: (tuple(t.shape), t.dtype)
                                                                       for n, t in want.items()}
    ptrs = {name: t.data_ptr() for name, t in ready.items()}
    dst, stats = run_transition(plan, 0, src, keep_in_place=False, preallocated=ready)
    for name, t in want.items():
        assert torch.equal(dst[name], t) and dst[name].data_ptr() == ptrs[name]
    assert stats.peak_bytes == stats.src_bytes + stats.dst_bytes  # all of them live before the first copy


def test_a_source_something_else_still_holds_loses_its_bytes_after_its_last_use():
    """A live module's reference cycles hold its shards until a full garbage collection: the engine gives their
    memory back itself, and keeps the storage of a source it adopted as its destination."""
    plan = _one_process_plan()
    src = {s.name: fill_local(plan.old, s.name, 0, seed=9) for s in plan.old.states}
    held = dict(src)  # the stand-in for the module's cycles
    want = {name: t.clone() for name, t in src.items()}
    dst, _ = run_transition(plan, 0, src, keep_in_place=False)
    for name, t in want.items():
        assert torch.equal(dst[name], t)
        assert held[name].untyped_storage().nbytes() == 0, name
    src = {name: t.clone() for name, t in want.items()}
    held = dict(src)
    dst, _ = run_transition(plan, 0, src)  # every state kept in place
    assert all(dst[name] is t and t.untyped_storage().nbytes() for name, t in held.items())
    assert all(torch.equal(dst[name], t) for name, t in want.items())


def test_a_storage_several_sources_share_is_emptied_after_the_last_of_them(monkeypatch):
    """FSDP2's shards are views of a padded buffer, and a module may lay several states in one buffer: the memory
    goes once no source on it is left to read, never while one is."""
    from engine_worker import on_one_storage

    plan = _one_process_plan()
    want = {s.name: fill_local(plan.old, s.name, 0, seed=10) for s in plan.old.states}
    flat, src = on_one_storage(want)
    seen = []
    free_source = _RankTransition._free_source

    def recording(self, name):
        free_source(self, name)
        seen.append((len(self.src), flat.untyped_storage().nbytes()))

    monkeypatch.setattr(_RankTransition, "_free_source", recording)
    dst, _ = run_transition(plan, 0, src, keep_in_place=False)
    assert all(torch.equal(dst[name], t) for name, t in want.items())
    assert len(seen) == len(want) and seen[-1] == (0, 0)
    assert all(nbytes == flat.numel() for _, nbytes in seen[:-1])
    # A destination on the sources' storage (here the sources themselves, written in place) keeps it, and so does
    # an entry the plan does not read, which stays with the caller.
    flat, src = on_one_storage(want)
    dst, _ = run_transition(plan, 0, src, keep_in_place=False, preallocated=dict(src))
    assert flat.untyped_storage().nbytes() == flat.numel()
    assert all(torch.equal(dst[name], t) for name, t in want.items())
    flat, src = on_one_storage(want)
    src["not in the plan"] = flat[:4]
    dst, _ = run_transition(plan, 0, src, keep_in_place=False)
    assert list(src) == ["not in the plan"] and flat.untyped_storage().nbytes() == flat.numel()
    assert all(torch.equal(dst[name], t) for name, t in want.items())


def test_a_preallocated_tensor_that_does_not_fit_is_refused_by_name():
    plan = _one_process_plan()
    src = lambda: {s.name: fill_local(plan.old, s.name, 0, seed=7) for s in plan.old.states}  # noqa: E731
    ready = allocate_destinations(plan, 0)
    with pytest.raises(TransitionError, match=r"preallocated tensor for state 'w' is \(5, 7\) torch.float32"):
        run_transition(plan, 0, src(), preallocated={**ready, "w": torch.empty(5, 7)})
    with pytest.raises(TransitionError, match=r"state 'w.m' is \(7, 5\) torch.float32 .* needs a contiguous "
                                              r"\(7, 5\) torch.bfloat16"):
        run_transition(plan, 0, src(), preallocated={"w.m": torch.empty(7, 5)})
    with pytest.raises(TransitionError, match="state 'nope', which this process does not hold"):
        run_transition(plan, 0, src(), preallocated={"nope": torch.empty(1)})


def test_the_copies_run_with_fewer_threads_and_the_count_comes_back(monkeypatch):
    """A team that fills the process's cores stalls beside gloo's thread (docs/benchmarks.md, "Copy threads")."""
    assert [default_copy_threads(n) for n in (1, 2, 3, 8, 16)] == [1, 1, 2, COPY_THREADS_MAX, COPY_THREADS_MAX]
    plan = _one_process_plan()
    seen = []
    copy_local = _RankTransition._copy_local

    def recording(self, *args):
        seen.append(torch.get_num_threads())
        return copy_local(self, *args)

    monkeypatch.setattr(_RankTransition, "_copy_local", recording)
    src = lambda: {s.name: fill_local(plan.old, s.name, 0, seed=8) for s in plan.old.states}  # noqa: E731
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        _, stats = run_transition(plan, 0, src(), keep_in_place=False)
        assert seen and set(seen) == {2} and stats.copy_threads == 2 and torch.get_num_threads() == 3
        seen.clear()
        _, stats = run_transition(plan, 0, src(), keep_in_place=False, copy_threads=1)
        assert set(seen) == {1} and stats.copy_threads == 1 and torch.get_num_threads() == 3
        with pytest.raises(TransitionError, match="copy_threads=0: pass at least 1"):
            run_transition(plan, 0, src(), copy_threads=0)

        def failing(self, *args):
            raise RuntimeError("a peer died")

        monkeypatch.setattr(_RankTransition, "_copy_local", failing)
        with pytest.raises(RuntimeError, match="a peer died"):
            run_transition(plan, 0, src(), keep_in_place=False)
        assert torch.get_num_threads() == 3  # restored on the way out of a failed transfer too
    finally:
        torch.set_num_threads(before)


def test_a_streamed_round_is_refused_on_cuda_where_nccl_needs_a_group():
    plan = _one_process_plan()
    src = {s.name: fill_local(plan.old, s.name, 0, seed=5) for s in plan.old.states}
    with pytest.raises(ValueError, match="NCCL"):
        run_transition(plan, 0, src, device="cuda", streamed=True)


def test_errors_name_the_bad_source():
    plan = _one_process_plan()
    good = {s.name: fill_local(plan.old, s.name, 0, seed=5) for s in plan.old.states}
    missing = dict(good)
    del missing["b"]
    with pytest.raises(TransitionError, match="no source tensor for state 'b'"):
        run_transition(plan, 0, missing)
    with pytest.raises(TransitionError, match=r"state 'w' has shape \(5, 7\)"):
        validate_sources(plan, 0, {**good, "w": torch.zeros(5, 7)})
    with pytest.raises(TransitionError, match="state 'w.m' has dtype torch.float32"):
        validate_sources(plan, 0, {**good, "w.m": torch.zeros(7, 5)})
    validate_sources(plan, 0, good)


# TP's column shards are FSDP's rows, so a switch between them keeps those; a dp_shard change moves every row.
@pytest.mark.parametrize("model,old,new,kind,keeps", [
    ("debug", "dp_shard=2", "tp=2", "fp32-adam", True),
    ("debug", "tp=2", "dp_shard=2", "bf16-adam", True),
    ("debug", "dp_shard=4", "dp_shard=2,tp=2", "fp32-adam", True),
    ("debug", "dp_replicate=2,dp_shard=2", "dp_shard=2,tp=2", "fp32-adam", True),
    ("debug", "dp_shard=4", "dp_shard=2", "fp32-adam", False),
    ("moe-debug", "dp_shard=4,ep=2", "dp_shard=4,ep=4", "fp32-adam", True),
])
def test_the_phases_count_as_kept_exactly_the_states_the_engine_keeps(model, old, new, kind, keeps):
    """The planner's phases leave a state a process keeps in place out of the bytes a phase doubles, so the engine
    must adopt every such state (else it would allocate a second tensor the phase did not count)."""
    layout = layout_for_model(model, ParallelConfig.parse(old), kind=kind)
    plan = plan_switch(layout, new, budget_bytes=1 << 20)
    procs = sorted(set(plan.old.processes) | set(plan.new.processes))
    q_old, q_new = positions(plan.old, procs), positions(plan.new, procs)
    any_kept = False
    for p in sorted(set(plan.old.processes) & set(plan.new.processes)):
        counted = set()
        for i, s in enumerate(plan.old.states):
            mask = kept_in_place(plan.old.class_arrays(plan.old.state_class[i]),
                                 plan.new.class_arrays(plan.new.state_class[i]), q_old, q_new)
            if mask[procs.index(p)]:
                counted.add(s.name)
        src = {s.name: torch.zeros(plan.old.shards(s.name, p).local_shape, dtype=torch.float32)
               for s in plan.old.states}
        run = _RankTransition(plan, p, src, None, None, "cpu")
        run.keep_in_place()
        assert counted == run.kept, (p, sorted(counted ^ run.kept)[:5])
        any_kept |= bool(counted)
    assert any_kept == keeps


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,cases,direct_min,ahead,streamed,one_storage", [
    (2, 6, None, False, False, False), (3, 6, None, False, False, False), (4, 6, None, True, False, False),
    (2, 6, 1, False, False, False), (3, 6, 1, False, False, False), (3, 6, 1, False, True, False),
    (3, 8, 1, False, False, True)],
    ids=["2", "3", "4-joiners-ahead", "2-in-place", "3-in-place", "3-in-place-streamed", "3-one-storage"])
def test_engine_random_switches(tmp_path, nprocs, cases, direct_min, ahead, streamed, one_storage):
    """With ``direct_min`` 1 every piece that is contiguous on one side is sent or received in place there. With
    ``ahead`` a process that holds no sources receives into destinations it allocated before the transfer. With
    ``streamed`` each send is posted as soon as it is packed and each receive unpacked as soon as it arrives. Every
    source is also held outside the engine, and its storage must be emptied all the same unless it was adopted as a
    destination; with ``one_storage`` a process's sources are views of one buffer, emptied only when none was."""
    extra = ([] if direct_min is None else ["--direct-min", str(direct_min)]) + (["--joiners-ahead"] if ahead else [])
    extra += (["--streamed"] if streamed else []) + (["--one-storage"] if one_storage else [])
    out = launch("engine_worker.py", nprocs, ["--cases", str(cases), "--seed", "1", *extra], tmp_path, timeout=100)
    multi_round = 0
    moved = 0
    in_place = 0
    received_ahead = 0
    for rank_out in out:
        assert len(rank_out["results"]) == cases
        for res in rank_out["results"]:
            assert res["ok"], f"rank {rank_out['rank']} case {res['desc']}: wrong destinations {res['errors']}"
            st = res.get("stats")
            if st is None:
                continue  # this process takes no part in that switch
            # The staging buffer: the budget plus < ALIGN bytes of padding per staged operation of a round.
            assert st["staging_bytes"] <= res["budget"] + ALIGN * res["max_ops"]
            # Hard: sources and destinations never coexist beyond their sum (plus one staging buffer).
            assert st["peak_bytes"] <= st["src_bytes"] + st["dst_bytes"] + st["staging_bytes"], res
            # Hard: the bound with C = the largest single local tensor of a state.
            bound = max(st["src_bytes"], st["dst_bytes"]) + st["staging_bytes"] + res["max_state_bytes"]
            assert st["peak_bytes"] <= bound, res
            # The switch runs in phases that each double at most half the budget (a state larger than that is a
            # phase alone) and stages a round in the other half (plus each message's alignment padding).
            in_flight = max(res["budget"] // 2, res["max_state_bytes"])
            assert st["peak_bound"] == max(st["src_bytes"], st["dst_bytes"]) + st["staging_bytes"] + in_flight
            assert st["peak_bytes"] <= st["peak_bound"], res
            multi_round += res["rounds"] > 2
            moved += st["bytes_sent"]
            in_place += st["bytes_zero_copy"]
            assert res["received_in_place_ahead"], res
            received_ahead += st["bytes_received"] if res["ahead"] else 0
    assert multi_round, "the budget should force several rounds in some case"
    assert moved > 0
    assert (in_place > 0) == (direct_min is not None)  # these tiny states are all below the default threshold
    assert (received_ahead > 0) == ahead, "some case should scale out, its joiners receiving into tensors made ahead"
    if one_storage:  # both ways: a buffer emptied after its last source, and one a kept state holds on to
        ends = {res["one_storage"] for r in out for res in r["results"] if "one_storage" in res}
        assert ends == {"kept", "emptied"}, ends


def test_the_wire_sees_a_box_as_contiguous_exactly_when_torch_does():
    from dynatrain.engine.wire import contiguous
    from dynatrain.vps.box import Box

    rng = random.Random(7)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        lo = tuple(rng.randint(0, n - 1) for n in shape)
        hi = tuple(rng.randint(a + 1, n) for a, n in zip(lo, shape))
        view = torch.empty(shape)[tuple(slice(a, b) for a, b in zip(lo, hi))]
        origin = tuple(0 for _ in shape)
        assert contiguous(shape, origin, Box(lo, hi)) == view.is_contiguous(), (shape, lo, hi)
