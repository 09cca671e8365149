"""The kinds of model dynatrain trains, each described once by a `ModelSpec` (torchtitan's): how to build it, the one
function that parallelises it, its analytic state specs, and the terms the layout policy prices it with.
`spec_for(config)` is the one place a config's type decides anything; everywhere else asks the spec. The dense
(Llama) and mixture-of-experts kinds are registered below (`models.builders` names their modules).

Pure Python at import (torch loads only when a spec builds or parallelises a module): the layout policy reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dynatrain.models import builders, cost_terms
from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig
from dynatrain.models.dense_specs import dense_layout, dense_states, dense_tp_dim, pipeline_stage_split
from dynatrain.models.moe_configs import MOE_CONFIGS, MoEConfig
from dynatrain.models.moe_specs import moe_layout, moe_stage_split, moe_states, moe_tp_dim

ZooConfig = ModelConfig | MoEConfig  # the built-in kinds' configs, for annotations


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """One kind of model. Every callable takes the kind's config first; ``work`` is the policy's `Workload`."""

    name: str          # short name: "dense", "moe"
    label: str         # in messages: "... not supported for {label} models"
    offer: str         # how an unknown model name's message offers this kind's configs: "a dense one (...)"
    config_type: type
    configs: Mapping[str, Any]  # the named configs of this kind
    build: Callable[[Any], Any]  # config -> module on the current device (meta under torch.device("meta"))
    # (module built on meta, mesh, ParallelConfig, models.parallelize.ParallelizeOptions) -> the module parallelised
    # in place; a model file knows nothing of parallelism, each kind's parallelisation is a module of its own
    parallelize_fn: Callable[[Any, Any, Any, Any], Any]
    states: Callable[..., tuple]  # (config, state kind) -> every routed StateSpec
    layout: Callable[..., Any]  # (config, ParallelConfig, state kind, rank_map, stages_per_rank) -> Layout
    tp_dim: Callable[[str, tuple[int, ...]], int | None]  # (parameter, shape) -> dim TP splits; None: whole
    stage_split: Callable[..., tuple] | None  # (config, pp, stages_per_rank) -> layer ranges; None: no pp
    placed_by_rules: bool  # every state follows `vps.rules`: a layout without pp follows from its ParallelConfig
    routed_experts: bool  # tokens go to experts: auxiliary loss, router load, ep layouts and their all-to-alls
    attention_width: Callable[[Any], int]  # query heads x head dim
    op_recompute_fraction: Callable[[Any], float]  # share of a block's forward FLOPs selective:op runs again
    layer_bytes: Callable[[Any, Any, int], tuple[float, float]]  # (config, work, tp) -> (block, final norm) B/token
    op_saved_bytes: Callable[[Any, Any, int, float], float]  # (config, work, tp, block B/token) -> kept per op

    @property
    def pipeline(self) -> bool:
        """Whether the module splits into pipeline stages (pp > 1 layouts are candidates)."""
        return self.stage_split is not None

    def stages(self, config, pp: int, stages_per_rank: int = 1) -> tuple[tuple[int, int], ...]:
        """The layer ranges of the ``pp * stages_per_rank`` stages, or a ValueError that says what to change."""
        if self.stage_split is None:
            raise ValueError(f"pipeline parallelism is not supported for {self.label} models yet: use pp=1")
        return self.stage_split(config, pp, stages_per_rank)


_SPECS: dict[type, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Make a kind known; its config type and its config names must be new."""
    if spec.config_type in _SPECS:
        raise ValueError(f"{spec.config_type.__name__} is already the config of kind "
                         f"{_SPECS[spec.config_type].name!r}")
    taken = sorted({n for s in _SPECS.values() for n in spec.configs if n in s.configs})
    if taken:
        raise ValueError(f"model name(s) {taken} of kind {spec.name!r} are taken by another kind")
    _SPECS[spec.config_type] = spec
    return spec


def kinds() -> tuple[ModelSpec, ...]:
    """The registered kinds, in registration order."""
    return tuple(_SPECS.values())


def spec_for(config) -> ModelSpec:
    """The spec of ``config``'s kind (a subclass of a registered config type is that kind)."""
    for cls in type(config).__mro__:
        if cls in _SPECS:
            return _SPECS[cls]
    known = ", ".join(f"{s.name} ({s.config_type.__name__})" for s in _SPECS.values())
    raise ValueError(f"no model kind is registered for a {type(config).__name__}: the known kinds are {known}; "
                     "register a ModelSpec for it (dynatrain.models.registry.register)")


def is_zoo_config(config) -> bool:
    """Whether ``config`` is a config of a registered kind (a user's dict or Hugging Face config is not)."""
    return isinstance(config, tuple(_SPECS))


def zoo_config_of(module) -> ZooConfig | None:
    """The config of the zoo model ``module`` is or holds: its ``model_config`` (the zoo's LightningModule builds its
    model from it in configure_model()), else the ``config`` of the first zoo model among its modules; None for a
    module with no zoo model, whatever else it calls ``model_config`` or ``config`` (a dict, a Hugging Face config)."""
    if module is None:
        return None
    config = getattr(module, "model_config", None)
    if is_zoo_config(config):
        return config
    for m in module.modules() if callable(getattr(module, "modules", None)) else ():
        config = getattr(m, "config", None)
        if is_zoo_config(config):
            return config
    return None


def zoo_names() -> list[str]:
    """Every named config, kind by kind."""
    return [name for spec in _SPECS.values() for name in sorted(spec.configs)]


def get_zoo_config(model: str | ZooConfig) -> ZooConfig:
    """A named config of any kind (or the config itself)."""
    if is_zoo_config(model):
        return model
    for spec in _SPECS.values():
        if model in spec.configs:
            return spec.configs[model]
    offers = " or ".join(f"{s.offer} ({', '.join(s.configs)})" for s in _SPECS.values())
    raise ValueError(f"unknown model {model!r}; choose {offers}")


register(ModelSpec(
    name="dense", label="dense", offer="a dense one", config_type=ModelConfig, configs=MODEL_CONFIGS,
    build=builders.build_dense, parallelize_fn=builders.parallelize_dense,
    states=dense_states, layout=dense_layout, tp_dim=dense_tp_dim, stage_split=pipeline_stage_split,
    placed_by_rules=True, routed_experts=False,
    attention_width=cost_terms.dense_attention_width,
    op_recompute_fraction=cost_terms.dense_op_recompute_fraction,
    layer_bytes=cost_terms.dense_layer_bytes, op_saved_bytes=cost_terms.dense_op_saved_bytes,
))
register(ModelSpec(
    name="moe", label="mixture-of-experts", offer="a mixture of experts", config_type=MoEConfig, configs=MOE_CONFIGS,
    build=builders.build_moe, parallelize_fn=builders.parallelize_moe,
    states=moe_states, layout=moe_layout, tp_dim=lambda name, shape: moe_tp_dim(name), stage_split=moe_stage_split,
    placed_by_rules=False, routed_experts=True,
    attention_width=cost_terms.moe_attention_width,
    op_recompute_fraction=cost_terms.moe_op_recompute_fraction,
    layer_bytes=cost_terms.moe_layer_bytes, op_saved_bytes=cost_terms.moe_op_saved_bytes,
))
