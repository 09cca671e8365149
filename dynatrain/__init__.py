"""dynatrain: online parallelism switching for elastic LLM training on PyTorch Lightning.

Importing the package registers ``strategy="dynatrain"`` with Lightning, in every process Lightning launches,
and freezes the objects its imports created, so the collections a switch runs stay cheap (see `dynatrain.memory`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from dynatrain.memory import freeze_import_time_objects
from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig, get_model_config
from dynatrain.strategies.dynatrain import DynaTrainStrategy
from dynatrain.vps.parallel_config import ParallelConfig

__version__ = "0.1.0"

if DynaTrainStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        DynaTrainStrategy.strategy_name,
        DynaTrainStrategy,
        description="FSDP2 + tensor parallelism with online layout switching",
    )

freeze_import_time_objects()

__all__ = ["MODEL_CONFIGS", "DynaTrainStrategy", "ModelConfig", "ParallelConfig", "get_model_config"]
