"""What a live module and its optimizer hold, named as the switch's capture names it: the check hashes the same
states the switch moves, each under the one name every rank and every layout gives it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

PARAM_GROUP = "#param_group"
SCHEDULER = "#scheduler"


def _read_only(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's detach goes through DTensor's dispatch (about 30 us each, 3,000 per check of a small model); the
    # switch's check reads values under no_grad, so a DTensor is taken as it is.
    from torch.distributed.tensor import DTensor

    return t if isinstance(t, DTensor) else t.detach()


def module_state_tensors(module: torch.nn.Module, optimizer=None, schedulers: Sequence = (),
                         param_groups: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(tensors, scalars) of ``module`` and ``optimizer`` as the switch's capture names them: each parameter by
    its name, each optimizer tensor of a parameter (not 0-d) as ``<param>.<key>``, each buffer by its name (the
    tensors themselves, DTensors not made local); every other optimizer entry (``step``, numbers, None) as a
    scalar ``<param>.<key>``. With ``param_groups``, each optimizer group's hyper-parameters as the scalar
    ``#param_group.<i>`` (its parameters by name); each of ``schedulers`` (torch LR schedulers) as
    ``#scheduler.<i>``, its ``state_dict()``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        tensors[name] = _read_only(p)
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[f"{name}.{key}"] = _read_only(v)
            else:
                scalars[f"{name}.{key}"] = v
    for name, b in module.named_buffers():
        tensors[name] = _read_only(b)
    if optimizer is not None and param_groups:
        for i, g in enumerate(optimizer.param_groups):
            scalars[f"{PARAM_GROUP}.{i}"] = {
                k: [names.get(id(p), "?") for p in v] if k == "params" else v for k, v in g.items()}
    for i, s in enumerate(schedulers):
        scalars[f"{SCHEDULER}.{i}"] = s.state_dict()
    return tensors, scalars
