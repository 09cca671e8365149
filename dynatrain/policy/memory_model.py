"""Predicted peak memory of one device under a layout: states, gradients, what FSDP holds gathered, activations kept
for backward and the logits (formulas in docs/layouts.md)."""

from __future__ import annotations

from dataclasses import dataclass

from dynatrain.models.configs import ModelConfig
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.planner.pipeline_cost import in_flight, stage_activation_bytes, stage_params
from dynatrain.policy.inputs import GiB, Workload
from dynatrain.policy.sizes import model_sizes, pipeline_loads
from dynatrain.vps.layout import DTYPE_ITEMSIZE
from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes on one device."""

    states: float       # this device's shard of weights, master copy and Adam moments
    grads: float        # this device's shard of the gradients
    gathered: float     # parameters FSDP holds unsharded at once, and one block's unsharded gradient
    activations: float  # kept for backward, one micro-batch, and one checkpointed block's recomputation
    logits: float       # the logits (this rank's vocabulary slice under loss parallelism) and the loss's fp32 copies

    @property
    def total(self) -> float:
        return self.states + self.grads + self.gathered + self.activations + self.logits

    def describe(self) -> str:
        parts = ("states", "grads", "gathered", "activations", "logits")
        return ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)


def _moe_layer_bytes(model: MoEConfig, work: Workload, tp: int) -> tuple[float, float]:
    """As `_dense_layer_bytes`, for the MoE block of dynatrain/models/moe.py: attention as the dense block
    (TP-sharded), then the router's fp32 scores, the ``top_k`` copies of the token sent to its experts (and
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
    return norms + attention + scores + router + routed + shared + _gathered_inputs(model, work, tp), final_norm


def _dense_layer_bytes(model: ModelConfig, work: Workload, tp: int) -> tuple[float, float]:
    """(one block's, the final norm's) activation bytes per token of the dense model without checkpointing: what
    autograd saves for the block in dynatrain/models/llama.py (see docs/layouts.md)."""
    if isinstance(model, MoEConfig):
        return _moe_layer_bytes(model, work, tp)
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
    return norms + sharded + scores + _gathered_inputs(model, work, tp), final_norm


def _gathered_inputs(model: ModelConfig | MoEConfig, work: Workload, tp: int) -> float:
    # Under sequence parallelism the attention's and the FFN's inputs are all-gathered over the sequence, and the
    # first matmul of each keeps that whole tensor for its weight gradient: replicated on every TP rank.
    return 2 * DTYPE_ITEMSIZE[work.compute_dtype] * model.dim if work.sequence_parallel and tp > 1 else 0.0


def _op_saved_bytes(model: ModelConfig | MoEConfig, work: Workload, tp: int, per_layer: float) -> float:
    """Bytes per token a block checkpointed per op keeps (`models.checkpointing`): the outputs of the 1st, 3rd,
    5th and 7th matmul (wq, wv, w1, w2; w2's is whole, a row-parallel partial sum under TP), of attention (its
    output and fp32 log-sum-exp per head) and, with tp > 1, of the two all-reduces (under sequence parallelism the
    two reduce-scatters, split over the sequence; the all-gathers are recomputed). For a MoE block, whose matmul
    count depends on the routing, half its activations."""
    if isinstance(model, MoEConfig):
        return per_layer / 2
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    h, kv = model.dim, model.n_kv_heads * model.head_dim
    saved = e * (h + kv + h + model.ffn_dim) / tp + 4 * model.n_heads / tp + e * h
    return saved + (2 * e * h / (tp if work.sequence_parallel else 1) if tp > 1 else 0.0)


def checkpointed_layers(work: Workload, layers: int) -> int:
    """How many of ``layers`` blocks are checkpointed whole (selective:op checkpoints every block per op: 0)."""
    every = work.checkpoint_every
    return layers // every if every else 0


def _blocks_bytes(model: ModelConfig | MoEConfig, work: Workload, tp: int, layers: int) -> tuple[float, float]:
    """(kept until backward, extra while one block recomputes) activation bytes per token of ``layers`` blocks
    under the workload's checkpointing. A checkpointed block keeps its input; its backward first recomputes its
    forward, so one block's activations (less what the op policy kept) exist again at a time."""
    per_layer, _ = _dense_layer_bytes(model, work, tp)
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    block_input = e * model.dim / (tp if work.sequence_parallel else 1)
    k = checkpointed_layers(work, layers)
    if work.activation_checkpointing == "selective:op":
        saved = _op_saved_bytes(model, work, tp, per_layer)
        return layers * (block_input + saved), max(per_layer - saved, 0.0)
    # Measured, not derived: under sequence parallelism a block checkpointed whole still keeps about three
    # sequence-gathered tensors per token (e*h each, on every TP rank; debug model, 8 layers: +19.5 MiB at tp=2,
    # +23 MiB at tp=4 against the same layout without sequence parallelism, bench/results/memory_model/).
    kept = block_input + (3 * e * model.dim if work.sequence_parallel and tp > 1 else 0.0)
    return (layers - k) * per_layer + k * kept, per_layer if k else 0.0


def _activation_bytes_per_token(model: ModelConfig | MoEConfig, work: Workload, tp: int) -> float:
    """Bytes one token's activations occupy at the peak of backward, over all layers."""
    kept, recompute = _blocks_bytes(model, work, tp, model.n_layers)
    return kept + recompute + _dense_layer_bytes(model, work, tp)[1]


def _logit_bytes_per_token(model: ModelConfig, work: Workload, tp: int) -> float:
    # The loss upcasts the logits and keeps a log-softmax. Under loss parallelism (tp > 1) every TP rank holds its
    # slice of the vocabulary only; without it the output gathers the full vocabulary on every rank.
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    upcast = 4 if e < 4 else 0
    split = tp if work.loss_parallel else 1
    return model.vocab_size / split * (e + upcast + 4)


def estimate_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    if cfg.pp > 1:
        return _pipeline_memory(cfg, work)
    model = work.model
    sizes = model_sizes(model, cfg.tp)
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
        logits=tokens * _logit_bytes_per_token(model, work, cfg.tp),
    )


def _pipeline_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    """The busiest pp rank's memory. Each stage's FSDP2 blocks keep their parameters gathered from the first forward
    to the end of the step (`apply_fsdp_stages`: the schedule runs several forwards before a backward), and torch's
    pipeline schedule accumulates their gradients unsharded, in the reduce dtype, until it reduce-scatters them once
    after the last micro-batch."""
    model, sizes = work.model, model_sizes(work.model, cfg.tp)
    _, final_norm = _dense_layer_bytes(model, work, cfg.tp)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    tokens = work.micro_batch * work.seq_len
    micro = max(1, work.global_batch // (cfg.dp_size * work.micro_batch))
    out = []
    for load in pipeline_loads(model, cfg.pp):
        # Checkpointing spreads over the stage's blocks; one block recomputes at a time, whatever is in flight.
        kept, recompute = _blocks_bytes(model, work, cfg.tp, load.layers)
        params = stage_params(load, sizes.block, sizes.embedding, sizes.root - sizes.embedding)
        gathered = params * ce if cfg.dp_shard > 1 or work.compute_dtype != work.weight_dtype else 0.0
        gathered += params * re if cfg.dp_size > 1 else 0.0
        out.append(MemoryEstimate(
            states=params / cfg.dp_shard * work.state_bytes,
            grads=params / cfg.dp_shard * work.grad_bytes,
            gathered=gathered,
            activations=tokens * (in_flight(cfg.pp, load.coordinate, micro)
                                  * stage_activation_bytes(load, kept / max(load.layers, 1), final_norm, model.dim * ce)
                                  + recompute),
            logits=tokens * _logit_bytes_per_token(model, work, cfg.tp) if load.last else 0.0,
        ))
    return max(out, key=lambda m: m.total)
