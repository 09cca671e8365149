from __future__ import annotations

import math

import pytest

from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.planner import NetworkModel, plan_switch
from dynatrain.policy import (
    GiB, CostModel, Devices, LayoutPolicy, Workload, choose_layout, enumerate_configs, estimate_layout,
    plan_layout, price_switch, rank_layouts, weigh_switch,
)
from dynatrain.models.specs import model_states
from dynatrain.vps import Layout, ParallelConfig

H100 = 989e12  # dense bf16 FLOP/s


def _gpus(count: int, memory_gb: float = 80) -> Devices:
    return Devices(count, int(memory_gb * 1e9), per_node=8, flops=H100)


def _cpus(count: int = 4) -> Devices:
    # gloo over loopback on a shared machine: slow links, a long per-collective latency, few FLOP/s.
    net = NetworkModel(gpus_per_node=4, link_gbps=10, nics_per_node=1, intra_node_gbps=20, round_latency_s=1e-4)
    return Devices(count, 4 * GiB, per_node=4, flops=50e9, efficiency=0.5, network=net)


def _debug_work(**kw) -> Workload:
    args = dict(seq_len=256, global_batch=32, micro_batch=4, compute_dtype="float32")
    args.update(kw)
    return Workload("debug", **args)


def _cfg(text: str) -> ParallelConfig:
    return ParallelConfig.parse(text)


# ------------------------------------------------------------------------------------------- known cases
@pytest.mark.parametrize("count", [64, 128])
@pytest.mark.parametrize("seq_len,micro_batch", [(2048, 1), (2048, 2), (4096, 1)])
def test_70b_on_80gb_devices_is_never_chosen_with_tp1(count, seq_len, micro_batch):
    assert "llama3-70b" in MODEL_CONFIGS
    work = Workload("llama3-70b", seq_len=seq_len, global_batch=4 * count, micro_batch=micro_batch)
    ranked = rank_layouts(_gpus(count), work)
    best = ranked[0]
    assert best.runnable and best.config.tp > 1
    assert best.memory_bytes <= best.memory_limit
    tp1 = [c for c in ranked if c.config.tp == 1]
    assert tp1 and all(not c.runnable and "does not fit memory" in c.excluded for c in tp1)


def test_debug_model_on_four_cpu_processes_picks_pure_data_parallel():
    best = choose_layout(_cpus(4), _debug_work())
    assert best.config.tp == 1 and best.config.dp_size == 4
    assert best.config == _cfg("dp_shard=4")  # ties on time go to the smallest memory
    ranked = rank_layouts(_cpus(4), _debug_work())
    with_tp = [c for c in ranked if c.config.tp > 1]
    assert all(c.step_seconds > best.step_seconds for c in with_tp)


def test_every_layout_is_listed_once_runnable_ones_fastest_first():
    ranked = rank_layouts(_cpus(4), _debug_work())
    debug = MODEL_CONFIGS["debug"]
    assert sorted(c.config for c in ranked) == sorted(enumerate_configs(4, debug))
    assert len(enumerate_configs(4)) == 6 and all(c.world_size == 4 for c in enumerate_configs(4))
    # With the model, pp=2 (3 layouts of the other 2 devices) and pp=4 (one) join: the debug model has 4 layers.
    assert len(enumerate_configs(4, debug)) == 10 and {c.pp for c in enumerate_configs(4, debug)} == {1, 2, 4}
    times = [c.step_seconds for c in ranked if c.runnable]
    assert times == sorted(times) and len(times) == 10


# ------------------------------------------------------------------------------------------- exclusions
def test_a_layout_that_does_not_fit_is_excluded_with_the_numbers():
    work = Workload("llama3-70b", seq_len=2048, global_batch=256, micro_batch=1)
    cand = estimate_layout("dp_shard=64", _gpus(64), work)
    assert not cand.runnable and cand.memory_bytes > cand.memory_limit
    assert "does not fit memory" in cand.excluded and "GiB per device" in cand.excluded
    assert "activations" in cand.excluded and "10% reserve" in cand.excluded


def test_no_layout_fits_raises_naming_every_reason():
    work = Workload("llama3-70b", seq_len=2048, global_batch=64, micro_batch=1)
    with pytest.raises(ValueError) as err:
        choose_layout(_gpus(8), work)
    text = str(err.value)
    assert "no layout of model 'llama3-70b' runs on 8 devices" in text
    for cfg in enumerate_configs(8):
        assert f"  {cfg.short()}: " in text
    assert "does not fit memory" in text
    with pytest.raises(ValueError, match="no layout"):
        plan_layout(_gpus(8), work)


def test_global_batch_not_divisible_is_excluded():
    work = _debug_work(global_batch=6, micro_batch=1)
    ranked = rank_layouts(_cpus(4), work)
    for c in ranked:
        if c.config.dp_size == 4:
            assert not c.runnable and "global_batch=6 is not a multiple of dp_size*micro_batch" in c.excluded
        else:
            assert c.runnable, c.excluded
    assert ranked[0].config.dp_size == 2 and ranked[0].time.micro_steps == 3


def test_tp_group_must_stay_inside_a_node():
    devices = Devices(8, 4 * GiB, per_node=2, flops=50e9,
                      network=NetworkModel(gpus_per_node=2, intra_node_gbps=20, link_gbps=10))
    cand = estimate_layout("dp_shard=2,tp=4", devices, _debug_work())
    assert not cand.runnable and "span nodes" in cand.excluded
    assert estimate_layout("dp_shard=4,tp=2", devices, _debug_work()).runnable


def test_tp_that_does_not_divide_the_model_is_excluded():
    cand = estimate_layout("dp_shard=1,tp=8", Devices(8, 4 * GiB, 8, 50e9), _debug_work())
    assert not cand.runnable and "does not divide n_kv_heads=4" in cand.excluded


# ------------------------------------------------------------------------------------------- cost model
def test_memory_shards_states_over_dp_shard_and_tp_only():
    model = MODEL_CONFIGS["debug"]
    work = _debug_work()
    n = model.num_params()
    one = estimate_layout("dp_shard=1", Devices(1, 4 * GiB, 1, 50e9), work).memory
    assert one.states == n * 12 and one.grads == n * 4  # fp32 weight + two fp32 moments; fp32 gradient
    four = _cpus(4)
    assert estimate_layout("dp_shard=4", four, work).memory.states == n * 12 / 4
    assert estimate_layout("dp_replicate=4", four, work).memory.states == n * 12
    # Norms are whole on every TP rank: TP keeps (tp - 1) extra copies of them.
    norms = (2 * model.n_layers + 1) * model.dim
    split = estimate_layout("dp_shard=2,tp=2", four, work).memory
    assert split.states * 4 == (n + norms) * 12
    bf16 = estimate_layout("dp_shard=4", four, _debug_work(state_kind="bf16-adam")).memory
    assert bf16.states == n * 14 / 4 and bf16.grads == n * 2 / 4


def test_activations_scale_with_micro_batch_and_shrink_with_tp():
    four = _cpus(4)
    a1 = estimate_layout("dp_shard=4", four, _debug_work(micro_batch=1)).memory.activations
    a2 = estimate_layout("dp_shard=4", four, _debug_work(micro_batch=2)).memory.activations
    assert a2 == pytest.approx(2 * a1)
    tp2 = estimate_layout("dp_shard=2,tp=2", four, _debug_work(micro_batch=1)).memory.activations
    assert a1 / 2 < tp2 < a1  # the norms stay replicated without sequence parallelism
    work = _debug_work(micro_batch=1, sequence_parallel=True)
    sp = estimate_layout("dp_shard=2,tp=2", four, work).memory
    # sequence parallelism splits everything but the attention's and the FFN's all-gathered inputs (fp32 here)
    gathered = work.seq_len * work.model.n_layers * 2 * 4 * work.model.dim
    assert sp.activations == pytest.approx(a1 / 2 + gathered) and sp.activations < tp2
    unfused = estimate_layout("dp_shard=4", four, _debug_work(micro_batch=1, fused_attention=False)).memory
    assert unfused.activations > a1


def test_compute_is_6n_plus_attention_per_token_split_over_devices():
    model = MODEL_CONFIGS["debug"]
    work = _debug_work()
    devices = _cpus(4)
    per_token = 6 * (model.num_params() - model.vocab_size * model.dim) + 12 * model.n_layers * model.dim * 256
    expected = 32 * 256 * per_token / 4 / (50e9 * 0.5)
    for cfg in ("dp_shard=4", "dp_replicate=2,tp=2", "tp=4"):
        assert estimate_layout(cfg, devices, work).time.compute == pytest.approx(expected)


def test_fsdp_volume_inside_one_node():
    model = MODEL_CONFIGS["debug"]
    work = _debug_work()
    devices = _cpus(4)
    t = estimate_layout("dp_shard=4", devices, work).time
    n, layers = model.num_params(), model.n_layers
    block = sum(math.prod(s) for k, s in model.param_shapes().items() if k.startswith("layers.0."))
    root = n - layers * block
    rate = devices.network.intra_bytes_per_s
    # fp32 gathers: forward all units, backward all but the last block and the root; fp32 reduce-scatter.
    per_micro = ((2 * n - block - root) * 4 * 3 / 4 + n * 4 * 3 / 4) / rate + (3 * layers + 1) * 1e-4
    assert t.micro_steps == 2 and t.fsdp == pytest.approx(2 * per_micro)
    assert t.hsdp == 0 and t.tp == 0


def test_groups_that_span_nodes_are_slower_and_tp_is_never_hidden():
    work = Workload("1b", seq_len=2048, global_batch=64, micro_batch=1)
    one_node = Devices(8, 80 * GiB, per_node=8, flops=H100)
    two_nodes = Devices(8, 80 * GiB, per_node=4, flops=H100, network=NetworkModel(gpus_per_node=4))
    inside = estimate_layout("dp_shard=8", one_node, work).time
    across = estimate_layout("dp_shard=8", two_nodes, work).time
    assert across.fsdp > inside.fsdp
    with_tp = estimate_layout("dp_shard=4,tp=2", one_node, work).time
    assert with_tp.tp > 0 and with_tp.total >= with_tp.compute + with_tp.tp


def test_overlap_factor_bounds_the_step_between_max_and_sum():
    work = Workload("1b", seq_len=2048, global_batch=64, micro_batch=1)
    devices = Devices(16, 80 * GiB, per_node=8, flops=H100, network=NetworkModel(gpus_per_node=8, link_gbps=25))
    hide = estimate_layout("dp_shard=16", devices, work, CostModel(overlap=1.0)).time
    none = estimate_layout("dp_shard=16", devices, work, CostModel(overlap=0.0)).time
    assert hide.total == pytest.approx(max(hide.compute, hide.fsdp))
    assert none.total == pytest.approx(none.compute + none.fsdp)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="per_node=4 but network.gpus_per_node=8"):
        Devices(4, GiB, per_node=4, flops=1e9, network=NetworkModel())
    with pytest.raises(ValueError, match="efficiency"):
        Devices(4, GiB, 4, 1e9, efficiency=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        Workload("debug", seq_len=4096, global_batch=8)
    with pytest.raises(ValueError, match="unknown model"):
        Workload("nope", seq_len=16, global_batch=8)


# ------------------------------------------------------------------------------------------- switch policy
def test_switch_cost_comes_from_the_routing_planner():
    devices, work = _cpus(4), _debug_work()
    cost = price_switch("dp_shard=2,tp=2", "dp_shard=4", devices, work, budget_bytes=1 << 20, fixed_seconds=0.5)
    old = Layout.from_config(model_states("debug", "fp32-adam"), _cfg("dp_shard=2,tp=2"))
    plan = plan_switch(old, "dp_shard=4", budget_bytes=1 << 20, gpus_per_node=4)
    assert cost.bytes_moved == plan.bytes_moved > 0 and cost.rounds == plan.num_rounds
    assert cost.transfer_seconds == pytest.approx(devices.network.predict_seconds(plan.traffic))
    assert cost.seconds == pytest.approx(cost.transfer_seconds + 0.5)


def test_same_device_switch_is_skipped_when_it_does_not_pay_over_the_horizon():
    devices, work = _cpus(4), _debug_work()
    current = _cfg("dp_shard=2,tp=2")
    verdict = weigh_switch(current, "dp_shard=4", devices, work, horizon_steps=1, fixed_seconds=1.0)
    per_step = verdict.current.step_seconds - verdict.candidate.step_seconds
    assert per_step > 0 and verdict.gain_seconds == pytest.approx(per_step)
    assert not verdict.pays and verdict.cost.seconds > verdict.gain_seconds
    breakeven = verdict.cost.seconds / per_step

    short = plan_layout(devices, work, current,
                        policy=LayoutPolicy(horizon_steps=math.floor(breakeven), fixed_seconds=1.0))
    assert short.target == current and not short.changes
    assert "does not pay" in short.reason and short.switch_seconds > short.gain_seconds
    assert short.bytes_moved == verdict.cost.bytes_moved

    long = plan_layout(devices, work, current,
                       policy=LayoutPolicy(horizon_steps=math.ceil(breakeven) + 1, fixed_seconds=1.0))
    assert long.changes and long.target == _cfg("dp_shard=4")
    assert long.gain_seconds > long.switch_seconds and long.reason.startswith("switch")


def test_the_best_layout_already_running_is_kept():
    devices, work = _cpus(4), _debug_work()
    for current in ("dp_shard=4", "dp_replicate=4"):  # equal predicted time: no switch for nothing
        decision = plan_layout(devices, work, current, policy=LayoutPolicy(horizon_steps=10**6))
        assert not decision.changes and decision.switch is None


def test_a_device_count_change_is_never_skipped():
    devices, work = _cpus(2), _debug_work()
    policy = LayoutPolicy(horizon_steps=0, fixed_seconds=1e9)
    decision = plan_layout(devices, work, "dp_shard=4", policy=policy)
    assert decision.changes and decision.target.world_size == 2 and decision.target.tp == 1
    assert "device count changed from 4 to 2" in decision.reason
    assert decision.switch.bytes_moved > 0 and decision.switch_seconds > 1e9
    with pytest.raises(ValueError, match="never skipped"):
        weigh_switch("dp_shard=4", "dp_shard=2", devices, work, horizon_steps=1)
    # Same count, but a process is lost and a fresh one takes its place: the old layout cannot run either.
    swap = plan_layout(_cpus(4), work, "dp_replicate=2,dp_shard=2", policy=policy, lost=[3])
    assert "processes leave or were lost" in swap.reason and swap.target == _cfg("dp_shard=4")
    assert swap.switch is not None and swap.switch.bytes_moved > 0


def test_a_current_layout_that_cannot_run_is_always_left():
    devices, work = _cpus(4), _debug_work(global_batch=6, micro_batch=1)
    decision = plan_layout(devices, work, "dp_shard=4", policy=LayoutPolicy(horizon_steps=0, fixed_seconds=1e9))
    assert decision.changes and decision.target.dp_size == 2
    assert "cannot run" in decision.reason and "global_batch=6" in decision.reason


def test_first_decision_has_no_switch():
    decision = plan_layout(_cpus(4), _debug_work())
    assert decision.current is None and decision.changes and decision.switch is None
    assert decision.target == _cfg("dp_shard=4") and decision.estimate.tokens_per_second > 0
    assert decision.ranked[0].config == decision.target


# ---------------------------------------------------------------------------------------------- mixture of experts
def _moe_work(**kw) -> Workload:
    args = dict(seq_len=1024, global_batch=256, micro_batch=1)
    args.update(kw)
    return Workload("qwen3-235b-a22b", **args)


def test_moe_candidates_take_every_ep_that_divides_dp_shard_and_the_experts():
    from dynatrain.models.moe_configs import MOE_CONFIGS

    cfg = MOE_CONFIGS["moe-debug"]  # 8 experts
    cands = enumerate_configs(32, cfg)
    assert ParallelConfig(1, 32, 1, 8) in cands and ParallelConfig(1, 16, 2, 4) in cands
    assert all(c.dp_shard % c.ep == 0 and cfg.n_experts % c.ep == 0 for c in cands)
    assert not any(c.ep == 16 for c in cands)  # divides dp_shard=16 or 32, not the 8 experts
    dense = enumerate_configs(32, MODEL_CONFIGS["1b"])
    assert [c for c in dense if c.pp == 1] == enumerate_configs(32)  # dense: no ep term
    assert any(c.pp > 1 and c.ep > 1 for c in cands)  # pipeline stages with expert parallelism (docs/pipeline.md)
    ranked = rank_layouts(_gpus(128), _moe_work())
    assert any(c.config.ep > 1 for c in ranked if c.runnable)


def test_moe_memory_splits_experts_over_dp_shard_and_keeps_them_whole_over_tp():
    from dynatrain.models.moe_configs import MOE_CONFIGS

    cfg = MOE_CONFIGS["qwen3-235b-a22b"]
    work = _moe_work()
    experts = sum(math.prod(s) for n, s in cfg.param_shapes().items() if ".moe.experts." in n)
    dense = cfg.num_params() - experts
    for layout in ("dp_shard=128", "dp_shard=128,ep=8", "dp_shard=128,ep=128"):
        mem = estimate_layout(layout, _gpus(128), work).memory
        assert mem.states == pytest.approx(cfg.num_params() / 128 * work.state_bytes)
    mem = estimate_layout("dp_shard=32,tp=4,ep=16", _gpus(128), work).memory
    tp_dense = sum(math.prod(s) // (4 if any(k in n for k in ("attention.w", "tok_embeddings", "output")) else 1)
                   for n, s in cfg.param_shapes().items() if ".moe.experts." not in n)
    assert tp_dense < dense
    assert mem.states == pytest.approx((tp_dense + experts) / 32 * work.state_bytes)


def test_moe_step_pays_for_the_token_all_to_all_over_the_ep_group():
    from dynatrain.models.moe_configs import MOE_CONFIGS

    cfg = MOE_CONFIGS["qwen3-235b-a22b"]
    work = _moe_work()
    devices = _gpus(128)
    none = estimate_layout("dp_shard=128", devices, work).time
    inside = estimate_layout("dp_shard=128,ep=8", devices, work).time
    across = estimate_layout("dp_shard=128,ep=64", devices, work).time
    assert none.ep == 0 and inside.ep > 0 and across.ep > inside.ep
    # ep=8 over tp=1 is one node: tokens x dim x top_k x bf16, 7/8 of it to the other members, 2 directions,
    # forward and backward, every layer and micro-batch, plus a round latency per all-to-all.
    net = devices.network
    nbytes = 1024 * cfg.dim * cfg.top_k * 2
    per_layer = 4 * (nbytes * 7 / 8 / net.intra_bytes_per_s + net.round_latency_s)
    assert inside.ep == pytest.approx(inside.micro_steps * cfg.n_layers * per_layer)
    assert inside.total == pytest.approx(inside.compute + inside.tp + inside.ep + inside.fsdp + inside.hsdp
                                         - inside.hidden)


def test_moe_switch_changing_ep_is_priced_from_the_expert_placements():
    work = _moe_work(state_kind="fp32")
    cost = price_switch("dp_shard=128,ep=8", "dp_shard=128,ep=16", _gpus(128), work)
    same = price_switch("dp_shard=128,ep=8", "dp_shard=128,ep=8", _gpus(128), work)
    assert same.bytes_moved == 0 and 0 < cost.bytes_moved < cost.bytes_total
