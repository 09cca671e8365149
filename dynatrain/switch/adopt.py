"""After the transfer: the target copy gets storage, the moved shards, the old buffers and optimizer state, and
takes the live module's place; the optimizer, schedules and data then follow the new layout."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dynatrain.switch.capture import BUFFER, local_tensor
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.states import Kept
from dynatrain.switch.target import transplant


def fill_target(target: nn.Module, dst: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give the target's parameters and buffers their moved tensors. A moved tensor that has the local shard's
    shape, dtype and device and is contiguous becomes the shard itself (FSDP2 re-reads its shards at lazy
    initialisation, as after ``to_empty``); any other is copied into fresh storage. The weights are not copied
    again after the transfer, nor allocated a second time. A tied parameter arrives once, under its first name, and
    every module that shares it gets that one parameter."""
    adopted: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for prefix, owner in target.named_modules():
            at = f"{prefix}." if prefix else ""
            for key, p in list(owner._parameters.items()):
                if p is not None:
                    if id(p) not in adopted:
                        adopted[id(p)] = _adopted_parameter(at + key, p, dst.pop(at + key), device)
                    owner._parameters[key] = adopted[id(p)]
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
                      kept: Kept) -> None:
    """The optimizer's hyper-parameters as they were; each parameter's moved optimizer tensors (DTensors placed
    like it) and kept scalars, its entries in the order the optimizer had created them."""
    if len(optimizer.param_groups) != len(kept.groups):
        raise RuntimeError("configure_optimizers() returned different parameter groups after the switch")
    for group, old in zip(optimizer.param_groups, kept.groups):
        group.update(old)
    params = dict(module.named_parameters())
    entries: dict[str, dict] = {}
    for state_name, (pname, key) in kept.param_of.items():
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
    for pname, scalars in kept.scalars.items():
        if pname in params:
            entries.setdefault(pname, {}).update(scalars)
    for pname, state in entries.items():
        optimizer.state[params[pname]] = {k: state[k] for k in kept.order.get(pname, state) if k in state}


def adopt_module(ctx: SwitchContext, module: nn.Module, target: nn.Module | None, names: list[str], mesh,
                 layout, positions: list[int], dst: dict[str, torch.Tensor]) -> None:
    """``target`` (None: ``module`` itself was parallelised for the layout) filled with the moved states and put in
    place of the live module's children ``names``; the strategy runs on ``mesh`` as ``layout`` from here."""
    fill_target(target if target is not None else module, dst, ctx.device)
    if target is not None:
        transplant(module, target, names)
    ctx.install(mesh, layout, positions)


def adopt_optimizer(ctx: SwitchContext, module: nn.Module, optimizer, dst: dict[str, torch.Tensor], kept: Kept,
                    schedulers: bool = True) -> None:
    """The new optimizer (None outside fit) with the moved and kept state; ``schedulers``: and the LR schedulers'
    states, which a joining process gets with the loop state instead."""
    if optimizer is not None:
        restore_optimizer(optimizer, module, dst, kept)
        if schedulers:
            ctx.load_scheduler_states(kept.schedulers)
    ctx.released = False
