"""What a world change does to Lightning: ranks, devices, rank-zero duties, loggers, and a process that left.

The bytes move in the switch driver (`dynatrain.switch`), which calls these through the strategy's context.
Lightning is told about the new world here: the cluster environment reports the process's
new rank and world size, `rank_zero_only` follows it, the progress bar moves to the new rank 0, and every logger
keeps the run's version so the new rank 0 writes into the same run directory.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dynatrain.strategies.lightning_internals import (
    continue_wandb_run,
    experiment_opened,
    set_logger_version,
    trainer_of,
    wandb_run_id,
)
from dynatrain.strategies.mesh_cache import forget_old_meshes

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ModelParallelStrategy as DynaTrainStrategy  # with forget_meshes


class ElasticEnvironment(LightningEnvironment):
    """Rank and world size set by the job's world generation; the device (local rank) never changes."""

    def __init__(self, global_rank: int, world_size: int, local_rank: int) -> None:
        super().__init__()
        self._fixed_local_rank = local_rank
        self.set_world_size(world_size)
        self.set_global_rank(global_rank)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def local_rank(self) -> int:
        return self._fixed_local_rank

    def node_rank(self) -> int:
        return 0


def set_world(strategy: "DynaTrainStrategy", rank: int, world_size: int) -> None:
    """Make Lightning see this process as ``rank`` of ``world_size`` (a new generation: no old mesh survives in
    DTensor's caches)."""
    forget_old_meshes()
    env = strategy.cluster_environment
    if not isinstance(env, ElasticEnvironment):
        local = env.local_rank() if env is not None else 0
        env = strategy.cluster_environment = ElasticEnvironment(rank, world_size, local)
    was_zero = rank_zero_only.rank == 0
    env.set_world_size(world_size)
    env.set_global_rank(rank)
    strategy.parallel_devices = [strategy.root_device] * world_size
    rank_zero_only.rank = fabric_rank_zero_only.rank = rank
    module = strategy.lightning_module
    trainer = trainer_of(module)
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if bar is not None:
        bar.enable() if rank == 0 else bar.disable()
    if rank == 0 and not was_zero:
        take_over_logging(trainer)
    strategy.form_control_group()


def logger_versions(trainer: pl.Trainer | None) -> list[Any]:
    """Each logger's version on this process (forcing its choice), to hand to a new rank 0."""
    if trainer is None:
        return []
    out = []
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            out.append(lg.experiment.id if rank_zero_only.rank == 0 else wandb_run_id(lg))
        else:
            out.append(getattr(lg, "version", None))
    return out


def adopt_logger_versions(trainer: pl.Trainer | None, versions: list[Any]) -> None:
    if trainer is None:
        return
    for lg, v in zip(trainer.loggers, versions):
        if v is None:
            continue
        if isinstance(lg, WandbLogger):
            continue_wandb_run(lg, v)  # a new rank 0 continues the run, not a new one
        else:
            set_logger_version(lg, v)


def take_over_logging(trainer: pl.Trainer | None) -> None:
    """On a process that just became rank 0: open the run's CSV log without erasing what was written."""
    if trainer is None:
        return
    for lg in trainer.loggers:
        if not isinstance(lg, CSVLogger) or experiment_opened(lg):
            continue
        path = Path(lg.log_dir) / "metrics.csv"
        rows = path.read_text() if path.is_file() else None
        writer = lg.experiment  # Lightning's writer deletes an existing metrics file when it opens the directory
        if rows:
            path.write_text(rows)
            writer.metrics_keys = next(csv.reader(io.StringIO(rows)))


def detach(strategy: "DynaTrainStrategy", trainer: pl.Trainer | None) -> None:
    """A process that left: no model, no group; Lightning winds its loop down without collectives."""
    strategy.detached = True
    strategy.control_group = None
    strategy.elastic.stop_heartbeat()
    strategy.forget_meshes()
    if trainer is not None:
        trainer.should_stop = True
    rank_zero_only.rank = fabric_rank_zero_only.rank = -1  # this process logs nothing more
