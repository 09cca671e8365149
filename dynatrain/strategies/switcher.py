"""`Switcher`: a `DynaTrainStrategy`'s layout switches, run only at optimizer-step boundaries.

It holds what lives between switches (the pending request, a switch prepared in the background, a joining
process's switch until Lightning has set it up, the loop's accumulation offset, the target builds), turns each kind
of switch into the driver's input (`switch.moves`) and runs the one driver (`switch.driver`). Requests are checked
and queued in `switch_requests`; Lightning's loop calls in through `fit_loop`.
"""

from __future__ import annotations

import lightning.pytorch as pl

from dynatrain.strategies import fit_loop, switch_requests
from dynatrain.strategies.switch_context import StrategyContext
from dynatrain.switch import driver
from dynatrain.switch.driver import Await
from dynatrain.switch.moves import InWorld, Join, Recovery
from dynatrain.switch.payload import JoinPayload
from dynatrain.switch.prepare import JoinerPrep, MemberPrep
from dynatrain.switch.in_world import InWorldPrep
from dynatrain.switch.recovery import RecoveryStop, WorldChangeError
from dynatrain.switch.report import RecoveryReport, SwitchReport
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.parallel_config import ParallelConfig


class Switcher:
    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.ctx = StrategyContext(strategy, lambda layout, world: self.check(layout, world_size=world),
                                   self._count_from_here)
        self.pending: switch_requests.Pending | None = None
        self.prepared: MemberPrep | InWorldPrep | None = None  # the pending switch, planned in the background
        self.joining = None  # a joining process's switch, waiting for Lightning's set-up (`switch_stages`)
        self.join_payload: JoinPayload | None = None
        self.accumulation_offset = 0
        self.targets = TargetLayouts(self.ctx)

    @property
    def trainer(self) -> pl.Trainer | None:
        return self.ctx.trainer

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        self.ctx.trainer = trainer

    @property
    def released(self) -> bool:
        """The old layout's state was handed to the engine: a failure now cannot be undone."""
        return self.ctx.released

    def _count_from_here(self, trainer: pl.Trainer) -> None:
        # Lightning's loop counts the accumulation that keeps the global batch from the switch on.
        self.accumulation_offset = trainer.fit_loop.epoch_loop.batch_progress.current.ready

    # ---- Lightning wiring ---------------------------------------------------------------------------------
    def attach(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
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

    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None, budget_mb: float | None = None,
               prepared=None) -> SwitchReport:
        """A layout switch within the current world (same processes), now; ``prepared``: the request's plan made
        ahead, used when its inputs still hold."""
        self.require_boundary()
        target = self.check(target)
        report = driver.run(self.ctx, InWorld(target, self.targets, self.strategy.switch_reports, rank_map,
                                              budget_mb, prepared))
        self.strategy.retire_meshes(keep=self.targets.has_build)
        return report

    # ---- a process lost -----------------------------------------------------------------------------------
    def recover(self, error: BaseException) -> RecoveryReport:
        """Every survivor: agree on who is left, re-form the world, rebuild the state from replicas."""
        layout, step = self.strategy.parallel_config, self.ctx.step
        if layout.pp > 1:
            # The survivors would have to agree on every stage's states without the lost process's view of its own.
            raise WorldChangeError(f"a process was lost while training as {layout.short()}: recovery from a lost "
                                   "process is not supported with pipeline parallelism yet; restart from the last "
                                   "snapshot") from error
        cause = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        move = Recovery(self.targets, cause)
        try:
            driver.run(self.ctx, move)
        except RecoveryStop as e:
            raise WorldChangeError(
                f"lost process(es) {move.lost} at step {step} ({cause}); the state cannot be rebuilt in memory: {e}. "
                "This process stops instead of training on partial state: resume from the latest snapshot "
                "(dynatrain.callbacks.Snapshot) or checkpoint") from None
        return self.strategy.recovery_reports[-1]

    # ---- a process joining a running job ------------------------------------------------------------------
    def join(self) -> None:
        """Register, wait for admission, and run the switch up to where Lightning's set-up takes over: the shards
        received (now, or once the module is built) and the target world entered."""
        manager = self.strategy.elastic
        manager.register_joiner(self.strategy.member_info())
        prep = JoinerPrep(manager.store, self.strategy.root_device)
        prep.prepare_now()  # the members train on meanwhile; once it is ready, they may admit it at the next boundary
        manager.mark_ready()
        change, payload = manager.await_admission(on_wait=prep.poll)
        self.join_payload = JoinPayload(**payload)
        self.joining = driver.switch_stages(self.ctx, Join(prep, change, self.join_payload))
        self._advance(None, Await.MODULE)

    def adopt_joined_module(self) -> None:
        """After the module's own parallelisation for the target layout: the received shards in place."""
        self._advance(self.strategy.lightning_module, Await.OPTIMIZER)

    def adopt_joined_optimizer(self) -> None:
        """After Lightning made the optimizer: its state as the members have it; then the check."""
        self._advance(self.ctx.optimizer(), Await.LOOP)

    def on_train_start(self) -> None:
        """After Lightning restored the loop state: the data laid out as the members have it."""
        if self.joining is not None:
            self._advance(None, None)

    def _advance(self, value, expect: Await | None) -> None:
        try:
            waiting = self.joining.send(value)
        except StopIteration:
            waiting = None
        if waiting is not expect:
            raise RuntimeError(f"a joining process's switch waits for {waiting}, expected {expect}")
        if waiting is None:
            self.joining = self.join_payload = None
            self.strategy.local_only = False
