"""`Switcher`: a `DynaTrainStrategy`'s layout switches, run only at optimizer-step boundaries.

It holds what lives between switches (the pending request, a switch prepared in the background, a joiner's
received state, the loop's accumulation offset, the target builds) and is the strategy's one entry to every kind
of switch. The stages live in their own modules: `fit_loop` (Lightning's loop), `switch_requests` (checks and the
queue), `states` (capture and release), `target` (target layouts), `same_world` and `world_switch` (the two kinds run
by members), `joiner` (a new process), `adopt`, `report`; `recovery` (a lost process) runs the same stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl

from dynatrain.strategies import fit_loop, joiner, switch_requests
from dynatrain.strategies.joiner import JoinState
from dynatrain.strategies.prepare import MemberPrep
from dynatrain.strategies.report import SwitchReport
from dynatrain.strategies.same_world import InWorldPrep, switch_in_world
from dynatrain.strategies.target import TargetLayouts
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.dynatrain import DynaTrainStrategy


class Switcher:
    def __init__(self, strategy: "DynaTrainStrategy") -> None:
        self.strategy = strategy
        self.pending: switch_requests.Pending | None = None
        self.joined: JoinState | None = None  # a joiner's received state until training starts
        self.prepared: MemberPrep | InWorldPrep | None = None  # the pending switch, planned in the background
        self.accumulation_offset = 0
        self.trainer: pl.Trainer | None = None
        self.targets = TargetLayouts(strategy)
        self.released = False  # the old layout's state was handed to the engine: a failure now cannot be undone

    # ---- Lightning wiring ---------------------------------------------------------------------------------
    def attach(self, trainer: pl.Trainer) -> None:
        fit_loop.attach(self, trainer)

    def at_boundary(self) -> bool:
        return fit_loop.at_boundary(self)

    def require_boundary(self) -> None:
        if not self.at_boundary():
            raise RuntimeError(
                "a layout switch can only run at an optimizer-step boundary: use strategy.request_switch(), "
                "which waits for the end of the current gradient accumulation"
            )
        for guard in self.strategy.switch_guards:
            guard()

    def optimizer(self):
        return self.strategy.optimizers[0] if self.strategy.optimizers else None

    # ---- requests -----------------------------------------------------------------------------------------
    def check(self, target: str | ParallelConfig, world_size: int | None = None) -> ParallelConfig:
        """Parse and validate a target against the devices, the model and the global batch."""
        return switch_requests.check_target(self, target, world_size)

    def request(self, target: str | ParallelConfig, leave=(), wait: bool = False, plan_ahead: bool = False
                ) -> ParallelConfig:
        return switch_requests.request(self, target, leave, wait, plan_ahead)

    def run_pending(self) -> SwitchReport | None:
        """Run the pending request if it can run now; a scale-out waits (across boundaries) for its joiners."""
        return switch_requests.run_pending(self)

    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None,
               budget_mb: float | None = None) -> SwitchReport:
        """A layout switch within the current world (same processes), now."""
        return switch_in_world(self, target, rank_map=rank_map, budget_mb=budget_mb)

    # ---- a process joining a running job ------------------------------------------------------------------
    def join(self) -> None:
        joiner.join(self)

    def adopt_joined_module(self) -> None:
        joiner.adopt_joined_module(self)

    def adopt_joined_optimizer(self) -> None:
        joiner.adopt_joined_optimizer(self)

    def on_train_start(self) -> None:
        if self.joined is not None:
            joiner.start_training(self)
