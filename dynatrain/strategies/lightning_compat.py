"""What code written for Lightning's `ModelParallelStrategy` expects of a strategy, kept by `DynaTrainStrategy`:
its ``data_parallel_size`` / ``tensor_parallel_size`` arguments with their meaning of ``"auto"``, and its refusal of
modules wrapped by the old FSDP API."""

from __future__ import annotations

from torch import nn


def lightning_sizes(parallel, data_parallel_size, tensor_parallel_size) -> tuple | None:
    """``(data_parallel_size, tensor_parallel_size)`` when either was given (the other is then ``"auto"``, as in
    ModelParallelStrategy), else None; ValueError when ``parallel`` names a layout too."""
    if data_parallel_size is None and tensor_parallel_size is None:
        return None
    if parallel != "auto":
        raise ValueError(f"parallel={str(parallel)!r} and data_parallel_size / tensor_parallel_size both name the "
                         "layout: give one of them")
    return ("auto" if data_parallel_size is None else data_parallel_size,
            "auto" if tensor_parallel_size is None else tensor_parallel_size)


def refuse_fsdp1(module: nn.Module, strategy_name: str) -> None:
    """TypeError, as ModelParallelStrategy raises, for a module wrapped by ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`. The "
            f"`{strategy_name}` only supports the new FSDP2 APIs in PyTorch >= 2.4: apply `fully_shard` instead, "
            "or leave the module unwrapped (without configure_model() it is sharded per block by default)"
        )
