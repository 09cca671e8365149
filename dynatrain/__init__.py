"""dynatrain: online parallelism switching for elastic LLM training on PyTorch Lightning.

Importing the package registers ``strategy="dynatrain"`` with Lightning, in every process Lightning launches.
"""

from lightning.pytorch.strategies import StrategyRegistry

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

__all__ = ["MODEL_CONFIGS", "DynaTrainStrategy", "ModelConfig", "ParallelConfig", "get_model_config"]
