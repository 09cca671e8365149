"""The Lightning strategy and its glue. `DynaTrainStrategy` loads Lightning, so it is resolved on first use: importing
`dynatrain.strategies.registration` (which ``import dynatrain`` does) must not."""

__all__ = ["DynaTrainStrategy"]


def __getattr__(name: str):
    if name == "DynaTrainStrategy":
        from dynatrain.strategies.dynatrain import DynaTrainStrategy

        return DynaTrainStrategy
    raise AttributeError(f"module 'dynatrain.strategies' has no attribute {name!r}")
