"""Parameter counts the cost model needs, counted exactly from a model config's shapes and its TP rules, and the
layers each pipeline stage runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from dynatrain.models.configs import ModelConfig
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.models.moe_specs import is_routed_expert, moe_tp_dim
from dynatrain.models.specs import pipeline_stage_split, rule_for_param
from dynatrain.planner.pipeline_cost import StageLoad, stage_loads


@dataclass(frozen=True)
class ModelSizes:
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
def model_sizes(model: ModelConfig | MoEConfig, tp: int) -> ModelSizes:
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
        return ModelSizes(tp_local, block, root, matmul, experts, expert_block, active, embedding)
    matmul = model.num_params() - model.vocab_size * model.dim
    return ModelSizes(tp_local, block, root, matmul, embedding=embedding)


@lru_cache(maxsize=256)
def pipeline_loads(model: ModelConfig | MoEConfig, pp: int) -> tuple[StageLoad, ...]:
    """What each pp rank runs, by the stage split the runtime uses (one stage per rank)."""
    if isinstance(model, MoEConfig):
        raise ValueError("pipeline parallelism is not supported for mixture-of-experts models yet: use pp=1")
    return stage_loads(pipeline_stage_split(model, pp), pp)
