"""Virtual Parameter Space: every training state in one global coordinate space. Pure Python."""

from dynatrain.vps.parallel_config import MESH_DIM_NAMES, ParallelConfig

__all__ = ["MESH_DIM_NAMES", "ParallelConfig"]
