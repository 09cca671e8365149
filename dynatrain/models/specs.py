"""The zoo's analytic state specs: every routed state of a Llama model and how `apply_tp` + `apply_fsdp` split it,
computed from the config alone (mixture-of-experts models: `models.moe_specs`). `dynatrain plan` plans 1,024-rank
switches from these without building a model; a test holds them equal to the specs captured from a real
parallelised model."""

from __future__ import annotations

from collections.abc import Sequence

from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig
from dynatrain.models.moe_configs import MOE_CONFIGS, MoEConfig
from dynatrain.models.moe_specs import moe_layout, moe_states
from dynatrain.models.tp_plan import tp_shard_dim
from dynatrain.vps.layout import STATE_KINDS, Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.rules import ShardRule


def rule_for_param(name: str, shape: tuple[int, ...]) -> ShardRule:
    """The rule `apply_tp` gives a model parameter, read from the one TP table in `models.tp_plan`."""
    try:
        dim = tp_shard_dim(name)
    except KeyError as err:
        raise ValueError(f"{err.args[0]}: add it to dynatrain/models/tp_plan.py") from None
    return ShardRule(tuple(shape), dim)


def zoo_names() -> list[str]:
    """Every model name the analytic specs know, dense and mixture-of-experts."""
    return sorted(MODEL_CONFIGS) + sorted(MOE_CONFIGS)


def get_zoo_config(model: "str | ModelConfig | MoEConfig") -> "ModelConfig | MoEConfig":
    """A dense or mixture-of-experts config by name (or the config itself)."""
    if isinstance(model, (ModelConfig, MoEConfig)):
        return model
    if model in MOE_CONFIGS:
        return MOE_CONFIGS[model]
    if model in MODEL_CONFIGS:
        return MODEL_CONFIGS[model]
    raise ValueError(f"unknown model {model!r}; choose a dense one ({', '.join(MODEL_CONFIGS)}) or a mixture of "
                     f"experts ({', '.join(MOE_CONFIGS)})")


def model_states(model: "str | ModelConfig | MoEConfig", kind: str = "fp32-adam") -> tuple[StateSpec, ...]:
    """Every routed state of a model: per parameter, the weight and its optimizer states (see STATE_KINDS)."""
    cfg = get_zoo_config(model)
    if isinstance(cfg, MoEConfig):
        return moe_states(cfg, kind)
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown state kind {kind!r}; choose one of {', '.join(STATE_KINDS)}")
    out = []
    for name, shape in cfg.param_shapes().items():
        rule = rule_for_param(name, shape)
        for suffix, dtype in STATE_KINDS[kind]:
            out.append(StateSpec(name + suffix, shape, dtype, rule.tp_dim, rule.fused))
    return tuple(out)


def layout_for_model(
    model: "str | ModelConfig | MoEConfig", pcfg: ParallelConfig, kind: str = "fp32-adam",
    rank_map: Sequence[int | None] | None = None,
) -> Layout:
    cfg = get_zoo_config(model)
    if isinstance(cfg, MoEConfig):
        return moe_layout(cfg, pcfg, kind, rank_map)
    pcfg.validate(cfg)
    return Layout.from_config(model_states(cfg, kind), pcfg, rank_map)
