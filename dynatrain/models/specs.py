"""The zoo's analytic state specs, for any registered kind of model: every routed state and how the kind's
parallelisation splits it, computed from the config alone (dense: `models.dense_specs`, mixture of experts:
`models.moe_specs`; the kind comes from `models.registry`). `dynatrain plan` plans 1,024-rank switches from these
without building a model; tests hold them equal to the specs captured from real parallelised models.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynatrain.models.dense_specs import (  # noqa: F401  (the dense entry points callers import from here)
    param_stages,
    pipeline_layout,
    pipeline_stage_split,
    rule_for_param,
)
from dynatrain.models.registry import ZooConfig, get_zoo_config, spec_for, zoo_names  # noqa: F401
from dynatrain.vps.layout import Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig


def model_states(model: str | ZooConfig, kind: str = "fp32-adam") -> tuple[StateSpec, ...]:
    """Every routed state of a model: per parameter, the weight and its optimizer states (see STATE_KINDS)."""
    cfg = get_zoo_config(model)
    return spec_for(cfg).states(cfg, kind)


def layout_for_model(
    model: str | ZooConfig, pcfg: ParallelConfig, kind: str = "fp32-adam",
    rank_map: Sequence[int | None] | None = None, stages_per_rank: int = 1,
) -> Layout:
    """The layout the zoo's parallelisation gives ``model`` on ``pcfg``; ``rank_map`` defaults to position =
    process. With ``pp > 1`` the model runs ``pp * stages_per_rank`` stages (interleaved schedules take more than
    one per rank); without pp there is one stage whatever ``stages_per_rank`` says."""
    cfg = get_zoo_config(model)
    return spec_for(cfg).layout(cfg, pcfg, kind, rank_map, stages_per_rank)
