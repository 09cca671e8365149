from dynatrain.callbacks.progress import StepPrinter

__all__ = ["StepPrinter"]
