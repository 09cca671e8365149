"""Pipeline stages with routed experts in the layout policy: pp x ep candidates, a stage's experts in its memory,
its experts' compute and all-to-alls in its step, and a pp x ep switch priced from the analytic layouts. Pure
Python."""

from __future__ import annotations

import pytest

from dynatrain.models.moe_configs import MOE_CONFIGS
from dynatrain.models.moe_specs import moe_stage_split
from dynatrain.models.specs import layout_for_model
from dynatrain.planner import plan_switch
from dynatrain.policy import Devices, Workload, enumerate_configs, estimate_layout, price_switch
from dynatrain.policy.sizes import model_sizes
from dynatrain.vps import ParallelConfig

P = ParallelConfig.parse
QWEN = MOE_CONFIGS["qwen3-235b-a22b"]
H100 = Devices(1024, 80 * 10**9, per_node=8, flops=989e12)
WORK = Workload("qwen3-235b-a22b", seq_len=4096, global_batch=2048, micro_batch=1, activation_checkpointing="full")


def test_pp_candidates_of_a_moe_model_take_every_ep_of_their_stage():
    cands = set(enumerate_configs(16, MOE_CONFIGS["moe-debug"]))  # 2 layers, 8 experts
    assert P("pp=2,dp_shard=8,ep=8") in cands and P("pp=2,dp_shard=4,tp=2,ep=4") in cands
    assert P("pp=2,dp_replicate=2,dp_shard=4,ep=2") in cands
    assert {c.pp for c in cands} == {1, 2} and all(c.world_size == 16 for c in cands)
    # ep divides the stage's dp_shard and the experts: never 16 (8 experts), never past a stage's 8 ranks
    assert max(c.ep for c in cands if c.pp == 2) == 8 and max(c.ep for c in cands if c.pp == 1) == 8
    assert {c.pp for c in enumerate_configs(16, MOE_CONFIGS["moe-debug"], pipeline=False)} == {1}


def test_a_stage_holds_its_layers_experts_sharded_over_its_dp_shard_and_gathers_its_ep_share():
    piped = estimate_layout("pp=8,dp_shard=128,ep=8", H100, WORK)
    flat = estimate_layout("dp_shard=1024,ep=8", H100, WORK)
    sizes = model_sizes(QWEN, 1)
    busiest = max(hi - lo for lo, hi in moe_stage_split(QWEN, 8))
    expert_state = busiest * sizes.expert_block / 128 * WORK.state_bytes
    # The experts are most of the state: the busiest stage's 12 of 94 layers over its 128 ranks, the same share of
    # the whole as 94 layers over 1,024.
    assert expert_state < piped.memory.states < 1.1 * expert_state
    assert piped.memory.states == pytest.approx(flat.memory.states, rel=0.1)
    # Gathered for the step on the busiest, first stage: its embedding and layers with its ep group's 16 of 128
    # experts each, in bf16 and as fp32 gradients.
    gathered = (sizes.embedding + busiest * (sizes.block + sizes.expert_block / 8)) * (2 + 4)
    assert piped.memory.gathered == pytest.approx(gathered, rel=0.05)
    assert piped.runnable and piped.memory.total < 0.85 * piped.memory_limit  # the recipe's 15 % to spare


def test_a_stage_pays_its_experts_compute_and_its_layers_all_to_alls():
    with_ep = estimate_layout("pp=8,dp_shard=128,ep=8", H100, WORK).time
    without = estimate_layout("pp=8,dp_shard=128", H100, WORK).time
    assert with_ep.ep > 0 and without.ep == 0
    # 16 micro-batches, the busiest stage's layers: its share of the whole model's all-to-alls per micro-batch.
    flat = estimate_layout("dp_shard=1024,ep=8", H100, WORK).time
    per_layer_micro = flat.ep / flat.micro_steps / QWEN.n_layers
    assert with_ep.ep == pytest.approx(16 * 12 * per_layer_micro)
    assert with_ep.bubble == pytest.approx((with_ep.compute + with_ep.tp + with_ep.ep + with_ep.p2p) * 7 / 16)
    # A pp rank computes its stage's 12 of 94 layers, experts included, on the stage's 128 of 1,024 devices.
    share = 12 / 94 * 1024 / 128
    assert 0.9 * share * flat.compute < with_ep.compute < 1.1 * share * flat.compute
    assert 0.9 * share * flat.recompute < with_ep.recompute < 1.1 * share * flat.recompute


def test_a_pp_x_ep_switch_is_priced_from_the_analytic_layouts():
    devices = Devices(8, 80 * 10**9, per_node=4, flops=50e9)
    work = Workload("moe-debug", seq_len=256, global_batch=32, micro_batch=2, compute_dtype="float32")
    cost = price_switch("dp_shard=8,ep=8", "pp=2,dp_shard=4,ep=4", devices, work, budget_bytes=1 << 20)
    cfg = MOE_CONFIGS["moe-debug"]
    old, new = layout_for_model(cfg, P("dp_shard=8,ep=8")), layout_for_model(cfg, P("pp=2,dp_shard=4,ep=4"))
    plan = plan_switch(old, new, budget_bytes=1 << 20, gpus_per_node=4)
    assert cost.bytes_moved == plan.bytes_moved > 0 and cost.rounds == plan.num_rounds
