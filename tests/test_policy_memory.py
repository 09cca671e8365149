"""The layout policy's memory model with activation checkpointing and loss parallelism, and the search choosing a
checkpointing policy for a layout that would not fit without one (pure: no processes)."""

from __future__ import annotations

import pytest

from dynatrain.policy import GiB, Devices, LayoutPolicy, Workload, estimate_layout, estimate_memory
from dynatrain.policy.step_model import recompute_fraction
from dynatrain.vps.parallel_config import ParallelConfig

POLICIES = ("none", "selective:op", "selective:2", "full")


def _debug(policy: str = "none", **kw) -> Workload:
    return Workload("debug", seq_len=256, global_batch=4, micro_batch=4, compute_dtype="float32",
                    reduce_dtype="float32", activation_checkpointing=policy, **kw)


def test_debug_figures_by_hand():
    # debug: dim 256, 4 layers, 8 heads, 4 kv heads (kv width 128), ffn 768, vocab 512; fp32, 1024 tokens, tp=1.
    tokens, h, kv, f = 1024, 256, 128, 768
    per_layer = 2 * (4 + 4) * h + 4 * (2 * h + 2 * kv) + 4 * (h + kv) + 4 * 4 * f  # norms; q,k,v,out; rope; swiglu
    assert per_layer == 20992
    final_norm, block_input = 8 * h, 4 * h
    saved_op = 4 * (h + kv + h + f) + 4 * 8 + 4 * h  # wq, wv, attention out, w1; lse per head; w2 (whole)
    expected = {
        "none": 4 * per_layer + final_norm,
        "full": 4 * block_input + per_layer + final_norm,           # inputs kept, one block recomputed
        "selective:2": 2 * per_layer + 2 * block_input + per_layer + final_norm,  # blocks 1 and 3 checkpointed
        "selective:op": 4 * (block_input + saved_op) + (per_layer - saved_op) + final_norm,
    }
    cfg = ParallelConfig.parse("dp_shard=1")
    for policy, per_token in expected.items():
        m = estimate_memory(cfg, _debug(policy))
        assert m.activations == tokens * per_token, policy
        assert m.logits == tokens * 512 * (4 + 4)  # fp32 logits and the log-softmax
        # Per block wq, wo (256x256), wk, wv (256x128), w1, w2, w3 (256x768), two norms; embedding, output, norm.
        params = 4 * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * 512 * h + h
        assert m.grads == 4 * params and m.states == 12 * params and m.gathered == 0


@pytest.mark.parametrize("model,dtype,layout", [("debug", "float32", "dp_shard=1"), ("125m", "bfloat16", "tp=2"),
                                                ("llama3-8b", "bfloat16", "dp_shard=4,tp=2")])
def test_checkpointing_lowers_activations_in_order(model, dtype, layout):
    work = Workload(model, seq_len=512, global_batch=8, micro_batch=1, compute_dtype=dtype)
    acts = {p: estimate_memory(ParallelConfig.parse(layout), work.with_checkpointing(p)).activations
            for p in POLICIES}
    assert acts["none"] > acts["selective:op"] > acts["full"]
    assert acts["none"] > acts["selective:2"] > acts["full"]
    rest = {p: estimate_memory(ParallelConfig.parse(layout), work.with_checkpointing(p)) for p in POLICIES}
    # Checkpointing changes the activations only.
    assert len({(m.states, m.grads, m.gathered, m.logits) for m in rest.values()}) == 1


def test_pipeline_stage_activations_follow_checkpointing():
    work = Workload("125m", seq_len=512, global_batch=8, micro_batch=1)
    cfg = ParallelConfig.parse("pp=2,dp_shard=2")
    none, full = (estimate_memory(cfg, work.with_checkpointing(p)).activations for p in ("none", "full"))
    assert full < none / 3


def test_loss_parallel_splits_the_logits_over_tp():
    cfg = ParallelConfig.parse("tp=2")
    split = estimate_memory(cfg, _debug()).logits
    whole = estimate_memory(cfg, _debug(loss_parallel=False)).logits
    assert whole == 2 * split == 1024 * 512 * 8
    assert estimate_memory(ParallelConfig.parse("dp_shard=2"), _debug()).logits == whole  # tp=1: nothing to split


def test_recompute_costs_step_time():
    devices = Devices(1, 80 * GiB, per_node=1, flops=1e12)
    times = {p: estimate_layout("dp_shard=1", devices, _debug(p)).time for p in POLICIES}
    assert times["none"].recompute == 0
    assert times["none"].total < times["selective:op"].total < times["full"].total
    assert times["none"].total < times["selective:2"].total < times["full"].total
    # Full recompute runs every block's forward again: a third of the blocks' forward + backward.
    assert recompute_fraction(_debug("full")) == 1 and recompute_fraction(_debug("selective:2")) == 0.5
    assert 0 < recompute_fraction(_debug("selective:op")) < 0.5
    assert times["full"].compute == pytest.approx(times["none"].compute + times["full"].recompute)


def _needed(policy: str, layout: str, work: Workload) -> float:
    return estimate_memory(ParallelConfig.parse(layout), work.with_checkpointing(policy)).total


def test_selective_2_comes_after_op_by_recompute_not_memory():
    # The order is by recompute (op ~0.4 of a forward, every 2nd block 0.5); on the zoo's dense blocks every 2nd block
    # keeps more than per op, so auto takes selective:2 only where per op does not fit and it does: never here.
    work = Workload("125m", seq_len=1024, global_batch=8, micro_batch=4)
    assert recompute_fraction(work.with_checkpointing("selective:op")) < 0.5
    assert _needed("selective:2", "dp_shard=2", work) > _needed("selective:op", "dp_shard=2", work)


@pytest.mark.parametrize("policy", ["selective:op", "full"])
def test_auto_picks_the_first_policy_that_fits(policy):
    work = Workload("125m", seq_len=1024, global_batch=8, micro_batch=4, activation_checkpointing="auto")
    # Devices just large enough for ``policy`` (reserve 10%), too small for the ones before it in the order.
    memory = int(_needed(policy, "dp_shard=2", work) / 0.9) + 1
    devices = Devices(2, memory, per_node=2, flops=1e12)
    cand = estimate_layout("dp_shard=2", devices, work)
    assert cand.runnable and cand.checkpointing == policy
    assert cand.memory.total == _needed(policy, "dp_shard=2", work)
    assert f"checkpointing {policy}" in cand.describe()
    assert cand.time.recompute > 0


def test_auto_changes_nothing_where_everything_fits():
    devices = Devices(4, 80 * GiB, per_node=4, flops=1e12)
    plain, auto = (Workload("125m", seq_len=1024, global_batch=8, activation_checkpointing=p) for p in ("none", "auto"))
    a, b = LayoutPolicy().decide(devices, plain), LayoutPolicy().decide(devices, auto)
    assert a.target == b.target and a.reason == b.reason and b.checkpointing == "none"
    assert a.estimate.step_seconds == b.estimate.step_seconds


def test_decision_states_the_checkpointing_it_needs():
    work = Workload("125m", seq_len=1024, global_batch=8, micro_batch=4, activation_checkpointing="auto")
    best_without = min(_needed("none", c, work) for c in ("dp_shard=2", "tp=2", "dp_replicate=2"))
    devices = Devices(2, int(best_without * 0.9 * 0.9), per_node=2, flops=1e12)
    decision = LayoutPolicy().decide(devices, work)
    assert decision.checkpointing != "none"
    assert f"with activation checkpointing {decision.checkpointing} to fit memory" in decision.reason
    # A fixed policy is never changed: with "none" nothing fits.
    with pytest.raises(ValueError, match="no layout"):
        LayoutPolicy().decide(devices, work.with_checkpointing("none"))


def test_nothing_fits_even_with_full_checkpointing():
    work = Workload("125m", seq_len=1024, global_batch=8, micro_batch=4, activation_checkpointing="auto")
    cand = estimate_layout("dp_shard=2", Devices(2, 1 << 20, per_node=2, flops=1e12), work)
    assert not cand.runnable and cand.checkpointing == "full"
    assert "even with full activation checkpointing" in cand.excluded


def test_checkpointing_spellings():
    assert _debug("selective").activation_checkpointing == "selective:op"
    assert _debug("selective:1").activation_checkpointing == "full"
    assert _debug(True).activation_checkpointing == "full"
    with pytest.raises(ValueError, match="selective:N"):
        _debug("selective:0")
    with pytest.raises(ValueError, match="resolves it per layout"):
        estimate_memory(ParallelConfig.parse("dp_shard=1"), _debug("auto"))
