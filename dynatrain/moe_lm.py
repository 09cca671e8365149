"""The mixture-of-experts side of the zoo's LightningModule (`dynatrain.llama_lm.CausalLM`).

An MoE model is parallelised by the zoo's `parallelize_moe` for the strategy's layout (ep included), and its
routers' load is read from each layer's ``tokens_per_expert``: summed over the data-parallel ranks once per
optimizer step, it moves the expert bias and gives the expert-load metrics (tokens per expert and max/mean).
"""

from __future__ import annotations

import torch
from torch import nn

from dynatrain.models.checkpointing import ActivationCheckpointing
from dynatrain.models.configs import ModelConfig
from dynatrain.models.parallelize import apply_block_options
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.models.specs import get_zoo_config
from dynatrain.vps.parallel_config import ParallelConfig


def zoo_config(name: str, overrides: dict | None = None) -> ModelConfig | MoEConfig:
    """A named dense (Llama) or mixture-of-experts config, with fields replaced by ``overrides``."""
    return get_zoo_config(name).with_overrides(**(overrides or {}))


def is_moe(config) -> bool:
    return isinstance(config, MoEConfig)


def build_moe(config: MoEConfig) -> nn.Module:
    from dynatrain.models.moe import MoETransformer

    return MoETransformer(config)


def parallelize_for(model: nn.Module, mesh, pcfg: ParallelConfig, strategy) -> None:
    """Data, tensor and expert parallelism for ``pcfg`` (the strategy's layout, the target's while a switch builds
    it; under Lightning's ModelParallelStrategy data and tensor parallelism on its mesh)."""
    from dynatrain.models.moe import parallelize_moe

    if getattr(strategy, "sequence_parallel", False):
        raise ValueError("sequence_parallel is not supported for mixture-of-experts models: set the strategy's "
                         "sequence_parallel to false")
    if pcfg.pp > 1:
        raise ValueError(f"pipeline parallelism is not supported for mixture-of-experts models yet (their router "
                         f"losses and token counts span every stage): use pp=1, not {pcfg.short()}")
    policy = ActivationCheckpointing.parse(getattr(strategy, "activation_checkpointing", None))
    if policy.per_op and pcfg.ep > 1:
        raise ValueError(f"activation_checkpointing='selective:op' does not work with ep > 1 ({pcfg.short()}): the "
                         "routed experts' own FSDP runs other ops when the block is recomputed than in its forward; "
                         "use 'full' or 'selective:N' with expert parallelism")
    parallelize_moe(model, mesh, pcfg, mp_policy=getattr(strategy, "mp_policy", None))
    # After FSDP here, which is the same as before it: neither wraps a module, both replace the block's forward.
    backend = getattr(strategy, "compile_backend", None)
    apply_block_options(model, policy, backend)
    if backend is not None:
        for layer in model.layers.values():
            # The routed experts run eagerly between the compiled parts: torch traces `_grouped_mm` for bf16 inputs
            # only, and their token counts are data-dependent.
            experts = layer.moe.experts
            experts.forward = torch.compiler.disable(experts.forward)


# ---- the routers' load ------------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.moe for layer in model.layers.values()]


def local_counts(model: nn.Module) -> torch.Tensor:
    """This rank's tokens per expert since the last step, ``[n_layers, n_experts]`` in fp32 (the buffers may be
    bf16 under bf16-true precision, where counts above 256 are no longer exact)."""
    return torch.stack([moe.tokens_per_expert.float() for moe in moe_layers(model)])


def apply_load(model: nn.Module, counts: torch.Tensor) -> None:
    """Move every layer's expert bias by the job's load of the step and start counting again."""
    for moe, layer_counts in zip(moe_layers(model), counts):
        moe.update_expert_bias(layer_counts.to(moe.tokens_per_expert.dtype))


def reset_counts(model: nn.Module) -> None:
    for moe in moe_layers(model):
        moe.tokens_per_expert.zero_()


def imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Per layer, the busiest expert's tokens over the mean (1 is perfect balance; 0 for a layer that saw none)."""
    mean = counts.mean(-1)
    return torch.where(mean > 0, counts.max(-1).values / mean.clamp_min(1e-12), torch.zeros_like(mean))


def load_metrics(counts: torch.Tensor, per_expert: bool) -> dict[str, float]:
    """The expert-load metrics of one step: ``moe/layer{i}/imbalance``, the whole model's ``moe/imbalance_max``
    and, with ``per_expert``, ``moe/layer{i}/expert{e}_tokens``."""
    ratios = imbalance(counts)
    out = {f"moe/layer{i}/imbalance": float(r) for i, r in enumerate(ratios)}
    out["moe/imbalance_max"] = float(ratios.max())
    if per_expert:
        for i, layer in enumerate(counts.tolist()):
            out.update({f"moe/layer{i}/expert{e}_tokens": n for e, n in enumerate(layer)})
    return out
