"""Pipeline parallelism in the layout policy: pp candidates, the busiest stage's memory, the 1F1B bubble and
stage-to-stage sends in the step time, choosing pp, and pricing a switch that changes pp. Pure Python."""

from __future__ import annotations

import pytest

from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.specs import layout_for_model
from dynatrain.models.stage_split import stage_split
from dynatrain.planner import NetworkModel, plan_switch
from dynatrain.policy import (
    GiB, Devices, LayoutPolicy, Workload, choose_layout, enumerate_configs, estimate_layout, price_switch,
    rank_layouts,
)
from dynatrain.vps import ParallelConfig

P = ParallelConfig.parse
DEBUG = MODEL_CONFIGS["debug"]  # 4 layers


def test_pp_candidates_divide_the_devices_and_give_every_stage_a_layer():
    cands = enumerate_configs(16, MODEL_CONFIGS["1b"])  # 16 layers
    pps = {c.pp for c in cands}
    assert pps == {1, 2, 4, 8, 16} and all(c.world_size == 16 for c in cands)
    assert {c.pp for c in enumerate_configs(16, DEBUG)} == {1, 2, 4}  # 4 layers: no pp=8 or 16
    assert {c.pp for c in enumerate_configs(16)} == {1}  # without a model there is no layer count
    # A module the strategy cannot run as a pipeline (no pipeline_loss) is offered no pp layout.
    assert {c.pp for c in enumerate_configs(16, DEBUG, pipeline=False)} == {1}


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
    # pp=1 layout without loss parallelism (whole logits on every TP rank); under 1F1B the last stage alone holds
    # the logits, for one micro-batch.
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    devices = Devices(4, int(2.4 * GiB), per_node=4, flops=50e9, efficiency=0.5, network=net)
    work = Workload("125m", seq_len=1024, global_batch=16, micro_batch=4, loss_parallel=False)
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
    moe = estimate_layout("pp=4,dp_shard=2,ep=2", devices, Workload("moe-debug", seq_len=256, global_batch=64))
    assert not moe.runnable and "pp=4 needs at least one layer per stage" in moe.excluded  # moe-debug has 2


def test_a_pp_switch_is_priced_from_the_analytic_layouts():
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    devices = Devices(8, 4 * GiB, per_node=4, flops=50e9, network=net)
    work = Workload("debug", seq_len=256, global_batch=32, micro_batch=2, compute_dtype="float32")
    cost = price_switch("dp_shard=4,tp=2", "pp=2,dp_shard=2,tp=2", devices, work, budget_bytes=1 << 20)
    old, new = layout_for_model(DEBUG, P("dp_shard=4,tp=2")), layout_for_model(DEBUG, P("pp=2,dp_shard=2,tp=2"))
    plan = plan_switch(old, new, budget_bytes=1 << 20, gpus_per_node=4)
    assert cost.bytes_moved == plan.bytes_moved > 0 and cost.rounds == plan.num_rounds
