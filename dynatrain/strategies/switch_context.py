"""`StrategyContext`: the `SwitchContext` a `DynaTrainStrategy` hands the switch driver, over the strategy's public
API and Lightning's trainer. What the driver may touch is listed here and nowhere else."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.strategies.lightning_internals import trainer_of
from dynatrain.strategies.lightning_world import adopt_logger_versions, detach, logger_versions, set_world
from dynatrain.strategies.loop_state import loop_checkpoint
from dynatrain.switch.context import SwitchSettings
from dynatrain.vps.parallel_config import ParallelConfig


class StrategyContext:
    """``check``: validates a layout for a number of processes (the strategy's request checks); ``on_data``: called
    with the trainer after the data split followed a new layout (the loop counts accumulation from there)."""

    def __init__(self, strategy, check: Callable[[ParallelConfig, int], ParallelConfig],
                 on_data: Callable[[Any], None]) -> None:
        self.strategy = strategy
        self._check, self._on_data = check, on_data
        self.trainer = None  # set when the fit loop is attached
        self.released = False

    # ---- the running layout -------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.strategy.lightning_module

    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    @property
    def layout(self) -> ParallelConfig:
        return self.strategy.parallel_config

    @property
    def positions(self) -> list[int]:
        positions = self.strategy.positions
        return list(range(self.strategy.world_size)) if positions is None else list(positions)

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.strategy.device_mesh

    @property
    def rank(self) -> int:
        return self.strategy.global_rank

    @property
    def control_group(self):
        return self.strategy.control_group

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else 0

    @property
    def settings(self) -> SwitchSettings:
        o = self.strategy.switching
        return SwitchSettings(verify=o.verify_switches, budget_bytes=o.budget_bytes, rank_map=o.rank_map)

    @property
    def elastic(self):
        return self.strategy.elastic

    @property
    def data_fixed(self) -> bool:
        return self.strategy.data_split.fixed

    def optimizer(self):
        return self.strategy.optimizers[0] if self.strategy.optimizers else None

    def optimizers(self) -> list:
        return list(self.strategy.optimizers)

    def drop_optimizers(self) -> None:
        self.strategy.optimizers = []

    def scheduler_states(self) -> list[dict]:
        return [cfg.scheduler.state_dict() for cfg in self.strategy.lr_scheduler_configs]

    # ---- building a layout --------------------------------------------------------------------------------
    def build_mesh(self, layout: ParallelConfig, ranks=None) -> DeviceMesh:
        return self.strategy.build_mesh(layout, ranks=ranks)

    def build_target(self, mesh: DeviceMesh, layout: ParallelConfig) -> nn.Module:
        return self.strategy.build_target(mesh, layout)

    def placeholder(self) -> nn.Module | None:
        return self.strategy.placeholder_module()

    def check_layout(self, layout: ParallelConfig, world_size: int) -> ParallelConfig:
        return self._check(layout, world_size)

    def choose_layout(self, world_size: int) -> ParallelConfig | None:
        chooser = self.strategy.layout_chooser
        return chooser(world_size) if chooser is not None else None

    # ---- adopting -----------------------------------------------------------------------------------------
    def install(self, mesh: DeviceMesh, layout: ParallelConfig, positions) -> None:
        self.strategy.install_layout(mesh, layout, positions)

    def _fitting_trainer(self):
        trainer = self.trainer or trainer_of(self.module)
        return trainer if trainer is not None and trainer.state.fn == TrainerFn.FITTING else None

    def make_optimizer(self):
        trainer = self._fitting_trainer()
        if trainer is None:
            return None
        self.strategy.setup_optimizers(trainer)
        return self.optimizer()

    def load_scheduler_states(self, states: list[dict]) -> None:
        for cfg, state in zip(self.strategy.lr_scheduler_configs, states):
            cfg.scheduler.load_state_dict(state)

    def restart_steps(self, layout: ParallelConfig) -> None:
        self.strategy.build_pipeline()
        trainer = self.trainer
        if trainer is not None:
            self.strategy.data_split.apply(trainer, layout.dp_size, self.strategy.dp_rank)
            self._on_data(trainer)

    # ---- worlds -------------------------------------------------------------------------------------------
    def enter_world(self, rank: int, world_size: int) -> None:
        set_world(self.strategy, rank, world_size)

    def forget_meshes(self, drop_groups: bool = False) -> None:
        self.strategy.forget_meshes(drop_groups=drop_groups)

    def leave_job(self) -> None:
        detach(self.strategy, self.trainer)

    def loop_state(self) -> dict:
        return loop_checkpoint(self.trainer)

    def logger_versions(self) -> list:
        return logger_versions(self.trainer)

    def adopt_logger_versions(self, versions: list) -> None:
        adopt_logger_versions(self.trainer or self.module.trainer, versions)

    # ---- outcomes -----------------------------------------------------------------------------------------
    def publish(self, report) -> None:
        strategy = self.strategy
        strategy.switch_reports.append(report)
        share = report.verify_share
        rank_zero_info(
            f"layout switch {report.old_layout} -> {report.new_layout} at step {report.step}: "
            f"{report.bytes_moved / 2**20:.1f} MiB moved of {report.bytes_total / 2**20:.1f} MiB, "
            f"stall {report.stall_s:.3f}s"
            + (f", verified bitwise ({share:.0%} of the stall)" if report.verified and share is not None else ""))
        for hook in strategy.after_switch:
            hook(report)

    def on_recovered(self, report) -> None:
        self.strategy.recovery_reports.append(report)
        # The step in progress is discarded: whatever counted its micro-batches starts that step afresh.
        for owner in [self.module, *(self.trainer.callbacks if self.trainer is not None else [])]:
            hook = getattr(owner, "on_train_step_discarded", None)
            if callable(hook):
                hook()
        rank_zero_warn(f"lost process(es) {report.lost} at step {report.step}: the {report.survivors} survivors "
                       f"rebuilt the state from replicas and go on as {report.new_layout} ({report.seconds:.2f}s)")
