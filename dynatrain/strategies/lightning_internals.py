"""Lightning's internals outside the fit loop (whose own are in `fit_loop`), reached here for the strategy, its
switch context and its elastic set-up: a module's trainer before Lightning's ``trainer`` property would answer, a
module's device mesh, the data connector's ``prepare_data``, the strategy's process-group set-up, and the Fabric
helpers `ModelParallelStrategy` builds on, and the loggers' run identity a new rank 0 takes over (`lightning_world`
tells Lightning of a changed world through these and Lightning's public API). What is touched, and the Lightning
versions this runs with, is in docs/lightning.md.
"""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn


def trainer_of(module: nn.Module | None) -> pl.Trainer | None:
    """The module's trainer, None where it has none (Lightning's ``trainer`` property raises there)."""
    return getattr(module, "_trainer", None)


def attach_trainer(module: nn.Module, trainer: pl.Trainer | None) -> None:
    """Give a copy of a LightningModule its original's trainer (copying drops it)."""
    module._trainer = trainer


def set_module_mesh(module: nn.Module | None, mesh) -> None:
    """The LightningModule's ``device_mesh``, as `ModelParallelStrategy` sets it."""
    if module is not None:
        module._device_mesh = mesh


def prepare_data_alone(trainer: pl.Trainer) -> None:
    """Make the trainer's ``prepare_data`` run on this process alone: Lightning brackets it with a barrier on a new
    group of the whole world, which the members of a running job passed long ago."""

    def prepare() -> None:
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("prepare_data", datamodule):
            datamodule.prepare_data()

    trainer._data_connector.prepare_data = prepare


def setup_distributed(strategy: pl.strategies.ModelParallelStrategy) -> None:
    """Lightning's own process-group set-up of the strategy."""
    strategy._setup_distributed()


def settle_process_group_backend(strategy: pl.strategies.ModelParallelStrategy) -> str:
    """Fix the backend the strategy's groups take, the one it was given, else the device's (as Lightning chooses),
    where Lightning's own set-up would (an elastic job forms its groups itself); returns it."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    return strategy._process_group_backend


def process_group_timeout(strategy: pl.strategies.ModelParallelStrategy) -> timedelta | None:
    """The ``timeout`` the strategy was given for its process groups."""
    return strategy._timeout


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Initialise a module built on meta by its ``reset_parameters()``, as `ModelParallelStrategy` does."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers, device: torch.device) -> None:
    _optimizers_to_device(optimizers, device)


def wandb_run_id(logger) -> str | None:
    """A W&B logger's run id on a process that is not rank 0 (its ``experiment`` is a dummy there)."""
    return logger._id


def continue_wandb_run(logger, run_id: str) -> None:
    """Make a W&B logger continue run ``run_id`` instead of starting a new one when this process becomes rank 0."""
    logger._id = run_id
    logger._wandb_init.update(id=run_id, resume="allow")


def set_logger_version(logger, version) -> bool:
    """Give a logger with a version of its own (CSV, TensorBoard) ``version``; False for one without."""
    if not hasattr(logger, "_version"):
        return False
    logger._version = version
    return True


def experiment_opened(logger) -> bool:
    """Whether a CSV logger's writer exists already (opening it erases the directory's metrics file)."""
    return logger._experiment is not None
