"""`TargetBuilder`: the LightningModule's parallelisation run again for another layout, on the meta device.

The strategy keeps the module as it was before `configure_model()` ran (a `ModuleTemplate`); a target layout is
a copy of it parallelised by the user's own `configure_model()`, or by the strategy's ``parallelize_fn``, on the
target's mesh.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.models.context_parallel import check_context_parallel
from dynatrain.strategies.lightning_internals import attach_trainer, trainer_of
from dynatrain.switch.target import ModuleTemplate
from dynatrain.vps.parallel_config import ParallelConfig


class TargetBuilder:
    """``mesh``: the target's mesh while a target is built (None otherwise), the one `parallelize` runs on then."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.template: ModuleTemplate | None = None  # the LightningModule before configure_model(), on meta
        self.mesh: DeviceMesh | None = None

    def keep_template(self) -> None:
        """Keep the module as the user built it, once: every target layout is parallelised from it."""
        module = self.strategy.lightning_module
        if self.template is None and module is not None:
            trainer = trainer_of(module)
            self.template = ModuleTemplate(module, keep=(trainer,),
                                           adopt=lambda copy: attach_trainer(copy, trainer_of(module)))

    def placeholder(self) -> nn.Module | None:
        """An unparallelised copy of the module on meta (for a process that left the job to hold), if kept."""
        return self.template.fresh() if self.template is not None else None

    def build(self, mesh: DeviceMesh, pcfg: ParallelConfig) -> nn.Module:
        """A copy of the LightningModule parallelised for ``pcfg`` on ``mesh`` by the user's own configure_model()
        (or the strategy's ``parallelize_fn``), on the meta device."""
        if self.template is None:
            raise ValueError("the LightningModule was not set up by this strategy's fit, so its parallelisation "
                             "cannot be run again for another layout")
        strategy = self.strategy

        def parallelize(module) -> None:
            if strategy.has_configure_model:
                with strategy.precision_plugin.module_init_context():
                    module.configure_model()
            else:
                strategy.parallelize(module)

        # While the target is built, the strategy answers with its layout, as the module's mesh does.
        self.mesh, current = mesh, strategy.parallel_config
        strategy.parallel_config = pcfg
        try:
            target = self.template.build(mesh, parallelize)
        finally:
            self.mesh, strategy.parallel_config = None, current
        check_context_parallel(target, pcfg)
        return strategy.precision_plugin.convert_module(target)
