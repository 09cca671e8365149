"""Switch requests: checked at once (a bad target raises ValueError and nothing changes), queued, and run at an
optimizer-step boundary; a scale-out waits there, across boundaries, until enough joiners are ready, and is planned
in the background meanwhile (`prepare`). Any other switch can be planned ahead the same way (``plan_ahead``): its
plan starts at the request, on a background thread, and the switch runs at the end of the next optimizer step, so
the plan is not in the stall and the step trained meanwhile on the old layout is not lost. Which boundary that is
follows from the step count alone, the same on every rank whatever its plan's progress (a plan not done by then is
waited for there)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from dynatrain.elastic.store import connect as connect_store
from dynatrain.check.verify import SwitchVerificationError
from dynatrain.strategies.pipeline_runner import check_pipeline_module
from dynatrain.switch import driver
from dynatrain.switch.capture import Captured, check_switchable
from dynatrain.switch.in_world import InWorldPrep, in_world_inputs
from dynatrain.switch.moves import WorldChange, change_inputs
from dynatrain.switch.prepare import MemberPrep, free_working_bytes
from dynatrain.switch.recovery import WorldChangeError
from dynatrain.switch.report import SwitchReport
from dynatrain.switch.states import capture_states
from dynatrain.vps.parallel_config import ParallelConfig


class Switching(Protocol):
    """What requests need of the strategy's `Switcher`."""

    strategy: Any
    ctx: Any
    targets: Any
    pending: "Pending | None"
    prepared: Any

    @property
    def trainer(self) -> Any: ...

    @property
    def released(self) -> bool: ...

    def switch(self, target, *, rank_map=None, budget_mb=None, prepared=None) -> SwitchReport: ...

    def require_boundary(self) -> None: ...


@dataclass
class Pending:
    target: ParallelConfig
    leave: tuple[int, ...]
    requested_at: float
    wait: bool = False  # a scale-out holds training at its boundary until its joiners are ready (or time out)
    plan_ahead: bool = False  # planned from the request on, run at the end of the next optimizer step
    requested_step: int | None = None  # the trainer's global step at the request, while it trains


def check_target(switcher: Switching, target: str | ParallelConfig, world_size: int | None = None
                 ) -> ParallelConfig:
    """Parse and validate a target against the devices, the model and the global batch."""
    strategy = switcher.strategy
    world_size = strategy.world_size if world_size is None else world_size
    target = ParallelConfig.parse(target).validate(strategy.model_config(), world_size)
    if target.pp > 1:
        check_pipeline_module(strategy.lightning_module)
        n_layers = getattr(strategy.model_config(), "n_layers", None)
        per_rank = strategy.parallelism.stages_per_rank
        stages = target.pp * per_rank
        if n_layers is not None and stages > n_layers:
            raise ValueError(f"{target.short()} with {per_rank} stage(s) per rank needs {stages} "
                             f"pipeline stages of at least one layer, and the model has {n_layers}: use a "
                             f"smaller pp")
    datamodule = getattr(switcher.trainer, "datamodule", None) if switcher.trainer else None
    seq_len = getattr(datamodule, "seq_len", None)
    if target.cp > 1 and isinstance(seq_len, int):
        target.sequence_chunk(seq_len)
    try:
        if datamodule is not None and hasattr(datamodule, "accumulation_for"):
            datamodule.accumulation_for(target.dp_size)
        data = getattr(strategy, "data_split", None)  # None: a strategy that owns no dataloader
        if data is not None:
            data.check(target.dp_size, _dp_ranks_kept(strategy, target, world_size))
    except ValueError as e:
        raise ValueError(f"cannot switch to {target.short()}: {e}") from None
    return target


def _dp_ranks_kept(strategy, target: ParallelConfig, world_size: int) -> bool:
    """Whether every process keeps its data-parallel rank (the same processes in the default arrangement)."""
    current = strategy.parallel_config
    if current is None or world_size != strategy.world_size:
        return False
    positions = strategy.positions or list(range(world_size))
    # A loader dynatrain cannot re-split switches in the identity arrangement: process q at position q.
    return all(current.dp_rank_of(positions.index(q)) == target.dp_rank_of(q) for q in range(world_size))


def check_world(switcher: Switching, target: ParallelConfig, leave: tuple[int, ...]) -> None:
    """A world change needs the elastic manager, known leavers and room under max_devices."""
    strategy = switcher.strategy
    world = strategy.world_size
    bad = [r for r in leave if not 0 <= r < world]
    if bad:
        raise ValueError(f"leave={list(leave)}: ranks {bad} are not in the current world of {world} processes")
    if target.world_size == world and not leave:
        return
    if strategy.elastic is None:
        raise ValueError(
            f"{target.short()} needs dp_replicate*dp_shard*tp = {target.world_size} devices, but there are "
            f"{world}: changing the number of processes needs an elastic job (DynaTrainStrategy(elastic=...), "
            "started with `dynatrain fit --elastic.max_devices N`)"
        )
    cap = strategy.elastic.config.max_devices
    if cap is not None and target.world_size > cap:
        raise ValueError(f"{target.short()} needs {target.world_size} processes, above elastic max_devices={cap}")


def _check_module(switcher: Switching, target: ParallelConfig, probe: bool = False) -> Captured | None:
    """Refuse now what the switch could not carry: the module's states, and its parallelisation for ``target``
    (run on meta; the result is kept for the switch). Returns the states it captured (None before set-up)."""
    strategy = switcher.strategy
    if getattr(strategy, "lightning_module", None) is None:
        return None  # nothing set up yet: the module is checked when the switch runs
    check_switchable(strategy.lightning_module, strategy.optimizers)
    captured = capture_states(switcher.ctx)
    switcher.targets.check(target, captured, probe=probe)
    return captured


def request(switcher: Switching, target: str | ParallelConfig, leave=(), wait: bool = False,
            plan_ahead: bool = False) -> ParallelConfig:
    leave = tuple(sorted({int(r) for r in leave}))
    parsed = ParallelConfig.parse(target)
    check_world(switcher, parsed, leave)
    target = check_target(switcher, parsed, world_size=parsed.world_size)
    changes_world = parsed.world_size != switcher.strategy.world_size or bool(leave)
    captured = _check_module(switcher, target, probe=changes_world)
    trainer = switcher.trainer
    training = trainer is not None and trainer.training
    switcher.pending = p = Pending(target, leave, time.monotonic(), wait, plan_ahead,
                                   trainer.global_step if training else None)
    switcher.prepared = None
    if not training:
        run_pending(switcher)
    elif plan_ahead:
        _prepare(switcher, p, captured)
    return target


def _due(switcher: Switching, p: Pending) -> bool:
    """Whether a request may run at this boundary: one planned ahead only once an optimizer step ended after it."""
    return not p.plan_ahead or p.requested_step is None or switcher.trainer.global_step > p.requested_step


def run_pending(switcher: Switching) -> SwitchReport | None:
    """Run the pending request if it can run now; a scale-out waits (across boundaries) for its joiners."""
    p = switcher.pending
    if p is None:
        return None
    strategy = switcher.strategy
    if p.target.world_size == strategy.world_size and not p.leave:
        if not _due(switcher, p):
            if switcher.prepared is None:  # planned at the request, normally
                _prepare(switcher, p)
            return None
        switcher.pending = None
        prepared, switcher.prepared = switcher.prepared, None
        with _refusable(switcher, p):
            return switcher.switch(p.target, prepared=prepared)
        return None
    change = f"world change {strategy.parallel_config.short()} -> {p.target.short()}"
    try:
        joiners = _agree_on_joiners(switcher, p)
        while joiners is None and p.wait:  # every rank waits alike: each round is one broadcast from rank 0
            time.sleep(0.2)
            joiners = _agree_on_joiners(switcher, p)
        if joiners is None:
            return None  # not enough joiners ready yet: ask again at the next boundary
        switcher.pending = None
        if joiners == "drop":
            switcher.prepared = None
            rank_zero_warn(f"scale-out to {p.target.short()} dropped: not enough joiners got ready within "
                           f"{strategy.elastic.config.join_timeout:.0f}s; training goes on with "
                           f"{strategy.world_size} processes")
            return None
        shrink = strategy.world_size - p.target.world_size + len(joiners)
        leaving = (f"ranks {sorted(p.leave)}" if p.leave else
                   f"{shrink} process(es) chosen by the planner" if shrink > 0 else "none")
        rank_zero_info(f"{change}: leaving {leaving}; admitting joiners {joiners or 'none'}")
        with _refusable(switcher, p):
            switcher.require_boundary()
            move = WorldChange(p.target, p.leave, joiners, switcher.targets, switcher.prepared)
            switcher.prepared = None
            return driver.run(switcher.ctx, move)
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
def _refusable(switcher: Switching, p: Pending):
    """A request that fails to plan (every rank computes the same plan, so all fail alike) before any state
    moved is refused with a warning; training goes on on the current layout."""
    try:
        yield
    except ValueError as e:
        if switcher.released:
            raise
        rank_zero_warn(f"switch to {p.target.short()} refused, training goes on as "
                       f"{switcher.strategy.parallel_config.short()}: {e}")


def _agree_on_joiners(switcher: Switching, p: Pending):
    """Rank 0 reads the ready joiners from the store; every rank gets its decision (one broadcast)."""
    strategy = switcher.strategy
    need = p.target.world_size - (strategy.world_size - len(p.leave))
    if need <= 0:
        if _due(switcher, p):
            return []
        if switcher.prepared is None:  # nobody joins: nothing the plan depends on changes until it is due
            _prepare(switcher, p)
        return None
    decision = None
    if strategy.global_rank == 0:
        manager = strategy.elastic
        ready = manager.ready_joiners()
        if len(ready) >= need:
            decision = ready[:need]
        elif time.monotonic() - p.requested_at > manager.config.join_timeout:
            for m in ready:
                manager.drop_joiner(m, f"the scale-out to {p.target.short()} timed out")
            decision = "drop"
        if switcher.prepared is not None:
            switcher.prepared.publish(manager.store)
    decision = strategy.broadcast(decision)
    if decision is None:
        _prepare(switcher, p)
    return decision


def _intent_store(switcher: Switching):
    """On rank 0, how the plan's thread connects to the store (a connection serves one thread); None elsewhere."""
    strategy = switcher.strategy
    if strategy.global_rank != 0:
        return None
    manager = strategy.elastic
    return lambda: connect_store(manager.endpoint, manager.token, timeout=manager.config.timeout)


def _prepare(switcher: Switching, p: Pending, captured: Captured | None = None) -> None:
    """While a scale-out waits for its joiners, or a switch planned ahead trains on: plan it in the background, for
    whichever joiners come (see `prepare`). Only a change with joiners publishes its intent for them. ``captured``:
    this rank's states as the request just captured them, if it did."""
    strategy = switcher.strategy
    if captured is None:
        captured = capture_states(switcher.ctx)
    if p.target.world_size == strategy.world_size and not p.leave:
        inputs = in_world_inputs(switcher.ctx, switcher.targets, p.target, captured, strategy.switch_reports,
                                 built=switcher.targets.has_build(p.target))
        if switcher.prepared is None or switcher.prepared.inputs != inputs:
            switcher.prepared = InWorldPrep(inputs)
        return
    inputs = change_inputs(switcher.ctx, switcher.targets, p.target, p.leave, None, captured)
    if switcher.prepared is None or switcher.prepared.inputs != inputs:
        if not inputs.joiners:
            switcher.prepared = MemberPrep(inputs)
            return
        # A step boundary: what the allocator holds free now is what the steps work in.
        working = free_working_bytes(strategy.root_device) if strategy.global_rank == 0 else 0
        switcher.prepared = MemberPrep(inputs, _intent_store(switcher), working)
