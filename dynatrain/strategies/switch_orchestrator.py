"""`SwitchOrchestrator`: a `DynaTrainStrategy`'s layout switches, each request owned from its arrival to its report.

A request is checked once, when it arrives (`switch_checks`: a bad target raises ValueError and nothing changes),
queued, and run at an optimizer-step boundary, which Lightning's loop reports through `fit_loop`. Its course is one
state machine (`RequestState`): requested -> prepared -> run -> reported, or dropped on the way. A scale-out waits at
its boundary, across boundaries, until enough joiners are ready, and is planned in the background meanwhile
(`switch.prepare`). Any other switch can be planned ahead the same way (``plan_ahead``): its plan starts at the
request, on a background thread, and the switch runs at the end of the next optimizer step, so the plan is not in
the stall and the step trained meanwhile on the old layout is not lost. Which boundary that is follows from the step
count alone, the same on every rank whatever its plan's progress (a plan not done by then is waited for there).

The orchestrator also runs the two switches nobody requests: the survivors' recovery from a lost process, and a
joining process's side of a world change, which waits for Lightning's set-up. Each runs the one driver
(`switch.driver`) with the kind of move it is (`switch.moves`, `switch.joining`, `switch.survivors`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from dynatrain.check.hashing import warm_up as warm_up_switch_check
from dynatrain.check.verify import SwitchVerificationError
from dynatrain.elastic.world import NextGeneration
from dynatrain.strategies import fit_loop, formed_ahead
from dynatrain.strategies.switch_checks import check_module, check_target, check_world
from dynatrain.strategies.switch_context import StrategyContext
from dynatrain.switch import driver
from dynatrain.switch.capture import Captured
from dynatrain.switch.in_world import InWorldPrep, in_world_inputs
from dynatrain.switch.joining import Await, Join
from dynatrain.switch.moves import InWorld, WorldChange, change_inputs
from dynatrain.switch.payload import JoinPayload
from dynatrain.switch.prepare import JoinerPrep, MemberPrep, free_working_bytes
from dynatrain.switch.report import PhaseTimer
from dynatrain.switch.recovery import RecoveryStop, WorldChangeError
from dynatrain.switch.report import RecoveryReport, SwitchReport
from dynatrain.switch.states import capture_states
from dynatrain.switch.survivors import Recovery
from dynatrain.switch.target import TargetLayouts
from dynatrain.vps.parallel_config import ParallelConfig


class RequestState(Enum):
    REQUESTED = "requested"  # checked, queued for a step boundary
    PREPARED = "prepared"  # planned in the background (again, when what it plans from changed)
    RUN = "run"  # taken from the queue at a boundary: the driver runs it
    REPORTED = "reported"  # done, its report published
    DROPPED = "dropped"  # replaced by a later request, refused before any state moved, or its joiners never came


_NEXT = {
    RequestState.REQUESTED: {RequestState.PREPARED, RequestState.RUN, RequestState.DROPPED},
    RequestState.PREPARED: {RequestState.PREPARED, RequestState.RUN, RequestState.DROPPED},
    RequestState.RUN: {RequestState.REPORTED, RequestState.DROPPED},
    RequestState.REPORTED: set(),
    RequestState.DROPPED: set(),
}


@dataclass
class SwitchRequest:
    target: ParallelConfig  # checked
    leave: tuple[int, ...]
    requested_at: float
    wait: bool = False  # a scale-out holds training at its boundary until its joiners are ready (or time out)
    plan_ahead: bool = False  # planned from the request on, run at the end of the next optimizer step
    requested_step: int | None = None  # the trainer's global step at the request, while it trains
    in_world: bool = True  # the same processes: no process leaves or joins
    state: RequestState = RequestState.REQUESTED
    prep: MemberPrep | InWorldPrep | None = None  # its plan, made in the background
    ahead: NextGeneration | None = None  # a scale-out's target generation, forming while training goes on
    admitted: list[str] | None = None  # the joiners it forms with
    forming_since: float | None = None
    forming_step: int | None = None  # the trainer's step when its target generation began to form
    watcher: "formed_ahead.Watcher | None" = None  # admits ready joiners and forms with them inside a step
    attempts: int = 0  # watchers started, the same count on every member

    def to(self, state: RequestState) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"a switch request to {self.target.short()} cannot go from {self.state.value} to "
                               f"{state.value}")
        self.state = state
        if state is RequestState.DROPPED:  # a generation formed for it ends
            if self.watcher is not None and self.watcher.take().ahead is not None:
                self.watcher.ahead.discard()
            if isinstance(self.prep, MemberPrep):
                self.prep.discard()
            if self.ahead is not None:
                self.ahead.discard()

    def prepared(self, prep: MemberPrep | InWorldPrep) -> None:
        self.to(RequestState.PREPARED)
        self.prep = prep


class SwitchOrchestrator:
    """Holds what lives between switches: the pending request, a joining process's switch until Lightning has set
    it up, the loop's accumulation offset, the target builds."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.ctx = StrategyContext(strategy, lambda layout, world: self.check(layout, world_size=world),
                                   self._count_from_here)
        self.pending: SwitchRequest | None = None
        self.joining = None  # a joining process's switch, waiting for Lightning's set-up (`switch.joining`)
        self.join_payload: JoinPayload | None = None
        self.join_waits: dict[str, float] = {}  # a joining process's waits before its switch (`SwitchReport.joined`)
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

    @property
    def prepared(self) -> MemberPrep | InWorldPrep | None:
        """The pending request's plan, made in the background."""
        return self.pending.prep if self.pending is not None else None

    def _count_from_here(self, trainer: pl.Trainer) -> None:
        # Lightning's loop counts the accumulation that keeps the global batch from the switch on.
        self.accumulation_offset = fit_loop.micro_batches_done(trainer)

    def _run(self, request: SwitchRequest, move) -> SwitchReport | None:
        """The driver, with the strategy's transfer (`engine.run_transition` unless a test or benchmark set
        another)."""
        request.to(RequestState.RUN)
        report = driver.run(self.ctx, move, transfer=self.strategy.switch_transfer)
        request.to(RequestState.REPORTED)
        return report

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
        return check_target(self.strategy, self.trainer, target, world_size)

    def request(self, target: str | ParallelConfig, leave=(), wait: bool = False, plan_ahead: bool = False
                ) -> ParallelConfig:
        leave = tuple(sorted({int(r) for r in leave}))
        parsed = ParallelConfig.parse(target)
        check_world(self.strategy, parsed, leave)
        target = self.check(parsed, world_size=parsed.world_size)
        in_world = parsed.world_size == self.strategy.world_size and not leave
        captured = check_module(self.strategy, self.ctx, self.targets, target, probe=not in_world)
        trainer = self.trainer
        training = trainer is not None and trainer.training
        if self.pending is not None:
            self.pending.to(RequestState.DROPPED)  # the latest request wins: one switch at the boundary
        self.pending = request = SwitchRequest(target, leave, time.monotonic(), wait, plan_ahead,
                                               trainer.global_step if training else None, in_world)
        if not training:
            self.run_pending()
        elif plan_ahead:
            self._prepare(request, captured)
        return target

    def drop_pending(self) -> None:
        """Training ended with a request still pending: it never runs, and a world formed for it ends."""
        if self.pending is not None:
            self.pending.to(RequestState.DROPPED)
            self.pending = None

    def switch(self, target: str | ParallelConfig, *, rank_map: str | None = None, budget_mb: float | None = None
               ) -> SwitchReport:
        """A layout switch within the current world (same processes), now."""
        self.require_boundary()
        request = SwitchRequest(self.check(target), (), time.monotonic())
        return self._run_in_world(request, rank_map, budget_mb)

    def run_pending(self) -> SwitchReport | None:
        """Run the pending request if it can run now; a scale-out waits (across boundaries) for its joiners."""
        request = self.pending
        if request is None:
            return None
        if request.in_world:
            if not self._due(request):
                if request.prep is None:  # planned at the request, normally
                    self._prepare(request)
                return None
            self.pending = None
            with self._refusable(request):
                self.require_boundary()
                return self._run_in_world(request)
            return None
        return self._run_world_change(request)

    def _run_in_world(self, request: SwitchRequest, rank_map: str | None = None, budget_mb: float | None = None
                      ) -> SwitchReport:
        move = InWorld(request.target, self.targets, self.strategy.switch_reports, rank_map, budget_mb,
                       request.prep)
        report = self._run(request, move)
        self.strategy.retire_meshes(keep=self.targets.has_build)
        return report

    def _run_world_change(self, request: SwitchRequest) -> SwitchReport | None:
        strategy = self.strategy
        change = f"world change {strategy.parallel_config.short()} -> {request.target.short()}"
        try:
            if request.admitted is not None:  # admitted, its world forming since
                while not formed_ahead.formed(self, request):
                    if request.admitted is None:  # dropped: ready joiners again, waited for here if it holds
                        return self._run_world_change(request) if request.wait else None
                    if not request.wait:  # it switches at a later boundary; one that holds training, at this one
                        return None
                    time.sleep(formed_ahead.POLL)
                self.pending = None
                rank_zero_info(f"{change}: admitting joiners {request.admitted}, the world formed while training "
                               "went on")
                move = WorldChange(request.target, (), request.admitted, self.targets, request.prep,
                                   formed_ahead.generation(request), request.forming_step)
                with self._refusable(request):
                    self.require_boundary()
                    return self._run(request, move)
                return None
            joiners = self._agree_on_joiners(request)
            while joiners is None and request.wait:  # every rank waits alike: each round is one broadcast
                time.sleep(0.2)
                joiners = self._agree_on_joiners(request)
            if joiners is None:
                return None  # not enough joiners ready yet: ask again at the next boundary
            self.pending = None
            if joiners == "drop":
                request.to(RequestState.DROPPED)
                rank_zero_warn(f"scale-out to {request.target.short()} dropped: not enough joiners got ready within "
                               f"{strategy.elastic.config.join_timeout:.0f}s; training goes on with "
                               f"{strategy.world_size} processes")
                return None
            if formed_ahead.start(self, request, joiners):
                self.pending = request  # it switches once its world has formed: now, if the watcher began it
                return self._run_world_change(request)
            shrink = strategy.world_size - request.target.world_size + len(joiners)
            leaving = (f"ranks {sorted(request.leave)}" if request.leave else
                       f"{shrink} process(es) chosen by the planner" if shrink > 0 else "none")
            rank_zero_info(f"{change}: leaving {leaving}; admitting joiners {joiners or 'none'}")
            with self._refusable(request):
                self.require_boundary()
                move = WorldChange(request.target, request.leave, joiners, self.targets, request.prep,
                                   forming_step=request.forming_step)
                return self._run(request, move)
            return None
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, SwitchVerificationError):
                raise
            # A peer that died, or a joiner that vanished, shows up as a collective or rendezvous timeout.
            raise WorldChangeError(
                f"{change} failed: a process of the job did not take part within the "
                f"{strategy.elastic.config.timeout:.0f}s elastic timeout (it died or hung); this process stops "
                f"instead of training on partial state. Restart from the last checkpoint. Cause: {e}"
            ) from e

    @contextmanager
    def _refusable(self, request: SwitchRequest):
        """A request that fails to plan (every rank computes the same plan, so all fail alike) before any state
        moved is refused with a warning; training goes on on the current layout."""
        try:
            yield
        except ValueError as e:
            if self.released:
                raise
            request.to(RequestState.DROPPED)
            rank_zero_warn(f"switch to {request.target.short()} refused, training goes on as "
                           f"{self.strategy.parallel_config.short()}: {e}")

    def _due(self, request: SwitchRequest) -> bool:
        """Whether a request may run at this boundary: one planned ahead only once an optimizer step ended after it."""
        return (not request.plan_ahead or request.requested_step is None
                or self.trainer.global_step > request.requested_step)

    def _agree_on_joiners(self, request: SwitchRequest):
        """Rank 0 reads the ready joiners from the store; every rank gets its decision (one broadcast)."""
        strategy = self.strategy
        need = request.target.world_size - (strategy.world_size - len(request.leave))
        if need <= 0:
            if self._due(request):
                return []
            if request.prep is None:  # nobody joins: nothing the plan depends on changes until it is due
                self._prepare(request)
            return None
        decision = None
        admitted = formed_ahead.taken(request)  # every member stops its watcher here
        if strategy.global_rank == 0:
            manager = strategy.elastic
            ready = admitted or manager.ready_joiners()
            if len(ready) >= need:
                decision = ready[:need]
            elif time.monotonic() - request.requested_at > manager.config.join_timeout:
                for m in ready:
                    manager.drop_joiner(m, f"the scale-out to {request.target.short()} timed out")
                decision = "drop"
            if request.prep is not None:
                request.prep.publish(manager.store)
        decision = strategy.broadcast(decision)
        if decision is None:
            self._prepare(request)
            formed_ahead.watch(self, request)
        return decision

    def _prepare(self, request: SwitchRequest, captured: Captured | None = None) -> None:
        """While a scale-out waits for its joiners, or a switch planned ahead trains on: plan it in the background,
        for whichever joiners come (see `switch.prepare`). Only a change with joiners publishes its intent for
        them. ``captured``: this rank's states as the request just captured them, if it did."""
        strategy = self.strategy
        if captured is None:
            captured = capture_states(self.ctx)
        if request.in_world:
            inputs = in_world_inputs(self.ctx, self.targets, request.target, captured, strategy.switch_reports,
                                     built=self.targets.has_build(request.target))
            if request.prep is None or request.prep.inputs != inputs:
                request.prepared(InWorldPrep(inputs, self.ctx.rank))
            return
        inputs = change_inputs(self.ctx, self.targets, request.target, request.leave, None, captured)
        if request.prep is not None and request.prep.inputs == inputs:
            return
        member = self.ctx.elastic.member_id
        if not inputs.joiners:
            if request.prep is not None:
                request.prep.discard()
            request.prepared(MemberPrep(inputs, form=self._former(inputs), member=member))
            request.forming_step = self.ctx.step
            return
        # A step boundary: what the allocator holds free now is what the steps work in.
        working = free_working_bytes(strategy.root_device) if strategy.global_rank == 0 else 0
        request.prepared(MemberPrep(inputs, self.intent_store(), working, member=member))

    def _former(self, inputs):
        """How a change whose members are all known forms its target generation ahead, once planned."""
        manager = self.strategy.elastic
        return lambda world_plan: formed_ahead.form_target(manager, world_plan, inputs.union)

    def intent_store(self):
        """On rank 0, how the plan's thread connects to the store (a connection serves one thread); None
        elsewhere."""
        return self.store_connection() if self.strategy.global_rank == 0 else None

    def store_connection(self):
        """How a background thread connects to the job's store (a connection serves one thread)."""
        return self.strategy.elastic.new_connection

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
            driver.run(self.ctx, move, transfer=self.strategy.switch_transfer)
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
        if self.strategy.switching.verify_switches:
            warm_up_switch_check()  # its check's one-time set-up, before the members wait on it in the switch
        manager.mark_ready()
        waits = PhaseTimer()
        self.join_waits = waits.phases
        change, payload = manager.await_admission(on_wait=prep.poll)
        waits.lap("admission")
        if payload is None:  # admitted to a world forming while the members train: formed now, the payload after
            manager.join_world(change, None)
            waits.lap("formation")
            payload = manager.await_payload(change, on_wait=prep.poll)
            waits.lap("payload")
        self.join_payload = JoinPayload(**payload)
        self.joining = driver.switch_stages(self.ctx, Join(prep, change, self.join_payload),
                                            transfer=self.strategy.switch_transfer)
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
        except StopIteration as done:
            waiting = None
            report = done.value
            report.joined = {**self.join_waits, **report.joined}
            self.strategy.join_report = report
        if waiting is not expect:
            raise RuntimeError(f"a joining process's switch waits for {waiting}, expected {expect}")
        if waiting is None:
            self.joining = self.join_payload = None
            self.strategy.local_only = False
