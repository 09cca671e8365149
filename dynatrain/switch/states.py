"""A switch's states on this process: captured from the live module and optimizer (and agreed across ranks), what
survives besides the routed shards (`Kept`), and the release of the old shards to the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dynatrain.runtime import control_group
from dynatrain.switch.capture import Captured, capture, check_switchable
from dynatrain.switch.context import SwitchContext
from dynatrain.switch.recovery import reshard
from dynatrain.switch.stage_capture import merge_stages
from dynatrain.switch.target import release_children


@dataclass
class Kept:
    """What a switch carries besides the routed shards; the same on every rank of a data-parallel group.

    ``param_of``: state -> (owner, optimizer key; None for the weight, `BUFFER` for a buffer); ``scalars``: per
    parameter, its optimizer entries that are not routed (``step``); ``order``: per parameter, its optimizer entries'
    keys in the order the optimizer created them; ``groups``: the optimizer's hyper-parameters per group;
    ``schedulers``: each LR scheduler's state."""

    param_of: dict[str, tuple[str, str | None]]
    scalars: dict[str, dict]
    order: dict[str, list[str]]
    groups: list[dict] = field(default_factory=list)
    schedulers: list[dict] = field(default_factory=list)


@dataclass
class Held:
    """This process's side of a switch before anything moves: the live module and optimizer, their states."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    captured: Captured
    kept: Kept
    waited: float = 0.0  # seconds in the agreement: mostly waiting for the slowest rank to end its step


def capture_states(ctx: SwitchContext) -> Captured:
    """This rank's states of the live module and optimizer; under pp with every stage's specs and kept entries
    beside them (`merge_stages`)."""
    module, optimizer = ctx.module, ctx.optimizer()
    captured = capture(module, optimizer, ctx.mesh)
    if ctx.layout is None or ctx.layout.pp == 1:
        return captured
    return merge_stages(captured, entry_order(module, optimizer), ctx.control_group)


def hold(ctx: SwitchContext, agree: bool = True) -> Held:
    """The live states, checked switchable and, with ``agree``, equal on every rank (one all-reduce of their
    fingerprint before anything moves); without it (a recovery, whose world is broken) as they are, once FSDP's
    sharded parameters are back where a fault mid-step may have left the unsharded ones."""
    module, optimizer = ctx.module, ctx.optimizer()
    if not agree:
        reshard(module)
    else:
        check_switchable(module, ctx.optimizers())
    captured = capture_states(ctx)
    waited = 0.0
    if agree and ctx.world_size > 1:
        start = time.perf_counter()
        _agree_on(ctx, captured)
        waited = time.perf_counter() - start
    return Held(module, optimizer, captured, keep(ctx, captured, module, optimizer), waited)


def _agree_on(ctx: SwitchContext, captured: Captured) -> None:
    mark = captured.fingerprint()
    high, neg_low = control_group.all_reduce_ints([mark, -mark], ctx.control_group, op=dist.ReduceOp.MAX)
    if high != mark or neg_low != -mark:
        raise ValueError("the ranks hold different sets of states (names, shapes, dtypes or placements): a "
                         "module or optimizer that differs between ranks cannot be switched")


def entry_order(module: nn.Module, optimizer) -> dict[str, list[str]]:
    """Per parameter name, its optimizer entries' keys in the order the optimizer created them."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: list(st) for p, st in optimizer.state.items()} if optimizer is not None else {}


def keep(ctx: SwitchContext, captured: Captured, module: nn.Module, optimizer) -> Kept:
    return Kept(
        param_of=captured.param_of, scalars=captured.scalars,
        order=captured.order if captured.order is not None else entry_order(module, optimizer),
        groups=[{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else [],
        schedulers=ctx.scheduler_states(),
    )


def release(ctx: SwitchContext, held: Held) -> list[str]:
    """Drop the live module's and optimizer's hold on the old shards (the engine empties each shard's storage after
    its last send) and on the last step's gradients; returns the names of the module's children the target
    replaces."""
    for p in held.module.parameters():
        p.grad = None  # as large as the weights and no source of the engine's: the module's cycles would keep them
    optimizer = held.optimizer
    if optimizer is not None:
        optimizer.state.clear()
        for g in optimizer.param_groups:
            g["params"] = []
    held.optimizer = None
    ctx.drop_optimizers()
    ctx.released = True
    return release_children(held.module)
