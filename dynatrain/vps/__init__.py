"""Virtual Parameter Space: every training state in one global coordinate space. Pure Python."""

from dynatrain.vps.box import Box
from dynatrain.vps.layout import DTYPE_ITEMSIZE, STATE_KINDS, Layout, StateSpec
from dynatrain.vps.parallel_config import MESH_DIM_NAMES, ParallelConfig
from dynatrain.vps.placement import LocalShards, Replicate, Shard, Sharding, StridedShard, chunk_bounds
from dynatrain.vps.rules import ShardRule, layout_shards, local_shards

__all__ = [
    "MESH_DIM_NAMES", "ParallelConfig",
    "Box", "Layout", "StateSpec", "DTYPE_ITEMSIZE", "STATE_KINDS",
    "LocalShards", "Replicate", "Shard", "Sharding", "StridedShard", "chunk_bounds",
    "ShardRule", "layout_shards", "local_shards",
]
