"""Layout planner: which ``pp x dp_replicate x dp_shard x tp`` (and, for a mixture-of-experts model, which ``ep``)
to run on the devices at hand, and whether a switch to it pays for itself. Pipeline layouts are costed as 1F1B with
one stage per pp rank (the terms are in `planner.pipeline_cost`).

Pure Python (no torch, no process group): a 70B model on 1,024 devices is sized in milliseconds. The cost model,
its formulas and its assumptions are in docs/layouts.md; the switch cost comes from the routing planner
(`plan_switch`) and its network model.

    devices = Devices(count=64, memory_bytes=80 * GiB, per_node=8, flops=989e12)
    work = Workload("llama3-70b", seq_len=4096, global_batch=256, micro_batch=1)
    best = choose_layout(devices, work)                       # LayoutCandidate, or ValueError listing why not
    decision = plan_layout(devices, work, current=ParallelConfig.parse("dp_shard=16,tp=4"))
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from dynatrain.models.configs import ModelConfig
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.models.moe_specs import is_routed_expert, moe_tp_dim
from dynatrain.planner.network import NetworkModel
from dynatrain.planner.pipeline_cost import (
    StageLoad, StageTerms, boundary_inside_node, in_flight, p2p_seconds, pipeline_step, stage_activation_bytes,
    stage_loads, stage_params, tp_all_reduces,
)
from dynatrain.planner.schedule import plan_switch
from dynatrain.models.specs import (
    get_zoo_config, layout_for_model, model_states, pipeline_stage_split, rule_for_param,
)
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS, Layout
from dynatrain.vps.parallel_config import ParallelConfig

GiB = 1 << 30
DEFAULT_SWITCH_BUDGET = 256 << 20  # the strategy's default switch_budget_mb


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Devices:
    """The devices at hand. ``flops``: peak FLOP/s of one device in the compute dtype; ``efficiency``: the
    fraction of it that training reaches (model FLOPs utilisation). ``network`` defaults to the routing
    planner's model with ``gpus_per_node = per_node``; device ``i`` lives on node ``i // per_node``."""

    count: int
    memory_bytes: int
    per_node: int
    flops: float
    efficiency: float = 0.4
    network: NetworkModel | None = None

    def __post_init__(self) -> None:
        for name in ("count", "memory_bytes", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Devices.{name} must be a positive integer, got {value!r}")
        if not self.flops > 0:
            raise ValueError(f"Devices.flops must be positive, got {self.flops!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Devices.efficiency is a fraction of peak in (0, 1], got {self.efficiency!r}")
        if self.network is None:
            object.__setattr__(self, "network", NetworkModel(gpus_per_node=self.per_node))
        elif self.network.gpus_per_node != self.per_node:
            raise ValueError(
                f"Devices.per_node={self.per_node} but network.gpus_per_node={self.network.gpus_per_node}: "
                "give the network model the same devices per node"
            )

    def with_count(self, count: int) -> "Devices":
        return Devices(count, self.memory_bytes, self.per_node, self.flops, self.efficiency, self.network)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains. ``state_kind`` names the routed states as in `vps.layout.STATE_KINDS`
    (``fp32-adam``: fp32 weights + fp32 Adam moments, what the strategy keeps). ``compute_dtype`` is the dtype
    FSDP gathers parameters in and activations are kept in (the strategy's ``param_dtype``; ``float32`` without
    mixed precision); ``reduce_dtype`` the dtype of the gradient reduction."""

    model: ModelConfig | MoEConfig | str
    seq_len: int
    global_batch: int
    micro_batch: int = 1
    state_kind: str = "fp32-adam"
    compute_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    sequence_parallel: bool = False
    fused_attention: bool = True
    pipeline: bool = True  # pp layouts are candidates (the module can be split into stages)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", get_zoo_config(self.model))
        for name in ("seq_len", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds max_seq_len={self.model.max_seq_len} of model {self.model.name!r}"
            )
        if self.state_kind not in STATE_KINDS:
            raise ValueError(f"unknown state kind {self.state_kind!r}; choose one of {', '.join(STATE_KINDS)}")
        for name in ("compute_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_ITEMSIZE:
                raise ValueError(f"Workload.{name}={getattr(self, name)!r} is not one of {', '.join(DTYPE_ITEMSIZE)}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter element of all routed states (weight, master copy, Adam moments)."""
        return sum(DTYPE_ITEMSIZE[dtype] for _, dtype in STATE_KINDS[self.state_kind])

    @property
    def grad_bytes(self) -> int:
        # FSDP2 hands the reduced gradient back in the dtype of the sharded weight.
        return DTYPE_ITEMSIZE[STATE_KINDS[self.state_kind][0][1]]

    @property
    def weight_dtype(self) -> str:
        return STATE_KINDS[self.state_kind][0][1]


@dataclass(frozen=True)
class CostModel:
    """Knobs of the model that are not facts about the hardware or the job.

    ``reserve_fraction``: memory kept free for the allocator's fragmentation, the runtime and communication
    buffers. ``overlap``: the fraction of compute time that can hide data-parallel communication (FSDP
    prefetches the next block's all-gather and reduce-scatters the previous block's gradient while computing);
    1 means ``max(compute, comm)``, 0 means ``compute + comm``. Tensor-parallel all-reduces are never hidden."""

    reserve_fraction: float = 0.1
    overlap: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")


# ---------------------------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes on one device."""

    states: float       # this device's shard of weights, master copy and Adam moments
    grads: float        # this device's shard of the gradients
    gathered: float     # parameters FSDP holds unsharded at once, and one block's unsharded gradient
    activations: float  # kept for backward, one micro-batch
    logits: float       # full-vocabulary logits and the loss's fp32 copies, one micro-batch

    @property
    def total(self) -> float:
        return self.states + self.grads + self.gathered + self.activations + self.logits

    def describe(self) -> str:
        parts = ("states", "grads", "gathered", "activations", "logits")
        return ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)


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
    bubble: float = 0.0  # pipeline stages idle while the pipeline fills and drains (pp > 1)
    p2p: float = 0.0     # activations and their gradients sent between pipeline stages (pp > 1)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.ep + self.fsdp + self.hsdp - self.hidden + self.bubble + self.p2p


@dataclass(frozen=True)
class LayoutCandidate:
    """One layout on the devices at hand: its predictions, or why it cannot run (``reasons``)."""

    config: ParallelConfig
    reasons: tuple[str, ...] = ()
    time: StepTime | None = None
    memory: MemoryEstimate | None = None
    memory_limit: float = 0.0
    tokens_per_step: int = 0

    @property
    def runnable(self) -> bool:
        return not self.reasons

    @property
    def excluded(self) -> str | None:
        return "; ".join(self.reasons) if self.reasons else None

    @property
    def step_seconds(self) -> float | None:
        return None if self.time is None else self.time.total

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.time is None else self.tokens_per_step / self.time.total

    @property
    def memory_bytes(self) -> float | None:
        return None if self.memory is None else self.memory.total

    def describe(self) -> str:
        head = f"{self.config.short():<34}"
        if not self.runnable:
            return f"{head} excluded: {self.excluded}"
        return (f"{head} {self.step_seconds:9.3f} s/step {self.tokens_per_second:12.0f} tokens/s "
                f"{self.memory_bytes / GiB:7.1f} GiB/device")


# ---------------------------------------------------------------------------------------------- model sizes
@dataclass(frozen=True)
class _Sizes:
    tp_local: int  # parameters one TP rank holds before FSDP shards them, routed experts excluded
    block: int     # of those, one transformer block's
    root: int      # of those, the root FSDP unit's (embeddings, final norm, output)
    matmul: int    # global parameters one token multiplies: all but the input embedding and the routed experts
    experts: int = 0        # routed expert parameters, all layers (whole on every TP rank)
    expert_block: int = 0   # of those, one layer's
    expert_active: int = 0  # routed expert parameters one token multiplies (top_k of n_experts)
    embedding: int = 0      # of ``root``, the input embedding's (the rest, final norm and output, runs last)


def _tp_dim(model: ModelConfig | MoEConfig, name: str, shape: tuple[int, ...]) -> int | None:
    return moe_tp_dim(name) if isinstance(model, MoEConfig) else rule_for_param(name, shape).tp_dim


@lru_cache(maxsize=256)
def _sizes(model: ModelConfig | MoEConfig, tp: int) -> _Sizes:
    tp_local = block = root = experts = expert_block = embedding = 0
    for name, shape in model.param_shapes().items():
        n = math.prod(shape)
        if is_routed_expert(name):
            experts += n
            expert_block += n if name.startswith("layers.0.") else 0
            continue
        local = n if _tp_dim(model, name, shape) is None else n // tp
        tp_local += local
        if name.startswith("layers.0."):
            block += local
        elif not name.startswith("layers."):
            root += local
            embedding += local if name.startswith("tok_embeddings.") else 0
    if isinstance(model, MoEConfig):
        active = experts * model.top_k // model.n_experts
        matmul = model.num_params() - experts - model.vocab_size * model.dim
        return _Sizes(tp_local, block, root, matmul, experts, expert_block, active, embedding)
    matmul = model.num_params() - model.vocab_size * model.dim
    return _Sizes(tp_local, block, root, matmul, embedding=embedding)


# ---------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class _Group:
    size: int
    nodes: int      # nodes its members span
    per_node: int   # fewest members on one of those nodes: that node's links are the bottleneck


def _group(positions: Sequence[int], per_node: int) -> _Group:
    counts = Counter(p // per_node for p in positions)
    return _Group(len(positions), len(counts), min(counts.values()))


def _groups(cfg: ParallelConfig, per_node: int) -> tuple[_Group, _Group]:
    """The dp_shard and dp_replicate groups through position 0 (mesh order (r*S + s)*T + t); the others are
    translations of them."""
    r, s, t = cfg.dp_replicate, cfg.dp_shard, cfg.tp
    shard = [i * t for i in range(s)]
    replicate = [i * s * t for i in range(r)]
    return _group(shard, per_node), _group(replicate, per_node)


def _expert_groups(cfg: ParallelConfig, per_node: int) -> tuple[_Group, _Group]:
    """The ep and efsdp groups through position 0: an ep group is ``ep`` consecutive dp_shard indices, an efsdp
    group every ``ep``-th one."""
    t = cfg.tp
    ep = [i * t for i in range(cfg.ep)]
    efsdp = [i * cfg.ep * t for i in range(cfg.efsdp)]
    return _group(ep, per_node), _group(efsdp, per_node)


def _tp_spans_nodes(cfg: ParallelConfig, per_node: int) -> bool:
    t = cfg.tp
    return any((g * t) // per_node != (g * t + t - 1) // per_node for g in range(cfg.world_size // t))


# ---------------------------------------------------------------------------------------------- collectives
def _inter_share(devices: Devices) -> float:
    """Inter-node bytes/s one device gets while every device of its node communicates at once."""
    net = devices.network
    busy = min(devices.per_node, devices.count)
    return min(net.gpu_inter_bytes_per_s, net.node_inter_bytes_per_s / busy)


def _collective_seconds(nbytes: float, group: _Group, devices: Devices, all_reduce: bool) -> float:
    """Bandwidth time of one ring all-gather / reduce-scatter (or all-reduce) of an ``nbytes`` buffer.

    Every member receives ``(n-1)/n`` of the buffer (twice for an all-reduce), mostly over intra-node edges;
    the part that originates on other nodes enters each node once and is spread over that node's members'
    inter-node links."""
    n = group.size
    if n == 1 or nbytes == 0:
        return 0.0
    passes = 2 if all_reduce else 1
    net = devices.network
    intra = passes * nbytes * (n - 1) / n / net.intra_bytes_per_s
    if group.nodes == 1:
        return intra
    k = group.per_node
    inter = passes * nbytes * (n - k) / n / (k * _inter_share(devices))
    return max(inter, intra if k > 1 else 0.0)


def _all_to_all_seconds(nbytes: float, group: _Group, devices: Devices) -> float:
    """Bandwidth time of one all-to-all in which every member sends ``nbytes``, spread evenly over the members
    (its own share stays): the share for members on other nodes leaves over the inter-node links."""
    n = group.size
    if n == 1 or nbytes == 0:
        return 0.0
    net = devices.network
    k = group.per_node
    intra = nbytes * (k - 1) / n / net.intra_bytes_per_s
    inter = nbytes * (n - k) / n / _inter_share(devices)
    return max(intra, inter)


# ---------------------------------------------------------------------------------------------- estimates
def _moe_activation_bytes_per_token(model: MoEConfig, work: Workload, tp: int) -> float:
    """As `_activation_bytes_per_token`, for the MoE block of dynatrain/models/moe.py: attention as the dense
    block (TP-sharded), then the router's fp32 scores, the ``top_k`` copies of the token sent to its experts (and
    received back), each expert's SwiGLU intermediates, and the shared expert's; none of the MoE part is split
    over TP (every TP rank routes the same tokens)."""
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, s, k = model.dim, work.seq_len, model.top_k
    q = model.n_heads * model.attn_head_dim
    kv = model.n_kv_heads * model.attn_head_dim
    norms = 2 * (4 + e) * h / (tp if work.sequence_parallel else 1)
    attention = (e * (2 * q + 2 * kv) + 4 * (q + kv)) / tp
    scores = 0 if work.fused_attention else 2 * e * model.n_heads * s / tp
    router = 4 * 2 * model.n_experts
    routed = k * (2 * e * h + 4 * e * model.moe_ffn_dim)
    shared = 4 * e * model.shared_ffn_dim
    final_norm = (4 + e) * h / (tp if work.sequence_parallel else 1)
    return model.n_layers * (norms + attention + scores + router + routed + shared) + final_norm


def _activation_bytes_per_token(model: ModelConfig, work: Workload, tp: int) -> float:
    """Bytes one token's activations occupy until backward, over all layers: what autograd saves for the
    block in dynatrain/models/llama.py (see docs/layouts.md)."""
    if isinstance(model, MoEConfig):
        return _moe_activation_bytes_per_token(model, work, tp)
    per_layer, final_norm = _dense_layer_bytes(model, work, tp)
    return model.n_layers * per_layer + final_norm


def _dense_layer_bytes(model: ModelConfig, work: Workload, tp: int) -> tuple[float, float]:
    """(one block's, the final norm's) activation bytes per token of the dense model."""
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, f, s = model.dim, model.ffn_dim, work.seq_len
    kv = model.n_kv_heads * model.head_dim
    # Each RMSNorm keeps its fp32 upcast and its output; both are replicated over the TP group unless
    # sequence parallelism shards them.
    norms = 2 * (4 + e) * h / (tp if work.sequence_parallel else 1)
    # q, k, v and the attention output; RoPE's fp32 complex copies of q and k; SwiGLU's w1 and w3 outputs,
    # silu and the product. All TP-sharded.
    sharded = (e * (2 * h + 2 * kv) + 4 * (h + kv) + 4 * e * f) / tp
    # Without a fused kernel the scores and the softmax of every head are kept: a row of seq_len per head.
    scores = 0 if work.fused_attention else 2 * e * model.n_heads * s / tp
    final_norm = (4 + e) * h / (tp if work.sequence_parallel else 1)
    return norms + sharded + scores, final_norm


def _logit_bytes_per_token(model: ModelConfig, work: Workload) -> float:
    # The output gathers the full vocabulary on every TP rank; the loss upcasts them and keeps a log-softmax.
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    upcast = 4 if e < 4 else 0
    return model.vocab_size * (e + upcast + 4)


def estimate_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    if cfg.pp > 1:
        return _pipeline_memory(cfg, work)
    model = work.model
    sizes = _sizes(model, cfg.tp)
    # Routed experts split over ep and then over efsdp: every dp_shard rank holds 1/dp_shard of them, whatever ep.
    shard = (sizes.tp_local + sizes.experts) / cfg.dp_shard
    # A block gathers its experts over efsdp only: each rank computes with its ep group's share.
    block = sizes.block + sizes.expert_block / cfg.ep
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    gathered = 0.0
    if cfg.dp_shard > 1 or work.compute_dtype != work.weight_dtype:
        # The root stays gathered through forward and backward; prefetch holds the current and next block.
        gathered += (sizes.root + 2 * block) * ce
    if cfg.dp_size > 1:
        gathered += block * re  # one block's gradient before it is reduced
    tokens = work.micro_batch * work.seq_len
    return MemoryEstimate(
        states=shard * work.state_bytes,
        grads=shard * work.grad_bytes,
        gathered=gathered,
        activations=tokens * _activation_bytes_per_token(model, work, cfg.tp),
        logits=tokens * _logit_bytes_per_token(model, work),
    )


def _compute_seconds(cfg: ParallelConfig, devices: Devices, work: Workload) -> float:
    model = work.model
    sizes = _sizes(model, 1)
    width = model.n_heads * model.attn_head_dim if isinstance(model, MoEConfig) else model.dim
    per_token = 6 * sizes.matmul + 12 * model.n_layers * width * work.seq_len
    rate = devices.flops * devices.efficiency
    dense = work.tokens_per_step * per_token / devices.count / rate
    # Routed experts are not split over TP: every TP rank computes its tokens' experts in full.
    experts = work.tokens_per_step * 6 * sizes.expert_active / cfg.dp_size / rate
    return dense + experts


def estimate_step(cfg: ParallelConfig, devices: Devices, work: Workload, cost: CostModel,
                  micro_steps: int) -> StepTime:
    if cfg.pp > 1:
        return _pipeline_step(cfg, devices, work, cost, micro_steps)
    model = work.model
    sizes = _sizes(model, cfg.tp)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    latency = devices.network.round_latency_s
    shard_group, replicate_group = _groups(cfg, devices.per_node)
    layers = model.n_layers

    fsdp = 0.0
    if cfg.dp_shard > 1:
        # Forward gathers every unit; backward gathers again all but the last block and the root, which
        # stay gathered after forward; every unit's gradient is reduce-scattered. All of it per micro-batch.
        gather = (2 * sizes.tp_local - sizes.block - sizes.root) * ce
        fsdp = (_collective_seconds(gather, shard_group, devices, all_reduce=False)
                + _collective_seconds(sizes.tp_local * re, shard_group, devices, all_reduce=False)
                + (3 * layers + 1) * latency)
    fsdp += _expert_fsdp_seconds(cfg, sizes, devices, work)
    hsdp = 0.0
    if cfg.dp_replicate > 1:
        local = (sizes.tp_local + sizes.experts) / cfg.dp_shard
        hsdp = (_collective_seconds(local * re, replicate_group, devices, all_reduce=True)
                + (layers + 1) * latency)
    tp = 0.0
    if cfg.tp > 1:
        tp_group = _Group(cfg.tp, 1, cfg.tp)
        activation = work.micro_batch * work.seq_len * model.dim * ce
        # Two all-reduces per block forward, two backward; the embedding's output and the output layer's
        # input gradient; the full-vocabulary logits gathered once.
        reduces = 4 * layers + 2
        logits = work.micro_batch * work.seq_len * model.vocab_size * ce
        tp = (reduces * _collective_seconds(activation, tp_group, devices, all_reduce=True)
              + _collective_seconds(logits, tp_group, devices, all_reduce=False)
              + (reduces + 1) * latency)

    compute = _compute_seconds(cfg, devices, work)
    dp_comm = micro_steps * (fsdp + hsdp)
    ep = _all_to_all_step_seconds(cfg, devices, work)
    return StepTime(micro_steps, compute, micro_steps * fsdp, micro_steps * hsdp, micro_steps * tp,
                    hidden=min(dp_comm, cost.overlap * compute), ep=micro_steps * ep)


# ---------------------------------------------------------------------------------------------- pipeline stages
@lru_cache(maxsize=256)
def _pipeline_loads(model: ModelConfig | MoEConfig, pp: int) -> tuple[StageLoad, ...]:
    """What each pp rank runs, by the stage split the runtime uses (one stage per rank)."""
    if isinstance(model, MoEConfig):
        raise ValueError("pipeline parallelism is not supported for mixture-of-experts models yet: use pp=1")
    return stage_loads(pipeline_stage_split(model, pp), pp)


def _pipeline_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    """The busiest pp rank's memory. Each stage's FSDP2 blocks keep their parameters gathered from the first forward
    to the end of the step (`apply_fsdp_stages`: the schedule runs several forwards before a backward), and torch's
    pipeline schedule accumulates their gradients unsharded, in the reduce dtype, until it reduce-scatters them once
    after the last micro-batch."""
    model, sizes = work.model, _sizes(work.model, cfg.tp)
    per_layer, final_norm = _dense_layer_bytes(model, work, cfg.tp)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    tokens = work.micro_batch * work.seq_len
    micro = max(1, work.global_batch // (cfg.dp_size * work.micro_batch))
    out = []
    for load in _pipeline_loads(model, cfg.pp):
        params = stage_params(load, sizes.block, sizes.embedding, sizes.root - sizes.embedding)
        gathered = params * ce if cfg.dp_shard > 1 or work.compute_dtype != work.weight_dtype else 0.0
        gathered += params * re if cfg.dp_size > 1 else 0.0
        out.append(MemoryEstimate(
            states=params / cfg.dp_shard * work.state_bytes,
            grads=params / cfg.dp_shard * work.grad_bytes,
            gathered=gathered,
            activations=(in_flight(cfg.pp, load.coordinate, micro) * tokens
                         * stage_activation_bytes(load, per_layer, final_norm, model.dim * ce)),
            logits=tokens * _logit_bytes_per_token(model, work) if load.last else 0.0,
        ))
    return max(out, key=lambda m: m.total)


def _pipeline_step(cfg: ParallelConfig, devices: Devices, work: Workload, cost: CostModel,
                   micro_steps: int) -> StepTime:
    """A 1F1B step (`pipeline_cost.pipeline_step`). Per micro-batch a pp rank computes its blocks, runs their TP
    all-reduces and exchanges activations with its neighbours; FSDP gathers each stage once per step (those
    all-gathers can hide behind compute) and reduce-scatters once after the last micro-batch, exposed like the HSDP
    all-reduce."""
    model = work.model
    sizes, whole = _sizes(model, cfg.tp), _sizes(model, 1)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    latency = devices.network.round_latency_s
    shard_group, replicate_group = _groups(cfg, devices.per_node)
    activation = work.micro_batch * work.seq_len * model.dim * ce
    all_reduce = _collective_seconds(activation, _Group(cfg.tp, 1, cfg.tp), devices, all_reduce=True) + latency
    logits = _collective_seconds(work.micro_batch * work.seq_len * model.vocab_size * ce,
                                 _Group(cfg.tp, 1, cfg.tp), devices, all_reduce=False) + latency
    link = (devices.network.intra_bytes_per_s if boundary_inside_node(cfg.world_size, devices.per_node)
            else _inter_share(devices))
    # Per token: a block's matmuls and attention scores; the final norm and the output projection.
    block_flops = 6 * whole.block + 12 * model.dim * work.seq_len
    head_flops = 6 * (whole.root - whole.embedding)
    terms = []
    for load in _pipeline_loads(model, cfg.pp):
        flops = stage_params(load, block_flops, 0, head_flops)  # the embedding is a lookup: no matmul
        compute = work.tokens_per_step * flops / cfg.stage_size / (devices.flops * devices.efficiency)
        tp = micro_steps * (tp_all_reduces(load) * all_reduce + (logits if load.last else 0.0)) if cfg.tp > 1 else 0.0
        params = stage_params(load, sizes.block, sizes.embedding, sizes.root - sizes.embedding)
        gather = _collective_seconds(params * ce, shard_group, devices, all_reduce=False) if cfg.dp_shard > 1 else 0.0
        fsdp = (gather + _collective_seconds(params * re, shard_group, devices, all_reduce=False)
                + 2 * (load.layers + 1) * latency) if cfg.dp_shard > 1 else 0.0
        hsdp = (_collective_seconds(params / cfg.dp_shard * re, replicate_group, devices, all_reduce=True)
                + (load.layers + 1) * latency) if cfg.dp_replicate > 1 else 0.0
        terms.append(StageTerms(compute, tp, p2p_seconds(activation, micro_steps, link, latency), fsdp, hsdp,
                                min(gather, cost.overlap * compute)))
    slowest, exposed, bubble = pipeline_step(terms, micro_steps)
    return StepTime(micro_steps, slowest.compute, exposed.fsdp, exposed.hsdp, slowest.tp, exposed.hidden,
                    bubble=bubble, p2p=slowest.p2p)


def _expert_fsdp_seconds(cfg: ParallelConfig, sizes: _Sizes, devices: Devices, work: Workload) -> float:
    """One micro-batch's all-gathers and reduce-scatters of the routed experts: each rank's ep-local experts
    over its efsdp group (over all of dp_shard without ep)."""
    if not sizes.experts or cfg.efsdp == 1:
        return 0.0
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    _, efsdp_group = _expert_groups(cfg, devices.per_node)
    local, block = sizes.experts / cfg.ep, sizes.expert_block / cfg.ep
    return (_collective_seconds((2 * local - block) * ce, efsdp_group, devices, all_reduce=False)
            + _collective_seconds(local * re, efsdp_group, devices, all_reduce=False)
            + 3 * work.model.n_layers * devices.network.round_latency_s)


def _all_to_all_step_seconds(cfg: ParallelConfig, devices: Devices, work: Workload) -> float:
    """One micro-batch's token all-to-alls with ep > 1: per layer every rank sends each of its tokens ``top_k``
    times (dispatch) and gets them back (combine), forward and again backward, over its ep group. Never hidden:
    the layer waits for its tokens."""
    model = work.model
    if cfg.ep == 1 or not isinstance(model, MoEConfig):
        return 0.0
    tokens = work.micro_batch * work.seq_len
    nbytes = tokens * model.dim * model.top_k * DTYPE_ITEMSIZE[work.compute_dtype]
    ep_group, _ = _expert_groups(cfg, devices.per_node)
    per_layer = 2 * 2 * (_all_to_all_seconds(nbytes, ep_group, devices) + devices.network.round_latency_s)
    return model.n_layers * per_layer


def _structural_reasons(cfg: ParallelConfig, devices: Devices, work: Workload) -> list[str]:
    reasons = []
    if cfg.world_size != devices.count:
        reasons.append(f"needs {cfg.world_size} devices, {devices.count} are at hand")
    if cfg.tp > 1 and _tp_spans_nodes(cfg, devices.per_node):
        reasons.append(f"a TP group of {cfg.tp} would span nodes of {devices.per_node} devices: "
                       "tensor parallelism stays inside a node")
    per_step = cfg.dp_size * work.micro_batch
    if work.global_batch % per_step:
        reasons.append(
            f"global_batch={work.global_batch} is not a multiple of dp_size*micro_batch = "
            f"{cfg.dp_size}*{work.micro_batch} = {per_step}: gradient accumulation cannot keep the global batch"
        )
    if cfg.pp > 1 and work.global_batch // per_step < cfg.pp:
        reasons.append(
            f"1F1B needs at least pp={cfg.pp} micro-batches per step, and global_batch / (dp_size*micro_batch) = "
            f"{work.global_batch // per_step}: use a smaller pp or dp_size, or a larger global_batch"
        )
    return reasons


def _memory_reason(memory: MemoryEstimate, limit: float, devices: Devices, cost: CostModel) -> str:
    return (f"does not fit memory: needs {memory.total / GiB:.1f} GiB per device ({memory.describe()} GiB), "
            f"{limit / GiB:.1f} GiB usable ({devices.memory_bytes / GiB:.1f} GiB less the "
            f"{cost.reserve_fraction:.0%} reserve)")


def estimate_layout(cfg: ParallelConfig | str, devices: Devices, work: Workload,
                    cost: CostModel = CostModel()) -> LayoutCandidate:
    """Predictions for one layout, or the reasons it cannot run on ``devices``."""
    cfg = ParallelConfig.parse(cfg)
    limit = devices.memory_bytes * (1 - cost.reserve_fraction)
    base = dict(config=cfg, memory_limit=limit, tokens_per_step=work.tokens_per_step)
    try:
        cfg.validate(work.model)
        if cfg.pp > 1:
            _pipeline_loads(work.model, cfg.pp)
    except ValueError as err:
        return LayoutCandidate(reasons=(str(err),), **base)
    reasons = _structural_reasons(cfg, devices, work)
    memory = estimate_memory(cfg, work)
    if memory.total > limit:
        reasons.append(_memory_reason(memory, limit, devices, cost))
    time = None
    if cfg.world_size == devices.count and not work.global_batch % (cfg.dp_size * work.micro_batch):
        time = estimate_step(cfg, devices, work, cost, work.global_batch // (cfg.dp_size * work.micro_batch))
    return LayoutCandidate(reasons=tuple(reasons), time=time, memory=memory, **base)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(count: int, model: ModelConfig | MoEConfig | None = None, pipeline: bool = True
                      ) -> list[ParallelConfig]:
    """Every (dp_replicate, dp_shard, tp) whose product is ``count``; for a mixture-of-experts ``model`` also
    every ep that divides both dp_shard and the model's experts; for a dense ``model`` also every pp > 1 that
    divides ``count`` and has a layer per stage, with every (dp_replicate, dp_shard, tp) of ``count / pp``."""
    n_experts = getattr(model, "n_experts", None)
    out = []
    for tp in _divisors(count):
        for shard in _divisors(count // tp):
            eps = [e for e in _divisors(shard) if n_experts and not n_experts % e] or [1]
            out += [ParallelConfig(count // (tp * shard), shard, tp, ep) for ep in eps]
    if isinstance(model, ModelConfig) and pipeline:
        for pp in _divisors(count)[1:]:
            if pp > model.n_layers:
                break
            stage = count // pp
            out += [ParallelConfig(stage // (tp * shard), shard, tp, pp=pp)
                    for tp in _divisors(stage) for shard in _divisors(stage // tp)]
    return out


def _rank_key(c: LayoutCandidate) -> tuple:
    # Equal predicted times (compute-bound layouts) go to the smaller memory footprint, then the simpler mesh.
    return (float(f"{c.step_seconds:.9g}"), c.memory_bytes, c.config.tp, c.config.dp_replicate, c.config.ep,
            c.config.pp)


def rank_layouts(devices: Devices, work: Workload, cost: CostModel = CostModel()) -> list[LayoutCandidate]:
    """Every layout of ``devices.count`` devices: runnable ones fastest first, then the excluded ones."""
    cands = [estimate_layout(cfg, devices, work, cost)
             for cfg in enumerate_configs(devices.count, work.model, work.pipeline)]
    runnable = sorted((c for c in cands if c.runnable), key=_rank_key)
    return runnable + [c for c in cands if not c.runnable]


def _no_fit_message(devices: Devices, work: Workload, ranked: Iterable[LayoutCandidate]) -> str:
    lines = [
        f"no layout of model {work.model.name!r} runs on {devices.count} devices of "
        f"{devices.memory_bytes / GiB:.1f} GiB ({devices.per_node} per node) with seq_len={work.seq_len}, "
        f"global_batch={work.global_batch}, micro_batch={work.micro_batch}:"
    ]
    lines += [f"  {c.config.short()}: {c.excluded}" for c in ranked]
    return "\n".join(lines)


def choose_layout(devices: Devices, work: Workload, cost: CostModel = CostModel()) -> LayoutCandidate:
    """The runnable layout with the shortest predicted step; ValueError listing every exclusion if none runs."""
    ranked = rank_layouts(devices, work, cost)
    if not ranked[0].runnable:
        raise ValueError(_no_fit_message(devices, work, ranked))
    return ranked[0]


# ---------------------------------------------------------------------------------------------- switch cost
@dataclass(frozen=True)
class SwitchCost:
    """What the routing planner predicts for moving every state from one layout to another."""

    bytes_moved: int
    bytes_total: int
    rounds: int
    transfer_seconds: float  # the network model's time for the plan's rounds
    fixed_seconds: float     # the stall besides the transfer (rebuilding model and optimizer, agreement)

    @property
    def seconds(self) -> float:
        return self.transfer_seconds + self.fixed_seconds


def price_switch(current: ParallelConfig | str, target: ParallelConfig | str, devices: Devices, work: Workload,
                 *, budget_bytes: int = DEFAULT_SWITCH_BUDGET, fixed_seconds: float = 0.0,
                 rank_map: Sequence[int | None] | None = None, leave: Iterable[int] = (),
                 lost: Iterable[int] = ()) -> SwitchCost:
    """Plan the switch as the strategy would (optimal rank map, TP groups inside nodes) and time it.

    ``rank_map``: the process at each position of ``current`` (identity by default). ``leave``/``lost`` pass
    through to `plan_switch` for a change of device count."""
    current, target = ParallelConfig.parse(current), ParallelConfig.parse(target)
    if isinstance(work.model, MoEConfig) or current.pp > 1 or target.pp > 1:
        # Expert placements follow no dense rule, and a pipeline stage holds the layers of the model's stage
        # split: both layouts come from the analytic placements.
        old = layout_for_model(work.model, current, work.state_kind, rank_map)
        target = layout_for_model(work.model, target, work.state_kind)
    else:
        old = Layout.from_config(model_states(work.model, work.state_kind), current, rank_map)
    plan = plan_switch(old, target, leave=leave, lost=lost, rank_map="optimal", budget_bytes=budget_bytes,
                       gpus_per_node=devices.per_node, compare_identity=False)
    return SwitchCost(plan.bytes_moved, plan.bytes_total, plan.num_rounds,
                      devices.network.predict_seconds(plan.traffic), fixed_seconds)


@dataclass(frozen=True)
class SwitchVerdict:
    """A same-device-count switch weighed: the time it saves over ``horizon_steps`` against what it costs."""

    current: LayoutCandidate
    candidate: LayoutCandidate
    horizon_steps: int
    cost: SwitchCost

    @property
    def gain_seconds(self) -> float:
        """Predicted training time saved over the horizon; infinite when the current layout cannot run."""
        if self.current.step_seconds is None or not self.current.runnable:
            return math.inf
        return self.horizon_steps * (self.current.step_seconds - self.candidate.step_seconds)

    @property
    def net_seconds(self) -> float:
        return self.gain_seconds - self.cost.seconds

    @property
    def pays(self) -> bool:
        return self.candidate.runnable and self.net_seconds > 0


def weigh_switch(current: ParallelConfig | str, candidate: ParallelConfig | str, devices: Devices,
                 work: Workload, *, horizon_steps: int, cost: CostModel = CostModel(),
                 budget_bytes: int = DEFAULT_SWITCH_BUDGET, fixed_seconds: float = 0.0,
                 rank_map: Sequence[int | None] | None = None) -> SwitchVerdict:
    """Whether switching ``current`` -> ``candidate`` on the same devices pays over ``horizon_steps`` steps."""
    current, candidate = ParallelConfig.parse(current), ParallelConfig.parse(candidate)
    if isinstance(horizon_steps, bool) or not isinstance(horizon_steps, int) or horizon_steps < 0:
        raise ValueError(f"horizon_steps must be a non-negative integer, got {horizon_steps!r}")
    for name, cfg in (("current", current), ("candidate", candidate)):
        if cfg.world_size != devices.count:
            raise ValueError(
                f"{name} layout {cfg.short()} needs {cfg.world_size} devices, {devices.count} are at hand: only a "
                "switch on the same devices is weighed; a change of device count is never skipped (plan_layout)"
            )
    return SwitchVerdict(
        estimate_layout(current, devices, work, cost), estimate_layout(candidate, devices, work, cost),
        horizon_steps,
        price_switch(current, candidate, devices, work, budget_bytes=budget_bytes, fixed_seconds=fixed_seconds,
                     rank_map=rank_map),
    )


# ---------------------------------------------------------------------------------------------- policy
def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class LayoutDecision:
    """What to run next. ``target == current`` means keep the current layout."""

    current: ParallelConfig | None
    target: ParallelConfig
    reason: str
    estimate: LayoutCandidate                # the target's predictions
    current_estimate: LayoutCandidate | None
    switch: SwitchCost | None                # None when nothing was priced
    gain_seconds: float | None               # predicted time saved over the horizon by the chosen switch
    horizon_steps: int
    ranked: tuple[LayoutCandidate, ...] = field(repr=False, default=())

    @property
    def changes(self) -> bool:
        return self.target != self.current

    @property
    def switch_seconds(self) -> float | None:
        return None if self.switch is None else self.switch.seconds

    @property
    def bytes_moved(self) -> int | None:
        return None if self.switch is None else self.switch.bytes_moved


@dataclass(frozen=True)
class LayoutPolicy:
    """Choose the best layout for the devices at hand; on the same devices, switch only when it pays.

    ``horizon_steps``: optimizer steps the new layout is expected to run (until the next resource change).
    ``fixed_seconds``: stall of a switch besides the transfer. ``max_priced``: how many of the layouts faster
    than the current one are priced (each costs one routing plan); the one with the largest net gain wins."""

    horizon_steps: int = 200
    cost: CostModel = CostModel()
    budget_bytes: int = DEFAULT_SWITCH_BUDGET
    fixed_seconds: float = 0.0
    max_priced: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.horizon_steps, bool) or not isinstance(self.horizon_steps, int) or self.horizon_steps < 0:
            raise ValueError(f"horizon_steps must be a non-negative integer, got {self.horizon_steps!r}")
        if self.max_priced < 1:
            raise ValueError(f"max_priced must be at least 1, got {self.max_priced!r}")
        if self.fixed_seconds < 0:
            raise ValueError(f"fixed_seconds must be >= 0, got {self.fixed_seconds!r}")

    def decide(self, devices: Devices, work: Workload, current: ParallelConfig | str | None = None, *,
               rank_map: Sequence[int | None] | None = None, leave: Iterable[int] = (),
               lost: Iterable[int] = ()) -> LayoutDecision:
        ranked = tuple(rank_layouts(devices, work, self.cost))
        if not ranked[0].runnable:
            raise ValueError(_no_fit_message(devices, work, ranked))
        best = ranked[0]
        if current is None:
            return self._decision(None, best, "no current layout: the best predicted throughput", ranked)
        current = ParallelConfig.parse(current)
        leave, lost = tuple(leave), tuple(lost)
        if current.world_size != devices.count or leave or lost:
            cost = self._price(current, best.config, devices, work, rank_map, leave, lost)
            change = (f"device count changed from {current.world_size} to {devices.count}"
                      if current.world_size != devices.count else "processes leave or were lost")
            reason = (f"{change}: the current layout cannot run, so the switch is never skipped; "
                      f"{best.config.short()} is the best predicted")
            return self._decision(current, best, reason, ranked, switch=cost)
        now = estimate_layout(current, devices, work, self.cost)
        if not now.runnable:
            cost = self._price(current, best.config, devices, work, rank_map, leave, lost)
            return self._decision(current, best, f"the current layout cannot run: {now.excluded}", ranked,
                                  now=now, switch=cost, gain=math.inf)
        return self._weigh(current, now, ranked, devices, work, rank_map)

    def _weigh(self, current: ParallelConfig, now: LayoutCandidate, ranked: tuple[LayoutCandidate, ...],
               devices: Devices, work: Workload, rank_map) -> LayoutDecision:
        faster = [c for c in ranked if c.runnable and _rank_key(c)[0] < _rank_key(now)[0]][: self.max_priced]
        if not faster:
            return self._decision(current, now, "the current layout is already the best predicted", ranked, now=now)
        verdicts = [
            SwitchVerdict(now, c, self.horizon_steps,
                          self._price(current, c.config, devices, work, rank_map, (), ()))
            for c in faster
        ]
        pick = max(verdicts, key=lambda v: v.net_seconds)
        figures = (f"{pick.candidate.config.short()} saves {pick.gain_seconds:.3g} s over {self.horizon_steps} "
                   f"steps ({now.step_seconds:.4g} -> {pick.candidate.step_seconds:.4g} s/step), the switch costs "
                   f"{pick.cost.seconds:.3g} s ({_size(pick.cost.bytes_moved)} moved)")
        if pick.pays:
            return self._decision(current, pick.candidate, f"switch: {figures}", ranked, now=now,
                                  switch=pick.cost, gain=pick.gain_seconds)
        return self._decision(current, now, f"keep {current.short()}: {figures}, which does not pay", ranked,
                              now=now, switch=pick.cost, gain=pick.gain_seconds)

    def _price(self, current, target, devices, work, rank_map, leave, lost) -> SwitchCost | None:
        if current == target and not leave and not lost:
            return None
        return price_switch(current, target, devices, work, budget_bytes=self.budget_bytes,
                            fixed_seconds=self.fixed_seconds, rank_map=rank_map, leave=leave, lost=lost)

    def _decision(self, current, target: LayoutCandidate, reason: str, ranked, *, now=None, switch=None,
                  gain=None) -> LayoutDecision:
        return LayoutDecision(current, target.config, reason, target, now, switch, gain, self.horizon_steps, ranked)


def plan_layout(devices: Devices, work: Workload, current: ParallelConfig | str | None = None, *,
                policy: LayoutPolicy | None = None, rank_map: Sequence[int | None] | None = None,
                leave: Iterable[int] = (), lost: Iterable[int] = ()) -> LayoutDecision:
    """The layout to run on ``devices`` next, given the ``current`` one (None at start); see `LayoutPolicy`."""
    return (policy or LayoutPolicy()).decide(devices, work, current, rank_map=rank_map, leave=leave, lost=lost)
