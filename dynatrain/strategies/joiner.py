"""A process joining a running job: register, wait for admission, receive this process's shards and enter the
target world; then, as Lightning sets the process up, adopt the shards, the optimizer state and the loop state.

`join` runs in `setup_environment`, before Lightning builds the model: the shards wait in `switcher.joined` for
the strategy's set-up, the optimizer and Lightning's restore of the loop state. When nobody leaves, the transfer
runs on the target generation and waits for the set-up instead: the joiner's Lightning set-up (data, the module's
own parallelisation) then overlaps the members' build of the same mesh and model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dynatrain import engine
from dynatrain.engine.verify import differing, local_checksums, reduce_sums
from dynatrain.planner.schedule import SwitchPlan
from dynatrain.strategies.adopt import fill_target, move_data, restore_optimizer
from dynatrain.strategies.capture import capture
from dynatrain.strategies.join_payload import decode_scalars
from dynatrain.strategies.lightning_world import adopt_logger_versions, set_world
from dynatrain.strategies.prepare import JoinerPrep, plan_from_payload
from dynatrain.strategies.report import check_unchanged
from dynatrain.strategies.world_switch import ranks_in
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher


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


class _Receive:
    """The joiner's part of the members' transfer: it sends nothing and keeps what it received."""

    def __init__(self, plan: SwitchPlan, me: int, union: list[str], device: torch.device,
                 ready: dict[str, torch.Tensor] | None = None) -> None:
        self.plan, self.me, self.union, self.device = plan, me, union, device
        self.dst: dict[str, torch.Tensor] | None = None
        # A joiner holds no sources, so its destinations fit its memory bound now: allocated (and on CPU mapped)
        # before the members' transfer starts instead of while their bytes arrive, if not while it waited.
        self.ready = ready if ready is not None else engine.allocate_destinations(plan, me, device)

    def __call__(self, world) -> dict[str, torch.Tensor]:
        ready, self.ready = self.ready, {}
        # Looked up on the package at call time: the benchmarks replace it there.
        self.dst, _ = engine.run_transition(self.plan, self.me, {}, group_ranks=ranks_in(world, self.union),
                                            device=self.device, preallocated=ready)
        return self.dst


def join(switcher: "Switcher") -> None:
    """Register, wait for admission, receive this process's shards (now, or deferred to Lightning's set-up) and
    enter the target world."""
    strategy = switcher.strategy
    manager = strategy.elastic
    manager.register_joiner(strategy.member_info())
    prep = JoinerPrep(manager.store, strategy.root_device)
    prep.prepare_now()  # the members train on meanwhile; once it is ready, they may admit it at the next boundary
    manager.mark_ready()
    t, payload = manager.await_admission(on_wait=prep.poll)
    plan, old_layout = prep.plan_for(payload) or plan_from_payload(payload)
    target = ParallelConfig.parse(payload["target"])
    me = payload["union"].index(manager.member_id)
    receive = _Receive(plan, me, payload["union"], strategy.root_device, prep.destinations_for(plan, me))
    ahead = set(t.new) == set(t.union)  # as `WorldSwitch` decides it
    world = manager.join_world(t, None if ahead else receive)
    set_world(strategy, world.rank, world.world_size)
    strategy.parallel_config = target
    strategy.positions = list(payload["target_ranks"])
    strategy._device_mesh = strategy._build_mesh(target, ranks=strategy.positions)
    adopt_logger_versions(switcher.trainer or strategy.lightning_module.trainer, payload["loggers"])
    switcher.joined = JoinState(
        dst=receive.dst, receive=(lambda: receive(world)) if ahead else None,
        scalars=decode_scalars(payload["scalars"], strategy.root_device),
        groups=payload["groups"], checkpoint=payload["checkpoint"], old_totals=payload["old_totals"],
        old_layout=old_layout, new_layout=plan.new, process=me,
        param_of={k: (v[0], v[1]) for k, v in payload["param_of"].items()}, order=payload["order"],
    )


def receive_joined(switcher: "Switcher") -> None:
    """A joiner whose transfer waited for Lightning's set-up: receive its shards now (once)."""
    joined = switcher.joined
    if joined is not None and joined.receive is not None:
        receive, joined.receive = joined.receive, None
        joined.dst = receive()


def adopt_joined_module(switcher: "Switcher") -> None:
    """After the module's own parallelisation for the target layout: the received shards in place."""
    receive_joined(switcher)
    module = switcher.strategy.lightning_module
    fill_target(module, switcher.joined.dst, switcher.strategy.root_device)


def adopt_joined_optimizer(switcher: "Switcher") -> None:
    """After `setup_optimizers`: optimizer state and hyper-parameters as the members had them; then verify."""
    joined, strategy = switcher.joined, switcher.strategy
    module, optimizer = strategy.lightning_module, switcher.optimizer()
    if optimizer is not None:
        for group, old in zip(optimizer.param_groups, joined.groups):
            group.update(old)
        restore_optimizer(optimizer, module, joined.dst, joined.param_of, joined.scalars, joined.order)
    if joined.old_totals is not None:
        new_totals = reduce_sums(local_checksums(joined.new_layout, joined.process,
                                                 capture(module, optimizer, strategy.device_mesh).sources),
                                 strategy.root_device)
        check_unchanged(differing(joined.old_layout, joined.old_totals, joined.new_layout, new_totals),
                        joined.old_layout.config, strategy.parallel_config)


def start_training(switcher: "Switcher") -> None:
    """After Lightning restored the loop state (its schedulers were stepped before the switch, as Lightning steps
    them before `on_train_batch_end`): lay out the data as the members did."""
    switcher.joined = None
    strategy = switcher.strategy
    move_data(switcher, strategy.parallel_config)
    strategy.local_only = False
