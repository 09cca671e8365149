"""dynatrain: online parallelism switching for elastic LLM training on PyTorch Lightning.

Importing the package registers ``strategy="dynatrain"`` with Lightning (at once, or when Lightning is imported:
see `dynatrain.registration`), in every process Lightning launches, and freezes the objects imports created, so
the collections a switch runs stay cheap (see `dynatrain.memory`). The pure layers (`dynatrain.vps`,
`dynatrain.planner`) import without Lightning.
"""

from dynatrain.memory import freeze_import_time_objects
from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig, get_model_config
from dynatrain.registration import register_when_lightning_loads
from dynatrain.vps.parallel_config import ParallelConfig

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "DynaTrainStrategy":
        from dynatrain.strategies.dynatrain import DynaTrainStrategy

        return DynaTrainStrategy
    raise AttributeError(f"module 'dynatrain' has no attribute {name!r}")


register_when_lightning_loads()
freeze_import_time_objects()

__all__ = ["MODEL_CONFIGS", "DynaTrainStrategy", "ModelConfig", "ParallelConfig", "get_model_config"]
