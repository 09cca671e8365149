"""Parameter counts the cost model needs, counted exactly from a model config's shapes and its TP rules, and the
layers each pipeline stage runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from dynatrain.models.moe_specs import is_routed_expert
from dynatrain.models.registry import ZooConfig, spec_for
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


@lru_cache(maxsize=256)
def model_sizes(model: ZooConfig, tp: int) -> ModelSizes:
    spec = spec_for(model)
    tp_local = block = root = experts = expert_block = embedding = 0
    for name, shape in model.param_shapes().items():
        n = math.prod(shape)
        if is_routed_expert(name):
            experts += n
            expert_block += n if name.startswith("layers.0.") else 0
            continue
        local = n if spec.tp_dim(name, shape) is None else n // tp
        tp_local += local
        if name.startswith("layers.0."):
            block += local
        elif not name.startswith("layers."):
            root += local
            embedding += local if name.startswith("tok_embeddings.") else 0
    active = experts * model.top_k // model.n_experts if spec.routed_experts else 0
    matmul = model.num_params() - experts - model.vocab_size * model.dim
    return ModelSizes(tp_local, block, root, matmul, experts, expert_block, active, embedding)


@lru_cache(maxsize=256)
def pipeline_loads(model: ZooConfig, pp: int) -> tuple[StageLoad, ...]:
    """What each pp rank runs, by the stage split the runtime uses (one stage per rank)."""
    return stage_loads(spec_for(model).stages(model, pp), pp)
