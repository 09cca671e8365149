"""dynatrain: online parallelism switching for elastic LLM training on PyTorch Lightning.

Importing the package registers ``strategy="dynatrain"`` with Lightning (at once, or when Lightning is imported:
see `dynatrain.strategies.registration`), in every process Lightning launches, and changes nothing else in the
interpreter: no environment variable, no ``gc.freeze`` (dynatrain's entry points freeze the import-time objects, a
script of yours calls `dynatrain.runtime.memory.freeze_import_time_objects` after its imports: see
`dynatrain.runtime.memory`). Settings are arguments (`dynatrain.settings`). The pure layers (`dynatrain.vps`,
`dynatrain.planner`) import without Lightning.
"""

from dynatrain.models.configs import MODEL_CONFIGS, ModelConfig, get_model_config
from dynatrain.runtime.version import __version__
from dynatrain.strategies.registration import register_when_lightning_loads
from dynatrain.vps.parallel_config import ParallelConfig

_OPTIONS = ("DataOptions", "ParallelismOptions", "SwitchingOptions")


def __getattr__(name: str):
    # The strategy and its options load Lightning and torch: resolved on first use.
    if name == "DynaTrainStrategy":
        from dynatrain.strategies.dynatrain import DynaTrainStrategy

        return DynaTrainStrategy
    if name in _OPTIONS:
        from dynatrain.strategies import options

        return getattr(options, name)
    raise AttributeError(f"module 'dynatrain' has no attribute {name!r}")


# The registration itself, the one change importing dynatrain makes: `strategy="dynatrain"` in Lightning's
# StrategyRegistry, now when Lightning is loaded, else by a one-shot import hook that does it once
# `lightning.pytorch` finishes loading (and removes itself).
register_when_lightning_loads()

__all__ = ["MODEL_CONFIGS", "DataOptions", "DynaTrainStrategy", "ModelConfig", "ParallelConfig", "ParallelismOptions",
           "SwitchingOptions", "get_model_config"]
