"""The user's own parallelisation, run again for a target layout on the meta device.

Lightning asks `configure_model()` to be idempotent, so it cannot be called again on the live, parallelised
module. Instead the strategy keeps a *template*: the LightningModule as it was before `configure_model()` ran,
with every parameter and buffer on the meta device (no memory) and what else it holds copied where it can be
(`module_copy`). A target is a copy of the template whose
`device_mesh` is the target mesh, on which `configure_model()` (or the strategy's own parallelisation) runs as it
did at start-up; DTensor then records the target placements, which the switch plans from. After the transfer,
the copy's parameter-holding children replace the live module's (`transplant`): the LightningModule object, its
hooks, metrics and attributes stay those Lightning knows.

`TargetLayouts` reads a target's placements from such builds, once per layout: on the target's real mesh within
the world, on probe meshes of fake groups (`probe`) for a world of another size or another pipeline stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch import nn

from dynatrain.check.placement import remember as remember_placements
from dynatrain.models.pipeline_split import pipeline_stages
from dynatrain.switch.capture import target_shardings
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.module_copy import meta_copy
from dynatrain.switch.probe import probe_mesh
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig


class ModuleTemplate:
    """The LightningModule before `configure_model()`, on meta; `build` makes a target copy of it.

    ``keep``: objects the module refers to that its copies share rather than copy (its trainer); ``adopt``: called
    with each copy, to give it what copying drops (a LightningModule's trainer)."""

    def __init__(self, module: nn.Module, keep: tuple = (),
                 adopt: Callable[[nn.Module], None] | None = None) -> None:
        self.keep = keep
        self.adopt = adopt
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
        target = meta_copy(self.template, self.keep)
        if self.adopt is not None:
            self.adopt(target)
        return target


def to_meta(module: nn.Module) -> None:
    """Move the module's parameter-holding children (and its own parameters) to meta; metrics and other children
    without parameters keep their state. A tied parameter stays one (`Module.to` would give each user its own)."""
    memo: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            new = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
            memo[id(t)] = memo[id(new)] = new  # a module two children share is met twice
        return memo[id(t)]

    owners = [module._modules[n] for n in param_children(module)]
    for owner in [m for child in owners for m in child.modules()] + [module]:
        for table in (owner._parameters, owner._buffers) if owner is not module else (owner._parameters,):
            for n, t in list(table.items()):
                if t is not None:
                    table[n] = meta(t)


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


class _BuildFailed(Exception):
    """The module's own parallelisation raised (its ``__cause__``) while a target layout was built."""


class TargetLayouts:
    """Per target layout, every parameter's sharding there (from the module's parallelisation run on meta, once per
    layout), and the build made when a switch was requested, kept for the switch to reuse."""

    def __init__(self, ctx: SwitchContext) -> None:
        self.ctx = ctx
        self._shardings: dict[ParallelConfig, dict] = {}  # per target layout: parameter -> Sharding
        self._probes: dict = {}  # target layout -> its meta build on the default rank order, made at request time
        self.build_seconds: dict[ParallelConfig, float] = {}  # the last build of each layout on its real mesh

    def check(self, target: ParallelConfig, captured, probe: bool = False) -> None:
        """Run the module's parallelisation for ``target`` now (a ValueError if it fails); keep the build."""
        _, built = self.layout(target, captured, probe=probe)
        if built is not None:
            self._probes[target] = built

    def layout(self, target: ParallelConfig, captured, probe: bool = False):
        """The target layout of the captured states and, when there is one, the build to reuse (see
        `shardings`)."""
        shardings, built = self.shardings(target, captured, probe)
        return Layout.from_shardings(captured.specs, shardings, target), built

    def shardings(self, target: ParallelConfig, captured, probe: bool = False):
        """Per captured state, its sharding in ``target``, from the module's parallelisation run on meta (once per
        layout). Within the world it runs on the target's real mesh in the default rank order, and that build is
        returned for reuse when the plan keeps the order; for another world size (``probe``) on a mesh of fake
        groups (`probe`)."""
        shardings = self._shardings.get(target)
        built = self._probes.pop(target, None) if shardings is not None and not probe else None
        if shardings is None:
            try:
                if probe or target.pp > 1:
                    # A pipeline's other stages are read from probes placed on them; nothing is built to reuse.
                    with ExitStack() as probes:
                        builds = [self._probe_build(probes, target, stage) for stage in range(target.pp)]
                        per_param = target_shardings(builds, captured)
                    built = None
                else:
                    start = time.perf_counter()
                    mesh = self.ctx.build_mesh(target)
                    built = self._build(mesh, target)
                    self.build_seconds[target] = time.perf_counter() - start
                    remember_placements(built)  # for the check after the switch that adopts this build
                    per_param = target_shardings([(built, mesh)], captured)
            except _BuildFailed as e:
                cause = e.__cause__
                raise ValueError(f"the model's parallelisation failed for {target.short()} (run on the meta device): "
                                 f"{type(cause).__name__}: {cause}") from cause
            shardings = {captured.param_of[s.name][0]: sh for s, sh in zip(captured.specs, per_param)}
            self._shardings[target] = shardings
        try:
            return tuple(shardings[captured.param_of[s.name][0]] for s in captured.specs), built
        except KeyError as e:
            raise ValueError(f"state {e.args[0]!r} appeared after the target layout was built") from None

    def _probe_build(self, probes: ExitStack, target: ParallelConfig, stage: int):
        """(the module parallelised for ``target`` as pipeline stage ``stage`` sees it, its probe mesh); the probe's
        groups stay registered until ``probes`` closes."""
        mesh = probes.enter_context(probe_mesh(target, self.ctx.device.type, stage))
        build = self._build(mesh, target)
        if target.pp > 1 and pipeline_stages(build) is None:
            raise ValueError(f"{target.short()} asks for pipeline stages, but the module's parallelisation split no "
                             "model into stages (see docs/pipeline.md): use pp=1 for this module")
        return build, mesh

    def _build(self, mesh, target: ParallelConfig):
        try:
            return self.ctx.build_target(mesh, target)
        except Exception as e:
            raise _BuildFailed() from e

    def has_build(self, target: ParallelConfig) -> bool:
        """Whether a build of ``target`` on the default rank order is kept for its switch."""
        return target in self._probes

    def forget_builds(self) -> None:
        """Drop the meta builds made at request time, which hold this world's meshes that a world change ends, and
        the placements read from them: a process that joins the next world has none, and every rank must take the
        same branch at a request there (a build on a real mesh creates process groups)."""
        self._probes.clear()
        self._shardings.clear()
        self.build_seconds.clear()
