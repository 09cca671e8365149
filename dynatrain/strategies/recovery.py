"""Recovery from a process lost while the job trains: re-form the world on the survivors, rebuild from replicas.

A fault inside an optimizer step leaves every survivor's weights, Adam moments and step as they were after the
last step that completed everywhere (the update is local and runs only after the step's collectives). So when
every shard the lost processes held also lives on a survivor (``dp_replicate >= 2``, or TP-replicated states),
the survivors hold the whole committed state: the routing planner plans a switch from the old layout with the
lost processes' data unreadable, onto a layout for the survivors, and the engine moves it over a new generation
of the world. The step that failed is run again on the same samples, since the data position follows the
optimizer steps taken.

What cannot be rebuilt this way (a shard with no replica, survivors that disagree on the step, a fault inside a
switch, whose engine frees shards as it sends them) stops the job with `WorldChangeError` naming why; the job then
resumes from its latest committed snapshot.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from dynatrain import engine
from dynatrain.memory import release_freed_memory, resident_bytes
from dynatrain.planner.schedule import plan_switch
from dynatrain.strategies.adopt import adopt_module
from dynatrain.strategies.capture import capture
from dynatrain.strategies.lightning_world import forget_old_meshes, set_world
from dynatrain.strategies.prepare import plan_mesh_safe
from dynatrain.strategies.report import PhaseTimer
from dynatrain.strategies.same_world import planner_rank_map
from dynatrain.strategies.states import keep_states, release_module
from dynatrain.vps.layout import Layout
from dynatrain.vps.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from dynatrain.strategies.switcher import Switcher

# What gloo and NCCL say when a peer of a collective died or stopped answering.
_PEER_LOSS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
    "nccl communicator", "remote process exited", "socket",
)


def is_peer_loss(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error).lower() for s in _PEER_LOSS)


class WorldChangeError(RuntimeError):
    """A world change or a recovery could not complete; the process must not go on training."""


@dataclass
class RecoveryReport:
    step: int
    lost: list[str]
    survivors: int
    old_layout: str
    new_layout: str
    bytes_moved: int
    seconds: float
    cause: str
    phases: dict

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _reshard(model) -> None:
    """A fault mid-forward or mid-backward leaves FSDP's unsharded parameters registered on some modules;
    put the sharded ones (which the optimizer holds, unchanged since the last step) back. Local, no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _drop_groups(meshes) -> None:
    """Meshes keep their process groups in a registry (on the root mesh); empty it so the groups can go."""
    for mesh in meshes:
        for m in (mesh, getattr(mesh, "_root_mesh", None)):
            registry = getattr(m, "_pg_registry", None)
            if registry is not None:
                registry.clear()


def survivors_target(switcher: "Switcher", count: int) -> ParallelConfig:
    """The layout for ``count`` survivors: the old one when nobody was lost (a transient fault), else the one the
    job's policy chooses (`strategy.layout_chooser`, set by the ElasticCallback), else the old TP degree when it
    still divides, else pure FSDP; always one the model and the global batch accept."""
    strategy = switcher.strategy
    old = strategy.parallel_config
    candidates: list[ParallelConfig] = [old] if count == old.world_size else []
    chooser = getattr(strategy, "layout_chooser", None)
    if chooser is not None:
        try:
            candidates.append(chooser(count))
        except ValueError:
            pass
    candidates.extend(old.survivor_layouts(count))
    errors = []
    for c in candidates:
        try:
            return switcher.check(c, world_size=count)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(f"no layout fits the {count} surviving processes: " + "; ".join(errors))


def recover(switcher: "Switcher", error: BaseException) -> RecoveryReport:
    """Every survivor: agree on who is left, re-form the world, rebuild the state from replicas."""
    timer = PhaseTimer()
    footprint = resident_bytes()
    strategy = switcher.strategy
    manager = strategy.elastic
    trainer = switcher.trainer
    old_world = manager.world
    old_cfg = strategy.parallel_config
    if old_cfg.pp > 1:
        # The survivors would have to agree on every stage's states without the lost process's view of its own.
        raise WorldChangeError(f"a process was lost while training as {old_cfg.short()}: recovery from a lost process "
                               "is not supported with pipeline parallelism yet; restart from the last snapshot"
                               ) from error
    step = trainer.global_step if trainer is not None else 0
    start = time.monotonic()
    cause = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"

    # Keep the local shards as plain tensors and drop everything that references the broken groups: a gloo
    # group's connections close only when its last reference goes, and a survivor still blocked in a
    # collective with this process fails at once then, instead of at the group's timeout.
    module, optimizer = strategy.lightning_module, switcher.optimizer()
    _reshard(module)
    captured = capture(module, optimizer, strategy.device_mesh)
    src = captured.sources
    kept = keep_states(switcher, captured, optimizer)
    names = release_module(switcher, module, optimizer)
    switcher.targets.forget_builds()
    del optimizer
    gc.collect()
    _drop_groups([*strategy._meshes.values(), strategy._device_mesh])
    strategy._meshes.clear()
    strategy._device_mesh = module._device_mesh = None
    forget_old_meshes()  # the caches hold old meshes, which hold the groups
    old_world.leave(barrier=False)
    survivors = manager.agree_on_survivors({"step": step})
    members = list(old_world.members)
    lost = [m for m in members if m not in survivors]
    timer.lap("agree")

    def stop(why: str) -> WorldChangeError:
        return WorldChangeError(
            f"lost process(es) {lost} at step {step} ({cause}); the state cannot be rebuilt in memory: {why}. "
            "This process stops instead of training on partial state: resume from the latest snapshot "
            "(dynatrain.callbacks.Snapshot) or checkpoint")

    steps = sorted({int(info["step"]) for info in survivors.values()})
    if len(steps) != 1:
        raise stop(f"the survivors stopped at different optimizer steps {steps}")

    lost_ranks = [members.index(m) for m in lost]
    old_layout = Layout.from_shardings(captured.specs, captured.shardings, old_cfg, rank_map=strategy.positions)
    new_members = sorted(survivors)
    rank_of = {members.index(m): new_members.index(m) for m in new_members}  # plan id (old rank) -> new rank
    world = manager.reform(new_members)
    set_world(strategy, world.rank, world.world_size)
    try:
        target = survivors_target(switcher, len(survivors))
        target_layout, _ = switcher.targets.layout(target, captured, probe=True)
        plan, target_ranks = plan_mesh_safe(
            lambda order: plan_switch(old_layout, target_layout, lost=lost_ranks,
                                      rank_map=order or planner_rank_map(strategy.rank_map),
                                      budget_bytes=strategy.switch_budget_bytes),
            lambda plan: [rank_of[p] for p in plan.new.rank_map], target)
    except ValueError as e:
        raise stop(str(e)) from None
    me = members.index(manager.member_id)
    del captured
    timer.lap("plan")

    dst, _ = engine.run_transition(plan, me, src, group_ranks=rank_of, device=strategy.root_device)
    del src
    timer.lap("transfer")
    new_mesh = strategy._build_mesh(target, ranks=target_ranks)
    adopt_module(switcher, strategy.build_target(new_mesh, target), names, new_mesh, target, target_ranks, dst, kept)
    timer.lap("adopt")
    release_freed_memory(footprint)
    report = RecoveryReport(step=step, lost=lost, survivors=len(new_members), old_layout=old_cfg.short(),
                            new_layout=target.short(), bytes_moved=plan.bytes_moved,
                            seconds=time.monotonic() - start, cause=cause, phases=timer.phases)
    strategy.recovery_reports.append(report)
    # The step in progress is discarded: whatever counted its micro-batches starts that step afresh.
    for owner in [strategy.lightning_module, *(trainer.callbacks if trainer is not None else [])]:
        hook = getattr(owner, "on_train_step_discarded", None)
        if callable(hook):
            hook()
    rank_zero_warn(f"lost process(es) {lost} at step {step}: the {len(new_members)} survivors rebuilt the state "
                   f"from replicas and go on as {target.short()} ({report.seconds:.2f}s)")
    return report
