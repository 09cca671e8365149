"""What one rank hands the engine and gets back: per state the local shape and dtype its layout gives this rank,
and the check of the source tensors a caller passes in, before any byte moves."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dynatrain.planner.schedule import SwitchPlan
from dynatrain.vps.layout import Layout

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "complex64": torch.complex64,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name ("float32", "bfloat16", ...)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype for layout dtype {name!r}; known: {', '.join(_DTYPES)}") from None


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """The bytes of a local tensor of ``shape`` and layout dtype ``dtype``."""
    return math.prod(shape) * torch_dtype(dtype).itemsize


class TransitionError(RuntimeError):
    """The engine cannot run this plan with the tensors it was given (raised before any byte moves)."""


def expected_sources(plan: SwitchPlan, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """state -> (local shape, dtype name) of every old local tensor ``rank`` holds (empty: holds none)."""
    return _expected(plan.old, rank)


def expected_destinations(plan: SwitchPlan, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """state -> (local shape, dtype name) of every new local tensor ``rank`` will hold."""
    return _expected(plan.new, rank)


def _expected(layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    if layout.position_of(rank) is None:
        return out
    for spec in layout.states:
        out[spec.name] = (tuple(layout.shards(spec.name, rank).local_shape), spec.dtype)
    return out


def validate_sources(plan: SwitchPlan, rank: int, src: Mapping[str, torch.Tensor]) -> None:
    """Raise TransitionError naming the first source tensor that is missing or has the wrong shape, dtype
    or device. Purely local: a caller that must keep all ranks in step all-reduces the outcome itself."""
    device = None
    for name, (shape, dtype) in expected_sources(plan, rank).items():
        t = src.get(name)
        numel = 1
        for d in shape:
            numel *= d
        if t is None:
            if numel == 0:
                continue  # an empty shard carries nothing: tolerate its absence
            raise TransitionError(
                f"rank {rank}: no source tensor for state {name!r}; the old layout gives this rank a local "
                f"tensor of shape {shape} and dtype {dtype}"
            )
        if not isinstance(t, torch.Tensor):
            raise TransitionError(f"rank {rank}: source of state {name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape:
            raise TransitionError(
                f"rank {rank}: source tensor of state {name!r} has shape {tuple(t.shape)}, the old layout "
                f"gives this rank shape {shape}"
            )
        if t.dtype != torch_dtype(dtype):
            raise TransitionError(
                f"rank {rank}: source tensor of state {name!r} has dtype {t.dtype}, the layout says {dtype}"
            )
        if numel and device is not None and t.device != device:
            raise TransitionError(
                f"rank {rank}: source tensors live on {device} and {t.device} (state {name!r}): use one device"
            )
        if numel:
            device = t.device
