"""What a world change does to Lightning: ranks, devices, rank-zero duties, loggers, and a joiner's start.

The bytes move in `Switcher.switch_world` (current members) and `join_running_job` (a new process); both run the
same plan, built from the same inputs. Lightning is told about the new world here: the cluster environment
reports the process's new rank and world size, `rank_zero_only` follows it, the progress bar moves to the new
rank 0, and every logger keeps the run's version so the new rank 0 writes into the same run directory.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dynatrain.vps.layout import StateSpec
from dynatrain.vps.placement import Replicate, Shard, Sharding, StridedShard

if TYPE_CHECKING:
    from dynatrain.strategies.dynatrain import DynaTrainStrategy


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


def forget_old_meshes() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches. They key a DeviceMesh by its rank layout,
    not by this process's rank or groups: after a world change, an op on a mesh of the same shape would otherwise
    get back tensors of an old generation's mesh (a stale rank, dead groups), which DCP and `full_tensor` read."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()


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
    trainer = strategy._lightning_module.trainer if strategy._lightning_module is not None else None
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if bar is not None:
        bar.enable() if rank == 0 else bar.disable()
    if rank == 0 and not was_zero:
        take_over_logging(trainer)


def logger_versions(trainer: pl.Trainer | None) -> list[Any]:
    """Each logger's version on this process (forcing its choice), to hand to a new rank 0."""
    if trainer is None:
        return []
    out = []
    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            out.append(lg.experiment.id if rank_zero_only.rank == 0 else lg._id)
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
            lg._id = v
            lg._wandb_init.update(id=v, resume="allow")  # a new rank 0 continues the run, not a new one
        elif hasattr(lg, "_version"):
            lg._version = v


def take_over_logging(trainer: pl.Trainer | None) -> None:
    """On a process that just became rank 0: open the run's CSV log without erasing what was written."""
    if trainer is None:
        return
    for lg in trainer.loggers:
        if not isinstance(lg, CSVLogger) or lg._experiment is not None:
            continue
        path = Path(lg.log_dir) / "metrics.csv"
        rows = path.read_text() if path.is_file() else None
        writer = lg.experiment  # Lightning's writer deletes an existing metrics file when it opens the directory
        if rows:
            path.write_text(rows)
            writer.metrics_keys = next(csv.reader(io.StringIO(rows)))


# ---- what a joiner receives -----------------------------------------------------------------------------------
def _encode_sharding(sh: Sharding) -> list:
    kinds = [["R"] if isinstance(p, Replicate) else ["S", p.dim] if isinstance(p, Shard) else
             ["SS", p.dim, p.split_factor] for p in sh.placements]
    held = None if sh.held is None else [sh.held[0], list(sh.held[1])]
    return [list(sh.mesh_shape), kinds, [list(run) for run in sh.dims], held]


def _decode_sharding(row: list) -> Sharding:
    mesh, kinds, dims, held = row
    make = {"R": lambda: Replicate(), "S": lambda d: Shard(d), "SS": lambda d, f: StridedShard(d, f)}
    return Sharding(tuple(mesh), tuple(make[k[0]](*k[1:]) for k in kinds), tuple(tuple(r) for r in dims),
                    None if held is None else (held[0], tuple(held[1])))


def encode_specs(specs, old_shardings, new_shardings) -> list:
    """The states of a world change with their old and new placements, as JSON for a joiner."""
    return [[s.name, list(s.shape), s.dtype, _encode_sharding(a), _encode_sharding(b)]
            for s, a, b in zip(specs, old_shardings, new_shardings)]


def decode_specs(rows: list) -> tuple[tuple[StateSpec, ...], tuple[Sharding, ...], tuple[Sharding, ...]]:
    specs = tuple(StateSpec(n, tuple(shape), dtype) for n, shape, dtype, _, _ in rows)
    return (specs, tuple(_decode_sharding(r[3]) for r in rows), tuple(_decode_sharding(r[4]) for r in rows))


def encode_scalars(scalars: dict[str, dict]) -> dict:
    out = {}
    for name, entries in scalars.items():
        out[name] = {k: ({"tensor": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                         if isinstance(v, torch.Tensor) else v) for k, v in entries.items()}
    return out


def decode_scalars(encoded: dict, device: torch.device) -> dict[str, dict]:
    out = {}
    for name, entries in encoded.items():
        out[name] = {k: (torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device=device)
                         if isinstance(v, dict) and "tensor" in v else v) for k, v in entries.items()}
    return out


def loop_checkpoint(trainer: pl.Trainer) -> dict:
    """The part of a Lightning checkpoint that is not model or optimizer state, as of the switch boundary."""
    ckpt: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "loops": {"fit_loop": trainer.fit_loop.state_dict()},
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
    }
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        ckpt[type(datamodule).__qualname__] = datamodule.state_dict()
    ckpt["callbacks"] = _callback_states(trainer)
    return json.loads(json.dumps(ckpt))  # what crosses the store is JSON: fail here, not on the joiner


def _callback_states(trainer: pl.Trainer) -> dict[str, dict]:
    """Stateful callbacks' `state_dict`s, so a joiner resumes them where the members are (a scripted sequence
    of requests, for one). A state that is not plain JSON (tensors, paths) stays behind: the joiner's callback
    then starts fresh, as it does without a checkpoint."""
    out = {}
    for cb in trainer.callbacks:
        state = cb.state_dict()
        if not state:
            continue
        try:
            out[cb.state_key] = json.loads(json.dumps(state))
        except (TypeError, ValueError):
            continue
    return out


@dataclass
class JoinState:
    """What a joiner holds between its transfer (in `setup_environment`) and Lightning's restore."""

    dst: dict[str, torch.Tensor] | None  # None until `receive` ran
    scalars: dict[str, dict]
    groups: list[dict]
    checkpoint: dict
    old_totals: list[int] | None
    old_layout: Any
    new_layout: Any
    process: int
    param_of: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    order: dict[str, list[str]] = field(default_factory=dict)
    receive: Callable[[], dict[str, torch.Tensor]] | None = None  # a transfer deferred to Lightning's set-up
    report: dict = field(default_factory=dict)
