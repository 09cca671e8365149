"""Context parallelism (the ``cp`` layout term): the load-balanced split, attention over the gathered keys equal to
the whole sequence's (simulated cp ranks in one process, then the zoo's model on 2 gloo ranks, forward and backward),
the layout's mesh and data-parallel ranks, its placements (FSDP over dp_shard x cp) captured from a real build equal
to the analytic ones, and the refusals with their reasons."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _launch import launch
from dynatrain.models.configs import MODEL_CONFIGS
from dynatrain.models.context_parallel import ContextParallel, check_context_parallel
from dynatrain.models.specs import layout_for_model
from dynatrain.vps.parallel_config import LayoutError, ParallelConfig


class _SimulatedRank(ContextParallel):
    """cp rank ``rank`` of ``size`` in one process: the all-gather is the concatenation of every simulated rank's
    shard of the whole tensor, which is what the collective returns."""

    def __init__(self, size: int, rank: int, whole: dict) -> None:
        self.size, self.rank, self.whole = size, rank, whole
        self._mask = None

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        full = self.whole[id(x)]
        return torch.cat([_SimulatedRank(self.size, r, {}).shard(full, dim=2) for r in range(self.size)], dim=2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_simulated_cp_ranks_attend_as_the_whole_sequence(cp):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=gen)  # grouped-query: 4 query heads over 2 key/value heads
    k, v = torch.randn(2, 2, 32, 8, generator=gen), torch.randn(2, 2, 32, 8, generator=gen)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    seen = []
    for rank in range(cp):
        probe = _SimulatedRank(cp, rank, {})
        local_k, local_v = probe.shard(k, dim=2), probe.shard(v, dim=2)
        sim = _SimulatedRank(cp, rank, {id(local_k): k, id(local_v): v})
        out = sim.attention(probe.shard(q, dim=2), local_k, local_v)
        torch.testing.assert_close(out, probe.shard(whole, dim=2), rtol=1e-5, atol=1e-6)
        seen += probe.positions(32 // cp).tolist()
    assert sorted(seen) == list(range(32))  # every token on exactly one rank
    if cp == 4:  # rank 0 holds the first and the last chunk, rank 3 the two middle ones
        assert _SimulatedRank(4, 0, {}).positions(8).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
        assert _SimulatedRank(4, 3, {}).positions(8).tolist() == list(range(12, 20))


@pytest.mark.multiprocess
def test_cp_forward_and_backward_equal_the_unsplit_model(tmp_path):
    results = launch("context_parallel.py", 2, ["--layout", "cp=2"], tmp_path, timeout=200)
    assert sorted(r["cp_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["local_len"] == 16 and r["params"] == 21
        assert r["logits_max_abs_diff"] <= 1e-5, r
        assert r["loss_rel_diff"] <= 1e-6, r
        assert r["max_grad_rel_diff"] <= 1e-5, r


@pytest.mark.multiprocess
def test_cp_moe_with_ep_forward_loss_with_aux_router_counts_and_backward_equal_the_unsplit_model(tmp_path):
    # cp=2,ep=2: the two cp ranks of a sample are also its ep group, each sending its own tokens to the experts
    results = launch("context_parallel.py", 2, ["--layout", "cp=2,ep=2", "--model", "moe-debug"], tmp_path,
                     timeout=200)
    assert sorted(r["cp_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["local_len"] == 16 and r["params"] == 29
        assert r["logits_max_abs_diff"] <= 1e-5, r
        # the load-balancing loss is taken over whole sequences: a rank's own tokens alone would give another value
        assert r["aux"] > 0 and r["aux_rel_diff"] <= 1e-6, r
        assert r["loss_rel_diff"] <= 1e-6, r
        assert r["max_grad_rel_diff"] <= 1e-5, r
        # each rank counts its own tokens' choices (2 x 16 tokens, top-2, per layer); their sum is the whole's
        assert r["counts_equal"] is True and r["local_counts_sum"] == [128.0, 128.0], r


def test_cp_layout_mesh_data_ranks_and_sequence_chunks():
    pcfg = ParallelConfig.parse("dp_shard=2,cp=2")
    assert pcfg.world_size == 4 and pcfg.dp_size == 2 and pcfg.fsdp_shard == 4
    assert pcfg.mesh_shape == (1, 2, 2, 1) and pcfg.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert pcfg.root_dims("dp_shard_cp") == (1, 2) and pcfg.flattened_dims()["dp_shard_cp"] == ("dp_shard", "cp")
    # the cp ranks of one data-parallel rank (and its tp ranks) read the same samples
    assert [pcfg.dp_rank_of(q) for q in range(4)] == [0, 0, 1, 1]
    assert [ParallelConfig.parse("cp=2,tp=2").dp_rank_of(q) for q in range(4)] == [0, 0, 0, 0]
    piped = ParallelConfig.parse("pp=2,cp=2")
    assert piped.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and piped.stage_size == 2
    assert piped.without_pp() == ParallelConfig(cp=2) and ParallelConfig.parse(str(piped)) == piped
    assert piped.short() == "pp=2,cp=2"
    assert pcfg.sequence_chunk(64) == 16
    with pytest.raises(LayoutError, match=r"cp=4 splits each sequence into 2\*cp = 8 equal chunks.*length 36"):
        ParallelConfig(cp=4).sequence_chunk(36)
    with pytest.raises(ValueError, match=r"needs pp\*dp_replicate\*dp_shard\*cp\*tp = 8 devices"):
        ParallelConfig.parse("pp=2,cp=2,tp=2").validate(world_size=4)


def test_cp_with_ep_takes_whole_cp_groups_from_dp_shard_x_cp_and_keeps_positions():
    from dynatrain.models.moe_configs import MOE_CONFIGS
    from dynatrain.models.parallelize import mesh_safe

    pcfg = ParallelConfig.parse("dp_shard=4,cp=2,ep=4").validate(MOE_CONFIGS["moe-debug"], 8)
    assert pcfg.mesh_dim_names == ("dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")
    assert pcfg.mesh_shape == (1, 2, 2, 2, 1) and pcfg.efsdp == 2
    assert pcfg.flattened_dims()["ep"] == ("dp_shard_in_ep", "cp") and pcfg.root_dims("ep") == (2, 3)
    assert pcfg.root_dims("dp_shard_cp") == (1, 2, 3)
    # positions and data-parallel ranks are those of dp_shard=4,cp=2: ep changes which states a position holds
    assert [pcfg.dp_rank_of(q) for q in range(8)] == [ParallelConfig(dp_shard=4, cp=2).dp_rank_of(q)
                                                      for q in range(8)]
    with pytest.raises(ValueError, match=r"ep=2 with cp=4 takes its ranks from dp_shard x cp, whole cp groups.*"
                                         r"choose ep among \[4\]"):
        ParallelConfig.parse("cp=4,ep=2")
    # FSDP's group spans dp_shard x cp flattened: the ranks must ascend along it, not only along each of the two
    assert mesh_safe([0, 1, 2, 3], ParallelConfig(dp_shard=2, cp=2))
    assert not mesh_safe([0, 2, 1, 3], ParallelConfig(dp_shard=2, cp=2))


def test_cp_refusals_name_the_reason():

    class PlainAttention(nn.Module):  # a user's module whose parallelisation made nothing cp-aware
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(LayoutError, match=r"cp=2 splits each sequence over cp=2 ranks, but the attention of "
                                          r"PlainAttention is not cp-aware: call .*enable_context_parallel"):
        check_context_parallel(PlainAttention(), ParallelConfig(cp=2))
    check_context_parallel(PlainAttention(), ParallelConfig(dp_shard=2))


@pytest.mark.parametrize("layout", ["dp_shard=2,cp=2,tp=2", "dp_replicate=2,cp=2", "pp=2,cp=2"])
def test_cp_placements_captured_from_a_build_equal_the_analytic_ones(one_process_group, layout):
    from test_pipeline_specs import _captured_layout

    pcfg = ParallelConfig.parse(layout)
    cfg = MODEL_CONFIGS["debug"]
    captured = _captured_layout(cfg, pcfg, 1)
    analytic = layout_for_model(cfg, pcfg)
    # FSDP shards over dp_shard x cp: the boxes are those of dp_shard * cp without cp
    flat = layout_for_model(cfg, ParallelConfig(pcfg.dp_replicate, pcfg.fsdp_shard, pcfg.tp, pp=pcfg.pp))
    for spec in analytic.states:
        for p in range(pcfg.world_size):
            assert analytic.shards(spec.name, p) == captured.shards(spec.name, p) == flat.shards(spec.name, p), \
                (layout, spec.name, p)


def test_memory_and_step_models_count_cp_savings_and_the_gathered_keys_and_values():
    from dynatrain.policy.inputs import CostModel, Devices, Workload
    from dynatrain.policy.memory_model import estimate_memory
    from dynatrain.policy.step_model import estimate_step

    cfg = MODEL_CONFIGS["llama3-8b"].with_overrides(max_seq_len=32768)
    work = Workload(cfg, seq_len=32768, global_batch=32, micro_batch=1)
    flat, split = estimate_memory(ParallelConfig(dp_shard=32), work), estimate_memory(ParallelConfig(dp_shard=4, cp=8), work)
    # states shard over dp_shard x cp as over dp_shard alone; a cp rank keeps an eighth of the tokens' activations,
    # plus each layer's keys and values of the whole sequence (8 kv heads x 128, bf16) and one bool mask
    assert split.states == flat.states and split.grads == flat.grads
    gathered_kv = 32 * 32768 * 2 * 8 * 128 * 2 + 32768 / 8 * 32768
    assert split.activations == pytest.approx(flat.activations / 8 + gathered_kv, rel=1e-12)
    assert split.logits == pytest.approx(flat.logits / 8, rel=1e-12)
    devices = Devices(count=32, memory_bytes=80 * 2**30, per_node=8, flops=989e12)
    times = {c: estimate_step(ParallelConfig(dp_shard=32 // c, cp=c), devices, work, CostModel(), 8) for c in (1, 8)}
    assert times[1].cp == 0 and 0 < times[8].cp < times[8].total
    # a mixture of experts: a cp rank computes and routes its part of every sequence only
    moe = Workload("qwen3-30b-a3b", seq_len=32768, global_batch=32, micro_batch=1)
    flat, split = (estimate_step(ParallelConfig.parse(t), devices, moe, CostModel(), 8)
                   for t in ("dp_shard=32,ep=8", "dp_shard=16,cp=2,ep=8"))
    assert split.compute == pytest.approx(flat.compute, rel=1e-12)
    assert 0 < split.ep < flat.ep
