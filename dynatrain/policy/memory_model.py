"""Predicted peak memory of one device under a layout: states, gradients, what FSDP holds gathered, activations kept
for backward and the logits (formulas in docs/layouts.md; what one block keeps comes from its kind's spec,
`models.registry`)."""

from __future__ import annotations

from dataclasses import dataclass

from dynatrain.models.configs import ModelConfig
from dynatrain.models.registry import ZooConfig, spec_for
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


def checkpointed_layers(work: Workload, layers: int) -> int:
    """How many of ``layers`` blocks are checkpointed whole (selective:op checkpoints every block per op: 0)."""
    every = work.checkpoint_every
    return layers // every if every else 0


def _blocks_bytes(model: ZooConfig, work: Workload, tp: int, layers: int) -> tuple[float, float]:
    """(kept until backward, extra while one block recomputes) activation bytes per token of ``layers`` blocks
    under the workload's checkpointing. A checkpointed block keeps its input; its backward first recomputes its
    forward, so one block's activations (less what the op policy kept) exist again at a time."""
    spec = spec_for(model)
    per_layer, _ = spec.layer_bytes(model, work, tp)
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    block_input = e * model.dim / (tp if work.sequence_parallel else 1)
    k = checkpointed_layers(work, layers)
    if work.activation_checkpointing == "selective:op":
        saved = spec.op_saved_bytes(model, work, tp, per_layer)
        return layers * (block_input + saved), max(per_layer - saved, 0.0)
    # Measured, not derived: under sequence parallelism a block checkpointed whole still keeps about three
    # sequence-gathered tensors per token (e*h each, on every TP rank; debug model, 8 layers: +19.5 MiB at tp=2,
    # +23 MiB at tp=4 against the same layout without sequence parallelism, bench/results/memory_model/).
    kept = block_input + (3 * e * model.dim if work.sequence_parallel and tp > 1 else 0.0)
    return (layers - k) * per_layer + k * kept, per_layer if k else 0.0


def _activation_bytes_per_token(model: ZooConfig, work: Workload, tp: int) -> float:
    """Bytes one token's activations occupy at the peak of backward, over all layers."""
    kept, recompute = _blocks_bytes(model, work, tp, model.n_layers)
    return kept + recompute + spec_for(model).layer_bytes(model, work, tp)[1]


def _logit_bytes_per_token(model: ModelConfig, work: Workload, tp: int) -> float:
    # The loss upcasts the logits and keeps a log-softmax. Under loss parallelism (tp > 1) every TP rank holds its
    # slice of the vocabulary only; without it the output gathers the full vocabulary on every rank.
    e = DTYPE_ITEMSIZE[work.compute_dtype]
    upcast = 4 if e < 4 else 0
    split = tp if work.loss_parallel else 1
    return model.vocab_size / split * (e + upcast + 4)


def cp_attention_bytes(model: ZooConfig, work: Workload, cfg: ParallelConfig, layers: int) -> float:
    """Context parallelism's own activation bytes of ``layers`` blocks, one micro-batch: every attention keeps the
    whole sequence's keys and values, all-gathered from the cp group, for its backward (a block checkpointed whole
    gathers them again when it recomputes, one block at a time), and the mask of this rank's queries over every key
    (one tensor, shared by every layer)."""
    if cfg.cp == 1:
        return 0.0
    kv = spec_for(model).attention_width(model) * model.n_kv_heads / model.n_heads / cfg.tp
    gathered = work.micro_batch * work.seq_len * 2 * kv * DTYPE_ITEMSIZE[work.compute_dtype]
    kept = layers - checkpointed_layers(work, layers)
    return (kept + (1 if kept < layers else 0)) * gathered + work.seq_len / cfg.cp * work.seq_len


def estimate_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    if cfg.pp > 1:
        return _pipeline_memory(cfg, work)
    model = work.model
    sizes = model_sizes(model, cfg.tp)
    # Routed experts split over ep and then over efsdp: every dp_shard rank holds 1/dp_shard of them, whatever ep.
    # With cp, FSDP shards over dp_shard x cp.
    shard = (sizes.tp_local + sizes.experts) / cfg.fsdp_shard
    # A block gathers its experts over efsdp only: each rank computes with its ep group's share.
    block = sizes.block + sizes.expert_block / cfg.ep
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    gathered = 0.0
    if cfg.fsdp_shard > 1 or work.compute_dtype != work.weight_dtype:
        # The root stays gathered through forward and backward; prefetch holds the current and next block.
        gathered += (sizes.root + 2 * block) * ce
    if cfg.dp_size * cfg.cp > 1:
        gathered += block * re  # one block's gradient before it is reduced
    tokens = work.micro_batch * work.seq_len / cfg.cp  # a cp rank computes its part of every sequence
    return MemoryEstimate(
        states=shard * work.state_bytes,
        grads=shard * work.grad_bytes,
        gathered=gathered,
        activations=tokens * _activation_bytes_per_token(model, work, cfg.tp)
        + cp_attention_bytes(model, work, cfg, model.n_layers),
        logits=tokens * _logit_bytes_per_token(model, work, cfg.tp),
    )


def _pipeline_memory(cfg: ParallelConfig, work: Workload) -> MemoryEstimate:
    """The busiest pp rank's memory. Each stage's FSDP2 blocks keep their parameters gathered from the first forward
    to the end of the step (`apply_fsdp_stages`: the schedule runs several forwards before a backward), and torch's
    pipeline schedule accumulates their gradients unsharded, in the reduce dtype, until it reduce-scatters them once
    after the last micro-batch. A stage's routed experts are sharded over its dp_shard ranks and gathered over efsdp
    only: each rank holds its ep group's share of them gathered."""
    model, sizes = work.model, model_sizes(work.model, cfg.tp)
    _, final_norm = spec_for(model).layer_bytes(model, work, cfg.tp)
    ce, re = DTYPE_ITEMSIZE[work.compute_dtype], DTYPE_ITEMSIZE[work.reduce_dtype]
    tokens = work.micro_batch * work.seq_len
    micro = max(1, work.global_batch // (cfg.dp_size * work.micro_batch))
    out = []
    for load in pipeline_loads(model, cfg.pp):
        # Checkpointing spreads over the stage's blocks; one block recomputes at a time, whatever is in flight.
        kept, recompute = _blocks_bytes(model, work, cfg.tp, load.layers)
        dense = stage_params(load, sizes.block, sizes.embedding, sizes.root - sizes.embedding)
        experts = load.layers * sizes.expert_block
        params = dense + experts / cfg.ep  # what the stage's rank holds gathered
        gathered = params * ce if cfg.dp_shard > 1 or work.compute_dtype != work.weight_dtype else 0.0
        gathered += params * re if cfg.dp_size > 1 else 0.0
        out.append(MemoryEstimate(
            states=(dense + experts) / cfg.dp_shard * work.state_bytes,
            grads=(dense + experts) / cfg.dp_shard * work.grad_bytes,
            gathered=gathered,
            activations=tokens * (in_flight(cfg.pp, load.coordinate, micro)
                                  * stage_activation_bytes(load, kept / max(load.layers, 1), final_norm, model.dim * ce)
                                  + recompute),
            logits=tokens * _logit_bytes_per_token(model, work, cfg.tp) if load.last else 0.0,
        ))
    return max(out, key=lambda m: m.total)
