"""The user's own parallelisation, run again for a target layout on the meta device.

Lightning asks `configure_model()` to be idempotent, so it cannot be called again on the live, parallelised
module. Instead the strategy keeps a *template*: the LightningModule as it was before `configure_model()` ran,
with every parameter and buffer on the meta device (no memory). A target is a copy of the template whose
`device_mesh` is the target mesh, on which `configure_model()` (or the strategy's own parallelisation) runs as it
did at start-up; DTensor then records the target placements, which the switch plans from. After the transfer,
the copy's parameter-holding children replace the live module's (`transplant`): the LightningModule object, its
hooks, metrics and attributes stay those Lightning knows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def meta_copy(module: nn.Module, keep: tuple = ()) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors; objects in ``keep`` (the trainer)
    are shared, not copied. The copy holds no device mesh: a mesh keeps its process groups alive, and a group
    that outlives its world keeps a survivor's peers blocked in it."""
    memo: dict[int, object] = {id(obj): obj for obj in keep if obj is not None}
    mesh = getattr(module, "_device_mesh", None)
    if mesh is not None:
        memo[id(mesh)] = None
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class ModuleTemplate:
    """The LightningModule before `configure_model()`, on meta; `build` makes a target copy of it."""

    def __init__(self, module: nn.Module, keep: tuple = ()) -> None:
        self.keep = keep
        self.source = module
        self.template = meta_copy(module, keep)

    def build(self, mesh, parallelize: Callable[[nn.Module], None]) -> nn.Module:
        """A copy parallelised on ``mesh`` by ``parallelize`` (on meta: nothing is allocated)."""
        target = self.fresh()
        target._device_mesh = mesh
        with torch.device("meta"):
            parallelize(target)
        return target

    def fresh(self) -> nn.Module:
        """An unparallelised copy on meta (also what a process that left the job holds in place of its model, so
        the module's hooks that still run as its loop winds down find their modules)."""
        target = copy.deepcopy(self.template, {id(obj): obj for obj in self.keep if obj is not None})
        if hasattr(self.source, "_trainer"):
            target._trainer = self.source._trainer  # a LightningModule drops its trainer when it is copied
        return target


def to_meta(module: nn.Module) -> None:
    """Move the module's parameter-holding children (and its own parameters) to meta; metrics and other children
    without parameters keep their state."""
    for n in param_children(module):
        module._modules[n].to("meta")
    for n, p in list(module._parameters.items()):
        if p is not None:
            module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


def param_children(module: nn.Module) -> list[str]:
    """The names of the module's children that hold parameters: what a switch replaces."""
    return [n for n, child in module.named_children() if next(child.parameters(), None) is not None]


def release_children(live: nn.Module) -> list[str]:
    """Drop the live module's parameter-holding children (the switch's engine holds their shards now)."""
    names = param_children(live)
    for n in names:
        live._modules[n] = None
    for n in list(live._parameters):
        live._parameters[n] = None
    return names


def transplant(live: nn.Module, target: nn.Module, names: list[str]) -> None:
    """Give ``live`` the target copy's children ``names`` (and its own parameters, if any)."""
    for n in names:
        live._modules[n] = target._modules.get(n)
    for n, p in target._parameters.items():
        live._parameters[n] = p
