"""After the transfer: the target copy gets storage, the moved shards, the old buffers and optimizer state."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dynatrain.strategies.capture import BUFFER, local_tensor


def fill_target(target: nn.Module, names: list[str], dst: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate the target's children ``names`` on ``device`` and copy each parameter's and buffer's moved
    tensor in, freeing it as soon as it is copied."""
    for n in names:
        child = target._modules[n]
        if child is not None:
            child.to_empty(device=device)
    for n, p in list(target._parameters.items()):
        if p is not None and p.is_meta:  # a parameter the LightningModule holds itself
            target._parameters[n] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    with torch.no_grad():
        for name, p in target.named_parameters():
            new = dst.pop(name)
            local = local_tensor(p)
            if new.shape != local.shape:
                raise RuntimeError(f"{name}: the switch produced {tuple(new.shape)}, "
                                   f"the target holds {tuple(local.shape)}")
            local.copy_(new)
            del new
        for name, b in target.named_buffers():
            b.copy_(dst.pop(name).reshape(b.shape))


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
