"""Virtual Parameter Space: every training state in one global coordinate space. Pure Python."""

from dynatrain.vps.box import Box
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS, Layout, StateSpec, model_states
from dynatrain.vps.parallel_config import MESH_DIM_NAMES, ParallelConfig
from dynatrain.vps.rules import LocalShards, ShardRule, chunk_bounds, layout_shards, local_shards, rule_for_param

__all__ = [
    "MESH_DIM_NAMES", "ParallelConfig",
    "Box", "Layout", "StateSpec", "model_states", "DTYPE_ITEMSIZE", "STATE_KINDS",
    "LocalShards", "ShardRule", "chunk_bounds", "layout_shards", "local_shards", "rule_for_param",
]
