"""The mixture-of-experts side of the zoo's LightningModule (`dynatrain.lm.causal_lm.CausalLM`).

An MoE model is built and parallelised through its kind's spec (`models.registry`: `models.moe` and
`models.parallelize_moe`, ep and pp included), and its routers' load is read from each layer's ``tokens_per_expert``:
summed over the data-parallel ranks (and the pipeline stages, each holding its layers' rows) once per optimizer step,
it moves the expert bias and gives the expert-load metrics (tokens per expert and max/mean).
"""

from __future__ import annotations

import torch
from torch import nn

from dynatrain.models.registry import ZooConfig, get_zoo_config


def zoo_config(name: str, overrides: dict | None = None) -> ZooConfig:
    """A named config of any kind (dense Llama, mixture of experts), with fields replaced by ``overrides``."""
    return get_zoo_config(name).with_overrides(**(overrides or {}))


# ---- the routers' load ------------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE of every layer this rank holds, by layer index (a pipeline stage holds some of them)."""
    return {int(key): layer.moe for key, layer in model.layers.items()}


def local_counts(model: nn.Module) -> torch.Tensor:
    """This rank's tokens per expert since the last step, ``[n_layers, n_experts]`` of the whole model in fp32 (the
    buffers may be bf16 under bf16-true precision, where counts above 256 are no longer exact); the rows of layers
    another pipeline stage holds are zero, so a sum over every rank has each layer's counts once per dp rank."""
    layers = moe_layers(model)
    cfg = model.config
    device = next(iter(layers.values())).tokens_per_expert.device
    counts = torch.zeros(cfg.n_layers, cfg.n_experts, device=device)
    for i, moe in layers.items():
        counts[i] = moe.tokens_per_expert.float()
    return counts


def apply_load(model: nn.Module, counts: torch.Tensor) -> None:
    """Move the expert bias of every layer this rank holds by the job's load of the step and start counting again."""
    for i, moe in moe_layers(model).items():
        moe.update_expert_bias(counts[i].to(moe.tokens_per_expert.dtype))


def reset_counts(model: nn.Module) -> None:
    """Forget the tokens routed and the auxiliary losses since the last step."""
    for moe in moe_layers(model).values():
        moe.reset_stats()


def stage_aux(model: nn.Module) -> torch.Tensor | None:
    """The step's auxiliary loss of the layers this rank holds: per layer the mean over its training forwards,
    summed (None when no layer computed one). Under pp each stage's share; their sum over stages is the model's."""
    means = [moe.aux_sum / moe.aux_forwards for moe in moe_layers(model).values() if moe.aux_forwards]
    return torch.stack(means).sum() if means else None


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
