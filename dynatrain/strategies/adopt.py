"""After the transfer: the target copy gets storage, the moved shards, the old buffers and optimizer state, and
takes the live module's place; the optimizer, schedules and data then follow the new layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dynatrain.strategies.capture import BUFFER, local_tensor
from dynatrain.strategies.target import transplant
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


def fill_target(target: nn.Module, dst: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give the target's parameters and buffers their moved tensors. A moved tensor that has the local shard's
    shape, dtype and device and is contiguous becomes the shard itself (FSDP2 re-reads its shards at lazy
    initialisation, as after ``to_empty``); any other is copied into fresh storage. The weights are not copied
    again after the transfer, nor allocated a second time."""
    with torch.no_grad():
        for prefix, owner in target.named_modules():
            at = f"{prefix}." if prefix else ""
            for key, p in list(owner._parameters.items()):
                if p is not None:
                    owner._parameters[key] = _adopted_parameter(at + key, p, dst.pop(at + key), device)
            for key, b in list(owner._buffers.items()):
                if b is not None:
                    owner._buffers[key] = _adopted_tensor(at + key, b, dst.pop(at + key).reshape(b.shape), device)


def _adopted_tensor(name: str, like: torch.Tensor, new: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``new`` itself when it can stand for ``like``'s storage, else a fresh contiguous copy of it."""
    if new.shape != like.shape:
        raise RuntimeError(f"{name}: the switch produced {tuple(new.shape)}, the target holds {tuple(like.shape)}")
    if new.dtype == like.dtype and new.device == device and new.is_contiguous():
        return new
    return torch.empty(like.shape, dtype=like.dtype, device=device).copy_(new)


def _adopted_parameter(name: str, p: nn.Parameter, new: torch.Tensor, device: torch.device) -> nn.Parameter:
    local = _adopted_tensor(name, local_tensor(p), new, device)
    if isinstance(p, DTensor):
        local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
    fresh = nn.Parameter(local, requires_grad=p.requires_grad)
    if torch.__future__.get_swap_module_params_on_conversion():  # the object must stay, as `to_empty` keeps it
        torch.utils.swap_tensors(p, fresh)
        return p
    return fresh


def restore_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module, dst: dict[str, torch.Tensor],
                      param_of: Mapping[str, tuple[str, str | None]], scalars: Mapping[str, dict],
                      order: Mapping[str, list[str]]) -> None:
    """Give each parameter its moved optimizer tensors (DTensors placed like it) and kept scalars, each parameter's
    entries in the order the optimizer had created them."""
    params = dict(module.named_parameters())
    entries: dict[str, dict] = {}
    for state_name, (pname, key) in param_of.items():
        if key is None or key == BUFFER:
            continue
        if pname not in params:  # another pipeline stage's parameter
            dst.pop(state_name, None)
            continue
        p, local = params[pname], dst.pop(state_name)
        if isinstance(p, DTensor):
            local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
        entries.setdefault(pname, {})[key] = local
    for pname, kept in scalars.items():
        if pname in params:
            entries.setdefault(pname, {}).update(kept)
    for pname, state in entries.items():
        optimizer.state[params[pname]] = {k: state[k] for k in order.get(pname, state) if k in state}


def adopt_module(switcher: "Switcher", target_module, names, mesh, target: ParallelConfig, positions, dst,
                 kept) -> None:
    """The target copy filled with the moved states and put in place of the live module's children; the
    optimizer, schedules and data then follow the new layout."""
    strategy = switcher.strategy
    module = strategy.lightning_module
    fill_target(target_module, dst, strategy.root_device)
    transplant(module, target_module, names)
    strategy._device_mesh = module._device_mesh = mesh
    strategy.parallel_config, strategy.positions = target, list(positions)
    _rebuild_optimizer(switcher, module, dst, kept)
    strategy.build_pipeline()
    move_data(switcher, target)
    switcher.released = False


def _rebuild_optimizer(switcher: "Switcher", module, dst, kept) -> None:
    """`configure_optimizers()` again, then the moved tensors, kept scalars, hyper-parameters and schedules."""
    strategy = switcher.strategy
    if switcher.trainer is None:
        return
    strategy.setup_optimizers(switcher.trainer)
    if not strategy.optimizers:
        return
    optimizer = strategy.optimizers[0]
    if len(optimizer.param_groups) != len(kept["groups"]):
        raise RuntimeError("configure_optimizers() returned different parameter groups after the switch")
    for group, old in zip(optimizer.param_groups, kept["groups"]):
        group.update(old)
    restore_optimizer(optimizer, module, dst, kept["param_of"], kept["scalars"], kept["order"])
    for cfg, state in zip(strategy.lr_scheduler_configs, kept["schedulers"]):
        cfg.scheduler.load_state_dict(state)


def move_data(switcher: "Switcher", target: ParallelConfig) -> None:
    """Every dataloader on the new data-parallel rank, with the gradient accumulation that keeps the global batch
    (`DataSplit`); Lightning's loop counts the accumulation from here."""
    trainer = switcher.trainer
    if trainer is None:
        return
    switcher.strategy.data_split.apply(trainer, target.dp_size, switcher.strategy.dp_rank)
    switcher.accumulation_offset = trainer.fit_loop.epoch_loop.batch_progress.current.ready
