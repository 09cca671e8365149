"""Analytic state specs of the zoo's mixture-of-experts models: every routed state and its placements under
`parallelize_moe`, from the config alone, so `dynatrain plan` sizes a 235B MoE switch at 1,024 ranks without
building anything. A test holds them equal to the placements captured from a real meta build.

What `parallelize_moe` gives (on the root mesh ``(dp_replicate, dp_shard, tp)``, or ``(dp_replicate, efsdp, ep,
tp)`` with ep, ``(dp_replicate, efsdp, dp_shard_in_ep, cp, tp)`` with ep and cp, ep the flattened last two):
- tensor parallelism splits attention (wq, wk, wv on dim 0, wo on dim 1), the embedding (rows) and the output
  (dim 0); the router, the shared expert, the norms and the routed experts stay whole on every TP rank;
- dense states are FSDP2 ``Shard(0)`` over dp_shard x cp (``_StridedShard(0, tp)`` when TP split dim 0), replicated
  over dp_replicate: exactly the dense zoo's rule (`vps.rules.rule_sharding`);
- routed experts (``[E, ...]``) with ep > 1: ``Shard(0)`` over ep, then FSDP2 over efsdp on the ep-local stack,
  which DTensor records as ``_StridedShard(0, ep)`` on efsdp; with ep == 1 they are dense states.

With pipeline stages (``pp > 1``) the model is split as the dense zoo's (`moe_stage_split` balances the blocks by
what a token computes in them), and each stage's states keep the placements above on their stage's sub-mesh, held at
that stage's pp coordinate only.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from dynatrain.models.dense_specs import param_stages, pipeline_stage_split
from dynatrain.models.moe_configs import MoEConfig
from dynatrain.models.tp_styles import moe_tp_shard_dim
from dynatrain.vps.layout import STATE_KINDS, Layout, StateSpec
from dynatrain.vps.parallel_config import ParallelConfig
from dynatrain.vps.placement import Shard, Sharding, StridedShard
from dynatrain.vps.rules import ShardRule, rule_sharding

_EXPERT_SUFFIXES = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


def _block_suffix(name: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``attention.wq``; a top-level ``output.weight`` -> ``output``."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    if parts[-1] == "weight":
        parts = parts[:-1]
    return ".".join(parts)


def is_routed_expert(name: str) -> bool:
    return _block_suffix(name) in _EXPERT_SUFFIXES


def moe_tp_dim(name: str) -> int | None:
    """The dimension `parallelize_moe` splits over tp for parameter ``name`` (None: whole on every TP rank), read
    from the one TP table the real parallelisation uses (`models.tp_styles.MOE_BLOCK_PLAN`)."""
    return moe_tp_shard_dim(name)


def expert_sharding(pcfg: ParallelConfig) -> Sharding:
    """The placements of a routed expert stack ``[E, ...]`` on the root mesh of ``pcfg``."""
    if pcfg.ep == 1:
        return rule_sharding(ShardRule((1,)), pcfg)  # FSDP Shard(0) over dp_shard, like any whole-per-TP state
    names = pcfg.mesh_dim_names
    efsdp = names.index("efsdp")
    # A mesh dimension of size 1 splits nothing, and the captured sharding leaves it out: do the same (with cp,
    # ep spans (dp_shard_in_ep, cp), whose first may be 1).
    ep = tuple(d for d in pcfg.root_dims("ep") if pcfg.mesh_shape[d] > 1)
    placements, dims = [], []
    if pcfg.efsdp > 1:
        placements.append(StridedShard(0, pcfg.ep))
        dims.append((efsdp,))
    placements.append(Shard(0))
    dims.append(ep)
    return Sharding(pcfg.mesh_shape, tuple(placements), tuple(dims))


@lru_cache(maxsize=64)
def _param_shardings(cfg: MoEConfig, pcfg: ParallelConfig) -> tuple[tuple[str, tuple[int, ...], Sharding], ...]:
    experts = expert_sharding(pcfg)
    dense: dict[int | None, Sharding] = {}
    out = []
    for name, shape in cfg.param_shapes().items():
        if is_routed_expert(name):
            sh = experts
        else:
            tp_dim = moe_tp_dim(name)
            if tp_dim not in dense:
                # The rule's shape only matters for its rank; placements depend on the split dimension alone.
                dense[tp_dim] = rule_sharding(ShardRule((1, 1), tp_dim), pcfg)
            sh = dense[tp_dim]
        out.append((name, tuple(shape), sh))
    return tuple(out)


def moe_states(cfg: MoEConfig, kind: str = "fp32-adam") -> tuple[StateSpec, ...]:
    """Every routed state: per parameter (registration order), the weight and its optimizer states."""
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown state kind {kind!r}; choose one of {', '.join(STATE_KINDS)}")
    out = []
    for name, shape in cfg.param_shapes().items():
        tp_dim = None if is_routed_expert(name) else moe_tp_dim(name)
        for suffix, dtype in STATE_KINDS[kind]:
            out.append(StateSpec(name + suffix, shape, dtype, tp_dim))
    return tuple(out)


def moe_block_flops(cfg: MoEConfig) -> float:
    """Multiply-adds of one block per token: attention's projections, the router, the ``top_k`` routed experts a
    token visits and the shared expert (a pipeline stage's cost is what its tokens compute, not what it stores)."""
    hd, d = cfg.attn_head_dim, cfg.dim
    attention = 2 * d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd
    return attention + d * cfg.n_experts + 3 * d * (cfg.top_k * cfg.moe_ffn_dim + cfg.shared_ffn_dim)


def moe_stage_split(cfg: MoEConfig, pp: int, stages_per_rank: int = 1) -> tuple[tuple[int, int], ...]:
    """The layer ranges of the ``pp * stages_per_rank`` stages of a mixture-of-experts model, or a ValueError that
    says what to change; the live split (`models.parallelize_moe`) and the analytic layout both use it."""
    return pipeline_stage_split(cfg, pp, stages_per_rank, block=moe_block_flops(cfg))


def moe_layout(cfg: MoEConfig, pcfg: ParallelConfig, kind: str = "fp32-adam",
               rank_map: Sequence[int | None] | None = None, stages_per_rank: int = 1) -> Layout:
    """The layout `parallelize_moe` gives ``cfg`` on ``pcfg``; ``rank_map`` defaults to position = process. With
    pp, ``pp * stages_per_rank`` stages, stage ``j`` on pp coordinate ``j % pp``."""
    pcfg.validate(cfg)
    per_param = _param_shardings(cfg, pcfg)
    states = moe_states(cfg, kind)
    per_state = len(STATE_KINDS[kind])
    if pcfg.pp > 1:
        stage = param_stages(cfg, moe_stage_split(cfg, pcfg.pp, stages_per_rank))
        held: dict[tuple[Sharding, int], Sharding] = {}
        placed = []
        for name, _, sh in per_param:
            at = (sh, stage[name] % pcfg.pp)
            if at not in held:
                held[at] = sh.held_along(pcfg.pp_dim, (at[1],))
            placed.append(held[at])
    else:
        placed = [sh for _, _, sh in per_param]
    shardings = [sh for sh in placed for _ in range(per_state)]
    return Layout.from_shardings(states, shardings, pcfg, rank_map)
