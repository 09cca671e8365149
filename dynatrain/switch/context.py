"""What the switch driver needs from the training framework, and nothing more.

The driver never reads a strategy's fields: the strategy hands it a `SwitchContext`, whose members are the
running layout, a few settings, and the operations a switch calls (build a mesh, build the target on meta, the
optimizer, the world hooks). `dynatrain.strategies.switch_context` implements it for `DynaTrainStrategy`; a test
double implements it to drive the stages without Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dynatrain.vps.parallel_config import ParallelConfig


@dataclass(frozen=True)
class SwitchSettings:
    """``verify``: check every switch against the tensors' own placements (`check.verify`); ``budget_bytes``: the
    transient memory a switch may use per rank; ``rank_map``: ``"auto"``, ``"optimal"`` or ``"identity"``."""

    verify: bool = True
    budget_bytes: int = 256 * 2**20
    rank_map: str = "auto"


class SwitchContext(Protocol):
    # Set from the release of the old shards until the target is adopted: a failure then cannot be undone.
    released: bool

    # ---- the running layout ---------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def layout(self) -> ParallelConfig: ...

    @property
    def positions(self) -> list[int]:
        """Per mesh position, the rank there."""

    @property
    def mesh(self) -> DeviceMesh | None: ...

    @property
    def rank(self) -> int: ...

    @property
    def control_group(self) -> Any:
        """The current world's group for metadata (`dynatrain.runtime.control_group`); None without a process group."""

    @property
    def world_size(self) -> int: ...

    @property
    def step(self) -> int:
        """The optimizer steps taken."""

    @property
    def settings(self) -> SwitchSettings: ...

    @property
    def elastic(self) -> Any:
        """The job's `ElasticManager`, or None in a fixed world."""

    @property
    def data_fixed(self) -> bool:
        """A dataloader that cannot be re-split: processes keep their data-parallel ranks."""

    def optimizer(self) -> torch.optim.Optimizer | None: ...

    def optimizers(self) -> list[torch.optim.Optimizer]: ...

    def drop_optimizers(self) -> None:
        """Forget the optimizers: their state went to the engine."""

    def scheduler_states(self) -> list[dict]: ...

    # ---- building a layout ----------------------------------------------------------------------------------
    def build_mesh(self, layout: ParallelConfig, ranks: list[int] | None = None) -> DeviceMesh: ...

    def build_target(self, mesh: DeviceMesh, layout: ParallelConfig) -> nn.Module:
        """A copy of the module parallelised for ``layout`` on ``mesh`` by the user's own parallelisation, on meta."""

    def placeholder(self) -> nn.Module | None:
        """An unparallelised copy of the module on meta, for a process that left to hold."""

    def check_layout(self, layout: ParallelConfig, world_size: int) -> ParallelConfig:
        """``layout`` validated against the devices, the model and the data (ValueError)."""

    def choose_layout(self, world_size: int) -> ParallelConfig | None:
        """The job's policy's layout for ``world_size`` processes, if it has one."""

    # ---- adopting -------------------------------------------------------------------------------------------
    def install(self, mesh: DeviceMesh, layout: ParallelConfig, positions: list[int]) -> None:
        """The module and the strategy run on ``mesh`` as ``layout`` from now on."""

    def make_optimizer(self) -> torch.optim.Optimizer | None:
        """The user's optimizer and schedulers for the module as it is now (None outside fit)."""

    def load_scheduler_states(self, states: list[dict]) -> None: ...

    def restart_steps(self, layout: ParallelConfig) -> None:
        """Pipeline schedule and data split for ``layout``, before its first step."""

    # ---- worlds ---------------------------------------------------------------------------------------------
    def enter_world(self, rank: int, world_size: int) -> None: ...

    def forget_meshes(self, drop_groups: bool = False) -> None:
        """Forget every mesh of the current world (``drop_groups``: and unregister their process groups)."""

    def leave_job(self) -> None:
        """This process left: no model, no group from now on."""

    def loop_state(self) -> dict:
        """The training loop's state at this boundary, as JSON, for a process joining."""

    def logger_versions(self) -> list: ...

    def adopt_logger_versions(self, versions: list) -> None:
        """A joining process writes into the run's logs, as rank 0 does."""

    # ---- outcomes -------------------------------------------------------------------------------------------
    def publish(self, report: Any) -> None:
        """A completed switch's report: kept, logged, handed to every hook."""

    def on_recovered(self, report: Any) -> None:
        """The survivors of a lost process go on: the step in progress is discarded."""
