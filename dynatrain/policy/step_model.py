"""Predicted seconds of one optimizer step under a layout: compute, the data-parallel collectives (partly hidden
behind compute), tensor-parallel all-reduces, expert all-to-alls and, with pp > 1, the 1F1B bubble and the
activations sent between stages (formulas in docs/layouts.md)."""

from __future__ import annotations

from dataclasses import dataclass

from dynatrain.models.registry import spec_for
from dynatrain.planner.pipeline_cost import (
    StageTerms, boundary_inside_node, p2p_seconds, pipeline_step, stage_params, tp_all_reduces,
)
from dynatrain.policy.comm import (
    Group, all_to_all_seconds, collective_seconds, cp_group, dp_groups, expert_groups, inter_share,
)
from dynatrain.policy.inputs import CostModel, Devices, Workload
from dynatrain.policy.sizes import ModelSizes, model_sizes, pipeline_loads
from dynatrain.vps.layout import DTYPE_ITEMSIZE
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step (all ``micro_steps`` accumulation micro-batches)."""

    micro_steps: int
    compute: float
    fsdp: float    # all-gathers and reduce-scatters over dp_shard
    hsdp: float    # gradient all-reduces over dp_replicate
    tp: float      # activation all-reduces and the logits all-gather inside the TP group
    hidden: float  # data-parallel communication hidden behind compute
    ep: float = 0.0  # token dispatch and combine all-to-alls inside the ep group (mixture of experts)
    cp: float = 0.0  # keys and values all-gathered inside the cp group, their gradients reduce-scattered
    bubble: float = 0.0  # pipeline stages idle while the pipeline fills and drains (pp > 1)
    p2p: float = 0.0     # activations and their gradients sent between pipeline stages (pp > 1)
    recompute: float = 0.0  # of ``compute``, the checkpointed blocks' forward run again in the backward

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.ep + self.cp + self.fsdp + self.hsdp - self.hidden + self.bubble + self.p2p


def recompute_fraction(work: Workload) -> float:
    """The share of all blocks' forward FLOPs that checkpointing runs again: every checkpointed block's whole forward;
    per op, the matmuls the policy does not keep (wk, wo, w3 of a dense block, attention kept; half a MoE block)."""
    model = work.model
    if work.activation_checkpointing == "selective:op":
        return spec_for(model).op_recompute_fraction(model)
    every = work.checkpoint_every
    return (model.n_layers // every) / model.n_layers if every else 0.0


def _compute_seconds(cfg: ParallelConfig, devices: Devices, work: Workload) -> tuple[float, float]:
    """(all compute, of it the recomputation) seconds of one step."""
    model = work.model
    sizes = model_sizes(model, 1)
    width = spec_for(model).attention_width(model)
    blocks = 6 * sizes.block * model.n_layers + 12 * model.n_layers * width * work.seq_len
    per_token = 6 * sizes.matmul + 12 * model.n_layers * width * work.seq_len
    rate = devices.flops * devices.efficiency
    dense = work.tokens_per_step * per_token / devices.count / rate
    # Routed experts are not split over TP: every TP rank computes its tokens' experts in full (a cp rank's tokens
    # are its part of every sequence).
    experts = work.tokens_per_step * 6 * sizes.expert_active / (cfg.dp_size * cfg.cp) / rate
    # A forward is a third of forward + backward.
    recompute = recompute_fraction(work) / 3 * (work.tokens_per_step * blocks / devices.count / rate + experts)
    return dense + experts + recompute, recompute


def estimate_step(cfg: ParallelConfig, devices: Devices, work: Workload, cost: CostModel,
                  micro_steps: int) -> StepTime:
    if cfg.pp > 1:
        return _pipeline_step(cfg, devices, work, cost, micro_steps)
    model = work.model
    sizes = model_sizes(model, cfg.tp)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    latency = devices.network.round_latency_s
    shard_group, replicate_group = dp_groups(cfg, devices.per_node)
    layers = model.n_layers

    fsdp = 0.0
    if cfg.fsdp_shard > 1:
        # Forward gathers every unit; backward gathers again all but the last block and the root, which
        # stay gathered after forward; every unit's gradient is reduce-scattered. All of it per micro-batch.
        gather = (2 * sizes.tp_local - sizes.block - sizes.root) * ce
        fsdp = (collective_seconds(gather, shard_group, devices, all_reduce=False)
                + collective_seconds(sizes.tp_local * re, shard_group, devices, all_reduce=False)
                + (3 * layers + 1) * latency)
    fsdp += _expert_fsdp_seconds(cfg, sizes, devices, work)
    hsdp = 0.0
    if cfg.dp_replicate > 1:
        local = (sizes.tp_local + sizes.experts) / cfg.fsdp_shard
        hsdp = (collective_seconds(local * re, replicate_group, devices, all_reduce=True)
                + (layers + 1) * latency)
    tp = 0.0
    if cfg.tp > 1:
        tp_group = Group(cfg.tp, 1, cfg.tp)
        activation = work.micro_batch * work.seq_len / cfg.cp * model.dim * ce
        # Two all-reduces per block forward, two backward; the embedding's output and the output layer's
        # input gradient; the full-vocabulary logits gathered once.
        reduces = 4 * layers + 2
        logits = work.micro_batch * work.seq_len / cfg.cp * model.vocab_size * ce
        tp = (reduces * collective_seconds(activation, tp_group, devices, all_reduce=True)
              + collective_seconds(logits, tp_group, devices, all_reduce=False)
              + (reduces + 1) * latency)

    compute, recompute = _compute_seconds(cfg, devices, work)
    dp_comm = micro_steps * (fsdp + hsdp)
    ep = _all_to_all_step_seconds(cfg, devices, work)
    return StepTime(micro_steps, compute, micro_steps * fsdp, micro_steps * hsdp, micro_steps * tp,
                    hidden=min(dp_comm, cost.overlap * compute), ep=micro_steps * ep, recompute=recompute,
                    cp=micro_steps * cp_seconds(cfg, devices, work))


def cp_seconds(cfg: ParallelConfig, devices: Devices, work: Workload) -> float:
    """One micro-batch's context-parallel collectives: per block, keys and values all-gathered in the forward (and
    again when a checkpointed block recomputes) and their gradients reduce-scattered in the backward, each the
    whole sequence's on every cp rank."""
    if cfg.cp == 1:
        return 0.0
    model = work.model
    kv = spec_for(model).attention_width(model) * model.n_kv_heads / model.n_heads / cfg.tp
    whole = work.micro_batch * work.seq_len * kv * DTYPE_ITEMSIZE[work.compute_dtype]
    group = cp_group(cfg, devices.per_node)
    per_block = 2 * (2 + recompute_fraction(work)) * (collective_seconds(whole, group, devices, all_reduce=False)
                                                      + devices.network.round_latency_s)
    return model.n_layers * per_block


def _pipeline_step(cfg: ParallelConfig, devices: Devices, work: Workload, cost: CostModel,
                   micro_steps: int) -> StepTime:
    """A 1F1B step (`pipeline_cost.pipeline_step`). Per micro-batch a pp rank computes its blocks, runs their TP
    all-reduces (and, with routed experts, its layers' token all-to-alls over ep) and exchanges activations with its
    neighbours; FSDP gathers each stage once per step (those all-gathers can hide behind compute) and
    reduce-scatters once after the last micro-batch, exposed like the HSDP all-reduce. A stage's routed experts are
    gathered and reduced over efsdp, their ep group's share each."""
    model = work.model
    sizes, whole = model_sizes(model, cfg.tp), model_sizes(model, 1)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    latency = devices.network.round_latency_s
    shard_group, replicate_group = dp_groups(cfg, devices.per_node)
    activation = work.micro_batch * work.seq_len * model.dim * ce
    all_reduce = collective_seconds(activation, Group(cfg.tp, 1, cfg.tp), devices, all_reduce=True) + latency
    logits = collective_seconds(work.micro_batch * work.seq_len * model.vocab_size * ce,
                                 Group(cfg.tp, 1, cfg.tp), devices, all_reduce=False) + latency
    link = (devices.network.intra_bytes_per_s if boundary_inside_node(cfg.world_size, devices.per_node)
            else inter_share(devices))
    # Per token: a block's matmuls and attention scores; the final norm and the output projection.
    block_flops = 6 * whole.block + 12 * spec_for(model).attention_width(model) * work.seq_len
    again = recompute_fraction(work) / 3  # a forward is a third of forward + backward
    head_flops = 6 * (whole.root - whole.embedding)
    rate = cfg.stage_size * devices.flops * devices.efficiency
    # Routed experts are not split over TP: every TP rank of a stage computes its tokens' experts in full.
    expert_flops = 6 * whole.expert_active / model.n_layers * cfg.tp
    a2a_per_layer = _all_to_all_step_seconds(cfg, devices, work) / model.n_layers
    _, efsdp_group = expert_groups(cfg, devices.per_node)
    terms, recomputes = [], []
    for load in pipeline_loads(model, cfg.pp):
        flops = stage_params(load, block_flops * (1 + again), 0, head_flops)  # the embedding is a lookup: no matmul
        compute = work.tokens_per_step * (flops + load.layers * expert_flops * (1 + again)) / rate
        recomputes.append(work.tokens_per_step * stage_params(load, (block_flops + expert_flops) * again, 0, 0) / rate)
        tp = micro_steps * (tp_all_reduces(load) * all_reduce + (logits if load.last else 0.0)) if cfg.tp > 1 else 0.0
        params = stage_params(load, sizes.block, sizes.embedding, sizes.root - sizes.embedding)
        gather = collective_seconds(params * ce, shard_group, devices, all_reduce=False) if cfg.dp_shard > 1 else 0.0
        fsdp = (gather + collective_seconds(params * re, shard_group, devices, all_reduce=False)
                + 2 * (load.layers + 1) * latency) if cfg.dp_shard > 1 else 0.0
        experts = load.layers * sizes.expert_block / cfg.ep  # the stage's ep-local experts
        if experts and cfg.efsdp > 1:
            expert_gather = collective_seconds(experts * ce, efsdp_group, devices, all_reduce=False)
            gather += expert_gather
            fsdp += (expert_gather + collective_seconds(experts * re, efsdp_group, devices, all_reduce=False)
                     + 2 * load.layers * latency)
        hsdp = (collective_seconds((params / cfg.dp_shard + experts / cfg.efsdp) * re, replicate_group, devices,
                                   all_reduce=True)
                + (load.layers + 1) * latency) if cfg.dp_replicate > 1 else 0.0
        p2p = p2p_seconds(activation, micro_steps, link, latency)
        terms.append(StageTerms(compute, tp, p2p, fsdp, hsdp, min(gather, cost.overlap * compute),
                                ep=micro_steps * load.layers * a2a_per_layer))
    slowest, exposed, bubble = pipeline_step(terms, micro_steps)
    return StepTime(micro_steps, slowest.compute, exposed.fsdp, exposed.hsdp, slowest.tp, exposed.hidden,
                    ep=slowest.ep, bubble=bubble, p2p=slowest.p2p, recompute=recomputes[terms.index(slowest)])


def _expert_fsdp_seconds(cfg: ParallelConfig, sizes: ModelSizes, devices: Devices, work: Workload) -> float:
    """One micro-batch's all-gathers and reduce-scatters of the routed experts: each rank's ep-local experts
    over its efsdp group (over all of dp_shard without ep)."""
    if not sizes.experts or cfg.efsdp == 1:
        return 0.0
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    _, efsdp_group = expert_groups(cfg, devices.per_node)
    local, block = sizes.experts / cfg.ep, sizes.expert_block / cfg.ep
    return (collective_seconds((2 * local - block) * ce, efsdp_group, devices, all_reduce=False)
            + collective_seconds(local * re, efsdp_group, devices, all_reduce=False)
            + 3 * work.model.n_layers * devices.network.round_latency_s)


def _all_to_all_step_seconds(cfg: ParallelConfig, devices: Devices, work: Workload) -> float:
    """One micro-batch's token all-to-alls with ep > 1: per layer every rank sends each of its tokens ``top_k``
    times (dispatch) and gets them back (combine), forward and again backward, over its ep group. Never hidden:
    the layer waits for its tokens."""
    model = work.model
    if cfg.ep == 1 or not spec_for(model).routed_experts:
        return 0.0
    tokens = work.micro_batch * work.seq_len / cfg.cp  # a cp rank routes its part of every sequence
    nbytes = tokens * model.dim * model.top_k * DTYPE_ITEMSIZE[work.compute_dtype]
    ep_group, _ = expert_groups(cfg, devices.per_node)
    per_layer = 2 * 2 * (all_to_all_seconds(nbytes, ep_group, devices) + devices.network.round_latency_s)
    return model.n_layers * per_layer
