"""The mixture-of-experts side of the zoo's LightningModule (`dynatrain.llama_lm.CausalLM`).

An MoE model is built and parallelised through its kind's spec (`models.registry`: `models.builders.build_moe` and
`parallelize_moe_for`, ep included), and its routers' load is read from each layer's ``tokens_per_expert``: summed
over the data-parallel ranks once per optimizer step, it moves the expert bias and gives the expert-load metrics
(tokens per expert and max/mean).
"""

from __future__ import annotations

import torch
from torch import nn

from dynatrain.models.builders import parallelize_moe_for as parallelize_for  # noqa: F401  (the name callers use)
from dynatrain.models.registry import ZooConfig, get_zoo_config


def zoo_config(name: str, overrides: dict | None = None) -> ZooConfig:
    """A named config of any kind (dense Llama, mixture of experts), with fields replaced by ``overrides``."""
    return get_zoo_config(name).with_overrides(**(overrides or {}))


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
