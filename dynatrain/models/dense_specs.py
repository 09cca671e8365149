"""Analytic state specs of the zoo's dense (Llama) models: every routed state and how `apply_tp` + `apply_fsdp` split
it, computed from the config alone. A test holds them equal to the specs captured from a real parallelised model.

With pipeline parallelism (``pp > 1``) the live runtime splits the model by `models.stage_split` and applies TP then
FSDP2 on each stage's ``(dp_replicate, dp_shard, tp)`` sub-mesh, so a state keeps the placements it has without pp
and is ``held`` only at its stage's pp coordinate: the embedding on stage 0, the final norm and the output on the
last stage, block ``i`` on the stage `stage_split` gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynatrain.models.configs import ModelConfig
from dynatrain.models.stage_split import stage_of_layer, stage_split
from dynatrain.models.tp_styles import tp_shard_dim
from dynatrain.vps.layout import STATE_KINDS, Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.placement import LocalShards, Sharding
from dynatrain.vps.rules import ShardRule, layout_shards, rule_sharding


def rule_for_param(name: str, shape: tuple[int, ...]) -> ShardRule:
    """The rule `apply_tp` gives a model parameter, read from the one TP table in `models.tp_styles`."""
    try:
        dim = tp_shard_dim(name)
    except KeyError as err:
        raise ValueError(f"{err.args[0]}: add it to dynatrain/models/tp_styles.py") from None
    return ShardRule(tuple(shape), dim)


def dense_tp_dim(name: str, shape: tuple[int, ...]) -> int | None:
    return rule_for_param(name, shape).tp_dim


def dense_states(cfg: ModelConfig, kind: str = "fp32-adam") -> tuple[StateSpec, ...]:
    """Every routed state of a dense model: per parameter, the weight and its optimizer states (see STATE_KINDS)."""
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown state kind {kind!r}; choose one of {', '.join(STATE_KINDS)}")
    out = []
    for name, shape in cfg.param_shapes().items():
        rule = rule_for_param(name, shape)
        for suffix, dtype in STATE_KINDS[kind]:
            out.append(StateSpec(name + suffix, shape, dtype, rule.tp_dim, rule.fused))
    return tuple(out)


def dense_layout(cfg: ModelConfig, pcfg: ParallelConfig, kind: str = "fp32-adam",
                 rank_map: Sequence[int | None] | None = None, stages_per_rank: int = 1) -> Layout:
    """The layout the dense parallelisation gives ``cfg`` on ``pcfg`` (see `models.specs.layout_for_model`)."""
    pcfg.validate(cfg)
    if pcfg.pp == 1:
        return Layout.from_config(dense_states(cfg, kind), pcfg, rank_map)
    return pipeline_layout(cfg, pcfg, kind, rank_map, stages_per_rank)


def pipeline_stage_split(cfg: ModelConfig, pp: int, stages_per_rank: int = 1, block: float | None = None
                         ) -> tuple[tuple[int, int], ...]:
    """The layer ranges of the ``pp * stages_per_rank`` stages, or a ValueError that says what to change; ``block``
    as in `stage_split.model_stage_costs`."""
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    n_stages = pp * stages_per_rank
    if n_stages > cfg.n_layers:
        raise ValueError(
            f"pp={pp} x stages_per_rank={stages_per_rank} = {n_stages} pipeline stages need at least one layer "
            f"each, and model {cfg.name!r} has {cfg.n_layers}: choose pp x stages_per_rank <= {cfg.n_layers}"
        )
    return stage_split(cfg, n_stages, block)


def param_stages(cfg: ModelConfig, split: Sequence[tuple[int, int]]) -> dict[str, int]:
    """The stage of every parameter: the embedding on the first, the final norm and output on the last, block
    ``i``'s parameters on the stage whose layer range holds ``i``."""
    last = len(split) - 1
    out = {}
    for name in cfg.param_shapes():
        if name.startswith("layers."):
            out[name] = stage_of_layer(split, int(name.split(".", 2)[1]))
        elif name.startswith("tok_embeddings."):
            out[name] = 0
        else:
            out[name] = last
    return out


def pipeline_layout(cfg: ModelConfig, pcfg: ParallelConfig, kind: str = "fp32-adam",
                    rank_map: Sequence[int | None] | None = None, stages_per_rank: int = 1) -> Layout:
    """A dense model's layout with ``pp > 1``: every state's placements without pp, held at its stage's pp
    coordinate (stage ``j`` runs on coordinate ``j % pp``)."""
    split = pipeline_stage_split(cfg, pcfg.pp, stages_per_rank)
    stage = param_stages(cfg, split)
    states = dense_states(cfg, kind)
    stage_cfg = pcfg.without_pp()
    size, world = pcfg.stage_size, pcfg.world_size
    if rank_map is None:
        rank_map = tuple(range(world))
    if len(rank_map) != world:
        raise ValueError(f"layout {pcfg.short()} has {world} positions, the rank map {len(rank_map)}")
    # What `Layout.from_shardings` would compute position by position, built per stage: the held positions take
    # the shards of the layout without pp, every other position the empty shard. At 16,384 positions this is what
    # keeps a 405B layout at a fraction of a second.
    keys: dict[tuple, int] = {}
    classes: list[tuple[LocalShards, ...]] = []
    shardings: list[Sharding] = []
    state_class: list[int] = []
    stage_shards: dict[ShardRule, tuple[LocalShards, ...]] = {}
    placed: dict[tuple[ShardRule, int], Sharding] = {}
    params = list(stage)
    per_param = len(STATE_KINDS[kind])  # `dense_states` lists each parameter's states together, in this order
    for i, spec in enumerate(states):
        coordinate = stage[params[i // per_param]] % pcfg.pp
        rule = spec.rule
        sharding = placed.get((rule, coordinate))
        if sharding is None:
            sharding = placed[(rule, coordinate)] = rule_sharding(rule, pcfg).held_along(pcfg.pp_dim, (coordinate,))
        key = (spec.shape, sharding)
        c = keys.get(key)
        if c is None:
            c = keys[key] = len(classes)
            held = stage_shards.get(rule)
            if held is None:
                held = stage_shards[rule] = layout_shards(rule, stage_cfg)
            empty = (LocalShards((), (), (0,) * len(spec.shape)),)
            classes.append(empty * (coordinate * size) + held + empty * ((pcfg.pp - coordinate - 1) * size))
        shardings.append(sharding)
        state_class.append(c)
    return Layout(states, tuple(state_class), tuple(classes), tuple(rank_map), pcfg, tuple(shardings))

