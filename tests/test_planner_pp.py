"""Pipeline parallelism in the planners: the analytic pp layouts (each state held by one stage), switches that change
pp (every byte delivered once, bytes on the wire = bytes whose owner changes), the layout policy's pp candidates and
`dynatrain plan` with pp. Pure Python: no process group."""

from __future__ import annotations

import json

import pytest

from _planner_check import execute
from dynatrain.cli import plan as plan_cli
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.specs import layout_for_model
from dynatrain.models.stage_split import stage_split
from dynatrain.planner import NetworkModel, plan_switch
from dynatrain.planner.layouts import (
    GiB, Devices, LayoutPolicy, Workload, choose_layout, enumerate_configs, estimate_layout, price_switch,
    rank_layouts,
)
from dynatrain.planner.pipeline_cost import in_flight, stage_loads
from dynatrain.vps import Layout, ParallelConfig

P = ParallelConfig.parse
DEBUG = MODEL_CONFIGS["debug"]  # 4 layers


def _stage_of_positions(layout: Layout, name: str) -> set[int]:
    """The pp coordinates of the positions that hold any of state ``name``."""
    cfg = layout.config
    held = layout.classes[layout.state_class[layout.state_index(name)]]
    return {cfg.stage_of(q) for q, shards in enumerate(held) if shards.boxes}


def _covered_once_per_stage_position(layout: Layout, name: str) -> None:
    """The holding stage's positions hold the whole state, each element once per dp_replicate copy."""
    cfg = layout.config
    spec = layout.state(name)
    held = layout.classes[layout.state_class[layout.state_index(name)]]
    total = sum(shards.numel for shards in held)
    assert total == spec.numel * cfg.dp_replicate * (cfg.tp if spec.tp_dim is None else 1)


# ------------------------------------------------------------------------------------------- analytic layouts
@pytest.mark.parametrize("layout,v", [("pp=2,dp_shard=2,tp=2", 1), ("pp=4,dp_replicate=2", 1),
                                      ("pp=3,dp_shard=3", 1), ("pp=2,dp_shard=2", 2)])
def test_every_state_is_held_by_exactly_one_stage(layout, v):
    cfg = P(layout)
    lay = layout_for_model(DEBUG, cfg, stages_per_rank=v)
    assert lay.world_size == cfg.pp * cfg.stage_size and lay.config == cfg
    split = stage_split(DEBUG, cfg.pp * v)
    last = (cfg.pp * v - 1) % cfg.pp
    for spec in lay.states:
        stages = _stage_of_positions(lay, spec.name)
        assert len(stages) == 1, (spec.name, stages)
        (stage,) = stages
        if spec.name.startswith("tok_embeddings."):
            assert stage == 0
        elif spec.name.startswith(("norm.", "output.")):
            assert stage == last
        else:
            layer = int(spec.name.split(".")[1])
            owner = next(j for j, (lo, hi) in enumerate(split) if lo <= layer < hi)
            assert stage == owner % cfg.pp  # looped placement: stage j on pp rank j % pp
        _covered_once_per_stage_position(lay, spec.name)
    # Every stage holds something, and a position of another stage holds an empty (0, ...) tensor.
    for k in range(cfg.pp):
        q = k * cfg.stage_size
        assert lay.held_bytes(q) > 0
    emb = lay.shards("tok_embeddings.weight", cfg.stage_size * (cfg.pp - 1))
    assert emb.boxes == () and emb.local_shape == (0, 0)


def test_the_fast_pp_layout_equals_the_one_built_from_its_placements():
    for layout in ("pp=2,dp_shard=2,tp=2", "pp=4,dp_replicate=2", "pp=3,dp_shard=3,tp=1"):
        cfg = P(layout)
        fast = layout_for_model(DEBUG, cfg, kind="bf16-adam", rank_map=list(range(cfg.world_size))[::-1])
        slow = Layout.from_shardings(fast.states, fast.shardings, cfg, fast.rank_map)
        for i in range(len(fast.states)):
            assert fast.classes[fast.state_class[i]] == slow.classes[slow.state_class[i]], fast.states[i].name
        assert fast.shardings[0].held == (0, (0,))  # the embedding, on stage 0 of the pp mesh dimension
        assert fast.needed_bytes == slow.needed_bytes


def test_a_pp_layout_without_pp_is_the_plain_one():
    plain = layout_for_model(DEBUG, P("dp_shard=2,tp=2"), stages_per_rank=3)  # one stage whatever v says
    assert plain.classes == layout_for_model(DEBUG, P("dp_shard=2,tp=2")).classes and plain.shardings is None


def test_too_many_stages_and_experts_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"pp=2 x stages_per_rank=3 = 6 pipeline stages .* has 4: choose pp x "
                                         r"stages_per_rank <= 4"):
        layout_for_model(DEBUG, P("pp=2,dp_shard=2"), stages_per_rank=3)
    with pytest.raises(ValueError, match="choose pp <= 4"):
        layout_for_model(DEBUG, P("pp=8"))
    with pytest.raises(ValueError, match="stages_per_rank must be a positive integer"):
        layout_for_model(DEBUG, P("pp=2"), stages_per_rank=0)
    with pytest.raises(ValueError, match="not supported for mixture-of-experts models yet: use pp=1"):
        layout_for_model("moe-debug", P("pp=2,dp_shard=2"))
    # A pp shape alone does not say which layers a stage holds: the planner wants the Layout.
    with pytest.raises(ValueError, match="pass the target as a Layout"):
        plan_switch(layout_for_model(DEBUG, P("dp_shard=4")), "pp=2,dp_shard=2")


# ------------------------------------------------------------------------------------------- switches
def _bytes_whose_owner_changes(plan) -> int:
    """Independently of routing: per state and new position, the bytes its process needs less those it held."""
    old, new = plan.old, plan.new
    moved = 0
    for spec in new.states:
        for q, proc in enumerate(new.rank_map):
            need = new.shards(spec.name, proc).boxes
            have = old.boxes(spec.name, proc)
            kept = sum(b.intersect(h).numel for b in need for h in have if b.intersect(h) is not None)
            moved += (sum(b.numel for b in need) - kept) * spec.itemsize
    return moved


SWITCHES = [
    ("dp_shard=4,tp=2", "pp=2,dp_shard=2,tp=2"),      # pp 1 -> 2
    ("pp=2,dp_shard=2,tp=2", "pp=4,dp_shard=2"),      # pp 2 -> 4, tp off
    ("pp=4,dp_shard=2", "dp_shard=4,tp=2"),           # pp 4 -> 1, tp on
    ("pp=2,dp_replicate=2,dp_shard=2", "pp=4,tp=2"),  # HSDP replicas to more stages
    ("pp=3,dp_shard=2", "pp=2,dp_shard=3"),           # uneven splits on both sides
]


@pytest.mark.parametrize("old,new", SWITCHES)
@pytest.mark.parametrize("gpus_per_node", [None, 2])
def test_pp_switches_deliver_every_byte_once_and_move_only_what_changes_owner(old, new, gpus_per_node):
    a, b = layout_for_model(DEBUG, P(old)), layout_for_model(DEBUG, P(new))
    plan = plan_switch(a, b, budget_bytes=1 << 17, gpus_per_node=gpus_per_node)
    execute(plan)  # exact cover, values, budget, alloc/free order, sender and receiver agree
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan)
    assert plan.bytes_moved <= plan.bytes_moved_identity
    if gpus_per_node is not None:
        tp = P(new).tp
        rm = plan.new.rank_map
        assert all(len({p // gpus_per_node for p in rm[g:g + tp]}) == 1 for g in range(0, len(rm), tp))


def test_interleaved_stages_and_a_scale_in_across_a_pp_change():
    # Two stages per pp rank (4 stages of one layer, stage j on pp rank j % 2) -> 3 plain stages on 6 of the 8.
    a = layout_for_model(DEBUG, P("pp=2,dp_shard=4"), stages_per_rank=2)
    assert {k for k in range(2) if a.shards("layers.0.attention.wq.weight", 4 * k).boxes} == {0}
    assert {k for k in range(2) if a.shards("layers.1.attention.wq.weight", 4 * k).boxes} == {1}
    assert {k for k in range(2) if a.shards("layers.2.attention.wq.weight", 4 * k).boxes} == {0}
    b = layout_for_model(DEBUG, P("pp=3,dp_shard=2"))
    plan = plan_switch(a, b, leave=[7, 3], budget_bytes=1 << 16)
    execute(plan)
    assert not {3, 7} & set(plan.new.processes) and len(plan.new.processes) == 6
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan)


def test_moving_whole_stages_keeps_what_stays_on_its_stage():
    # Same stage size, pp 2 -> 4: with the optimal map every process keeps the quarter of the layers it still
    # holds; the identity map puts stage 1's processes on stage 2's layers too, so it cannot keep more.
    a, b = layout_for_model(DEBUG, P("pp=2,dp_shard=2")), layout_for_model(DEBUG, P("pp=4"))
    plan = plan_switch(a, b, budget_bytes=1 << 20)
    assert 0 < plan.bytes_moved < plan.bytes_total
    assert plan.bytes_moved == _bytes_whose_owner_changes(plan) <= plan.bytes_moved_identity


# ------------------------------------------------------------------------------------------- policy
def test_pp_candidates_divide_the_devices_and_give_every_stage_a_layer():
    cands = enumerate_configs(16, MODEL_CONFIGS["1b"])  # 16 layers
    pps = {c.pp for c in cands}
    assert pps == {1, 2, 4, 8, 16} and all(c.world_size == 16 for c in cands)
    assert {c.pp for c in enumerate_configs(16, DEBUG)} == {1, 2, 4}  # 4 layers: no pp=8 or 16
    assert {c.pp for c in enumerate_configs(16)} == {1}  # without a model there is no layer count
    # A module the strategy cannot run as a pipeline (no pipeline_loss) is offered no pp layout.
    assert {c.pp for c in enumerate_configs(16, DEBUG, pipeline=False)} == {1}


def test_stage_loads_and_1f1b_in_flight():
    loads = stage_loads(stage_split(MODEL_CONFIGS["llama3-70b"], 4), 4)
    assert sum(x.layers for x in loads) == 80 and loads[0].first and loads[-1].last
    assert [in_flight(4, k, 16) for k in range(4)] == [4, 3, 2, 1] and in_flight(4, 0, 2) == 2
    interleaved = stage_loads(stage_split(MODEL_CONFIGS["llama3-70b"], 8), 4)
    assert interleaved[3].last and not interleaved[0].last and sum(x.layers for x in interleaved) == 80


def test_pp_memory_counts_the_busiest_stage():
    work = Workload("llama3-70b", seq_len=2048, global_batch=256, micro_batch=1)
    devices = Devices(64, 80 * 10**9, per_node=8, flops=989e12)
    flat = estimate_layout("dp_shard=8,tp=8", devices, work).memory
    piped = estimate_layout("pp=8,tp=8", devices, work).memory
    # States and gradients split over the same 64 devices either way (one stage's layers, not sharded further).
    assert piped.states == pytest.approx(flat.states, rel=0.15)
    # The split is 8, 9, 10, 11, 11, 11, 11, 9 layers: the pace (11 layers) kept, early stages lighter since under
    # 1F1B stage k holds 8 - k micro-batches; the peak, 8 x 8 = 64 layer-micro-batches on the first stage, is less
    # than the whole model's 80 layers of one micro-batch without pp.
    assert stage_split(MODEL_CONFIGS["llama3-70b"], 8) == ((0, 8), (8, 17), (17, 27), (27, 38), (38, 49), (49, 60),
                                                           (60, 71), (71, 80))
    assert 0.6 * flat.activations < piped.activations < 0.8 * flat.activations
    assert piped.logits == 0  # the output runs on the last stage only, which is not the busiest
    # A stage keeps its blocks gathered through the step and accumulates fp32 gradients unsharded.
    assert piped.gathered > flat.gathered


def test_pp_step_pays_the_bubble_and_the_stage_to_stage_sends():
    work = Workload("llama3-70b", seq_len=2048, global_batch=256, micro_batch=1)
    devices = Devices(64, 80 * 10**9, per_node=8, flops=989e12)
    t = estimate_layout("pp=4,dp_shard=4,tp=4", devices, work).time
    assert t.micro_steps == 64
    assert t.bubble == pytest.approx((t.compute + t.tp + t.p2p) * 3 / 64)
    # 2048 tokens x 8192 x bf16 forward and back per micro-batch over a NIC share (25 GB/s) plus latency.
    per_micro = 2 * (2048 * 8192 * 2 / 25e9 + 20e-6)
    assert t.p2p == pytest.approx(64 * per_micro)
    assert t.total == pytest.approx(t.compute + t.tp + t.p2p + t.bubble + t.fsdp + t.hsdp - t.hidden)
    inside = estimate_layout("pp=2,dp_shard=2,tp=2", Devices(8, 80 * 10**9, per_node=8, flops=989e12),
                             work).time
    assert inside.p2p == pytest.approx(inside.micro_steps * 2 * (2048 * 8192 * 2 / 400e9 + 20e-6))


def test_policy_picks_pp_when_nothing_else_fits():
    # 125m on 4 small devices: a micro-batch's logits and the activations of all 12 layers do not fit any
    # pp=1 layout; under 1F1B the last stage alone holds the logits, for one micro-batch.
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    devices = Devices(4, int(2.4 * GiB), per_node=4, flops=50e9, efficiency=0.5, network=net)
    work = Workload("125m", seq_len=1024, global_batch=16, micro_batch=4)
    ranked = rank_layouts(devices, work)
    assert not any(c.runnable for c in ranked if c.config.pp == 1)
    best = choose_layout(devices, work)
    assert best.config.pp > 1 and best.memory_bytes <= best.memory_limit
    decision = LayoutPolicy().decide(devices, work, "dp_shard=4")
    assert decision.changes and decision.target.pp > 1 and "cannot run" in decision.reason
    assert decision.switch.bytes_moved > 0  # priced from the analytic pp layout


def test_policy_prefers_pp_when_it_is_faster_and_keeps_pp1_where_it_is():
    work = Workload("llama3-70b", seq_len=2048, global_batch=256, micro_batch=1)
    best = choose_layout(Devices(64, 80 * 10**9, per_node=8, flops=989e12), work)
    assert best.config.pp > 1 and best.time.bubble > 0
    # On the 4-process CPU setup of the debug model data parallelism hides its traffic: the bubble only costs.
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    cpus = Devices(4, 4 * GiB, per_node=4, flops=50e9, efficiency=0.5, network=net)
    debug = Workload("debug", seq_len=256, global_batch=32, micro_batch=4, compute_dtype="float32")
    assert choose_layout(cpus, debug).config == P("dp_shard=4")


def test_pp_layouts_the_schedule_cannot_run_are_excluded():
    devices = Devices(8, 80 * 10**9, per_node=8, flops=989e12)
    few = estimate_layout("pp=4,dp_shard=2", devices, Workload("1b", seq_len=1024, global_batch=4))
    assert not few.runnable and "1F1B needs at least pp=4 micro-batches" in few.excluded
    moe = estimate_layout("pp=2,dp_shard=4", devices, Workload("moe-debug", seq_len=256, global_batch=64))
    assert not moe.runnable and "not supported for mixture-of-experts" in moe.excluded


def test_a_pp_switch_is_priced_from_the_analytic_layouts():
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    devices = Devices(8, 4 * GiB, per_node=4, flops=50e9, network=net)
    work = Workload("debug", seq_len=256, global_batch=32, micro_batch=2, compute_dtype="float32")
    cost = price_switch("dp_shard=4,tp=2", "pp=2,dp_shard=2,tp=2", devices, work, budget_bytes=1 << 20)
    old, new = layout_for_model(DEBUG, P("dp_shard=4,tp=2")), layout_for_model(DEBUG, P("pp=2,dp_shard=2,tp=2"))
    plan = plan_switch(old, new, budget_bytes=1 << 20, gpus_per_node=4)
    assert cost.bytes_moved == plan.bytes_moved > 0 and cost.rounds == plan.num_rounds


# ------------------------------------------------------------------------------------------- dynatrain plan
def _json(capsys, *argv):
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_with_pp(capsys):
    out = _json(capsys, "--model", "llama3-70b", "--from", "dp_shard=16,tp=8", "--to", "pp=2,dp_shard=8,tp=8",
                "--gpus-per-node", "8")
    assert out["to"] == "pp=2,dp_shard=8,tp=8" and out["processes_new"] == 128 and out["stages_per_rank"] == 1
    # Each process keeps its 1/16 of the layers its new stage holds: half of what its new 1/8 share needs.
    assert out["fraction_moved"] == pytest.approx(0.5, abs=0.01)
    assert out["bytes_moved"] < out["bytes_moved_identity"] and out["predicted_seconds"] > 0
    back = _json(capsys, "--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "pp=4", "--stages-per-rank", "1",
                 "--budget-mb", "1")
    assert back["from"] == "pp=2,dp_shard=2" and back["processes_old"] == 4
    text_ok = plan_cli.main(["--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "dp_shard=2,tp=2",
                             "--stages-per-rank", "2"])
    assert text_ok == 0 and "2 pipeline stage(s) per pp rank" in capsys.readouterr().out


def test_plan_cli_refuses_too_many_stages_without_a_traceback(capsys):
    assert plan_cli.main(["--model", "debug", "--from", "pp=2,dp_shard=2", "--to", "pp=4",
                          "--stages-per-rank", "2"]) == 2
    err = capsys.readouterr().err
    assert "choose pp x stages_per_rank <= 4" in err and "Traceback" not in err
    assert plan_cli.main(["--model", "debug", "--from", "dp_shard=2", "--to", "pp=8"]) == 2
    assert "choose pp <= 4" in capsys.readouterr().err
    assert plan_cli.main(["--model", "moe-debug", "--from", "dp_shard=4", "--to", "pp=2,dp_shard=2"]) == 2
    assert "use pp=1" in capsys.readouterr().err
