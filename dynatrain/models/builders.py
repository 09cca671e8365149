"""How `CausalLM` builds and parallelises each kind of model: the registry's ``build`` and ``parallelize_fn``.

Torch is imported inside the functions: the registry that names them is read by the layout policy, which runs
without torch.
"""

from __future__ import annotations


def build_dense(config):
    """The dense decoder on the current device (the meta device under ``torch.device("meta")``)."""
    from dynatrain.models.llama import Transformer

    return Transformer(config)


def build_moe(config):
    """The mixture-of-experts decoder on the current device."""
    from dynatrain.models.moe import MoETransformer

    return MoETransformer(config)


def parallelize_dense_for(model, mesh, pcfg, strategy) -> None:
    """Tensor and data parallelism for ``pcfg``: the strategy's own ``parallelize`` when it has one (dynatrain's
    applies its ``parallelize_fn`` for the layout it is building, a switch's target included), else the zoo's on
    ``mesh`` (Lightning's ModelParallelStrategy)."""
    if hasattr(strategy, "parallelize"):
        strategy.parallelize(model)
        return
    from dynatrain.models.parallelize import dense_meshes, parallelize_model

    parallelize_model(model, *dense_meshes(mesh, pcfg.validate(model.config)))


def parallelize_moe_for(model, mesh, pcfg, strategy) -> None:
    """Pipeline, data, tensor and expert parallelism for ``pcfg`` (the strategy's layout, the target's while a switch
    builds it, with its ``stages_per_rank``; under Lightning's ModelParallelStrategy data and tensor parallelism on
    its mesh)."""
    import torch

    from dynatrain.models.checkpointing import ActivationCheckpointing
    from dynatrain.models.moe import parallelize_moe
    from dynatrain.models.parallelize import apply_block_options

    options = getattr(strategy, "parallelism", None)  # a DynaTrainStrategy's; Lightning's own strategies have none
    if getattr(options, "sequence_parallel", False):
        raise ValueError("sequence_parallel is not supported for mixture-of-experts models: set the strategy's "
                         "parallelism.sequence_parallel to false")
    policy = ActivationCheckpointing.parse(getattr(options, "activation_checkpointing", None))
    if policy.per_op and pcfg.ep > 1:
        raise ValueError(f"activation_checkpointing='selective:op' does not work with ep > 1 ({pcfg.short()}): the "
                         "routed experts' own FSDP runs other ops when the block is recomputed than in its forward; "
                         "use 'full' or 'selective:N' with expert parallelism")
    parallelize_moe(model, mesh, pcfg, mp_policy=getattr(options, "mp_policy", None),
                    stages_per_rank=getattr(options, "stages_per_rank", 1) if pcfg.pp > 1 else 1)
    # After FSDP here, which is the same as before it: neither wraps a module, both replace the block's forward.
    backend = getattr(options, "compile_backend", None)
    apply_block_options(model, policy, backend)
    if backend is not None:
        for layer in model.layers.values():
            # The routed experts run eagerly between the compiled parts: torch traces `_grouped_mm` for bf16 inputs
            # only, and their token counts are data-dependent.
            experts = layer.moe.experts
            experts.forward = torch.compiler.disable(experts.forward)
