from dynatrain.strategies.dynatrain import DynaTrainStrategy

__all__ = ["DynaTrainStrategy"]
