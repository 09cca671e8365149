"""The mixture-of-experts kind's ``parallelize_fn`` (`models.registry`): an `MoETransformer` built on the meta device,
parallelised for a layout in torchtitan's order, expert parallelism included.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from dynatrain.models import tp_styles
from dynatrain.models.checkpointing import ActivationCheckpointing
from dynatrain.models.context_parallel import enable_context_parallel
from dynatrain.models.expert_parallel import ExpertParallel
from dynatrain.models.moe import MoETransformer
from dynatrain.models.moe_specs import moe_stage_split
from dynatrain.models.parallelize import (
    ParallelizeOptions,
    apply_block_options,
    apply_cp,
    apply_fsdp,
    apply_tp,
    dense_meshes,
    split_for_pp,
)
from dynatrain.vps.parallel_config import ParallelConfig


def parallelize_moe(model: MoETransformer, mesh: DeviceMesh | None, pcfg: ParallelConfig,
                    options: ParallelizeOptions | None = None) -> MoETransformer:
    """Parallelise ``model`` for ``pcfg`` on ``mesh``, in this order:

    - cp: each sequence split over the cp ranks as in the dense model (`models.context_parallel`); routing is per
      token, so the MoE works on the rank's tokens, and only the auxiliary loss's token shares are summed over the
      cp group (the unsplit model's loss);
    - pp: the model keeps the layers of this rank's stages (layers placed by `moe_specs.moe_stage_split`),
      everything below runs on the stage's sub-mesh, and each layer's auxiliary loss joins the backward through its
      output;
    - tp: attention heads, embeddings and the output projection split as in the dense model; the router, the
      shared expert and the routed experts stay whole on every TP rank (each TP rank routes the same tokens); the
      logits come out whole (no sequence or loss parallelism);
    - ep: each layer's routed experts split over ``ep`` (`ExpertParallel`), tokens moved by all-to-all; with cp,
      the ep group spans whole cp groups (``ParallelConfig``), each rank sending its own tokens; then FSDP2 of the
      experts over the data-parallel ranks outside their ep group (``efsdp``, HSDP with ``dp_replicate``);
    - FSDP2 of each block and the root over all data-parallel ranks;
    - activation checkpointing, then `torch.compile`, per block: after FSDP here, which is the same as before it
      (neither wraps a module, both replace the block's forward); the routed experts run eagerly.

    An expert's gradient holds the tokens of its whole ep group, so its reduction divides by every data-parallel
    rank, as a dense weight's does. ``mesh`` is dynatrain's (``pcfg.mesh_dim_names``) or, without ep, Lightning
    ModelParallelStrategy's (``data_parallel``, ``tensor_parallel``)."""
    options = options or ParallelizeOptions()
    policy = _checked_policy(pcfg, options)
    pcfg.validate(model.config)  # tp against heads, KV heads and vocabulary; ep against the experts
    # Before a pipeline split: the stages' views copy the model's. The routers count the whole sequence's tokens.
    apply_cp(model, mesh, pcfg)
    if pcfg.cp > 1:
        for block in model.layers.values():
            enable_context_parallel(block.moe, mesh["cp"])
    stages = None
    if pcfg.pp > 1:
        split = moe_stage_split(model.config, pcfg.pp, options.stages_per_rank)
        stages = split_for_pp(model, mesh, pcfg, split, options.stages_per_rank)
        for block in model.layers.values():
            block.moe.aux_in_backward = True
    tp_mesh, dp_mesh = dense_meshes(mesh, pcfg)
    apply_tp(model, tp_mesh, block_plan=tp_styles.MOE_BLOCK_PLAN)
    if pcfg.ep > 1:
        apply_ep(model, mesh, pcfg, options.mp_policy, pipelined=stages is not None)
    apply_fsdp(model, dp_mesh, options.mp_policy, stages)
    apply_block_options(model, policy, options.compile_backend)
    if options.compile_backend is not None:
        for layer in model.layers.values():
            # The routed experts run eagerly between the compiled parts: torch traces `_grouped_mm` for bf16 inputs
            # only, and their token counts are data-dependent.
            experts = layer.moe.experts
            experts.forward = torch.compiler.disable(experts.forward)
    return model


def _checked_policy(pcfg: ParallelConfig, options: ParallelizeOptions) -> ActivationCheckpointing:
    """The checkpointing policy of ``options``, or a ValueError for what this kind cannot do, before anything
    changes."""
    if options.sequence_parallel:
        raise ValueError("sequence_parallel is not supported for mixture-of-experts models: set the strategy's "
                         "parallelism.sequence_parallel to false")
    policy = ActivationCheckpointing.parse(options.activation_checkpointing)
    if policy.per_op and pcfg.ep > 1:
        raise ValueError(f"activation_checkpointing='selective:op' does not work with ep > 1 ({pcfg.short()}): the "
                         "routed experts' own FSDP runs other ops when the block is recomputed than in its forward; "
                         "use 'full' or 'selective:N' with expert parallelism")
    return policy


def apply_ep(model: MoETransformer, mesh: DeviceMesh, pcfg: ParallelConfig, mp_policy: MixedPrecisionPolicy | None,
             pipelined: bool) -> None:
    """Split each layer's routed experts over the ep ranks, then `fully_shard` them over the data-parallel ranks
    outside their ep group; ``pipelined``: a pipeline stage's experts, gathered from forward to backward."""
    expert_dp = mesh["dp_replicate", "efsdp"] if pcfg.dp_replicate > 1 else mesh["efsdp"]
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if pipelined:
        # As the stage's blocks (`apply_fsdp_stages`): every micro-batch's forward runs before its backward.
        kwargs["reshard_after_forward"] = False
    gloo = mesh.device_type == "cpu"  # CPU meshes run on gloo
    # With cp, ep is a flattening (of dp_shard_in_ep and cp), read where the mesh keeps it: slicing it from the
    # root is deprecated in torch.
    ep_mesh = getattr(mesh, "_flatten_mapping", {}).get("ep")
    ep_mesh = mesh["ep"] if ep_mesh is None else ep_mesh
    for block in model.layers.values():
        parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
        fully_shard(block.moe.experts, mesh=expert_dp, **kwargs)
        # Every rank of a sample's cp group holds a loss of its own tokens, as a data-parallel rank does.
        block.moe.experts.set_gradient_divide_factor(float(pcfg.dp_size * pcfg.cp))
        if gloo and pcfg.efsdp > 1:
            # gloo has no pre-scaled sum: sum, then divide. (Not with one efsdp rank: torch then divides while
            # it copies the gradient and would divide a second time after a forced sum.)
            block.moe.experts.set_force_sum_reduction_for_comms(True)
